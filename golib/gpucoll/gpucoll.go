// Package gpucoll is the GPU backend: all-reduce through CUDA IPC peer
// memory with kernels compiled by NVRTC at run time.
package gpucoll

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/symm"
	"github.com/p2pcomm/p2pcomm/golib/topo"
)

// Options configure the GPU backend; zero values take the defaults.
type Options struct {
	Timeout      time.Duration // bound on every device-side wait (default 60 s)
	StagingBytes int64         // per-rank staging and scratch capacity (default 256 MiB)
	Tune         Table         // algorithm choice by size; nil: built-in defaults
	ForceAlgo    collective.Algorithm
	MaxBlocks    int      // grid limit, 1..128 (default 128)
	NVRTCOptions []string // extra options for the kernels, e.g. -DP2P_UNROLL=4
	ShareGPUs    bool     // several ranks on one GPU (tests only; see symm.Options)
	// Topology says which ranks share this rank's node; only their memory
	// is mapped (nil: every rank shares one node).
	Topology *topo.Topology
	// NetRails is how many rails (topo.NetRails) carry a rank's traffic
	// to other nodes: 1, 2, 4 or 8, 0 for the default.
	NetRails int
}

// DefaultStagingBytes is the staging capacity without P2PCOMM_STAGING_BYTES.
const DefaultStagingBytes = 256 << 20

// Backend implements collective.Backend on one GPU.
type Backend struct {
	drv     *cuda.Driver
	space   *symm.Space
	rank    int
	size    int
	device  int
	arch    int
	sms     int
	opts    Options
	signal  *symm.Buffer
	staging *symm.Buffer
	scratch *symm.Buffer
	halves  *symm.Buffer // deferred one-shot staging: two halves per rank
	ll      *symm.Buffer // LL receive buffers: two halves of llHalfBytes
	lamport *symm.Buffer // Lamport receive buffers: two halves of lamportHalfBytes, free words hold lamportFree
	bs      bootstrap.Bootstrap
	graph   graphSlots
	errHost unsafe.Pointer // *errorWord in pinned host memory
	errDev  uintptr
	kernels *kernelCache
	broken  error
	params  allReduceParams // reused per launch: no allocation on the hot path
	topo    *topo.Topology
	user    userKernels // kernels compiled from callers' sources
	nodes   *nodes      // all-reduce across nodes, from the first such call (nodes.go)
}

var _ collective.Backend = (*Backend)(nil)

// New creates the GPU backend collectively on CUDA device ordinal device.
func New(bs bootstrap.Bootstrap, device int, opts Options) (*Backend, error) {
	if opts.Timeout <= 0 {
		opts.Timeout = 60 * time.Second
	}
	if opts.StagingBytes <= 0 {
		opts.StagingBytes = DefaultStagingBytes
	}
	opts.StagingBytes = (opts.StagingBytes + 4095) &^ 4095
	if opts.MaxBlocks <= 0 || opts.MaxBlocks > kMaxBlocks {
		opts.MaxBlocks = kMaxBlocks
	}
	if bs.Size() > kMaxRanks {
		return nil, status.Errorf(status.Unsupported, "world size %d exceeds the GPU backend's limit of %d ranks", bs.Size(), kMaxRanks)
	}
	// Every rank learns if one cannot even start, instead of waiting for it
	// in the first exchange of symm.New.
	drv, cc, sms, err := probe(device)
	if err = bootstrap.Agree(bs, err); err != nil {
		return nil, err
	}
	top := opts.Topology
	if top == nil {
		top = topo.Single(bs.Rank(), bs.Size())
	}
	space, err := symm.New(drv, bs, device, symm.Options{ShareGPUs: opts.ShareGPUs, Node: top.Local()})
	if err != nil {
		return nil, err
	}
	if opts.ShareGPUs {
		sms = smsPerRank(sms, space.Peers())
		opts.MaxBlocks = min(opts.MaxBlocks, sms)
	}
	b := &Backend{drv: drv, space: space, bs: bs, rank: bs.Rank(), size: bs.Size(), device: device, arch: cc, sms: sms, opts: opts, topo: top}
	if err := b.allocWorkspace(); err != nil {
		b.Close()
		return nil, err
	}
	b.kernels = newKernelCache(drv, device, cc, opts.NVRTCOptions)
	// Every rank's signals are zero before any kernel can write a peer's.
	if err := bs.Barrier(); err != nil {
		b.Close()
		return nil, err
	}
	return b, nil
}

