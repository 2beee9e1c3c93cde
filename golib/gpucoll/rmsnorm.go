package gpucoll

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// rmsNormParams mirrors RMSNormParams in native/kernels/allreduce_rmsnorm.cu
// byte for byte (the table there; layout_test.go pins the offsets).
type rmsNormParams struct {
	AR          allReduceParams
	Residual    uint64
	Weight      uint64
	ResidualOut uint64
	Rows        int64
	Hidden      int32
	Eps         float32
}

func (q *rmsNormParams) bytes() []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(q)), unsafe.Sizeof(*q))
}

const rmsNormFile = "allreduce_rmsnorm.cu"

// rmsNormKernels names each algorithm's kernel for float16 and bfloat16.
var rmsNormKernels = map[collective.Algorithm][2]string{
	collective.OneShotLL: {"allreduce_rmsnorm_oneshot_ll<half16>", "allreduce_rmsnorm_oneshot_ll<bf16>"},
	collective.OneShotLamport: {"allreduce_rmsnorm_oneshot_lamport<half16>",
		"allreduce_rmsnorm_oneshot_lamport<bf16>"},
	collective.TwoShot: {"allreduce_rmsnorm_twoshot<half16>", "allreduce_rmsnorm_twoshot<bf16>"},
}

// rmsNormLLMaxBytes is the input up to which auto runs the LL one-shot on
// one rank, which has no Lamport areas to share; the two-shot beyond.
const rmsNormLLMaxBytes = 256 << 10

// rmsNormLamportMaxBytes is the input per rank up to which auto runs the
// Lamport one-shot (it sends the input once, with no flags): on two ranks
// all it can carry (as fast as the LL one-shot or faster from one row on,
// and 5% faster than the two-shot at 4 MiB); on more, 512 KiB, where each
// rank sends world - 1 copies (on 4 x H200 ahead of the LL one-shot at every
// size and of the two-shot to 512 KiB, behind it from 1 MiB:
// docs/BENCHMARKS.md); -1 on one rank, which needs no exchange.
func rmsNormLamportMaxBytes(ranks int) int64 {
	switch {
	case ranks == 2:
		return lamportMaxPayload(ranks)
	case ranks > 2:
		return min(512<<10, lamportMaxPayload(ranks))
	}
	return -1
}

