// Package comm is the communicator: it joins a bootstrap to a backend and
// serializes calls into it.
package comm

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/channel"
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/gpucoll"
	"github.com/p2pcomm/p2pcomm/golib/hostcoll"
	"github.com/p2pcomm/p2pcomm/golib/proxy"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/topo"
)

// Config says how to build a communicator. Env holds the environment as
// Python saw it at construction time: the Go runtime copies the process
// environment once, when the library is loaded, and would miss later changes.
type Config struct {
	Bootstrap string            `json:"bootstrap"` // auto, tcp, torch, mpi
	Device    int               `json:"device"`    // CUDA ordinal, or -1 for the CPU backend
	Env       map[string]string `json:"env"`
}

// Lookup reads a variable from the config's environment.
func (c Config) Lookup(key string) (string, bool) {
	v, ok := c.Env[key]
	return v, ok
}

func (c Config) int64Env(key string, def int64) (int64, error) {
	v, ok := c.Env[key]
	if !ok || v == "" {
		return def, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 {
		return 0, status.Errorf(status.InvalidArgument, "%s=%q: want a positive integer", key, v)
	}
	return n, nil
}

// hostKey says which host this process runs on; tests replace it to fake
// ranks on several hosts.
var hostKey = func(Config) []byte { return topo.HostKey() }

// Comm is one communicator.
type Comm struct {
	mu       sync.Mutex
	bs       bootstrap.Bootstrap
	backend  collective.Backend
	device   int
	topo     *topo.Topology
	timeout  time.Duration
	job      uint64 // names the job's shared-memory segments (bootstrap.JobToken)
	port     portConfig
	channels *channel.Channels // created at the first channel call
	closed   bool
}

// New builds a communicator collectively. torchBS is the bootstrap over a
// torch.distributed group, or nil.
func New(cfg Config, torchBS bootstrap.Bootstrap) (*Comm, error) {
	bs, err := pickBootstrap(cfg, torchBS)
	if err != nil {
		return nil, err
	}
	timeoutMs, err := cfg.int64Env("P2PCOMM_TIMEOUT_MS", 60_000)
	if err != nil {
		bs.Close()
		return nil, err
	}
	port, err := portSettings(cfg)
	if err != nil {
		bs.Close()
		return nil, err
	}
	top, err := discover(bs, cfg)
	if err != nil {
		bs.Close()
		return nil, err
	}
	var be collective.Backend
	if cfg.Device < 0 {
		var staging int64
		if staging, err = cfg.int64Env("P2PCOMM_STAGING_BYTES", hostcoll.DefaultStagingBytes); err != nil {
			bs.Close()
			return nil, err
		}
		var rails int64
		if rails, err = cfg.int64Env(topo.NetRailsEnv, 0); err != nil {
			bs.Close()
			return nil, err
		}
		be, err = hostcoll.New(bs, hostcoll.Options{
			Job: bootstrap.JobToken(cfg.Lookup), StagingBytes: staging, Timeout: time.Duration(timeoutMs) * time.Millisecond,
			Topology: top, NetRails: int(rails),
		})
	} else {
		be, err = newGPU(bs, cfg, time.Duration(timeoutMs)*time.Millisecond, top)
	}
	if err != nil {
		bs.Close()
		return nil, err
	}
	return &Comm{bs: bs, backend: be, device: cfg.Device, topo: top, timeout: time.Duration(timeoutMs) * time.Millisecond,
		job: bootstrap.JobToken(cfg.Lookup), port: port}, nil
}

// portConfig is how port channels are built: P2PCOMM_PORT_TRANSPORT=ucx
// sends peers of this node over UCX too ("auto", or unset, uses the copy
// engine for them on GPUs); P2PCOMM_UCX_STAGE_CHUNK and _SLOTS size the ring
// that stages device memory through host memory for UCX (bytes per chunk,
// chunks in flight per peer; 0 takes the transport's defaults);
// P2PCOMM_PORT_INLINE_BYTES caps the puts a kernel's port channel carries
// in the FIFO itself (0..64, default 64; 0: none).
type portConfig struct {
	forceUCX    bool
	stageChunk  uint64
	stageSlots  int
	inlineBytes uint32
}

func portSettings(cfg Config) (portConfig, error) {
	var p portConfig
	switch v := cfg.Env[channel.PortTransportEnv]; v {
	case "", "auto":
	case "ucx":
		p.forceUCX = true
	default:
		return p, status.Errorf(status.InvalidArgument, "%s=%q: want auto or ucx", channel.PortTransportEnv, v)
	}
	chunk, err := cfg.int64Env("P2PCOMM_UCX_STAGE_CHUNK", 0)
	if err != nil {
		return p, err
	}
	slots, err := cfg.int64Env("P2PCOMM_UCX_STAGE_SLOTS", 0)
	if err != nil {
		return p, err
	}
	p.stageChunk, p.stageSlots = uint64(chunk), int(slots)
	p.inlineBytes = proxy.InlineBytes
	if v := cfg.Env["P2PCOMM_PORT_INLINE_BYTES"]; v != "" {
		n, err := strconv.ParseUint(v, 10, 32)
		if err != nil || n > proxy.InlineBytes {
			return p, status.Errorf(status.InvalidArgument, "P2PCOMM_PORT_INLINE_BYTES=%q: want 0..%d", v, proxy.InlineBytes)
		}
		p.inlineBytes = uint32(n)
	}
	return p, nil
}

// discover learns which ranks share a host (one all-gather) and groups
// them into nodes, P2PCOMM_LOCAL_SIZE ranks each when it is set.
func discover(bs bootstrap.Bootstrap, cfg Config) (*topo.Topology, error) {
	localSize, err := cfg.int64Env(topo.LocalSizeEnv, 0)
	if err != nil {
		return nil, err
	}
	return topo.Discover(bs, hostKey(cfg), int(localSize))
}

func newGPU(bs bootstrap.Bootstrap, cfg Config, timeout time.Duration, top *topo.Topology) (collective.Backend, error) {
	staging, err := cfg.int64Env("P2PCOMM_STAGING_BYTES", gpucoll.DefaultStagingBytes)
	if err != nil {
		return nil, err
	}
	maxBlocks, err := cfg.int64Env("P2PCOMM_MAX_BLOCKS", 0)
	if err != nil {
		return nil, err
	}
	rails, err := cfg.int64Env(topo.NetRailsEnv, 0)
	if err != nil {
		return nil, err
	}
	opts := gpucoll.Options{Timeout: timeout, StagingBytes: staging, MaxBlocks: int(maxBlocks), NetRails: int(rails),
		NVRTCOptions: strings.Fields(cfg.Env["P2PCOMM_NVRTC_OPTIONS"]), ShareGPUs: cfg.Env["P2PCOMM_SHARE_GPUS"] == "1",
		Topology: top}
	if name, ok := cfg.Lookup("P2PCOMM_ALGO"); ok && name != "" {
		algo, ok := collective.ParseAlgorithm(name)
		if !ok {
			return nil, status.Errorf(status.InvalidArgument, "P2PCOMM_ALGO=%q: want one of %s", name,
				strings.Join(collective.AlgorithmNames(), ", "))
		}
		opts.ForceAlgo = algo
	}
	if path, ok := cfg.Lookup("P2PCOMM_TUNE_FILE"); ok && path != "" {
		if opts.Tune, err = gpucoll.LoadTable(path, bs.Size()); err != nil {
			return nil, err
		}
	}
	return gpucoll.New(bs, cfg.Device, opts)
}

func pickBootstrap(cfg Config, torchBS bootstrap.Bootstrap) (bootstrap.Bootstrap, error) {
	kind := cfg.Bootstrap
	if v, ok := cfg.Lookup("P2PCOMM_BOOTSTRAP"); ok && v != "" {
		kind = v
	}
	if kind == "" || kind == "auto" {
		switch {
		case torchBS != nil:
			kind = "torch"
		// The launcher first: jobs outside mpirun never load libmpi.
		case bootstrap.LaunchedByMPI(cfg.Lookup) && bootstrap.MPIAvailable(cfg.Lookup):
			kind = "mpi"
		default:
			kind = "tcp"
		}
	}
	switch kind {
	case "torch":
		if torchBS == nil {
			return nil, status.Errorf(status.Bootstrap, "torch bootstrap requested but no torch.distributed group was given")
		}
		return torchBS, nil
	case "mpi":
		return bootstrap.NewMPI(cfg.Lookup) // status.Unsupported, saying how to get Open MPI, when it cannot load
	case "tcp":
		tc, err := bootstrap.TCPConfigFromEnv(cfg.Lookup)
		if err != nil {
			return nil, err
		}
		return bootstrap.NewTCP(tc)
	}
	return nil, status.Errorf(status.InvalidArgument, "unknown bootstrap %q (want auto, torch, mpi or tcp)", kind)
}

// Rank is this process's rank.
func (c *Comm) Rank() int { return c.bs.Rank() }

// Size is the number of ranks.
func (c *Comm) Size() int { return c.bs.Size() }

// Device is the CUDA ordinal, or -1 on the CPU backend.
func (c *Comm) Device() int { return c.device }

// Topology says which node each rank belongs to (ranks of one node share a
// host and reach each other's memory directly; other nodes only through a
// PortChannel). The same on every rank; do not modify it.
func (c *Comm) Topology() *topo.Topology { return c.topo }

// Do runs f on the backend with the communicator locked; it fails once the
// communicator is closed.
func (c *Comm) Do(f func(collective.Backend) error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return status.Errorf(status.State, "communicator is closed")
	}
	return f(c.backend)
}

