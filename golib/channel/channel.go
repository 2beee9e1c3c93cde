// Package channel builds the per-peer handles kernels talk through
// (MemoryChannel over CUDA IPC inside a node, PortChannel through the proxy
// and a transport to any peer) over a communicator's registered memory, and
// lets the host drive port channels through the same FIFO kernels push to.
package channel

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/procenv"
	"github.com/p2pcomm/p2pcomm/golib/proxy"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/symm"
	"github.com/p2pcomm/p2pcomm/golib/topo"
	"github.com/p2pcomm/p2pcomm/golib/transport/cudaipc"
	"github.com/p2pcomm/p2pcomm/golib/transport/ucx"
)

// PortTransportEnv, set to "ucx", makes port channels use UCX for peers of
// this rank's node too (otherwise the copy engine over CUDA IPC): to
// exercise and measure the network path on one host.
const PortTransportEnv = "P2PCOMM_PORT_TRANSPORT"

// Config is what a communicator gives its channels.
type Config struct {
	Bootstrap bootstrap.Bootstrap
	Topology  *topo.Topology
	// Timeout bounds every wait: the proxy's, the host's (P2PCOMM_TIMEOUT_MS).
	Timeout time.Duration
	// ForceUCX: port channels use UCX for every peer (PortTransportEnv).
	ForceUCX bool
	// UCXDirs are searched for libucp.so.0 (ucx.Options.LibraryDirs).
	UCXDirs []string
	// UCXStageChunk and UCXStageSlots size UCX's staging ring (ucx.Options
	// ChunkBytes, RingChunks); 0 takes its defaults.
	UCXStageChunk uint64
	UCXStageSlots int
	// UCXStripes is how many workers carry a large staged chunk
	// (ucx.Options.Stripes); 0: ucx.StripesEnv, else the topology's
	// default (topo.Topology.Stripes).
	UCXStripes int
	// InlineBytes caps the puts a kernel's port channel to a UCX peer
	// copies into the FIFO itself (PortChannel.InlineMax; at most
	// proxy.InlineBytes): device memory staged for UCX then needs no copy
	// engine round trip before it leaves. 0: none.
	InlineBytes uint32
	// GPU is set on the GPU backend; Host on the CPU backend.
	GPU  *GPU
	Host Host
}

// GPU is what channels need of the GPU backend.
type GPU struct {
	Driver  *cuda.Driver
	Space   *symm.Space // the node's peers mapped; outlives the Channels
	Device  int
	ErrWord uintptr // device address of the communicator's ErrorWord
}

// Host is what channels need of the CPU backend.
type Host interface {
	// Contains reports whether [ptr, ptr+nbytes) is symmetric or registered.
	Contains(ptr uintptr, nbytes int64) bool
}

// Kind says which channels a set holds.
type Kind int

const (
	Memory Kind = iota + 1 // MemoryChannel
	Port                   // PortChannel
)

func (k Kind) String() string {
	if k == Memory {
		return "memory"
	}
	return "port"
}

// Channels are the channel sets of one communicator. Calls come from one
// goroutine at a time (the communicator serializes them); collective ones
// are marked.
type Channels struct {
	cfg    Config
	rank   int
	size   int
	sets   []*set // a set's id is its index plus one
	port   *portState
	mem    memState
	freed  []func() error // releases memory at Close, in order
	mu     sync.Mutex     // guards closed against Close from another goroutine
	closed bool
}

// set is one call's channels.
type set struct {
	id     uint64
	kind   Kind
	closed bool
	ptr    uintptr
	nbytes uint64
	port   []portPeer            // port sets: by rank; zero for self
	lanes  [][]proxy.PortChannel // lanes after the first over the same FIFO (kernels only)
}

// Err is the port channels' proxy's sticky error (nil while healthy or
// before the first port set): what a kernel's kErrProxy refers to.
func (c *Channels) Err() error {
	if c == nil || c.port == nil || c.port.svc == nil {
		return nil
	}
	return c.port.svc.Err()
}

// New returns the channels of a communicator; nothing is created until the
// first set.
func New(cfg Config) *Channels {
	if cfg.Timeout <= 0 {
		cfg.Timeout = proxy.DefaultTimeout
	}
	if cfg.Topology == nil {
		cfg.Topology = topo.Single(cfg.Bootstrap.Rank(), cfg.Bootstrap.Size())
	}
	return &Channels{cfg: cfg, rank: cfg.Bootstrap.Rank(), size: cfg.Bootstrap.Size()}
}

func (c *Channels) usable() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return status.Errorf(status.State, "channels used after the communicator closed")
	}
	return nil
}

