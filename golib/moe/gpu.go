package moe

import (
	"errors"
	"fmt"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// gpuEngine runs dispatch and combine with the kernels of moe_dispatch.cu
// and moe_combine.cu (see moe_common.cuh for the buffers and barriers).
type gpuEngine struct {
	dev GPU
	p   *plan
	fn  [numKernels]cuda.Function

	// One symmetric allocation holds every buffer: those peers address
	// (xs, meta, checks and hdr, comb, flags) and this rank's own.
	xs, meta, checks, hdr, comb, flags      uintptr
	sendSlot, pairRank, combRows, syncState uintptr
	checksBytes                             uint64 // status [2, W] and hdr [W, L+1], i32, adjacent
	peerStatus                              [2][maxRanks]uint64

	host     unsafe.Pointer // pinned: an eager call's checks [W], then a dispatch's hdr [W, L+1] (checksBytes)
	hostCopy uintptr        // the stream of a copy into host not yet waited for
	side     uintptr        // the stream a capturable call's copy of x overlaps the send kernel on
	fork     cuda.Event
	join     cuda.Event
	ready    cuda.Event // eager combine: every rank's checks are in host

	// Parameter blocks, filled in place per call: no allocation.
	dp dispatchParams
	xp expandParams
	cp combineParams
	pp postParams
	sy syncParams // what every MoeSync shares

	eagerCalls int // eager calls so far: the next one's status row parity and tag
	trace      trace
}

// layout carves aligned pieces out of one allocation.
type layout struct{ size int64 }

func (l *layout) take(n int64) int64 {
	off := (l.size + 255) &^ 255 // every piece 256-byte aligned: the kernels load 16-byte packs
	l.size = off + max(n, 0)
	return off
}

// newGPUEngine resolves the kernels this configuration launches, compiling
// them if this process has not yet; it allocates nothing (the caller does
// once the ranks agree).
func newGPUEngine(dev GPU, c Config, world int) (*gpuEngine, error) {
	if err := kernelProblem(c, world); err != nil {
		return nil, err
	}
	if err := dev.EnsureContext(); err != nil {
		return nil, err
	}
	g := &gpuEngine{dev: dev}
	for k := kernel(0); k < numKernels; k++ {
		if !k.needed(world) {
			continue
		}
		fn, err := dev.KernelFunction(k.file(), k.expr(c.DType, c.CombineDType, world))
		if err != nil {
			return nil, fmt.Errorf("ExpertParallel: build %s: %w", k, err)
		}
		g.fn[k] = fn
	}
	return g, nil
}

// setup allocates and initializes the buffers (collective), the side
// stream, the events and the pinned host copy, and fills what every
// parameter block shares.
func (g *gpuEngine) setup(p *plan) (err error) {
	g.p = p
	// The agreement's host exchange may have called back into Python, which
	// may have made another device current on this thread.
	if err := g.dev.EnsureContext(); err != nil {
		return err
	}
	W, Tm, K, L, E := int64(p.world), int64(p.maxTokens), int64(p.topK), int64(p.numLocal), int64(p.numExperts)
	var l layout
	xs := l.take(Tm * p.rowBytes())
	meta := l.take(W * Tm * (3*K + 1) * 4)
	checks := l.take((2*W + W*(L+1)) * 4) // status [2, W], then hdr [W, L+1]
	comb := l.take(W * (Tm + 1) * int64(p.hidden) * int64(p.transit.Size()))
	flags := l.take(syncFlagWords * 8)
	local := l.take(0)
	sendSlot := l.take(Tm * W * 4)
	pairRank := l.take((Tm*K + int64(p.blocks)*(W+E)) * 4)
	combRows := l.take(W * Tm * K * 4)
	syncState := l.take(syncKinds * syncStateBytes)
	base, err := g.dev.Alloc(l.size) // zeroed
	if err != nil {
		return fmt.Errorf("ExpertParallel: allocate %d bytes of buffers: %w", l.size, err)
	}
	at := func(off int64) uintptr { return base + uintptr(off) }
	g.xs, g.meta, g.checks, g.comb, g.flags = at(xs), at(meta), at(checks), at(comb), at(flags)
	g.hdr = g.checks + uintptr(2*W*4)
	g.checksBytes = uint64((2*W + W*(L+1)) * 4)
	g.sendSlot, g.pairRank, g.combRows, g.syncState = at(sendSlot), at(pairRank), at(combRows), at(syncState)
	var peerXs, peerMeta, peerHdr, peerComb, peerFlags [maxRanks]uint64
	for r := range p.world {
		pb, err := g.dev.PeerAddress(base, local, r)
		if err != nil {
			return fmt.Errorf("ExpertParallel: rank %d's buffers: %w", r, err)
		}
		peer := func(off int64) uint64 { return uint64(pb) + uint64(off) }
		peerXs[r], peerMeta[r], peerComb[r], peerFlags[r] = peer(xs), peer(meta), peer(comb), peer(flags)
		peerHdr[r] = peer(checks) + uint64(2*W*4)
		for par := range 2 {
			g.peerStatus[par][r] = peer(checks) + uint64(int64(par)*W*4)
		}
	}
	// Not sent and no row: -1 (0xff bytes) until a dispatch says otherwise.
	if err := g.dev.MemsetD8Async(g.sendSlot, 0xff, uint64(Tm*W*4), 0); err != nil {
		return err
	}
	if err := g.dev.MemsetD8Async(g.combRows, 0xff, uint64(W*Tm*K*4), 0); err != nil {
		return err
	}
	if err := g.dev.StreamSynchronize(0); err != nil {
		return err
	}
	if g.host, err = g.dev.MemHostAlloc(g.checksBytes, cuda.HostAllocPortable); err != nil {
		return fmt.Errorf("ExpertParallel: pinned host memory: %w", err)
	}
	if g.side, err = g.dev.StreamCreate(cuda.StreamNonBlocking); err != nil {
		return fmt.Errorf("ExpertParallel: side stream: %w", err)
	}
	for _, ev := range []*cuda.Event{&g.fork, &g.join, &g.ready} {
		if *ev, err = g.dev.EventCreate(cuda.EventDisableTiming); err != nil {
			return fmt.Errorf("ExpertParallel: event: %w", err)
		}
	}

	signal, errWord, timeoutNs := g.dev.WaitInfo()
	g.sy = syncParams{PeerFlags: peerFlags, State: uint64(g.syncState), Signal: uint64(signal), Err: uint64(errWord),
		TimeoutNs: timeoutNs}
	rank, world := int32(p.rank), int32(p.world)
	g.dp = dispatchParams{PeerMeta: peerMeta, PeerHdr: peerHdr, SendSlot: uint64(g.sendSlot), PairRank: uint64(g.pairRank),
		MaxTokens: int32(Tm), Hidden: int32(p.hidden), TopK: int32(K), NumExperts: int32(E), Rank: rank, World: world}
	g.xp = expandParams{PeerXs: peerXs, Meta: uint64(g.meta), Hdr: uint64(g.hdr), CombRows: uint64(g.combRows),
		MaxTokens: int32(Tm), RowBytes: int32(p.dispatchRowBytes()), TopK: int32(K), NumLocal: int32(L), World: world,
		Rank: rank, ScaleBytes: int32(p.scaleBytes()), XsScales: g.xsScales()}
	g.cp = combineParams{PeerComb: peerComb, Meta: uint64(g.meta), Hdr: uint64(g.hdr), CombRows: uint64(g.combRows),
		SendSlot: uint64(g.sendSlot), MaxTokens: int32(Tm), Hidden: int32(p.hidden), TopK: int32(K), Rank: rank,
		World: world, NumLocal: int32(L)}
	g.pp = postParams{NumExperts: int32(E), IDCode: checkInvalidArg, Rank: rank, World: world, Signal: uint64(signal),
		Err: uint64(errWord), TimeoutNs: timeoutNs}
	return nil
}

func (g *gpuEngine) sync(kind, bits int32) syncParams {
	s := g.sy
	s.Mode, s.Kind = g.p.syncMode(bits), kind
	return s
}

func (g *gpuEngine) launch(k kernel, grid, block, shared uint32, stream uintptr, params []byte) error {
	g.trace.add(k.String(), grid, block, shared, stream == g.side && stream != 0)
	if err := g.dev.LaunchFunction(g.fn[k], grid, block, shared, stream, params); err != nil {
		return fmt.Errorf("ExpertParallel: launch %s: %w", k, err)
	}
	return nil
}

// stage copies a's T rows into xs on stream; fp8 rows' scales go after
// the Tm rows' place (xsScales). Rows or scales built in place stay.
func (g *gpuEngine) stage(a *DispatchArgs, T int, stream uintptr) error {
	g.trace.add("stage", 0, 0, 0, stream == g.side)
	if a.X != g.xs {
		if err := g.dev.MemcpyAsync(g.xs, a.X, uint64(int64(T)*g.p.dispatchRowBytes()), stream); err != nil {
			return err
		}
	}
	if !g.p.fp8 || a.Scales == g.xsScalesAt() {
		return nil
	}
	return g.dev.MemcpyAsync(g.xsScalesAt(), a.Scales, uint64(int64(T)*g.p.scaleBytes()), stream)
}

// xsScales is where in xs the staged rows' scales start (fp8).
func (g *gpuEngine) xsScales() int64 { return int64(g.p.maxTokens) * g.p.dispatchRowBytes() }

func (g *gpuEngine) xsScalesAt() uintptr { return g.xs + uintptr(g.xsScales()) }

// postChecks runs an eager call's start barrier, moe_post_status: it posts
// this rank's check (code, or on the device whether every expert id in idx
// is in [-1, E)) into every rank's status row of the call's parity, tagged
// with the call, and waits for every rank's. Two rows, by call parity,
// because ranks read theirs after the barrier: a peer that has passed it
// may post the next call's check at once, but not the one after (that needs
// this rank at the next start barrier). With host, every rank's code also
// goes there (pinned memory, [W] int32). It returns this rank's status row
// of the call.
func (g *gpuEngine) postChecks(code int32, idx uintptr, numIDs, idxBytes int, stream uintptr, kind int32,
	host uintptr) (uintptr, error) {
	par := g.eagerCalls & 1
	if code < 0 || code >= 1<<statusTagShift { // not a status code: it would spill into the tag
		code = int32(status.InvalidArgument)
	}
	pp := &g.pp
	pp.PeerStatus, pp.Code, pp.Kind, pp.HostStatus = g.peerStatus[par], code, kind, uint64(host)
	pp.Tag = int32(g.eagerCalls%statusTagMax + 1) // never 0, the zeroed rows' tag
	g.eagerCalls++
	pp.TopkIdx, pp.NumIDs, pp.IdxBytes = 0, 0, 4
	if code == 0 && idx != 0 && numIDs > 0 {
		pp.TopkIdx, pp.NumIDs, pp.IdxBytes = uint64(idx), int32(numIDs), int32(idxBytes)
	}
	if err := g.launch(kPostStatus, 1, threads, 0, stream, paramBytes(pp)); err != nil {
		return 0, err
	}
	return g.checks + uintptr(par*g.p.world*4), nil
}

// dispatch runs a dispatch (see EP.Dispatch): the whole call when
// capturable, else up to the host's read of every rank's checks and counts,
// which it returns in checks and as the rows this rank receives.
func (g *gpuEngine) dispatch(a *DispatchArgs, checks []int32) (int64, error) {
	p := g.p
	T := a.NumTokens
	if a.Check != 0 {
		T = 0
	}
	var status uintptr
	if !a.Capturable {
		var err error
		idx := uintptr(0)
		if a.Check == 0 {
			idx = a.TopkIdx
		}
		if status, err = g.postChecks(a.Check, idx, T*p.topK, a.IdxBytes, a.Stream, kindDispatch, 0); err != nil {
			return 0, err
		}
	}
	// fp8 rows are in the buffer when their scales were built there too.
	inBuffer := a.X == g.xs && (!p.fp8 || a.Scales == g.xsScalesAt())
	d := p.dispatch(T, inBuffer, a.X%16 == 0, a.Capturable, a.Check != 0)
	dp := &g.dp
	dp.TopkIdx, dp.TopkW, dp.IdxBytes = 0, 0, 4
	if a.Check == 0 {
		dp.TopkIdx, dp.TopkW, dp.IdxBytes = uint64(a.TopkIdx), uint64(a.TopkWeights), int32(a.IdxBytes)
	}
	dp.NumTokens, dp.Counted, dp.IDsShared, dp.Status = int32(T), b2i(d.counted), b2i(d.idsShared), uint64(status)
	dp.Sync = g.sync(kindDispatch, d.sendMode)
	dp.StageSrc, dp.StageDst, dp.CountsHost = 0, 0, 0
	if !a.Capturable {
		dp.CountsHost = uint64(uintptr(g.host))
		g.hostCopy = a.Stream // the send kernel writes into host: wait for it before freeing that
	}
	grid := uint32(p.blocks)
	if d.overlap {
		if err := g.forkSide(a.Stream); err != nil {
			return 0, err
		}
	} else if d.inKernel {
		g.trace.add("stage in moe_dispatch_send", 0, 0, 0, false)
		dp.StageSrc, dp.StageDst = uint64(a.X), uint64(g.xs)
	} else if d.staged {
		// Eager: after the start barrier (moe_post_status), so no peer reads the
		// previous rows any more (capturable calls always overlap).
		if err := g.stage(a, T, a.Stream); err != nil {
			return 0, err
		}
	}
	if d.counted {
		if err := g.launch(kCount, grid, threads, d.countShared, a.Stream, paramBytes(dp)); err != nil {
			return 0, err
		}
	}
	if err := g.launch(kSend, grid, threads, d.sendShared, a.Stream, paramBytes(dp)); err != nil {
		return 0, err
	}
	if d.overlap {
		if err := g.stageOnSide(a, T); err != nil {
			return 0, err
		}
	}
	if a.Capturable {
		return p.maxRecvRows, g.expand(a.Out, a.Stream, d.expandMode)
	}
	// The send kernel's last block has passed the middle barrier, after
	// which every source's metadata, hdr and staged rows are in place, and
	// put every rank's check and the counts into host: the one host sync.
	start := time.Now()
	if err := g.dev.StreamSynchronize(a.Stream); err != nil {
		return 0, err
	}
	g.trace.waited(time.Since(start))
	g.hostCopy = 0
	// A wait that gave up left the host's words stale: report it (naming
	// the peer) rather than size a result by them.
	if err := g.dev.Check(); err != nil {
		return 0, err
	}
	words := unsafe.Slice((*int32)(g.host), p.world*(p.numLocal+2)) // checks [W], then hdr [W, L+1]
	copy(checks, words[:p.world])
	rows := int64(0)
	hdr := words[p.world:]
	for s := range p.world {
		for _, n := range hdr[s*(p.numLocal+1)+1 : (s+1)*(p.numLocal+1)] {
			rows += int64(n)
		}
	}
	return rows, nil
}

// forkSide makes the side stream wait for everything queued on stream so far.
func (g *gpuEngine) forkSide(stream uintptr) error {
	if err := g.dev.EventRecord(g.fork, stream); err != nil {
		return err
	}
	return g.dev.StreamWaitEvent(g.side, g.fork)
}

// stageOnSide copies x into xs on the side stream, where a capturable call
// first waits for the send kernel's block 0 to pass its start barrier
// (moe_stage_gate) and afterwards posts its staged flags (moe_stage_done),
// and makes stream wait for the copy (it precedes the middle barrier).
func (g *gpuEngine) stageOnSide(a *DispatchArgs, T int) error {
	if a.Capturable {
		if err := g.launch(kStageGate, 1, 32, 0, g.side, paramBytes(&g.dp)); err != nil {
			return err
		}
	}
	if err := g.stage(a, T, g.side); err != nil {
		return err
	}
	if a.Capturable {
		if err := g.launch(kStageDone, 1, 32, 0, g.side, paramBytes(&g.dp)); err != nil {
			return err
		}
	}
	if err := g.dev.EventRecord(g.join, g.side); err != nil {
		return err
	}
	return g.dev.StreamWaitEvent(a.Stream, g.join)
}

// expand runs moe_dispatch_expand into out (rows for out.Rows).
func (g *gpuEngine) expand(out Rows, stream uintptr, mode int32) error {
	xp := &g.xp
	xp.OutX, xp.OutInfo, xp.ExpertCounts, xp.RowCap = uint64(out.X), uint64(out.Info), uint64(out.Counts), out.Rows
	xp.OutScales = uint64(out.Scales)
	xp.Sync = g.sync(kindDispatch, mode)
	return g.launch(kExpand, uint32(g.p.blocks), threads, g.p.expandShared(), stream, paramBytes(xp))
}

// combine runs a combine (see EP.Combine); an eager one returns every
// rank's check in checks.
func (g *gpuEngine) combine(a *CombineArgs, checks []int32) error {
	p := g.p
	T := a.NumTokens
	if a.Check != 0 {
		T = 0
	}
	var status uintptr
	if !a.Capturable {
		var err error
		// The codes go to host as soon as every rank's is in: the host
		// waits for that, not for this call's kernels.
		if status, err = g.postChecks(a.Check, 0, 0, 4, a.Stream, kindCombine, uintptr(g.host)); err != nil {
			return err
		}
		g.hostCopy = a.Stream
		if err := g.dev.EventRecord(g.ready, a.Stream); err != nil {
			return err
		}
	}
	c := p.combine(T, a.Capturable)
	cp := &g.cp
	cp.ExpertOut, cp.Y, cp.RowCap = 0, 0, 0
	if a.Check == 0 {
		cp.ExpertOut, cp.Y, cp.RowCap = uint64(a.ExpertOut), uint64(a.Y), a.ExpertRows
	}
	cp.NumTokens, cp.SelfLocal, cp.Status = int32(T), b2i(c.selfLocal), uint64(status)
	cp.Sync = g.sync(kindCombine, c.sendMode)
	if err := g.launch(kCombineSend, uint32(p.blocks), threads, 0, a.Stream, paramBytes(cp)); err != nil {
		return err
	}
	if T > 0 {
		cp.Sync = g.sync(kindCombine, syncWait)
		k := kReduce
		if c.selfLocal {
			k = kReduceSelf
		}
		if err := g.launch(k, c.reduceGrid, threads, 0, a.Stream, paramBytes(cp)); err != nil {
			return err
		}
	}
	if !a.Capturable {
		start := time.Now()
		if err := g.dev.EventSynchronize(g.ready); err != nil {
			return err
		}
		g.trace.waited(time.Since(start))
		g.hostCopy = 0
		if err := g.dev.Check(); err != nil {
			return err
		}
		copy(checks, unsafe.Slice((*int32)(g.host), p.world))
	}
	return nil
}

// close releases what setup made besides the symmetric buffers (which
// live until the communicator closes). Not collective.
func (g *gpuEngine) close() error {
	if g.dev == nil {
		return nil
	}
	var errs []error
	if err := g.dev.EnsureContext(); err != nil {
		return err
	}
	if g.hostCopy != 0 { // a call failed between a copy into host and its wait
		errs = append(errs, g.dev.StreamSynchronize(g.hostCopy))
	}
	for _, ev := range []cuda.Event{g.fork, g.join, g.ready} {
		if ev != 0 {
			errs = append(errs, g.dev.EventDestroy(ev))
		}
	}
	if g.side != 0 {
		errs = append(errs, g.dev.StreamDestroy(g.side))
	}
	if g.host != nil {
		errs = append(errs, g.dev.MemFreeHost(g.host))
	}
	g.dev, g.host, g.side = nil, nil, 0
	if err := errors.Join(errs...); err != nil {
		return status.Errorf(status.CUDA, "ExpertParallel: close: %v", err)
	}
	return nil
}

func b2i(b bool) int32 {
	if b {
		return 1
	}
	return 0
}
