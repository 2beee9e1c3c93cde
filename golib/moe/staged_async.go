package moe

import (
	"fmt"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/status"
	timeline "github.com/p2pcomm/p2pcomm/golib/trace"
)

// Calls in stream order. A capturable call whose rows the kernels take
// runs its host work (the host path's exchanges, the rows' order and
// packing, the pairs of a combine) in host functions ordered on the
// caller's stream between its copies and its kernels: it queues
// everything and waits for nothing. A CUDA graph that records it runs the
// host functions again at each replay, with the same arguments. The host
// work's results sit in pinned buffers made at their largest once, which
// never move; the counts the host knows last travel in mapped words
// (items_at), which one thread of each block reads. A dispatch's packed
// rows go up through a kernel reading them in place, as many as arrived,
// each once (the expand would read each once per expert); a combine's
// partials are written in place, as many as there are tokens; the index
// arrays go up in copies of the most they can hold (a graph's copy has a
// fixed size), which are small. A host function that fails (a peer that
// never came) records why; the kernels after it then find no items, the
// counts say nothing arrived, a combine's y is NaN, and the EP's next call
// raises the failure. Eager calls wait for the host on the caller's thread
// (staged.go), after the stream when calls in stream order came before
// them.

// asyncReady makes the buffers of stream-ordered calls at their largest
// (once per EP; at construction for a capturable EP). Not while
// capturing: allocations and waits do not belong in a graph.
func (s *stagedEngine) asyncReady(capturing bool) error {
	if s.items.p != 0 {
		return nil
	}
	if capturing {
		return status.Errorf(status.Unsupported, "ExpertParallel across nodes: the first capturable call must run outside "+
			"a CUDA graph capture (it makes the call's buffers); or build the ExpertParallel with capturable=True")
	}
	if err := s.settle(); err != nil {
		return err
	}
	if err := s.dev.CtxSynchronize(); err != nil { // earlier calls' kernels may still use buffers remade here
		return err
	}
	p, k := s.p, s.k
	bufs := []struct {
		buf    *growBuf
		n      uint64
		mapped bool
		what   string
	}{
		{&s.rows, s.mostPacked(), true, "the received rows and partials"},
		{&s.index, 8 * uint64(p.maxRecvRows), false, "the rows' order and the pairs"},
		{&s.info, 16 * uint64(p.maxRecvRows), false, "the rows' metadata"},
		{&k.rows, s.mostPacked(), false, "the received rows and partials"},
		{&k.index, 8 * uint64(p.maxRecvRows), false, "the rows' order and the pairs"},
		{&s.items, 16, true, "the item counts"},
	}
	for _, b := range bufs {
		if b.buf.fixed && b.buf.cap >= b.n && b.buf.mapped == b.mapped {
			continue
		}
		b.buf.free(s.dev)
		b.buf.fixed, b.buf.mapped = true, b.mapped
		if err := b.buf.reserve(s.dev, b.n, b.n, b.what); err != nil {
			for _, b := range bufs { // not ready (items is made last): eager calls may still grow them
				b.buf.fixed = false
			}
			return err
		}
	}
	s.in.fixed, s.counts.fixed = true, true // made at their largest with the EP
	return nil
}

func (s *stagedEngine) capturing(stream uintptr) (bool, error) {
	st, err := s.dev.StreamCaptureStatus(stream)
	return st != cuda.CaptureNone, err
}

// fail records a host function's failure (the first one stays).
func (s *stagedEngine) fail(err error) { s.failed.CompareAndSwap(nil, &err) }

// failure is the recorded failure, or nil.
func (s *stagedEngine) failure() error {
	if e := s.failed.Load(); e != nil {
		return *e
	}
	return nil
}

// hostStepHook, when set (tests), runs before the work of each host
// function, given the rank and the step: dispatch, pairs or combine.
var hostStepHook func(rank int, step string)

