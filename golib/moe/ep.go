package moe

import (
	"io"
	"sync"

	"github.com/p2pcomm/p2pcomm/golib/status"
	timeline "github.com/p2pcomm/p2pcomm/golib/trace"
)

// EP is one rank's expert-parallel engine: built collectively by NewGPU
// or NewCPU, then used for dispatch and combine calls that every rank makes
// in the same order. Calls are serialized (the communicator's lock orders
// them with its other calls); Close takes only the EP's own lock, so that it
// can run from a finalizer while another call of the communicator (one
// waiting in a host exchange that called back into Python) holds that one.
type EP struct {
	mu sync.Mutex
	plan
	gpu    *gpuEngine
	cpu    *cpuEngine
	staged *stagedEngine // GPU tensors through cpu's path (ranks on several nodes)
	checks []int32       // every rank's check of the latest eager call
	// pending: an eager dispatch has run up to the host's read of the counts
	// and awaits Expand with pendingRows rows.
	pending     bool
	pendingRows int64
	closed      bool
}

// Rows is where a dispatch's result goes (device or host addresses, as
// the EP's path): X [Rows, H] of dtype (float8 with Config.DispatchFP8,
// and then Scales [Rows, H/128] float32), Info [4, Rows] int32 (local
// expert, source rank, source token, weight bits) and Counts [L+1] int32
// (rows per local expert, then R).
type Rows struct {
	X, Scales, Info, Counts uintptr
	Rows                    int64
}

// DispatchArgs is one dispatch. TopkIdx is [T, K] of IdxBytes-byte
// integers, TopkWeights [T, K] float32 and X [T, H] of dtype (float8 with
// Config.DispatchFP8, and then Scales [T, H/128] float32), all contiguous
// (X and Scales 16-byte aligned on GPU). Check is this rank's verdict on
// its arguments (0: passed, else the status code of its error): an eager
// call still takes part with T = 0, so that every rank fails together.
type DispatchArgs struct {
	X, Scales, TopkIdx  uintptr
	TopkWeights         uintptr
	NumTokens, IdxBytes int
	Check               int32
	Capturable          bool
	Stream              uintptr // GPU: the caller's stream
	Out                 Rows    // capturable: MaxRecvRows rows
	// orderOnly: a capturable call of the host path stops once the rows'
	// order is settled (the staged path's kernels lay them out).
	orderOnly bool
}

// CombineArgs is one combine: ExpertOut [ExpertRows, H] of dtype in the
// latest dispatch's row order, into Y [NumTokens, H] of dtype, NumTokens
// being this rank's tokens in that dispatch. Check as in DispatchArgs.
type CombineArgs struct {
	ExpertOut  uintptr
	ExpertRows int64
	Y          uintptr
	NumTokens  int
	Check      int32
	Capturable bool
	Stream     uintptr
}

// NewGPU builds an EP on the GPU backend, collectively: every rank
// resolves (and, the first time in a process, compiles) the kernels its
// configuration needs before the ranks agree on it, so that no rank
// compiles inside a call while its peers wait in their kernels; then the
// buffers are allocated. A rank that cannot take the configuration makes
// every rank fail: itself with its reason, the others with status.Mismatch
// naming it.
func NewGPU(g Group, dev GPU, c Config) (*EP, error) {
	var problem error
	var eng *gpuEngine
	if c.Rejected {
		problem = ErrRejected
	} else if problem = c.check(); problem == nil {
		eng, problem = newGPUEngine(dev, c, g.Size())
	}
	blocks, err := agree(g, c, problem, wantedBlocks(c.NumSMs, dev.SMCount()))
	if err != nil {
		return nil, err
	}
	e := &EP{plan: newPlan(c, g.Rank(), g.Size()), gpu: eng, checks: make([]int32, g.Size())}
	e.blocks = blocks
	if err := eng.setup(&e.plan); err != nil {
		eng.close()
		return nil, err
	}
	// Every rank's buffers are zeroed before any peer posts into them.
	if err := g.Barrier(); err != nil {
		eng.close()
		return nil, err
	}
	return e, nil
}

// NewCPU builds an EP on the CPU backend, collectively (see NewGPU).
func NewCPU(g Group, host Host, c Config) (*EP, error) {
	return newHostPath(g, host, nil, nil, c)
}

