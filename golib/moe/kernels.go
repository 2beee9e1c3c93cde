package moe

import (
	"fmt"

	"github.com/p2pcomm/p2pcomm/golib/reduce"
)

// Source files of the kernels, in native/kernels.
const (
	dispatchFile = "moe_dispatch.cu"
	combineFile  = "moe_combine.cu"
	stagedFile   = "moe_staged.cu"
)

// kernel names one of the MoE kernels.
type kernel int

const (
	kPostStatus kernel = iota
	kStageGate
	kStageDone
	kCount
	kSend
	kExpand
	kCombineSend
	kReduce
	kReduceSelf
	numKernels
)

var kernelNames = [numKernels]string{"moe_post_status", "moe_stage_gate", "moe_stage_done", "moe_dispatch_count",
	"moe_dispatch_send", "moe_dispatch_expand", "moe_combine_send", "moe_combine_reduce", "moe_combine_reduce_self"}

func (k kernel) String() string { return kernelNames[k] }

// file is the source that declares k.
func (k kernel) file() string {
	if k >= kCombineSend {
		return combineFile
	}
	return dispatchFile
}

// cTypes names each element type as the kernels' templates spell it.
var cTypes = map[reduce.DType]string{reduce.BFloat16: "bf16", reduce.Float16: "half16", reduce.Float32: "float"}

// oneGroupWorlds: a combine reduce in a world of this many ranks sums every
// rank's partial in one group (moe_combine_reduce<T, C, G> with G the world
// size), with all the loads of a pass in flight before any sum; other
// worlds take groups of 4 (G = 0).
func oneGroupWorld(world int) bool { return world >= 2 && world <= 4 }

// expr is the name expression of k as moe_*.cu instantiate it for
// element type dt, combine transit tr and a world of world ranks.
func (k kernel) expr(dt, tr reduce.DType, world int) string {
	t, c := cTypes[dt], cTypes[tr]
	switch k {
	case kPostStatus, kStageGate, kStageDone:
		return kernelNames[k]
	case kCount, kSend, kExpand:
		return fmt.Sprintf("%s<%s>", kernelNames[k], t)
	case kReduce:
		g := 0
		if oneGroupWorld(world) {
			g = world
		}
		return fmt.Sprintf("%s<%s, %s, %d>", kernelNames[k], t, c, g)
	}
	return fmt.Sprintf("%s<%s, %s>", kernelNames[k], t, c)
}

// needed says whether an EP of this world launches k (the self-local
// reduce is for a world of 2 only).
func (k kernel) needed(world int) bool { return k != kReduceSelf || world == 2 }

// stagedExprs are the name expressions of the staged path's kernels
// (moe_staged.cu) for element type dt and combine transit tr.
func stagedExprs(dt, tr reduce.DType) (expand, partials string) {
	return "moe_staged_expand", fmt.Sprintf("moe_staged_partials<%s, %s>", cTypes[dt], cTypes[tr])
}
