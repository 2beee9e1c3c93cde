package moe

import (
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/status"
	timeline "github.com/p2pcomm/p2pcomm/golib/trace"
)

// The staged path: an EP of GPU tensors whose ranks span nodes. Without a
// NIC that reaches GPU memory (UCX over tcp cannot, usefully), every byte
// that crosses nodes goes through host memory anyway, so the call runs the
// CPU path's protocol on pinned host copies of its tensors: the inputs
// come down on the caller's stream, the host path moves them (node-local
// peers through shared memory, other nodes through UCX), and the outputs go
// back up on the same stream; where they can, kernels lay the rows out and
// make the partials on the device (staged_kernels.go). Results are the host
// path's, which are the kernels' bit for bit.

// StagedDevice is what the staged path needs of the GPU backend: copies,
// streams, events, pinned and device memory, whether a stream is
// capturing, and its kernels (see GPU).
type StagedDevice interface {
	Runtime
	StreamCaptureStatus(stream uintptr) (cuda.CaptureStatus, error)
	MemAlloc(n uint64) (uintptr, error)
	MemFree(p uintptr) error
	KernelFunction(file, expr string) (cuda.Function, error)
	LaunchFunction(fn cuda.Function, grid, block, sharedBytes uint32, stream uintptr, params []byte) error
	// CtxSynchronize waits for all of the device's work of this context.
	CtxSynchronize() error
	// MemHostDevicePointer is the device address of mapped pinned memory.
	MemHostDevicePointer(host unsafe.Pointer) (uintptr, error)
	// LaunchHostFunc orders fn, which makes no CUDA call, on stream (a
	// graph that records it runs it at each replay) until release
	// (cuda.Driver.LaunchHostFunc).
	LaunchHostFunc(stream uintptr, fn func()) (release func(), err error)
	// LaunchHostFuncOnce orders fn on a stream that is not capturing; it
	// runs once (cuda.Driver.LaunchHostFuncOnce).
	LaunchHostFuncOnce(stream uintptr, fn func()) error
}

// growBuf is pinned host memory, or device memory, that grows on demand.
type growBuf struct {
	p      uintptr
	cap    uint64
	device bool    // device memory, else pinned host memory
	mapped bool    // pinned memory the kernels read too
	dp     uintptr // mapped: the device's address of p
	fixed  bool    // a CUDA graph may hold its address: made at its largest, it never moves
}

func (b *growBuf) addr() uintptr { return b.p }

// reserve makes room for n bytes (keeping none of the old contents),
// growing by doubling up to most, the most any call needs.
func (b *growBuf) reserve(dev StagedDevice, n, most uint64, what string) error {
	if n <= b.cap {
		return nil
	}
	if b.fixed && b.p != 0 {
		return status.Errorf(status.Internal, "ExpertParallel across nodes: %d bytes for %s outgrow its fixed buffer of %d", n, what, b.cap)
	}
	n = max(n, min(2*b.cap, most))
	b.free(dev)
	if b.device {
		p, err := dev.MemAlloc(n)
		if err != nil {
			return status.Errorf(status.Capacity, "ExpertParallel across nodes: allocate %d bytes of device memory for %s: %v", n, what, err)
		}
		b.p = p
	} else {
		flags := uint32(cuda.HostAllocPortable)
		if b.mapped {
			flags |= cuda.HostAllocDeviceMap
		}
		p, err := dev.MemHostAlloc(n, flags)
		if err != nil {
			return status.Errorf(status.Capacity, "ExpertParallel across nodes: pin %d bytes of host memory for %s: %v", n, what, err)
		}
		b.p = uintptr(p)
		if b.mapped {
			if b.dp, err = dev.MemHostDevicePointer(p); err != nil {
				b.free(dev)
				return fmt.Errorf("ExpertParallel across nodes: map %s into the device: %w", what, err)
			}
		}
	}
	b.cap = n
	return nil
}