// Check returns the first error the backend's kernels recorded (see
// collective.Backend.Check), with the port channels' proxy error beside it
// when there is one: a kernel sees only that its proxy failed, not why.
func (c *Comm) Check() error {
	return c.Do(func(b collective.Backend) error {
		err := b.Check()
		if err == nil {
			return nil
		}
		if perr := c.channels.Err(); perr != nil {
			return fmt.Errorf("%w (port channels' proxy: %v)", err, perr)
		}
		return err
	})
}

// WithChannels runs f on the communicator's channels, created at the first
// call, with the communicator locked (so a host-side wait holds other calls
// back until it returns).
func (c *Comm) WithChannels(f func(*channel.Channels) error) error {
	return c.Do(func(b collective.Backend) error {
		if c.channels == nil {
			cfg := channel.Config{Bootstrap: c.bs, Topology: c.topo, Timeout: c.timeout, ForceUCX: c.port.forceUCX,
				UCXStageChunk: c.port.stageChunk, UCXStageSlots: c.port.stageSlots, InlineBytes: c.port.inlineBytes}
			switch be := b.(type) {
			case *gpucoll.Backend:
				_, errWord, _ := be.WaitInfo()
				cfg.GPU = &channel.GPU{Driver: be.Driver(), Space: be.Space(), Device: be.Device(), ErrWord: errWord}
			case channel.Host:
				cfg.Host = be
			}
			c.channels = channel.New(cfg)
		}
		return f(c.channels)
	})
}

