// Package moe is mixture-of-experts expert parallelism: dispatch sends each
// token to the ranks that own its experts, combine brings the experts'
// outputs back, weighted, to the token's rank.
//
// An EP owns everything a call needs: its symmetric buffers, the kernels'
// parameter blocks, the order of the launches and their grids, the side
// stream that stages a dispatch's rows while its first kernel runs, the
// in-kernel barriers' state, and the host-memory path of the CPU backend.
// Callers pass tensors as addresses: inputs, and outputs they have sized
// (eager dispatch: after Dispatch has said how many rows arrived).
//
// Results are the same on every backend, bit for bit: rows in expert-major
// order (local expert, source rank, source token, k), and combine's float32
// sums in a fixed order (k ascending on each expert rank, rounded once to
// the transit type; then ranks ascending on the token's rank, rounded once).
package moe

import (
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// Group is the host-side exchange the construction agrees through (a
// communicator's bootstrap): bounded by its own timeout, never by a kernel's.
type Group interface {
	Rank() int
	Size() int
	AllGather(data []byte) ([][]byte, error)
	Barrier() error
}

// Config is one rank's construction arguments. Every rank must pass the
// same, except NumSMs (all take the smallest grid) and the tuning overrides.
type Config struct {
	NumExperts   int          `json:"num_experts"`
	Hidden       int          `json:"hidden"`
	MaxTokens    int          `json:"max_tokens"`
	TopK         int          `json:"topk"`
	DType        reduce.DType `json:"dtype"`
	CombineDType reduce.DType `json:"combine_dtype"`
	Capturable   bool         `json:"capturable"`
	// DispatchFP8: dispatch takes rows of float8 (e4m3) with a float32
	// scale per 128 columns (DeepSeek's layout) instead of rows of DType,
	// and moves both bit for bit; expert outputs and combine stay DType.
	DispatchFP8 bool `json:"dispatch_fp8"`
	// NumSMs bounds the blocks of each kernel (0: DefaultSMs).
	NumSMs int `json:"num_sms"`
	// Rejected says that the caller found this rank's arguments bad: the
	// construction still takes part in the agreement, so that the other
	// ranks fail (status.Mismatch, naming this rank) instead of waiting,
	// and New returns ErrRejected here.
	Rejected bool `json:"rejected"`
	// Tuning overrides; nil takes the default (see Tuning).
	Tuning Tuning `json:"tuning"`
}

// Tuning holds the thresholds that pick between paths giving the same bits.
// A nil field takes the default; tests set them to reach every path.
type Tuning struct {
	// EagerKernelStageBytes: eager dispatch has the send kernel copy x into
	// the staging buffer up to this many bytes of x (16-byte aligned, not
	// float8; default: any size), else a copy on the caller's stream does.
	EagerKernelStageBytes *int64 `json:"eager_kernel_stage_bytes"`
	// CountKernelMinPairs: dispatch runs moe_dispatch_count before the send
	// kernel from this many routed (token, k) pairs up
	// (DefaultCountKernelMinPairs; P2PCOMM_MOE_COUNT_PAIRS).
	CountKernelMinPairs *int64 `json:"count_kernel_min_pairs"`
	// SelfLocal: "auto" (or ""), "never" or "always": whether a world of 2
	// sums its own tokens' partials in the reduce kernel (P2PCOMM_MOE_SELF_LOCAL).
	SelfLocal string `json:"self_local"`
}

// Defaults of the thresholds and of the grid.
const (
	// DefaultSMs is the blocks of each kernel without Config.NumSMs.
	DefaultSMs = 24
	// DefaultCountKernelMinPairs: without the count kernel each send block
	// recounts every token before its range, which costs the last block
	// T*K id loads; below this many pairs that is less than a launch.
	DefaultCountKernelMinPairs = 8192
	// SelfLocalMinTokens: from this many tokens a world of 2 whose partials
	// travel in the ep's dtype sums its own tokens' partials in the reduce
	// (the send kernel then reads only what it pushes); for smaller batches
	// the reduce's chains of loads cost more than the send saves.
	SelfLocalMinTokens = 1024
)

// ErrRejected is New's error on a rank whose Config.Rejected was set: the
// caller raises its own reason.
var ErrRejected = status.Errorf(status.InvalidArgument, "ExpertParallel: this rank rejected its arguments")

// Info is what the caller needs to know of a constructed EP.
type Info struct {
	Kernels     bool    `json:"kernels"`       // GPU kernels (else the host path)
	Blocks      int     `json:"blocks"`        // the agreed grid (0 on the host path)
	MaxRecvRows int64   `json:"max_recv_rows"` // W * max_tokens * topk: a capturable dispatch's rows
	Staging     uintptr `json:"staging"`       // GPU: xs, [max_tokens, hidden] of dtype, where x may be built in place
	// SelfLocalMinTokens is the threshold this EP's combine uses.
	SelfLocalMinTokens int `json:"self_local_min_tokens"`
}

// fields are the construction arguments every rank must share, in the
// order and with the names the agreement reports them.
var fields = [...]string{"num_experts", "hidden", "topk", "max_tokens_per_rank", "dtype", "combine_dtype",
	"capturable", "world_size", "dispatch_fp8"}

func (c Config) shared(world int) [len(fields)]int64 {
	capt, fp8 := int64(0), int64(0)
	if c.Capturable {
		capt = 1
	}
	if c.DispatchFP8 {
		fp8 = 1
	}
	return [len(fields)]int64{int64(c.NumExperts), int64(c.Hidden), int64(c.TopK), int64(c.MaxTokens),
		int64(c.DType), int64(c.CombineDType), capt, int64(world), fp8}
}

// check is this rank's own verdict on c (the caller checked types and
// ranges already; this is the backstop, and the dtype rules).
func (c Config) check() error {
	for _, f := range []struct {
		name string
		v    int
	}{{"num_experts", c.NumExperts}, {"hidden", c.Hidden}, {"max_tokens_per_rank", c.MaxTokens}, {"topk", c.TopK}} {
		if f.v < 1 {
			return status.Errorf(status.InvalidArgument, "%s must be positive, got %d", f.name, f.v)
		}
	}
	if !isFloat(c.DType) {
		return status.Errorf(status.Unsupported, "dtype %s is not supported; use float32, float64, float16 or bfloat16", c.DType)
	}
	if c.CombineDType != reduce.Float32 && c.CombineDType != c.DType {
		return status.Errorf(status.Unsupported, "combine_dtype %s is not supported with dtype %s", c.CombineDType, c.DType)
	}
	if c.DispatchFP8 && c.Hidden%fp8ScaleCols != 0 {
		return status.Errorf(status.Unsupported, "fp8 dispatch needs hidden to be a multiple of %d (one scale per %d columns), got %d",
			fp8ScaleCols, fp8ScaleCols, c.Hidden)
	}
	if c.NumSMs < 0 {
		return status.Errorf(status.InvalidArgument, "num_sms must be positive, got %d", c.NumSMs)
	}
	switch c.Tuning.SelfLocal {
	case "", "auto", "never", "always":
	default:
		return status.Errorf(status.InvalidArgument, "self_local %q: want auto, never or always", c.Tuning.SelfLocal)
	}
	return nil
}

func isFloat(d reduce.DType) bool {
	return d == reduce.Float32 || d == reduce.Float64 || d == reduce.Float16 || d == reduce.BFloat16
}

// agree exchanges every rank's shared configuration, verdict and wanted
// grid on the host, before any collective allocation, so that a bad rank
// makes every rank fail (each with its own error, or a Mismatch naming it)
// instead of leaving its peers waiting in an allocation. It returns the
// smallest grid any rank wants: a kernel waits for as many blocks of each
// peer's send kernel as it has itself, so the grids must agree.
func agree(g Group, c Config, problem error, blocks int) (int, error) {
	world := g.Size()
	mine := make([]byte, 0, 8*(len(fields)+2))
	for _, v := range c.shared(world) {
		mine = binary.LittleEndian.AppendUint64(mine, uint64(v))
	}
	failed := uint64(0)
	if problem != nil {
		failed = 1
	}
	mine = binary.LittleEndian.AppendUint64(mine, failed)
	mine = binary.LittleEndian.AppendUint64(mine, uint64(blocks))
	all, err := g.AllGather(mine)
	if err != nil {
		return 0, fmt.Errorf("ExpertParallel: agree on the configuration: %w", err)
	}
	var bad []string
	lo, hi := c.shared(world), c.shared(world)
	least := blocks
	for r, rec := range all {
		if len(rec) != len(mine) {
			return 0, status.Errorf(status.Mismatch, "ExpertParallel: rank %d sent %d bytes of configuration, this rank %d", r, len(rec), len(mine))
		}
		for i := range fields {
			v := int64(binary.LittleEndian.Uint64(rec[8*i:]))
			lo[i], hi[i] = min(lo[i], v), max(hi[i], v)
		}
		if binary.LittleEndian.Uint64(rec[8*len(fields):]) != 0 {
			bad = append(bad, fmt.Sprint(r))
		}
		least = min(least, int(binary.LittleEndian.Uint64(rec[8*len(fields)+8:])))
	}
	if problem != nil {
		return 0, problem
	}
	if len(bad) > 0 {
		return 0, status.Errorf(status.Mismatch, "ExpertParallel: rank %s rejected its arguments or could not build its kernels (its own exception says which)",
			strings.Join(bad, ", "))
	}
	var differ []string
	for i, name := range fields {
		if lo[i] != hi[i] {
			differ = append(differ, fmt.Sprintf("%s (from %d to %d)", name, lo[i], hi[i]))
		}
	}
	if len(differ) > 0 {
		return 0, status.Errorf(status.InvalidArgument, "ExpertParallel: ranks passed different %s; every rank must pass the same configuration (dtypes and capturable are compared as codes)",
			strings.Join(differ, ", "))
	}
	if c.NumExperts%world != 0 {
		return 0, status.Errorf(status.InvalidArgument, "num_experts=%d must be divisible by the world size %d", c.NumExperts, world)
	}
	return least, nil
}