func (b *growBuf) free(dev StagedDevice) {
	switch {
	case b.p == 0:
	case b.device:
		dev.MemFree(b.p)
	default:
		dev.MemFreeHost(hostPtr(b.p))
	}
	b.p, b.cap, b.dp = 0, 0, 0
}

// stagedEngine carries one EP's calls between the device and the host path.
type stagedEngine struct {
	dev  StagedDevice
	host io.Closer // the host backend this EP made for itself
	p    *plan
	// in: a dispatch's x, then its ids and weights; a combine's y.
	// rows: with kernels, the received rows going up, then the partials
	// (come down, or written in place by calls in stream order).
	// laid: where the host lays out rows: dispatched rows out, a
	// combine's expert rows in (configurations or outputs the kernels do
	// not take). index: the kernels' row indices and weights.
	in, rows, laid, info, counts, index growBuf        // pinned
	k                                   *stagedKernels // nil: the host does the kernels' work
	done                                cuda.Event     // recorded after the latest upload
	uploading                           bool           // done awaits a wait before the buffers are reused
	lastRows                            int64          // rows of the latest result laid out (what combine reads)

	// Calls in stream order (staged_async.go): capturable calls run their
	// host work in host functions.
	hostMu   sync.Mutex            // the host path's state: host functions against the caller's thread
	ordered  bool                  // a call in stream order was made: its host functions may be pending
	closed   atomic.Bool           // quiesced: a host function reached after it runs nothing
	items    growBuf               // mapped: the item and packed-row counts the next kernels read
	bases    []int64               // a combine's partials by source, from its first host function to its second
	failed   atomic.Pointer[error] // a host function's failure, raised by the next call
	releases []func()              // host functions recorded in CUDA graphs, forgotten at close
}

// reserveRows makes room for n dispatched rows and their metadata.
func (s *stagedEngine) reserveRows(n int64) error {
	rb, most := uint64(s.p.rowBytes()), uint64(s.p.maxRecvRows)
	if err := s.laid.reserve(s.dev, uint64(max(n, 1))*rb, most*rb, "the dispatched rows"); err != nil {
		return err
	}
	return s.reserveMeta(n)
}

// reserveMeta makes room for the metadata of n dispatched rows.
func (s *stagedEngine) reserveMeta(n int64) error {
	return s.info.reserve(s.dev, 16*uint64(max(n, 1)), 16*uint64(s.p.maxRecvRows), "the rows' metadata")
}

// inLayout is where a dispatch's x, ids and weights of T tokens sit in
// s.in (the ids 8-byte aligned), and its size for T.
func (s *stagedEngine) inLayout(T int) (idx, w, size uint64) {
	K := uint64(s.p.topK)
	idx = (uint64(T)*uint64(s.p.rowBytes()) + 7) &^ 7
	w = idx + uint64(T)*K*8
	return idx, w, w + uint64(T)*K*4
}

func newStagedEngine(dev StagedDevice, host io.Closer, p *plan) (*stagedEngine, error) {
	s := &stagedEngine{dev: dev, host: host, p: p}
	if err := dev.EnsureContext(); err != nil {
		return nil, err
	}
	_, _, in := s.inLayout(p.maxTokens)
	err := s.in.reserve(dev, in, in, "a call's tokens")
	if err == nil {
		counts := 4 * uint64(p.numLocal+1)
		err = s.counts.reserve(dev, counts, counts, "the row counts")
	}
	if err == nil {
		s.k, err = loadStagedKernels(dev, p)
	}
	if err == nil && p.capturable && s.k == nil {
		// Capturable calls return every row position: room for all of them.
		err = s.reserveRows(p.maxRecvRows)
	}
	if err == nil && p.capturable && s.k != nil {
		err = s.asyncReady(false)
	}
	if err == nil {
		s.done, err = dev.EventCreate(cuda.EventDisableTiming)
	}
	if err != nil {
		s.release()
		return nil, err
	}
	return s, nil
}

