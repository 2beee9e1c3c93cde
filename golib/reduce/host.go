package reduce

import (
	"math"
	"unsafe"
)

// chunk is how many elements are accumulated at a time; the accumulator
// lives on the stack and stays in L1.
const chunk = 1024

// Host reduces n elements from each of srcs, in rank order, into dst.
// dst may alias any source. Floating-point half types accumulate in
// float32 and round once. Avg divides the sum by len(srcs); for integers it
// floors like torch.div(rounding_mode="floor").
//
// The order of accumulation is fixed (srcs[0] op srcs[1] op ...) so that
// every rank that reduces the same data gets bit-identical results.
func Host(dst unsafe.Pointer, srcs []unsafe.Pointer, n int, d DType, op Op) {
	if n <= 0 || len(srcs) == 0 {
		return
	}
	switch d {
	case Float32:
		hostNum(cast[float32](dst, n), casts[float32](srcs, n), op)
	case Float64:
		hostNum(cast[float64](dst, n), casts[float64](srcs, n), op)
	case Int32:
		hostNum(cast[int32](dst, n), casts[int32](srcs, n), op)
	case Int64:
		hostNum(cast[int64](dst, n), casts[int64](srcs, n), op)
	case Float16:
		hostHalf(cast[uint16](dst, n), casts[uint16](srcs, n), op, false)
	case BFloat16:
		hostHalf(cast[uint16](dst, n), casts[uint16](srcs, n), op, true)
	}
}

func cast[T any](p unsafe.Pointer, n int) []T { return unsafe.Slice((*T)(p), n) }

func casts[T any](ps []unsafe.Pointer, n int) [][]T {
	out := make([][]T, len(ps))
	for i, p := range ps {
		out[i] = cast[T](p, n)
	}
	return out
}

type number interface {
	~int32 | ~int64 | ~float32 | ~float64
}

func hostNum[T number](dst []T, srcs [][]T, op Op) {
	for lo := 0; lo < len(dst); lo += chunk {
		hi := min(lo+chunk, len(dst))
		d := dst[lo:hi]
		// Each element is read from every source before it is written, so
		// dst may be one of the sources; the fold order is srcs[0], [1], ...
		fold(d, srcs[0][lo:hi], srcs[1:], lo, op)
		if op == Avg {
			divide(d, len(srcs))
		}
	}
}

// fold writes d[i] = first[i] op rest[0][lo+i] op rest[1][lo+i] ..., in that
// order, in one pass for the common sum of two to four sources.
func fold[T number](d, first []T, rest [][]T, lo int, op Op) {
	n := len(d)
	first = first[:n] // equal lengths let the compiler drop bounds checks
	if op == Sum || op == Avg {
		switch len(rest) {
		case 0:
			copy(d, first)
			return
		case 1:
			b := rest[0][lo : lo+n]
			for i := range d {
				d[i] = first[i] + b[i]
			}
			return
		case 2:
			b, c := rest[0][lo:lo+n], rest[1][lo:lo+n]
			for i := range d {
				d[i] = first[i] + b[i] + c[i]
			}
			return
		case 3:
			b, c, e := rest[0][lo:lo+n], rest[1][lo:lo+n], rest[2][lo:lo+n]
			for i := range d {
				d[i] = first[i] + b[i] + c[i] + e[i]
			}
			return
		}
	}
	var acc [chunk]T
	a := acc[:n]
	copy(a, first)
	for _, s := range rest {
		combine(a, s[lo:lo+n], op)
	}
	copy(d, a)
}

// combine folds s into a elementwise. Avg accumulates as Sum.
func combine[T number](a, s []T, op Op) {
	s = s[:len(a)]
	switch op {
	case Sum, Avg:
		for i, v := range s {
			a[i] += v
		}
	case Prod:
		for i, v := range s {
			a[i] *= v
		}
	case Min:
		for i, v := range s {
			if v < a[i] || v != v { // v != v: NaN propagates, as in torch.minimum
				a[i] = v
			}
		}
	case Max:
		for i, v := range s {
			if v > a[i] || v != v {
				a[i] = v
			}
		}
	}
}

