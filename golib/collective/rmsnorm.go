package collective

import (
	"math"

	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// RMSNormMaxHidden is the longest row the fused all-reduce + RMSNorm takes
// (native/kernels/allreduce_rmsnorm.cu kRMSNormMaxHidden: a row is held by
// one GPU block).
const RMSNormMaxHidden = 16384

// rmsNormRowBytes: rows are whole 16-byte packs on every backend, so that
// every backend takes the same calls.
const rmsNormRowBytes = 16

// RMSNorm is one fused all-reduce + residual add + RMSNorm. X, Residual,
// Normed and ResidualOut hold Rows rows of Hidden elements, Weight one row;
// all of DType (float16 or bfloat16), in the backend's memory space. Per
// row, with float32 arithmetic:
//
//	sum          = all-reduce (sum) of X, rounded once to DType: the bits the
//	               backend's all-reduce gives
//	ResidualOut  = round(float(sum) + float(Residual))
//	Normed       = round(float(ResidualOut) * inv * float(Weight)),
//	               inv = 1/sqrt(mean over the row of float(ResidualOut)^2 + Eps)
//
// ResidualOut may be Residual (in place); nothing else may overlap.
type RMSNorm struct {
	X, Residual, Weight uintptr
	Normed, ResidualOut uintptr
	Rows                int64
	Hidden              int64
	DType               reduce.DType
	Eps                 float32
	Algo                Algorithm // Auto, OneShotLL, OneShotLamport or TwoShot
	Stream              uintptr
	// Reject, when set, is this rank's own validation failure: the backend
	// takes part in the call anyway, so that every peer fails too instead
	// of waiting, and returns Reject.
	Reject error
}

// RMSNormer is implemented by backends that run the fused all-reduce +
// residual add + RMSNorm (both do).
type RMSNormer interface {
	// AllReduceRMSNorm runs one collective RMSNorm call.
	AllReduceRMSNorm(req RMSNorm) error
}

// Count is the number of elements of X.
func (r RMSNorm) Count() int64 { return r.Rows * r.Hidden }

// Validate returns why the backends cannot run r (Unsupported or
// InvalidArgument), or nil. It checks the numbers, not the memory.
func (r RMSNorm) Validate() error {
	if r.DType != reduce.Float16 && r.DType != reduce.BFloat16 {
		return status.Errorf(status.Unsupported, "all-reduce + RMSNorm takes float16 or bfloat16, not %s", r.DType)
	}
	if r.Hidden <= 0 || r.Hidden > RMSNormMaxHidden {
		return status.Errorf(status.Unsupported, "all-reduce + RMSNorm: hidden size %d is outside [1, %d]", r.Hidden, RMSNormMaxHidden)
	}
	if per := int64(rmsNormRowBytes / r.DType.Size()); r.Hidden%per != 0 {
		return status.Errorf(status.Unsupported, "all-reduce + RMSNorm: hidden size %d is not a multiple of %d (rows of whole 16-byte packs)",
			r.Hidden, per)
	}
	if r.Rows < 0 {
		return status.Errorf(status.InvalidArgument, "all-reduce + RMSNorm: %d rows", r.Rows)
	}
	if r.Rows > math.MaxInt64/r.Hidden/int64(r.DType.Size()) {
		return status.Errorf(status.InvalidArgument, "all-reduce + RMSNorm: %d rows of %d elements overflow", r.Rows, r.Hidden)
	}
	if !(r.Eps >= 0) || math.IsInf(float64(r.Eps), 0) {
		return status.Errorf(status.InvalidArgument, "all-reduce + RMSNorm: eps %g is not a finite number >= 0", r.Eps)
	}
	switch r.Algo {
	case Auto, OneShotLL, OneShotLamport, TwoShot:
	default:
		return status.Errorf(status.Unsupported, "all-reduce + RMSNorm runs auto, oneshot_ll, oneshot_lamport or twoshot, not %s", r.Algo)
	}
	if r.Rows > 0 && (r.X == 0 || r.Residual == 0 || r.Weight == 0 || r.Normed == 0 || r.ResidualOut == 0) {
		return status.Errorf(status.InvalidArgument, "all-reduce + RMSNorm: a null tensor")
	}
	return nil
}