// kernelsFor says whether the kernels may read or write the rows at addr
// (device rows are read and written 16 bytes at a time).
func (s *stagedEngine) kernelsFor(addr uintptr) bool { return s.k != nil && addr%16 == 0 }

// settle waits until the latest upload has left the pinned buffers.
func (s *stagedEngine) settle() error {
	if !s.uploading {
		return nil
	}
	s.uploading = false
	return s.dev.EventSynchronize(s.done)
}

// uploaded marks the end of this call's uploads on stream.
func (s *stagedEngine) uploaded(stream uintptr) error {
	if err := s.dev.EventRecord(s.done, stream); err != nil {
		return err
	}
	s.uploading = true
	return nil
}

// refuseCapture: a call that waits for the host cannot be recorded into a
// CUDA graph.
func (s *stagedEngine) refuseCapture(stream uintptr, what string) error {
	st, err := s.dev.StreamCaptureStatus(stream)
	if err != nil {
		return err
	}
	if st != cuda.CaptureNone {
		return status.Errorf(status.Unsupported, "ExpertParallel across nodes on GPUs records only capturable calls of "+
			"16-bit or float32 rows whose size is a multiple of 16 bytes in a CUDA graph (this %s waits for the host "+
			"between its copies); call it outside the capture", what)
	}
	return nil
}

// download copies n bytes from the device at src to host dst, ordered on
// stream; the caller synchronizes.
func (s *stagedEngine) download(dst, src uintptr, n uint64, stream uintptr) error {
	if n == 0 || src == 0 {
		return nil
	}
	return s.dev.MemcpyAsync(dst, src, n, stream)
}

func (s *stagedEngine) dispatch(cpu *cpuEngine, a *DispatchArgs, checks []int32) (int64, error) {
	p := s.p
	if a.Capturable && s.kernelsFor(a.Out.X) {
		capturing, err := s.capturing(a.Stream)
		if err != nil {
			return 0, err
		}
		return s.dispatchAsync(cpu, a, capturing)
	}
	if err := s.refuseCapture(a.Stream, "dispatch"); err != nil {
		return 0, err
	}
	if err := s.settle(); err != nil {
		return 0, err
	}
	h, err := s.downloadInputs(a)
	if err == nil {
		err = s.dev.StreamSynchronize(a.Stream)
	}
	if err != nil {
		return 0, err
	}
	if a.Capturable { // rows the kernels do not take (those they take run in stream order)
		if err := s.reserveRows(p.maxRecvRows); err != nil {
			return 0, err
		}
		h.Out = Rows{X: s.laid.addr(), Info: s.info.addr(), Counts: s.counts.addr(), Rows: p.maxRecvRows}
	}
	var rows int64
	err = s.onHost(func() (err error) {
		rows, err = cpu.dispatch(&h, checks)
		return err
	})
	if err != nil || !a.Capturable {
		return rows, err
	}
	s.lastRows = cpu.received()
	return rows, s.upload(a.Out, p.maxRecvRows, true, a.Stream)
}

// onHost runs f, the host path's work of a call on the caller's thread,
// under the lock host functions take (released even if f panics).
func (s *stagedEngine) onHost(f func() error) error {
	s.hostMu.Lock()
	defer s.hostMu.Unlock()
	if timeline.On() {
		timeline.Mark("moe host work")
		defer timeline.Mark("moe host work done")
	}
	return f()
}

