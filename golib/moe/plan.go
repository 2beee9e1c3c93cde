package moe

import (
	"fmt"
	"math"

	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// plan is what an EP decided at construction: shapes, the agreed grid and
// the thresholds. Its methods decide each call's launches from it and the
// call's token count alone, so that they can be tested without a device.
type plan struct {
	world, rank             int
	numExperts, numLocal    int
	hidden, maxTokens, topK int
	dtype, transit          reduce.DType
	blocks                  int   // the agreed grid of every multi-block kernel (GPU)
	maxRecvRows             int64 // W * Tm * K
	eagerKernelStageBytes   int64
	countMinPairs           int64
	selfLocal               string // never, auto or always (never unless the world is 2 and topk <= combWide)
	capturable              bool   // the construction's default mode
	fp8                     bool   // dispatch moves float8 rows and their scales (Config.DispatchFP8)
}

func newPlan(c Config, rank, world int) plan {
	p := plan{world: world, rank: rank, numExperts: c.NumExperts, numLocal: c.NumExperts / world,
		hidden: c.Hidden, maxTokens: c.MaxTokens, topK: c.TopK, dtype: c.DType, transit: c.CombineDType,
		maxRecvRows: int64(world) * int64(c.MaxTokens) * int64(c.TopK), capturable: c.Capturable, fp8: c.DispatchFP8,
		eagerKernelStageBytes: math.MaxInt64, countMinPairs: DefaultCountKernelMinPairs, selfLocal: "never"}
	if v := c.Tuning.EagerKernelStageBytes; v != nil {
		p.eagerKernelStageBytes = *v
	}
	if v := c.Tuning.CountKernelMinPairs; v != nil {
		p.countMinPairs = *v
	}
	if world == 2 && c.TopK <= combWide {
		switch c.Tuning.SelfLocal {
		case "", "auto":
			p.selfLocal = "auto"
		default:
			p.selfLocal = c.Tuning.SelfLocal
		}
	}
	return p
}

// rowBytes is the bytes of one token row of dtype (expert outputs; the
// staging buffer holds Tm of them).
func (p *plan) rowBytes() int64 { return int64(p.hidden) * int64(p.dtype.Size()) }

// fp8ScaleCols is how many columns of a float8 row share one float32 scale.
const fp8ScaleCols = 128

// dispatchRowBytes is the bytes of one row that dispatch moves: of dtype,
// or of float8.
func (p *plan) dispatchRowBytes() int64 {
	if p.fp8 {
		return int64(p.hidden)
	}
	return p.rowBytes()
}

// scaleBytes is the bytes of one row's float32 scales (0 without fp8).
func (p *plan) scaleBytes() int64 {
	if p.fp8 {
		return 4 * int64(p.hidden) / fp8ScaleCols
	}
	return 0
}

// kernelProblem says why the GPU kernels cannot take a configuration (nil
// when they can): the same answer on every rank.
func kernelProblem(c Config, world int) error {
	why := ""
	switch {
	case c.DType != reduce.Float32 && c.DType != reduce.BFloat16 && c.DType != reduce.Float16:
		why = fmt.Sprintf("dtype %s (the kernels take bfloat16, float16 and float32)", c.DType)
	case c.DispatchFP8 && (c.Hidden/fp8ScaleCols*4)%16 != 0:
		why = fmt.Sprintf("fp8 dispatch of hidden=%d: its rows of scales are %d bytes, not a multiple of 16 (hidden a multiple of 512 is)",
			c.Hidden, c.Hidden/fp8ScaleCols*4)
	case int64(c.Hidden)*int64(c.DType.Size())%16 != 0:
		why = fmt.Sprintf("hidden=%d: rows of %d bytes, not a multiple of 16", c.Hidden, int64(c.Hidden)*int64(c.DType.Size()))
	case world > maxRanks:
		why = fmt.Sprintf("a world of %d ranks (at most %d)", world, maxRanks)
	case c.TopK > maxTopK:
		why = fmt.Sprintf("topk=%d (at most %d)", c.TopK, maxTopK)
	case c.NumExperts > maxExperts:
		why = fmt.Sprintf("num_experts=%d (at most %d)", c.NumExperts, maxExperts)
	case int64(world)*int64(c.MaxTokens)*int64(c.TopK) >= 1<<31:
		why = fmt.Sprintf("world_size * max_tokens_per_rank * topk = %d (below 2^31)", int64(world)*int64(c.MaxTokens)*int64(c.TopK))
	default:
		return nil
	}
	if c.DispatchFP8 {
		return status.Errorf(status.Unsupported, "ExpertParallel on GPU cannot take %s", why)
	}
	return status.Errorf(status.Unsupported, "ExpertParallel on GPU cannot take %s; the CPU backend can", why)
}

// wantedBlocks is this rank's grid: numSMs (0: DefaultSMs) within the
// GPU's SMs and the barriers' block limit.
func wantedBlocks(numSMs, sms int) int {
	b := DefaultSMs
	if numSMs > 0 {
		b = numSMs
	}
	if sms > 0 {
		b = min(b, sms)
	}
	return max(1, min(b, maxSyncBlocks))
}

// dispatchLaunch is how one dispatch runs on the GPU.
type dispatchLaunch struct {
	staged                                bool  // x is copied into xs (it is not built there)
	overlap                               bool  // that copy runs on the side stream, under the send kernel (capturable)
	inKernel                              bool  // the send kernel makes that copy (eager, aligned rows of dtype)
	counted                               bool  // moe_dispatch_count runs first
	idsShared                             bool  // the send kernel copies the expert ids into shared memory
	sendMode                              int32 // kSync* bits of the count, send and side-stream kernels
	expandMode                            int32
	countShared, sendShared, expandShared uint32
}

// dispatch plans a dispatch of T tokens (0 when this rank rejected its
// arguments: it then only takes part in the barriers); inBuffer says x is
// xs itself (fp8: and its scales are at xsScales), aligned that x may be
// copied by 16-byte packs. Capturable
// calls put both barriers inside the kernels; eager ones start with
// moe_post_status (the argument checks and the start barrier), and the
// send kernel's last block runs the middle one (every block posts its
// middle flags in both) and hands the host the counts.
func (p *plan) dispatch(T int, inBuffer, aligned, capturable, rejected bool) dispatchLaunch {
	var d dispatchLaunch
	d.staged = T > 0 && !inBuffer
	// Capturable: the copy runs on the side stream, which the send kernel's
	// block 0 releases (moe_stage_gate) once past its start barrier, before
	// which peers may still read the previous rows; moe_stage_done's staged
	// flags tell the peers' expands it is done. Eager: moe_post_status, the
	// start barrier, has run already, and the send kernel copies x (on the
	// caller's stream before it, when it cannot: fp8 rows and scales, or x
	// off 16-byte alignment); its blocks' middle flags then cover the copy,
	// which is all the peers wait for before they read xs.
	d.overlap = d.staged && capturable
	d.inKernel = d.staged && !capturable && !p.fp8 && aligned && int64(T)*p.dispatchRowBytes() <= p.eagerKernelStageBytes
	d.counted = T > 0 && int64(T)*int64(p.topK) >= p.countMinPairs
	d.idsShared = !rejected && !d.counted && 4*(int64(p.numExperts)+int64(T)*int64(p.topK)) <= sendSharedMax
	if capturable {
		// Every rank posts one staged flag per call, which every expand waits
		// for whether or not that rank copies x (ranks differ: x built in
		// the buffer, T = 0): moe_stage_done after the side stream's copy,
		// else the send kernel at once.
		d.sendMode = syncStart | syncArrive
		if d.staged {
			d.sendMode |= syncStageGo
		} else {
			d.sendMode |= syncPostStaged
		}
		d.expandMode = syncWait | syncStaged
	} else {
		d.sendMode = syncArrive
	}
	d.countShared = uint32(4 * (p.world + p.numExperts))
	ids := 0
	if d.idsShared {
		ids = T * p.topK
	}
	d.sendShared = uint32(4 * (p.numExperts + ids))
	d.expandShared = p.expandShared()
	return d
}

// expandShared is moe_dispatch_expand's dynamic shared memory: each local
// expert's total and, per source, its first row.
func (p *plan) expandShared() uint32 { return uint32(4 * (p.world + 1) * p.numLocal) }

// combineLaunch is how one combine runs on the GPU.
type combineLaunch struct {
	selfLocal  bool  // this rank's own tokens' partials are the reduce's (moe_combine_reduce_self)
	sendMode   int32 // kSync* bits of the send kernel
	reduceGrid uint32
}

// combine plans a combine of T tokens (this rank's latest dispatch's; 0
// when this rank rejected its arguments: no reduce then).
func (p *plan) combine(T int, capturable bool) combineLaunch {
	var c combineLaunch
	c.selfLocal = p.selfLocal == "always" ||
		(p.selfLocal == "auto" && p.transit == p.dtype && T >= SelfLocalMinTokens)
	// The middle barrier is inside the kernels in both modes; eager calls
	// start with moe_post_status (the argument checks and the start barrier).
	c.sendMode = syncArrive
	if capturable {
		c.sendMode |= syncStart
	}
	packs := int64(T) * p.rowBytes() / 16
	c.reduceGrid = uint32(max(1, min(int64(p.blocks), (packs+threads-1)/threads)))
	return c
}

// syncMode is a MoeSync mode: the bits and the send kernels' grid, which
// the waiters need to know whose middle flags to wait for.
func (p *plan) syncMode(bits int32) int32 { return bits | int32(p.blocks)<<syncGridShift }