// smsPerRank is the SMs each rank may count on when ranks share GPUs: a
// kernel waiting for a peer's spins on its SM, so the ranks on one GPU must
// all fit at once, with one SM each to spare for a one-block helper (the
// MoE stage gate). The most ranks on any GPU decides, so that every rank
// derives the same grids.
func smsPerRank(sms int, peers []symm.Peer) int {
	on := map[[16]byte]int{}
	most := 1
	for _, p := range peers {
		on[p.UUID]++
		most = max(most, on[p.UUID])
	}
	if most == 1 {
		return sms
	}
	return max(1, sms/most-1)
}

// probe loads the driver and reads what the backend needs of the device.
func probe(device int) (drv *cuda.Driver, cc, sms int, err error) {
	if drv, err = cuda.Load(); err != nil {
		return nil, 0, 0, fmt.Errorf("GPU backend needs the CUDA driver: %w", err)
	}
	if err = drv.EnsureContext(device); err != nil {
		return nil, 0, 0, fmt.Errorf("make device %d current: %w", device, err)
	}
	dev, err := drv.Device(device)
	if err != nil {
		return nil, 0, 0, err
	}
	if cc, err = drv.ComputeCapability(dev); err != nil {
		return nil, 0, 0, err
	}
	if sms, err = drv.DeviceAttribute(cuda.AttrMultiprocessorCount, dev); err != nil {
		return nil, 0, 0, err
	}
	return drv, cc, sms, nil
}

func (b *Backend) allocWorkspace() error {
	var err error
	if b.signal, err = b.space.Alloc(signalBytes); err != nil {
		return fmt.Errorf("allocate signals: %w", err)
	}
	if b.staging, err = b.space.Alloc(uint64(b.opts.StagingBytes)); err != nil {
		return fmt.Errorf("allocate %d bytes of staging: %w", b.opts.StagingBytes, err)
	}
	if b.scratch, err = b.space.Alloc(uint64(b.opts.StagingBytes)); err != nil {
		return fmt.Errorf("allocate %d bytes of scratch: %w", b.opts.StagingBytes, err)
	}
	if b.halves, err = b.space.Alloc(2 * deferredHalfBytes); err != nil {
		return fmt.Errorf("allocate one-shot staging: %w", err)
	}
	if b.ll, err = b.space.Alloc(uint64(2 * llHalfBytes(b.size))); err != nil {
		return fmt.Errorf("allocate LL buffers: %w", err)
	}
	// Every word free before any peer can send: the next allocation is
	// collective, and no peer gets past it before this rank does.
	if b.lamport, err = b.space.Alloc(2 * lamportHalfBytes); err != nil {
		return fmt.Errorf("allocate Lamport buffers: %w", err)
	}
	if err = b.drv.MemsetD32Async(b.lamport.Local, lamportFree, 2*lamportHalfBytes/4, 0); err == nil {
		err = b.drv.StreamSynchronize(0)
	}
	if err != nil {
		return fmt.Errorf("free the Lamport buffers: %w", err)
	}
	if b.graph.table, err = b.space.Alloc(maxGraphSlots * graphSlotBytes); err != nil {
		return fmt.Errorf("allocate graph slots: %w", err)
	}
	hm, err := b.space.HostMapped(uint64(unsafe.Sizeof(errorWord{})))
	if err != nil {
		return fmt.Errorf("allocate the error word: %w", err)
	}
	b.errHost, b.errDev = hm.Host, hm.Device
	*(*errorWord)(hm.Host) = errorWord{}
	return nil
}

// Alloc allocates symmetric device memory.
func (b *Backend) Alloc(nbytes int64) (uintptr, error) {
	if err := b.usable(); err != nil {
		return 0, err
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return 0, err
	}
	buf, err := b.space.Alloc(uint64(nbytes))
	if err != nil {
		return 0, err
	}
	return buf.Local, nil
}

// Free is not supported one allocation at a time: symmetric memory lives
// until the communicator closes.
func (b *Backend) Free(ptr uintptr) error {
	return status.Errorf(status.Unsupported, "GPU symmetric memory is released when the communicator closes")
}