// NewStaged builds, collectively, an EP of GPU tensors on ranks that span
// nodes: each call copies its tensors to pinned host memory on the
// caller's stream and runs the CPU path over host, a host backend of the
// same ranks and nodes that the EP owns from here on (closed with it, or
// here on failure). Capturable calls whose rows the kernels take can be
// recorded in a CUDA graph: recorded, the host's part becomes host
// functions on the stream (staged_async.go); other calls wait for the host.
func NewStaged(g Group, host interface {
	Host
	io.Closer
}, dev StagedDevice, c Config) (*EP, error) {
	return newHostPath(g, host, host, dev, c)
}

// newHostPath builds an EP on the host path, staged through dev's pinned
// memory when dev is not nil (owning closer).
func newHostPath(g Group, host Host, closer io.Closer, dev StagedDevice, c Config) (*EP, error) {
	var problem error
	if c.Rejected {
		problem = ErrRejected
	} else if problem = c.check(); problem == nil && c.DispatchFP8 {
		problem = status.Errorf(status.Unsupported,
			"fp8 dispatch runs on the GPU kernels of one node; this ExpertParallel takes the host path (CPU, or ranks on several nodes)")
	}
	e := &EP{plan: newPlan(c, g.Rank(), g.Size()), cpu: newCPUEngine(host), checks: make([]int32, g.Size())}
	if problem == nil && dev != nil {
		e.staged, problem = newStagedEngine(dev, closer, &e.plan)
	}
	fail := func(err error) (*EP, error) {
		e.cpu.close()
		if e.staged != nil {
			e.staged.close()
		} else if closer != nil {
			closer.Close()
		}
		return nil, err
	}
	if _, err := agree(g, c, problem, 0); err != nil {
		return fail(err)
	}
	if err := e.cpu.setup(g, &e.plan); err != nil {
		return fail(err)
	}
	if err := g.Barrier(); err != nil {
		return fail(err)
	}
	return e, nil
}

// Info describes the EP to its caller.
func (e *EP) Info() Info {
	in := Info{Kernels: e.gpu != nil, Blocks: e.blocks, MaxRecvRows: e.maxRecvRows, SelfLocalMinTokens: SelfLocalMinTokens}
	if e.gpu != nil {
		in.Staging = e.gpu.xs
	}
	return in
}

// Checks is every rank's verdict in the latest eager call, by rank (0:
// passed): when one is not 0 the call moved no data, and every rank's
// caller raises (its own error, or one naming the ranks that failed).
func (e *EP) Checks() []int32 { return e.checks }

func (e *EP) usable() error {
	if e.closed {
		return status.Errorf(status.State, "ExpertParallel is closed")
	}
	var err error
	switch {
	case e.gpu != nil:
		if err = e.gpu.dev.Check(); err == nil {
			err = e.gpu.dev.EnsureContext()
		}
	case e.staged != nil:
		if err = e.staged.failure(); err != nil {
			break
		}
		// A host function of a stream-ordered call may be using the host
		// path: then it records what it meets, and this call skips the look.
		if e.staged.hostMu.TryLock() {
			err = e.cpu.check()
			e.staged.hostMu.Unlock()
		}
		if err == nil {
			err = e.staged.dev.EnsureContext()
		}
	default:
		err = e.cpu.check()
	}
	return err
}