// registered checks that [ptr, ptr+nbytes) is memory of this rank that the
// backend knows (symmetric or registered), where channels can point.
func (c *Channels) registered(ptr uintptr, nbytes uint64) error {
	if ptr == 0 || nbytes == 0 {
		return status.Errorf(status.InvalidArgument, "channels over %#x (%d bytes): null or empty range", ptr, nbytes)
	}
	ok := false
	switch {
	case c.cfg.GPU != nil:
		_, ok = c.cfg.GPU.Space.Lookup(ptr, nbytes)
	case c.cfg.Host != nil:
		ok = c.cfg.Host.Contains(ptr, int64(nbytes))
	}
	if !ok {
		return status.Errorf(status.InvalidArgument,
			"channels over %#x (%d bytes): the range is neither from comm.empty() nor registered (comm.register_buffer)", ptr, nbytes)
	}
	return nil
}

// agreeOnRange makes one rank's bad range every rank's error, then checks
// that every rank passed the same size (status.Mismatch names the rank).
// Collective.
func (c *Channels) agreeOnRange(what string, local error, nbytes uint64) error {
	bs := c.cfg.Bootstrap
	if err := bootstrap.Agree(bs, local); err != nil {
		return err
	}
	sizes, err := bs.AllGather(binary.LittleEndian.AppendUint64(nil, nbytes))
	if err != nil {
		return fmt.Errorf("%s: exchange sizes: %w", what, err)
	}
	first := binary.LittleEndian.Uint64(sizes[0])
	for r, b := range sizes {
		if n := binary.LittleEndian.Uint64(b); n != first {
			return status.Errorf(status.Mismatch, "%s: rank %d passed %d bytes, rank 0 passed %d", what, r, n, first)
		}
	}
	return nil
}

// Reject takes part in a MemoryChannels or PortChannels call on behalf of
// a rank whose own arguments failed (reason): its peers fail with that
// reason instead of waiting for it, and Reject returns it. Collective.
func (c *Channels) Reject(kind Kind, reason error) error {
	if reason == nil {
		reason = status.Errorf(status.InvalidArgument, "%s channels rejected", kind)
	}
	return c.agreeOnRange(kind.String()+" channels", reason, 0)
}

// add records a new set and returns it with its id.
func (c *Channels) add(s *set) *set {
	c.sets = append(c.sets, s)
	s.id = uint64(len(c.sets))
	return s
}

// lookup returns the open set of id, of kind.
func (c *Channels) lookup(id uint64, kind Kind) (*set, error) {
	if err := c.usable(); err != nil {
		return nil, err
	}
	if id == 0 || id > uint64(len(c.sets)) {
		return nil, status.Errorf(status.InvalidArgument, "channel set %d does not exist", id)
	}
	s := c.sets[id-1]
	if s.closed {
		return nil, status.Errorf(status.State, "channel set %d is closed", id)
	}
	if s.kind != kind {
		return nil, status.Errorf(status.InvalidArgument, "channel set %d holds %s channels, not %s channels", id, s.kind, kind)
	}
	return s, nil
}

// CloseSet ends the use of a set: its handles must not be used afterwards.
// Its memory and registrations stay until the communicator closes (kernels
// may still be queued against them). Not collective.
func (c *Channels) CloseSet(id uint64) error {
	if err := c.usable(); err != nil {
		return err
	}
	if id == 0 || id > uint64(len(c.sets)) {
		return status.Errorf(status.InvalidArgument, "channel set %d does not exist", id)
	}
	c.sets[id-1].closed = true
	return nil
}

// Close stops the proxy, closes the transports and frees what the sets
// allocated. Not collective: kernels using the handles must have finished
// and peers must be done putting into this rank. Idempotent.
func (c *Channels) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.mu.Unlock()
	var errs []error
	if c.port != nil {
		errs = append(errs, c.port.close())
	}
	for _, f := range c.freed {
		errs = append(errs, f())
	}
	c.freed = nil
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("close channels: %w", err)
	}
	return nil
}

// onGPU reports whether channels point into device memory (GPU backend).
func (c *Channels) onGPU() bool { return c.cfg.GPU != nil }

// ucxOptions are the UCX transport's options for this communicator.
func (c *Channels) ucxOptions() ucx.Options {
	stripes := c.cfg.UCXStripes
	if _, set := procenv.Lookup(ucx.StripesEnv); stripes == 0 && !set && c.cfg.Topology != nil {
		stripes = c.cfg.Topology.Stripes()
	}
	return ucx.Options{Timeout: c.cfg.Timeout, LibraryDirs: c.cfg.UCXDirs, ChunkBytes: c.cfg.UCXStageChunk,
		RingChunks: c.cfg.UCXStageSlots, Stripes: stripes,
		SeparateHosts: c.cfg.Topology != nil && c.cfg.Topology.SharedHosts,
		OneHost:       c.cfg.Topology != nil && c.cfg.Topology.OneHost()}
}

// newIPC creates the copy-engine transport on this rank's GPU.
func (c *Channels) newIPC() (*cudaipc.Transport, error) {
	g := c.cfg.GPU
	if err := g.Driver.EnsureContext(g.Device); err != nil {
		return nil, err
	}
	return cudaipc.New(g.Driver, g.Space, c.cfg.Timeout)
}