// hostStep orders fn on the stream as a host function: run once, or
// (recorded) kept for a graph's replays until the EP closes. fn runs under
// hostMu, and not at all once a host function has failed; a failure (an
// error from fn, or a panic) is recorded, and onFail then leaves the
// step's outputs saying so.
func (s *stagedEngine) hostStep(stream uintptr, step string, recorded bool, fn func() error, onFail func()) error {
	guarded := func() {
		if s.closed.Load() {
			return // its buffers may be gone
		}
		s.hostMu.Lock()
		defer s.hostMu.Unlock()
		if s.closed.Load() {
			return
		}
		defer func() {
			if v := recover(); v != nil {
				s.fail(status.Errorf(status.Internal, "ExpertParallel across nodes: the host's part of a call (%s) panicked: %v", step, v))
			}
			if s.failure() != nil {
				onFail()
			}
		}()
		if s.failure() != nil {
			return
		}
		if hostStepHook != nil {
			hostStepHook(s.p.rank, step)
		}
		if timeline.On() {
			timeline.Mark("moe host function " + step)
			defer timeline.Mark("moe host function " + step + " done")
		}
		if err := fn(); err != nil {
			s.fail(err)
		}
	}
	s.ordered = true
	if !recorded {
		if err := s.dev.LaunchHostFuncOnce(stream, guarded); err != nil {
			return fmt.Errorf("ExpertParallel across nodes: order the host's work on the stream: %w", err)
		}
		return nil
	}
	release, err := s.dev.LaunchHostFunc(stream, guarded)
	if err != nil {
		return fmt.Errorf("ExpertParallel across nodes: order the host's work on the stream: %w", err)
	}
	s.releases = append(s.releases, release)
	return nil
}

// setItems leaves n for the next kernel's launch (items_at), and packed
// for the launch that takes the packed rows up (packedAt).
func (s *stagedEngine) setItems(n, packed int64) {
	w := unsafe.Slice((*int64)(hostPtr(s.items.p)), 2)
	w[0], w[1] = n, packed
}

// packedAt is the device address of the packed rows' count.
func (s *stagedEngine) packedAt() uint64 { return uint64(s.items.dp) + 8 }

// recorded ends a call in stream order: a failure to queue or record any
// of it leaves the stream or the graph unsound, and the EP with it.
func (s *stagedEngine) recorded(err error) error {
	if err != nil {
		s.fail(err)
	}
	return err
}

// dispatchAsync queues a capturable dispatch in stream order: x, the ids and
// the weights come down, a host function runs the host path's dispatch
// and packs what arrived, the rows' order goes up and the packed rows
// with it (moe_staged_expand without an index, reading them in place),
// moe_staged_expand lays the rows out in a.Out.X, and the metadata (laid
// out for a.Out.Rows rows) and counts go up.
func (s *stagedEngine) dispatchAsync(cpu *cpuEngine, a *DispatchArgs, capturing bool) (int64, error) {
	p := s.p
	if err := s.asyncReady(capturing); err != nil {
		return 0, err
	}
	rb := uint64(p.rowBytes())
	h, err := s.downloadInputs(a)
	h.orderOnly = true
	if err == nil {
		err = s.hostStep(a.Stream, "dispatch", capturing, func() error {
			_, err := cpu.dispatch(&h, nil)
			var items, packed int64
			if err == nil {
				items, packed, err = s.packForExpand(cpu, p.maxRecvRows)
			}
			if err == nil {
				s.setItems(items, packed)
			}
			return err
		}, func() {
			clear(int32sAt(s.counts.addr(), int64(p.numLocal+1)))
			s.setItems(0, 0)
		})
	}
	k := s.k
	if err == nil { // each item's packed row
		err = s.dev.MemcpyAsync(k.index.p, s.index.addr(), 4*uint64(p.maxRecvRows), a.Stream)
	}
	if err == nil { // the packed rows, one per token and source at most
		most := int64(p.world) * int64(p.maxTokens)
		sp := &stagedParams{Src: uint64(s.rows.dp), Dst: uint64(k.rows.p), Items: most, RowPacks: int32(rb / 16),
			ItemsAt: s.packedAt()}
		err = k.launch(s.dev, k.expand, most, sp, a.Stream)
	}
	if err == nil {
		sp := &stagedParams{Src: uint64(k.rows.p), Dst: uint64(a.Out.X), Index: uint64(k.index.p), Items: p.maxRecvRows,
			RowPacks: int32(rb / 16), ItemsAt: uint64(s.items.dp)}
		err = k.launch(s.dev, k.expand, p.maxRecvRows, sp, a.Stream)
	}
	if err == nil {
		// info holds 4 arrays of held = a.Out.Rows entries, as cpuEngine.order lays them out.
		err = s.dev.MemcpyAsync(a.Out.Info, s.info.addr(), 16*uint64(a.Out.Rows), a.Stream)
	}
	if err == nil {
		err = s.dev.MemcpyAsync(a.Out.Counts, s.counts.addr(), 4*uint64(p.numLocal+1), a.Stream)
	}
	return p.maxRecvRows, s.recorded(err)
}