// downloadInputs queues the copies of a dispatch's x, ids and weights
// into s.in on a.Stream, and returns a's arguments pointing there.
func (s *stagedEngine) downloadInputs(a *DispatchArgs) (DispatchArgs, error) {
	h := *a
	T, K, rb := uint64(a.NumTokens), uint64(s.p.topK), uint64(s.p.rowBytes())
	idxAt, wAt, _ := s.inLayout(a.NumTokens)
	h.X, h.TopkIdx, h.TopkWeights = s.in.addr(), s.in.addr()+uintptr(idxAt), s.in.addr()+uintptr(wAt)
	if a.X == 0 {
		h.X, h.TopkIdx, h.TopkWeights = 0, 0, 0
	}
	err := s.download(h.X, a.X, T*rb, a.Stream)
	if err == nil {
		err = s.download(h.TopkIdx, a.TopkIdx, T*K*uint64(a.IdxBytes), a.Stream)
	}
	if err == nil {
		err = s.download(h.TopkWeights, a.TopkWeights, T*K*4, a.Stream)
	}
	return h, err
}

// expand finishes an eager dispatch of out.Rows rows into out.
func (s *stagedEngine) expand(cpu *cpuEngine, out Rows, stream uintptr) error {
	if err := s.refuseCapture(stream, "dispatch"); err != nil {
		return err
	}
	if err := s.settle(); err != nil {
		return err
	}
	if s.ordered { // a call in stream order may still be running its host functions
		if err := s.dev.StreamSynchronize(stream); err != nil {
			return err
		}
	}
	if s.kernelsFor(out.X) {
		return s.expandOnDevice(cpu, out, out.Rows, stream)
	}
	if err := s.reserveRows(out.Rows); err != nil {
		return err
	}
	err := s.onHost(func() error {
		return cpu.expand(Rows{X: s.laid.addr(), Info: s.info.addr(), Counts: s.counts.addr(), Rows: out.Rows})
	})
	if err != nil {
		return err
	}
	// Combine reads what expand laid out: set only once a result exists.
	s.lastRows = cpu.received()
	return s.upload(out, out.Rows, true, stream)
}

// upload copies the expanded rows (s.lastRows of them; unless the device
// laid them out), their metadata and the counts from the pinned buffers to
// out on stream. The pinned metadata has the layout of held rows (as
// cpuEngine.order wrote it).
func (s *stagedEngine) upload(out Rows, held int64, rows bool, stream uintptr) error {
	p := s.p
	n, rb := uint64(s.lastRows), uint64(p.rowBytes())
	var err error
	if n > 0 {
		if rows {
			err = s.dev.MemcpyAsync(out.X, s.laid.addr(), n*rb, stream)
		}
		for j := uint64(0); j < 4 && err == nil; j++ {
			err = s.dev.MemcpyAsync(out.Info+uintptr(4*j*uint64(out.Rows)), s.info.addr()+uintptr(4*j*uint64(held)), 4*n, stream)
		}
	}
	if err == nil {
		err = s.dev.MemcpyAsync(out.Counts, s.counts.addr(), 4*uint64(p.numLocal+1), stream)
	}
	if err == nil {
		err = s.uploaded(stream)
	}
	if err != nil {
		// Copies queued before the failure may still read the buffers.
		s.dev.StreamSynchronize(stream)
	}
	return err
}