// AllReduceRMSNorm enqueues one fused all-reduce + residual add + RMSNorm
// (collective.RMSNorm) on req.Stream, as one kernel. It does not wait for
// the GPU: a peer that never arrives, or one that made another call, is
// reported by the kernel through the error word and raised at the next call
// or Check. A rank whose request is invalid (or carries Reject) still takes
// part, so that its peers raise MismatchError instead of waiting, and
// returns why.
func (b *Backend) AllReduceRMSNorm(req collective.RMSNorm) error {
	if err := b.Check(); err != nil {
		return err
	}
	if b.topo.MultiNode() {
		return b.acrossNodes("all-reduce + RMSNorm")
	}
	why := req.Reject
	if why == nil {
		why = req.Validate()
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	rows, dt := req.Rows, req.DType
	if why != nil && (rmsNormValidShape(req) != nil) {
		// Peers that made a valid call pick their kernel by its size: a
		// guess at what this rank meant, as far as its numbers allow.
		rows, dt = 0, reduce.BFloat16
		if req.DType == reduce.Float16 {
			dt = reduce.Float16
		}
	}
	nbytes := rows * req.Hidden * int64(dt.Size())
	algo := b.chooseRMSNorm(req.Algo, nbytes)
	grid := b.rmsNormGrid(algo, rows, nbytes)
	if why == nil && algo == collective.TwoShot && nbytes > b.opts.StagingBytes {
		why = status.Errorf(status.Capacity,
			"all-reduce + RMSNorm of %d bytes exceeds the staging capacity of %d bytes: raise P2PCOMM_STAGING_BYTES or split the rows",
			nbytes, b.opts.StagingBytes)
	}
	if why != nil {
		if err := b.launchRMSNorm(algo, dt, grid, b.emptyRMSNorm(algo, rejectSignature), req.Stream); err != nil {
			return err
		}
		return why
	}
	sig := rmsNormSignature(req.Rows, req.Hidden, req.DType, req.Eps, algo)
	if req.Rows == 0 {
		// Still a collective: a peer that passed rows learns of the mismatch.
		return b.launchRMSNorm(algo, dt, grid, b.emptyRMSNorm(algo, sig), req.Stream)
	}
	q := rmsNormParams{AR: *b.fill(req.Count(), reduce.Sum, sig), Residual: uint64(req.Residual),
		Weight: uint64(req.Weight), ResidualOut: uint64(req.ResidualOut), Rows: req.Rows, Hidden: int32(req.Hidden),
		Eps: req.Eps}
	q.AR.LocalSrc, q.AR.Out = uint64(req.X), uint64(req.Normed)
	if isLL(algo) {
		b.useLL(&q.AR, algo)
	}
	return b.launchRMSNorm(algo, dt, grid, &q, req.Stream)
}

// rmsNormValidShape: Validate's verdict on what picks the kernel and grid
// (dtype, rows, hidden), whatever else is wrong.
func rmsNormValidShape(req collective.RMSNorm) error {
	req.Eps, req.Algo = 0, collective.Auto
	req.X, req.Residual, req.Weight, req.Normed, req.ResidualOut = 1, 1, 1, 1, 1
	return req.Validate()
}

// emptyRMSNorm is the parameters of a call with no rows that carries sig:
// its LL headers or start flags tell the peers, nothing else is read or
// written. Its output is a harmless pointer the kernel accepts (not the
// two-shot's staging or scratch).
func (b *Backend) emptyRMSNorm(algo collective.Algorithm, sig int32) *rmsNormParams {
	q := &rmsNormParams{AR: *b.fill(0, reduce.Sum, sig), Hidden: 8}
	q.AR.Out = uint64(b.ll.Local)
	if isLL(algo) {
		b.useLL(&q.AR, algo)
		q.AR.Out = uint64(b.scratch.Local)
	}
	return q
}

// chooseRMSNorm resolves the algorithm of a call with nbytes of input per
// rank: the request (an unknown one is taken as auto; Validate refused it),
// else by size. The one-shots send what fits in their buffers; larger calls
// run the two-shot. Every rank resolves the same call the same way.
func (b *Backend) chooseRMSNorm(requested collective.Algorithm, nbytes int64) collective.Algorithm {
	algo := requested
	if _, ok := rmsNormKernels[algo]; !ok {
		switch {
		case nbytes <= rmsNormLamportMaxBytes(b.size):
			algo = collective.OneShotLamport
		case b.size == 1 && nbytes <= rmsNormLLMaxBytes:
			algo = collective.OneShotLL
		default:
			algo = collective.TwoShot
		}
	}
	if algo == collective.OneShotLL && nbytes > llMaxPayload {
		algo = collective.TwoShot
	}
	if algo == collective.OneShotLamport && nbytes > lamportMaxPayload(b.size) {
		algo = collective.TwoShot
	}
	return algo
}

// rmsNormGrid is the grid of a call; every rank derives the same one. The
// LL one-shot takes the LL all-reduce's grids (the whole grid sends; rows
// go to blocks in turn); the two-shot one block per row of a slice, rounded
// up to a power of two so that calls of slightly different sizes still pair
// their blocks (a mismatch, not a timeout).
func (b *Backend) rmsNormGrid(algo collective.Algorithm, rows, nbytes int64) uint32 {
	if isLL(algo) {
		return llGridFor(nbytes, b.size, b.opts.MaxBlocks)
	}
	per := (rows + int64(b.size) - 1) / int64(b.size)
	g := int64(1)
	for g < int64(b.opts.MaxBlocks) && g < per {
		g *= 2
	}
	return uint32(min(g, int64(b.opts.MaxBlocks)))
}

// rmsNormSignature summarizes a fused call as signature does an
// all-reduce; the leading tag keeps it apart from every all-reduce's.
func rmsNormSignature(rows, hidden int64, dt reduce.DType, eps float32, algo collective.Algorithm) int32 {
	h := fnv1a(2166136261, 0x4d524f4e534d52, 8) // "RMSNORM"
	h = fnv1a(h, uint64(rows), 8)
	h = fnv1a(h, uint64(hidden), 8)
	h = fnv1a(h, uint64(uint32(dt)), 4)
	h = fnv1a(h, uint64(math.Float32bits(eps)), 4)
	h = fnv1a(h, uint64(uint32(algo)), 4)
	return int32(h & 0x7fffffff)
}

func (b *Backend) launchRMSNorm(algo collective.Algorithm, dt reduce.DType, grid uint32, q *rmsNormParams, stream uintptr) error {
	names := rmsNormKernels[algo]
	expr := names[1]
	if dt == reduce.Float16 {
		expr = names[0]
	}
	fn, err := b.kernels.named(rmsNormFile, expr)
	if err != nil {
		return err
	}
	if err := b.drv.Launch(fn, grid, kThreads, 0, stream, q.bytes()); err != nil {
		return fmt.Errorf("launch %s all-reduce + RMSNorm: %w", algo, err)
	}
	return nil
}
