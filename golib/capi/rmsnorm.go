package main

/*
#include <stdint.h>

// One fused call's arguments in one block (see p2p_all_reduce_args).
typedef struct {
	uint64_t handle, x, residual, weight, normed, residual_out;
	int64_t rows, hidden;
	int32_t dtype;
	float eps;
	int32_t algo, reserved;
	uint64_t stream;
} p2p_all_reduce_rmsnorm_args;
*/
import "C"

import (
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// p2p_all_reduce_rmsnorm runs the fused all-reduce + residual add + RMSNorm
// (collective.RMSNorm): x, residual, normed and residual_out hold rows x
// hidden elements of dtype, weight hidden; residual_out may be residual.
// Collective; on GPU enqueued on stream as one kernel.
//
//export p2p_all_reduce_rmsnorm
func p2p_all_reduce_rmsnorm(h C.uint64_t, x, residual, weight, normed, residualOut C.uint64_t, rows, hidden C.int64_t,
	dtype C.int32_t, eps C.float, algo C.int32_t, stream C.uint64_t) C.int {
	return withRMSNormer(h, func(b collective.RMSNormer) error {
		return b.AllReduceRMSNorm(collective.RMSNorm{
			X: uintptr(x), Residual: uintptr(residual), Weight: uintptr(weight), Normed: uintptr(normed),
			ResidualOut: uintptr(residualOut), Rows: int64(rows), Hidden: int64(hidden), DType: reduce.DType(dtype),
			Eps: float32(eps), Algo: collective.Algorithm(algo), Stream: uintptr(stream),
		})
	})
}

// The block's layout is what Python packs ("<6Q2qifiiQ", 88 bytes).
var _ = [1]struct{}{}[unsafe.Sizeof(C.p2p_all_reduce_rmsnorm_args{})-88]

// p2p_all_reduce_rmsnorm_packed is p2p_all_reduce_rmsnorm with its
// arguments in a block (p2p_all_reduce_rmsnorm_args), read before it returns.
//
//export p2p_all_reduce_rmsnorm_packed
func p2p_all_reduce_rmsnorm_packed(a *C.p2p_all_reduce_rmsnorm_args) C.int {
	if a == nil {
		return guard(func() error {
			return status.Errorf(status.InvalidArgument, "p2p_all_reduce_rmsnorm_packed: null arguments")
		})
	}
	return p2p_all_reduce_rmsnorm(C.uint64_t(a.handle), C.uint64_t(a.x), C.uint64_t(a.residual), C.uint64_t(a.weight),
		C.uint64_t(a.normed), C.uint64_t(a.residual_out), C.int64_t(a.rows), C.int64_t(a.hidden), C.int32_t(a.dtype),
		C.float(a.eps), C.int32_t(a.algo), C.uint64_t(a.stream))
}

// p2p_all_reduce_rmsnorm_reject takes part in a fused call on behalf of a
// rank whose arguments Python rejected (rows, hidden and dtype as far as
// known pick the kernel its peers run), so that they fail with a mismatch
// instead of waiting; it returns code with message.
//
//export p2p_all_reduce_rmsnorm_reject
func p2p_all_reduce_rmsnorm_reject(h C.uint64_t, code C.int32_t, message *C.char, rows, hidden C.int64_t, dtype, algo C.int32_t,
	stream C.uint64_t) C.int {
	return withRMSNormer(h, func(b collective.RMSNormer) error {
		reject := status.Errorf(status.Code(code), "%s", C.GoString(message))
		return b.AllReduceRMSNorm(collective.RMSNorm{Reject: reject, Rows: int64(rows), Hidden: int64(hidden),
			DType: reduce.DType(dtype), Algo: collective.Algorithm(algo), Stream: uintptr(stream)})
	})
}

func withRMSNormer(h C.uint64_t, f func(collective.RMSNormer) error) C.int {
	return withBackend(h, func(b collective.Backend) error {
		r, ok := b.(collective.RMSNormer)
		if !ok {
			return status.Errorf(status.Unsupported, "this backend has no fused all-reduce + RMSNorm")
		}
		return f(r)
	})
}
