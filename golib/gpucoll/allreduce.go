package gpucoll

import (
	"fmt"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// AllReduce enqueues one all-reduce on req.Stream. It does not wait for the
// GPU: a peer that never arrives is reported by the kernel through the
// error word, and raised at the next call or Check.
func (b *Backend) AllReduce(req collective.AllReduce) error {
	if err := b.Check(); err != nil {
		return err
	}
	if b.topo.MultiNode() {
		return b.allReduceNodes(req)
	}
	if req.Reject != nil {
		return b.reject(req)
	}
	if err := reduce.Check(req.DType, req.Op); err != nil {
		return err
	}
	if req.Count < 0 {
		return status.Errorf(status.InvalidArgument, "negative element count %d", req.Count)
	}
	// The caller's thread may have another device's context current.
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	nbytes := req.Bytes()
	algo := b.choose(req.Algo, req.Count, req.DType, req.Op)
	g := b.geometry(algo, req.DType, req.Count)
	sig := signature(req.Count, req.DType, req.Op, algo)
	if req.Count == 0 {
		// Still a collective: a peer that passed data learns of the mismatch.
		return b.launchEmpty(algo, req.DType, g, sig, req.Stream)
	}
	p := b.fill(req.Count, req.Op, sig)
	p.LocalSrc, p.Out = uint64(req.Src), uint64(req.Dst)
	switch {
	case isLL(algo):
		// Peers receive into their own LL buffers: the input is read where
		// it is, registered or not.
		b.useLL(p, algo)
		return b.launchGrid(algo, req.DType, g.grid, req.Stream)
	case g.deferred:
		// Small one-shot: always staged (a local copy is cheaper than the end
		// barrier that reading a caller's buffer in place would need).
		b.useHalves(p)
		return b.launchGrid(algo, req.DType, g.grid, req.Stream)
	}
	// Registered input is read in place by peers; anything else the kernel
	// copies into its staging buffer itself, fused into the same launch.
	// Only two-shot may write its output over its input while peers still
	// read it (they stop before its middle barrier); the others must stage.
	buf, registered := b.space.Lookup(req.Src, uint64(nbytes))
	if registered && (req.Src != req.Dst || algo == collective.TwoShot) {
		off := req.Src - buf.Local
		for r := range b.size {
			p.PeerIn[r] = uint64(buf.Peers[r] + off)
		}
		p.LocalSrc = 0
		p.Signature = withSource(sig, buf.Seq, uint64(off))
	} else if nbytes > b.opts.StagingBytes {
		return b.refuse(algo, req.DType, g, req.Stream, status.Errorf(status.Capacity,
			"tensor of %d bytes exceeds the staging capacity of %d bytes: register it (comm.register_buffer) or raise P2PCOMM_STAGING_BYTES",
			nbytes, b.opts.StagingBytes))
	}
	if need := scratchBytes(algo, nbytes, b.size); need > b.opts.StagingBytes {
		return b.refuse(algo, req.DType, g, req.Stream, status.Errorf(status.Capacity,
			"%s all-reduce of %d bytes needs %d bytes of scratch, more than the %d available: use algorithm='twoshot' or raise P2PCOMM_STAGING_BYTES",
			algo, nbytes, need, b.opts.StagingBytes))
	}
	inPlace := algo == collective.TwoShot && p.LocalSrc == 0 && req.Src == req.Dst
	switch {
	case inPlace && (b.size == 2 || nbytes <= directMaxBytes):
		// Peers store into this rank's buffer: only ranks that all run in
		// place may pair up, so it takes part in the signature.
		p.Flags |= flagDirect
		p.Signature = withDirect(p.Signature)
	case algo == collective.TwoShot && nbytes >= pullMinBytes:
		p.Flags |= flagPull
	}
	if algo == collective.TwoShot && p.LocalSrc != 0 {
		p.GraphSlot = uint64(b.graph.slotFor(b.drv, req.Src, nbytes, req.Stream))
	}
	return b.launchGrid(algo, req.DType, g.grid, req.Stream)
}

// useLL points the kernel at every rank's LL buffers, and Lamport's at
// every rank's Lamport buffers too.
func (b *Backend) useLL(p *allReduceParams, algo collective.Algorithm) {
	p.HalfBytes = uint32(llHalfBytes(b.size))
	for r := range b.size {
		p.PeerIn[r] = uint64(b.ll.Peers[r])
		if algo == collective.OneShotLamport || algo == collective.TwoShotLamport {
			p.PeerScratch[r] = uint64(b.lamport.Peers[r])
		}
	}
}

// useHalves points deferred one-shot at every rank's two staging halves.
func (b *Backend) useHalves(p *allReduceParams) {
	p.HalfBytes = deferredHalfBytes
	for r := range b.size {
		p.PeerIn[r] = uint64(b.halves.Peers[r])
	}
}

// fill resets the reused parameter block with what every launch shares.
func (b *Backend) fill(count int64, op reduce.Op, sig int32) *allReduceParams {
	p := &b.params
	*p = allReduceParams{Err: uint64(b.errDev), Count: count, TimeoutNs: uint64(b.opts.Timeout.Nanoseconds()),
		Rank: int32(b.rank), World: int32(b.size), Op: int32(op), Signature: sig}
	for r := range b.size {
		p.PeerSignal[r] = uint64(b.signal.Peers[r])
		p.PeerScratch[r] = uint64(b.scratch.Peers[r])
		p.PeerIn[r] = uint64(b.staging.Peers[r])
	}
	return p
}

// reject takes part in the call with a signature no peer can match, so
// every peer's kernel skips the data and records a mismatch (raised at its
// next call or Check), while this rank returns its own validation error.
// req.Count and req.DType, when known, pick the grid the peers will use.
func (b *Backend) reject(req collective.AllReduce) error {
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	dt := req.DType
	if !dt.Valid() {
		dt = reduce.Float32
	}
	algo := b.choose(req.Algo, req.Count, dt, req.Op)
	return b.refuse(algo, dt, b.geometry(algo, dt, req.Count), req.Stream, req.Reject)
}

// refuse takes part in a call this rank cannot make, as reject does, and
// returns why: a rank whose tensor is too big to stage while its peers read
// theirs in place (registered on some ranks only) must not leave them
// waiting. When every rank refuses, none reports a mismatch.
func (b *Backend) refuse(algo collective.Algorithm, dt reduce.DType, g geometry, stream uintptr, why error) error {
	if err := b.launchEmpty(algo, dt, g, rejectSignature, stream); err != nil {
		return err
	}
	return why
}

// launchEmpty runs algo's kernel with no elements on the grid a call of
// geometry g uses: its barriers (or LL headers) carry sig to the peers, who
// compare it with theirs, and nothing else is read or written. Ring and
// recursive doubling sync only with neighbours and carry no signature, so
// for them it launches nothing: peers that expect data report this rank by
// timeout.
func (b *Backend) launchEmpty(algo collective.Algorithm, dt reduce.DType, g geometry, sig int32, stream uintptr) error {
	if algo == collective.Ring || algo == collective.RecursiveDoubling {
		return nil
	}
	p := b.fill(0, reduce.Sum, sig)
	// A harmless output each kernel accepts: one-shot's must not be its
	// staging, two-shot's must not be its scratch.
	p.Out = uint64(b.scratch.Local)
	if algo == collective.TwoShot {
		p.Out = uint64(b.staging.Local)
	}
	switch {
	case isLL(algo):
		b.useLL(p, algo)
	case g.deferred:
		b.useHalves(p)
	}
	return b.launchGrid(algo, dt, g.grid, stream)
}

func (b *Backend) launchGrid(algo collective.Algorithm, dt reduce.DType, grid uint32, stream uintptr) error {
	fn, err := b.kernels.function(algo, dt)
	if err != nil {
		return err
	}
	if err := b.drv.Launch(fn, grid, kThreads, 0, stream, b.params.bytes()); err != nil {
		return fmt.Errorf("launch %s all-reduce: %w", algo, err)
	}
	return nil
}

// scratchBytes is the scratch each algorithm needs per rank
// (native/kernels/LAYOUT.md), R being the payload rounded up to 128 bytes.
func scratchBytes(algo collective.Algorithm, nbytes int64, world int) int64 {
	r := (nbytes + 127) &^ 127
	switch algo {
	case collective.TwoShot:
		return r
	case collective.Ring:
		return 2 * r
	case collective.RecursiveDoubling:
		steps := int64(0)
		for w := world; w > 1; w >>= 1 {
			steps++
		}
		return max(steps-1, 0) * r
	}
	return 0
}