// Dispatch sends this rank's tokens to the ranks of their experts.
// Capturable calls run entirely, into a.Out, and never wait on the host.
// Eager calls agree on every rank's Check first (see Checks) and run up to
// the point where this rank knows how many rows it receives, which they
// return (0 when a rank failed): the caller sizes the outputs and calls
// Expand. Work is ordered on a.Stream.
func (e *EP) Dispatch(a *DispatchArgs) (int64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.pending = false
	if err := e.usable(); err != nil {
		return 0, err
	}
	// An eager fp8 call without its rows' scales still takes part (as a
	// rejected one), so that its peers fail with it instead of waiting.
	var own error
	if e.fp8 && a.Check == 0 && a.NumTokens > 0 && a.Scales == 0 {
		own = status.Errorf(status.InvalidArgument, "ExpertParallel: an fp8 dispatch needs the rows' scales")
		if a.Capturable {
			return 0, own
		}
		a.Check = int32(status.InvalidArgument)
	}
	if a.Check != 0 || a.NumTokens < 0 {
		a.X, a.Scales, a.TopkIdx, a.TopkWeights, a.NumTokens, a.IdxBytes = 0, 0, 0, 0, 0, 4
		if a.Check == 0 {
			a.Check = int32(status.InvalidArgument)
		}
	}
	if a.Check == 0 && (a.NumTokens > e.maxTokens || (a.IdxBytes != 4 && a.IdxBytes != 8)) {
		return 0, status.Errorf(status.InvalidArgument, "ExpertParallel: %d tokens of %d-byte ids (at most %d tokens)",
			a.NumTokens, a.IdxBytes, e.maxTokens)
	}
	if e.fp8 && a.Capturable && a.Out.Scales == 0 {
		return 0, status.Errorf(status.InvalidArgument, "ExpertParallel: a capturable fp8 dispatch needs room for the received rows' scales")
	}
	if a.Capturable && a.Out.Rows != e.maxRecvRows {
		return 0, status.Errorf(status.InvalidArgument, "ExpertParallel: a capturable dispatch returns %d rows, got room for %d",
			e.maxRecvRows, a.Out.Rows)
	}
	clear(e.checks)
	var rows int64
	var err error
	switch {
	case e.gpu != nil:
		rows, err = e.gpu.dispatch(a, e.checks)
	case e.staged != nil:
		rows, err = e.staged.dispatch(e.cpu, a, e.checks)
	default:
		rows, err = e.cpu.dispatch(a, e.checks)
	}
	if own != nil && err == nil {
		err = own
	}
	if err != nil || a.Capturable {
		return rows, err
	}
	for _, c := range e.checks {
		if c != 0 {
			return 0, nil
		}
	}
	e.pending, e.pendingRows = true, rows
	return rows, nil
}

// Expand finishes an eager dispatch: the rows Dispatch returned, with
// their metadata, into out (out.Rows must be that number).
func (e *EP) Expand(out Rows, stream uintptr) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.pending {
		return status.Errorf(status.State, "ExpertParallel: expand without a dispatch awaiting it")
	}
	if out.Rows != e.pendingRows {
		return status.Errorf(status.InvalidArgument, "ExpertParallel: the dispatch received %d rows, got room for %d",
			e.pendingRows, out.Rows)
	}
	if e.fp8 && out.Scales == 0 && out.Rows > 0 {
		return status.Errorf(status.InvalidArgument, "ExpertParallel: an fp8 dispatch needs room for the received rows' scales")
	}
	e.pending = false
	if err := e.usable(); err != nil {
		return err
	}
	switch {
	case e.gpu != nil:
		return e.gpu.expand(out, stream, 0)
	case e.staged != nil:
		return e.staged.expand(e.cpu, out, stream)
	}
	return e.cpu.expand(out)
}

// Combine sums, on each rank that dispatched, its tokens' expert outputs
// weighted by their topk weights, in the order the package documents.
// Eager calls agree on every rank's Check first (see Checks); capturable
// ones never wait on the host.
func (e *EP) Combine(a *CombineArgs) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.pending = false
	if err := e.usable(); err != nil {
		return err
	}
	if a.Check != 0 || a.NumTokens < 0 {
		a.ExpertOut, a.ExpertRows, a.Y, a.NumTokens = 0, 0, 0, 0
		if a.Check == 0 {
			a.Check = int32(status.InvalidArgument)
		}
	}
	if a.Check == 0 && a.NumTokens > e.maxTokens {
		return status.Errorf(status.InvalidArgument, "ExpertParallel: combine of %d tokens (at most %d)", a.NumTokens, e.maxTokens)
	}
	clear(e.checks)
	switch {
	case e.gpu != nil:
		return e.gpu.combine(a, e.checks)
	case e.staged != nil:
		return e.staged.combine(e.cpu, a, e.checks)
	}
	return e.cpu.combine(a, e.checks)
}

// Trace returns the kernel path's steps since the previous call of Trace
// (tests read it to see which path a call took).
func (e *EP) Trace() []Launch {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.gpu == nil {
		return nil
	}
	return e.gpu.trace.take()
}

// Close releases this rank's streams, events and pinned memory; the
// symmetric buffers live until the communicator closes. Not collective,
// but across nodes on GPUs it first waits for the device, so calls still
// queued in stream order finish, each waiting for its peers at most the
// timeout. Calls afterwards fail with status.State. Idempotent.
func (e *EP) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	e.closed = true
	if e.gpu != nil {
		return e.gpu.close()
	}
	if e.staged != nil {
		e.staged.quiesce()
	}
	_ = timeline.Write() // a diagnostic (P2PCOMM_PROXY_TRACE): a prefix that cannot be written does not fail Close
	err := e.cpu.close()
	if e.staged != nil {
		if serr := e.staged.close(); err == nil {
			err = serr
		}
	}
	return err
}