// Register opens peers' IPC mappings of [ptr, ptr+nbytes) so all-reduce on
// it runs in place without staging.
func (b *Backend) Register(ptr uintptr, nbytes int64) error {
	if err := b.usable(); err != nil {
		return err
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	_, err := b.space.Register(ptr, uint64(nbytes))
	return err
}

// Deregister forgets a registration.
func (b *Backend) Deregister(ptr uintptr) error { return b.space.Deregister(ptr) }

// Check reports what a kernel recorded in the error word. A timeout breaks
// the communicator for good: the ranks' counters no longer agree.
func (b *Backend) Check() error {
	if b.broken != nil {
		return b.broken
	}
	if b.errHost == nil {
		return nil
	}
	w := (*errorWord)(b.errHost)
	code := atomic.LoadUint32(&w.Code)
	if code == 0 {
		return nil
	}
	e := *w
	err := describe(e)
	if perr := b.nodes.proxyErr(); perr != nil && code != errMismatch {
		// The kernel saw only that its proxy failed, not why. A peer the
		// transport lost is the failure the caller must see (its code, the
		// rank it names).
		if code == errProxy && status.CodeOf(perr) == status.Timeout {
			err = status.Errorf(status.Timeout, "%v (all-reduce across nodes; on the device: %v)", perr, err)
		} else {
			err = fmt.Errorf("%w (all-reduce across nodes, proxy: %v)", err, perr)
		}
	}
	if code == errMismatch {
		// Nothing was reduced and every rank finished its barriers: usable.
		atomic.StoreUint32(&w.Code, 0)
		return err
	}
	b.broken = fmt.Errorf("communicator unusable: %w", err)
	return err
}

// Close frees everything. Not collective; idempotent. The caller's thread
// may have another device's context current, so this device's is made
// current first (frees and IPC closes act on the current context).
func (b *Backend) Close() error {
	var err error
	if b.nodes != nil && b.space != nil {
		// Kernels across nodes still queued or running need the proxies and
		// UCX that closeNodes stops (theirs and their peers'): stopped under
		// them, they would wait out their whole timeout, and so would the
		// frees below (they synchronize). Let them end first; with the proxies
		// up they end, or time out on a peer that is gone, within the timeout.
		if err = b.drv.EnsureContext(b.device); err == nil {
			err = b.drv.CtxSynchronize()
		}
	}
	err = errors.Join(err, b.closeNodes()) // its proxies use the memory freed below
	if b.space != nil {
		// Free even if the context could not be made current: a leak is
		// worse than a failed free, and both are reported.
		// Frees wait for the device, so no kernel of the modules unloaded
		// after them still runs.
		err = errors.Join(err, b.drv.EnsureContext(b.device), b.space.Close(), // also frees the host-mapped error word
			b.kernels.close())
		if err != nil {
			err = fmt.Errorf("close the GPU communicator: %w", err)
		}
		b.space = nil
	}
	b.errHost = nil
	if b.broken == nil {
		b.broken = status.Errorf(status.State, "communicator is closed")
	}
	return err
}

func (b *Backend) usable() error {
	if b.broken != nil {
		return b.broken
	}
	return nil
}

// PeerAddress returns where this process maps rank's copy of a symmetric or
// registered range.
func (b *Backend) PeerAddress(ptr uintptr, nbytes int64, rank int) (uintptr, error) {
	if err := b.usable(); err != nil {
		return 0, err
	}
	if rank < 0 || rank >= b.size {
		return 0, status.Errorf(status.InvalidArgument, "rank %d out of range [0, %d)", rank, b.size)
	}
	if !b.topo.SameNode(rank) {
		return 0, status.Errorf(status.Unsupported, "rank %d is on node %d, rank %d on node %d: memory of another node is not mapped (%s)",
			rank, b.topo.NodeOf[rank], b.rank, b.topo.Node(), b.topo)
	}
	buf, ok := b.space.Lookup(ptr, uint64(nbytes))
	if !ok {
		return 0, status.Errorf(status.InvalidArgument, "%#x (+%d bytes) is neither from comm.empty() nor registered", ptr, nbytes)
	}
	return buf.Peers[rank] + (ptr - buf.Local), nil
}

// acrossNodes is the error of calls that need every rank's memory.
func (b *Backend) acrossNodes(what string) error {
	return status.Errorf(status.Unsupported, "%s across nodes is not available on the GPU backend: this communicator spans %s", what, b.topo)
}

// Topology is the node layout the backend was built with.
func (b *Backend) Topology() *topo.Topology { return b.topo }

// Space is the backend's symmetric memory (its node's peers mapped); it
// lives until Close.
func (b *Backend) Space() *symm.Space { return b.space }

// Driver is the CUDA driver the backend uses.
func (b *Backend) Driver() *cuda.Driver { return b.drv }

// Device is the CUDA ordinal of the backend's GPU.
func (b *Backend) Device() int { return b.device }

// Timeout bounds every wait of the backend's kernels (P2PCOMM_TIMEOUT_MS).
func (b *Backend) Timeout() time.Duration { return b.opts.Timeout }

// NetRails is the rail count asked for across nodes (0: the default).
func (b *Backend) NetRails() int { return b.opts.NetRails }
