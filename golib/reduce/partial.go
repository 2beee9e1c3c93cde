package reduce

import "unsafe"

// A reduction split into stages (a node's ranks first, then the nodes) keeps
// one fixed expression per element: HostPartial folds one group's inputs in
// order into an accumulator of type AccType, HostFinish folds those partials
// in order, applies avg, and rounds once. 16-bit floats accumulate in float32
// across both stages, so splitting never rounds them twice.

// AccType is the element type partial results travel in: float32 for the
// 16-bit floats, d itself otherwise.
func AccType(d DType) DType {
	if d == Float16 || d == BFloat16 {
		return Float32
	}
	return d
}

// HostPartial folds n elements of srcs (of type d), in order, into dst (of
// type AccType(d)). Avg accumulates as a sum: HostFinish divides. dst may
// alias srcs[0] only when the two types are the same.
func HostPartial(dst unsafe.Pointer, srcs []unsafe.Pointer, n int, d DType, op Op) {
	if n <= 0 || len(srcs) == 0 {
		return
	}
	if op == Avg {
		op = Sum
	}
	switch d {
	case Float16, BFloat16:
		partialHalf(cast[float32](dst, n), casts[uint16](srcs, n), op, d == BFloat16)
	default:
		Host(dst, srcs, n, d, op)
	}
}

// HostFinish folds n elements of the partials srcs (of type AccType(d)), in
// order, into dst (of type d): avg divides the sum by divisor (the number of
// inputs behind all the partials), then 16-bit floats round once. dst may
// alias any source of its own type.
func HostFinish(dst unsafe.Pointer, srcs []unsafe.Pointer, n int, d DType, op Op, divisor int) {
	if n <= 0 || len(srcs) == 0 {
		return
	}
	switch d {
	case Float32:
		finishNum(cast[float32](dst, n), casts[float32](srcs, n), op, divisor)
	case Float64:
		finishNum(cast[float64](dst, n), casts[float64](srcs, n), op, divisor)
	case Int32:
		finishNum(cast[int32](dst, n), casts[int32](srcs, n), op, divisor)
	case Int64:
		finishNum(cast[int64](dst, n), casts[int64](srcs, n), op, divisor)
	case Float16, BFloat16:
		finishHalf(cast[uint16](dst, n), casts[float32](srcs, n), op, divisor, d == BFloat16)
	}
}

func finishNum[T number](dst []T, srcs [][]T, op Op, divisor int) {
	for lo := 0; lo < len(dst); lo += chunk {
		hi := min(lo+chunk, len(dst))
		d := dst[lo:hi]
		fold(d, srcs[0][lo:hi], srcs[1:], lo, op)
		if op == Avg {
			divide(d, divisor)
		}
	}
}

// partialHalf widens each source chunk and folds it in float32, like
// hostHalf, but stores the float32 sums unrounded.
func partialHalf(dst []float32, srcs [][]uint16, op Op, bf16 bool) {
	var tmp [chunk]float32
	for lo := 0; lo < len(dst); lo += chunk {
		hi := min(lo+chunk, len(dst))
		a, t := dst[lo:hi], tmp[:hi-lo]
		widen(a, srcs[0][lo:hi], bf16)
		for _, s := range srcs[1:] {
			widen(t, s[lo:hi], bf16)
			combine(a, t, op)
		}
	}
}

// finishHalf folds float32 partials, divides for avg, and rounds once.
func finishHalf(dst []uint16, srcs [][]float32, op Op, divisor int, bf16 bool) {
	var acc [chunk]float32
	for lo := 0; lo < len(dst); lo += chunk {
		hi := min(lo+chunk, len(dst))
		a := acc[:hi-lo]
		copy(a, srcs[0][lo:hi])
		for _, s := range srcs[1:] {
			combine(a, s[lo:hi], op)
		}
		if op == Avg {
			divide(a, divisor)
		}
		narrow(dst[lo:hi], a, bf16)
	}
}