// combineAsync queues a capturable combine in stream order: a host function
// writes the pairs of every token this rank received, they go up,
// moe_staged_partials writes their partials into pinned memory, a second
// host function runs the host path's combine on them, and y goes up.
func (s *stagedEngine) combineAsync(cpu *cpuEngine, a *CombineArgs, capturing bool) error {
	p, k := s.p, s.k
	if err := s.asyncReady(capturing); err != nil {
		return err
	}
	h := *a
	h.ExpertOut, h.ExpertRows = 0, 0
	if a.Y != 0 {
		h.Y = s.in.addr()
	}
	expertRows := a.ExpertRows
	if a.ExpertOut == 0 {
		expertRows = 0 // every pair counts as none
	}
	rb, cb := p.rowBytes(), int64(p.hidden*p.transit.Size())
	yBytes := int64(a.NumTokens) * rb
	err := s.hostStep(a.Stream, "pairs", capturing, func() error {
		bases, n, err := s.pairsForPartials(cpu, expertRows, true)
		if err == nil {
			s.bases = bases
			s.setItems(n, 0)
		}
		return err
	}, func() { s.setItems(0, 0) })
	most := int64(p.world) * int64(p.maxTokens) // tokens received at most
	if err == nil {                             // the pairs' rows, then their weights at weightsAt
		err = s.dev.MemcpyAsync(k.index.p, s.index.addr(), 8*uint64(p.maxRecvRows), a.Stream)
	}
	if err == nil {
		sp := &stagedParams{Src: uint64(a.ExpertOut), Dst: uint64(s.rows.dp), Index: uint64(k.index.p),
			Weights: uint64(k.index.p) + uint64(s.weightsAt()), Items: most, RowPacks: int32(rb / 16), TopK: int32(p.topK),
			ItemsAt: uint64(s.items.dp)}
		err = k.launch(s.dev, k.partials, most, sp, a.Stream)
	}
	if err == nil {
		err = s.hostStep(a.Stream, "combine", capturing, func() error {
			parts, bases := bytesAt(s.rows.addr(), int64(s.rows.cap)), s.bases
			fill := func(src, n int, dst []byte) {
				from := bases[src] * cb
				split(n, workers(n, cb), func(_, lo, hi int) {
					copy(dst[int64(lo)*cb:int64(hi)*cb], parts[from+int64(lo)*cb:from+int64(hi)*cb])
				})
			}
			return cpu.combineWith(&h, nil, fill)
		}, func() {
			if h.Y == 0 {
				return
			}
			y := bytesAt(h.Y, yBytes)
			for i := range y {
				y[i] = 0xff // NaN in every float type
			}
		})
	}
	if err == nil && a.Y != 0 && yBytes > 0 {
		err = s.dev.MemcpyAsync(a.Y, h.Y, uint64(yBytes), a.Stream)
	}
	return s.recorded(err)
}