// Barrier waits for every rank, through the backend when it has a faster
// barrier than the bootstrap.
func (c *Comm) Barrier() error {
	return c.Do(func(b collective.Backend) error {
		if fb, ok := b.(interface{ Barrier() error }); ok {
			return fb.Barrier()
		}
		return c.bs.Barrier()
	})
}

// AllGather exchanges data of every rank (the same length on all) through
// the bootstrap, on the host: bounded by the bootstrap's own timeout (a
// torch.distributed group's, for example), never by a kernel's. For setup
// agreements that must not desynchronize: a GPU collective whose peer comes
// late can time out on one rank and succeed on the other.
func (c *Comm) AllGather(data []byte) ([][]byte, error) {
	var out [][]byte
	err := c.Do(func(collective.Backend) error {
		got, err := c.bs.AllGather(data)
		if err != nil {
			return fmt.Errorf("host all-gather: %w", err)
		}
		for r, b := range got {
			if len(b) != len(data) {
				return status.Errorf(status.Mismatch, "host all-gather: rank %d sent %d bytes, this rank %d", r, len(b), len(data))
			}
		}
		out = got
		return nil
	})
	return out, err
}

// Close releases everything. Not collective; idempotent.
func (c *Comm) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	var err error
	if c.channels != nil {
		// The proxies and transports use the backend's memory: they go first.
		err = c.channels.Close()
	}
	if berr := c.backend.Close(); err == nil {
		err = berr
	}
	if berr := c.bs.Close(); err == nil {
		err = berr
	}
	if err != nil {
		return fmt.Errorf("close communicator: %w", err)
	}
	return nil
}