func (s *stagedEngine) combine(cpu *cpuEngine, a *CombineArgs, checks []int32) error {
	p := s.p
	if a.Capturable && s.k != nil && (a.ExpertOut == 0 || s.kernelsFor(a.ExpertOut)) {
		capturing, err := s.capturing(a.Stream)
		if err != nil {
			return err
		}
		return s.combineAsync(cpu, a, capturing)
	}
	if err := s.refuseCapture(a.Stream, "combine"); err != nil {
		return err
	}
	if err := s.settle(); err != nil {
		return err
	}
	if s.ordered {
		// A call in stream order or a replay before this call may still be
		// running its host functions, the dispatch whose rows this combine
		// sums among them.
		if err := s.dev.StreamSynchronize(a.Stream); err != nil {
			return err
		}
	}
	rb := uint64(p.rowBytes())
	h := *a
	var fill func(src, n int, dst []byte) // nil: the host path computes the partials
	if a.ExpertOut != 0 && s.kernelsFor(a.ExpertOut) {
		bases, err := s.partialsOnDevice(cpu, a.ExpertOut, a.ExpertRows, a.Stream)
		if err != nil {
			s.dev.StreamSynchronize(a.Stream)
			return err
		}
		cb := int64(p.hidden * p.transit.Size())
		parts := bytesAt(s.rows.addr(), int64(s.rows.cap))
		fill = func(src, n int, dst []byte) {
			from := bases[src] * cb
			split(n, workers(n, cb), func(_, lo, hi int) {
				copy(dst[int64(lo)*cb:int64(hi)*cb], parts[from+int64(lo)*cb:from+int64(hi)*cb])
			})
		}
		h.ExpertOut, h.ExpertRows = 0, 0
	} else if a.ExpertOut != 0 {
		// Only rows the latest dispatch filled are read (a capturable
		// call's tail is the caller's).
		s.hostMu.Lock() // a host function may have written it
		n := uint64(min(a.ExpertRows, s.lastRows))
		s.hostMu.Unlock()
		if err := s.laid.reserve(s.dev, max(n, 1)*rb, uint64(p.maxRecvRows)*rb, "the expert rows"); err != nil {
			return err
		}
		// Rows past n are never read, but the host path's view spans them.
		h.ExpertRows = int64(n)
		h.ExpertOut = s.laid.addr()
		if err := s.download(h.ExpertOut, a.ExpertOut, n*rb, a.Stream); err != nil {
			return err
		}
	}
	if a.Y != 0 {
		h.Y = s.in.addr()
	}
	if err := s.dev.StreamSynchronize(a.Stream); err != nil {
		return err
	}
	err := s.onHost(func() error { return cpu.combineWith(&h, checks, fill) })
	if err != nil {
		return err
	}
	if a.Y == 0 {
		return nil
	}
	for _, c := range checks {
		if c != 0 {
			return nil // no data moved
		}
	}
	err = s.dev.MemcpyAsync(a.Y, h.Y, uint64(a.NumTokens)*rb, a.Stream)
	if err == nil {
		err = s.uploaded(a.Stream)
	}
	if err != nil {
		s.dev.StreamSynchronize(a.Stream) // the copy may have been queued
	}
	return err
}

// quiesce waits for the device, whose calls and replays may still use the
// buffers and run host functions, then forgets the graphs' host functions
// (a graph replayed after its EP closed uses freed memory): before the
// host path and the buffers go.
func (s *stagedEngine) quiesce() {
	if !s.ordered {
		return
	}
	// Calls still queued, and replays, finish first: their peers wait for
	// them (each host function's waits are bounded).
	if err := s.dev.EnsureContext(); err == nil {
		s.dev.CtxSynchronize()
	}
	s.closed.Store(true) // should the device not have drained (a broken context), what runs later does nothing
	s.hostMu.Lock()      // a host function that is running holds it
	s.hostMu.Unlock()
	for _, r := range s.releases {
		r()
	}
	s.releases = nil
}

// release frees the pinned buffers and the event (after the latest upload).
func (s *stagedEngine) release() {
	if s.uploading {
		s.dev.EventSynchronize(s.done)
		s.uploading = false
	}
	if s.done != 0 {
		s.dev.EventDestroy(s.done)
		s.done = 0
	}
	for _, r := range s.releases {
		r()
	}
	s.releases = nil
	for _, b := range []*growBuf{&s.in, &s.rows, &s.laid, &s.info, &s.counts, &s.index, &s.items} {
		b.free(s.dev)
	}
	if s.k != nil {
		s.k.free(s.dev)
	}
}

// close releases the engine and the host backend it made (after the EP's
// host path has closed).
func (s *stagedEngine) close() error {
	err := s.dev.EnsureContext()
	s.release()
	if cerr := s.host.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("ExpertParallel across nodes: close: %w", err)
	}
	return nil
}