func divide[T number](a []T, world int) {
	switch a := any(a).(type) {
	case []float32:
		divFloat(a, float32(world))
	case []float64:
		divFloat(a, float64(world))
	case []int32:
		divFloor(a, int32(world))
	case []int64:
		divFloor(a, int64(world))
	}
}

func divFloat[T float32 | float64](a []T, w T) {
	for i := range a {
		a[i] /= w
	}
}

// divFloor divides like torch.div(rounding_mode="floor"); Go truncates.
func divFloor[T int32 | int64](a []T, w T) {
	for i, v := range a {
		q := v / w
		if v%w != 0 && v < 0 {
			q--
		}
		a[i] = q
	}
}

// hostHalf reduces 16-bit floats: each chunk is widened to float32, folded
// in float32 like the other types, and rounded once.
func hostHalf(dst []uint16, srcs [][]uint16, op Op, bf16 bool) {
	var acc, tmp [chunk]float32
	for lo := 0; lo < len(dst); lo += chunk {
		hi := min(lo+chunk, len(dst))
		a, t := acc[:hi-lo], tmp[:hi-lo]
		widen(a, srcs[0][lo:hi], bf16)
		for _, s := range srcs[1:] {
			widen(t, s[lo:hi], bf16)
			combine(a, t, op)
		}
		if op == Avg {
			divide(a, len(srcs))
		}
		narrow(dst[lo:hi], a, bf16)
	}
}

// widen and narrow branch once per chunk, so the per-element conversions
// are direct (inlinable) calls.
func widen(f []float32, h []uint16, bf16 bool) {
	h = h[:len(f)]
	if bf16 {
		for i, v := range h {
			f[i] = BF16ToFloat(v)
		}
		return
	}
	for i, v := range h {
		f[i] = HalfToFloat(v)
	}
}

func narrow(h []uint16, f []float32, bf16 bool) {
	h = h[:len(f)]
	if bf16 {
		for i, v := range f {
			h[i] = FloatToBF16(v)
		}
		return
	}
	for i, v := range f {
		h[i] = FloatToHalf(v)
	}
}

// BF16ToFloat widens a bfloat16 bit pattern.
func BF16ToFloat(b uint16) float32 { return math.Float32frombits(uint32(b) << 16) }

// FloatToBF16 rounds to nearest even; NaN stays NaN (written so that the
// compiler selects instead of jumping: loops over rows call it per element).
func FloatToBF16(f float32) uint16 {
	u := math.Float32bits(f)
	r := uint16((u + 0x7fff + (u>>16)&1) >> 16)
	if u&0x7fffffff > 0x7f800000 {
		r = uint16(u>>16) | 0x40
	}
	return r
}

// HalfToFloat widens an IEEE binary16 bit pattern.
func HalfToFloat(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp := uint32(h>>10) & 0x1f
	man := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f: // inf or NaN
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	case exp != 0:
		return math.Float32frombits(sign | (exp+112)<<23 | man<<13)
	case man == 0:
		return math.Float32frombits(sign)
	}
	// Subnormal: normalise.
	e := uint32(113)
	for man&0x400 == 0 {
		man <<= 1
		e--
	}
	return math.Float32frombits(sign | e<<23 | (man&0x3ff)<<13)
}

// FloatToHalf rounds to nearest even, overflowing to inf; NaN stays NaN.
func FloatToHalf(f float32) uint16 {
	u := math.Float32bits(f)
	sign := uint16(u>>16) & 0x8000
	abs := u & 0x7fffffff
	switch {
	case abs > 0x7f800000:
		return sign | 0x7e00
	case abs >= 0x477ff000: // rounds to >= 65520: inf
		return sign | 0x7c00
	case abs >= 0x38800000: // normal half
		r := abs - (112 << 23)
		r += 0xfff + (r>>13)&1
		return sign | uint16(r>>13)
	case abs < 0x33000000: // below half the smallest subnormal
		return sign
	}
	// Subnormal half: shift the implicit-one mantissa into place and round.
	e := abs >> 23
	man := abs&0x7fffff | 0x800000
	shift := 126 - e // 14 - (e-127) + 13 - 1... chosen so that result = round(f / 2^-24)
	half := uint32(1) << (shift - 1)
	rem := man & (1<<shift - 1)
	q := man >> shift
	if rem > half || (rem == half && q&1 == 1) {
		q++
	}
	return sign | uint16(q)
}
