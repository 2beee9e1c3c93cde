package reduce

import (
	"math"
	"unsafe"
)

// ResidualRMSNorm finishes a fused all-reduce + residual add + RMSNorm on
// the host, from the all-reduce's sum: for each of rows rows of hidden
// 16-bit floats (bfloat16 when bf16, else float16), in float32,
//
//	residualOut = round(float(sum) + float(residual))
//	normed      = round(float(residualOut) * inv * float(weight)),
//	inv         = 1/sqrt(sum of float(residualOut)^2 / hidden + eps)
//
// rounding to nearest even. The sum of squares runs over 8 lanes (element i
// into lane i % 8, lanes added pairwise), inv is computed in float64 and
// rounded once to float32. sum may be normed and residual may be
// residualOut: a row is read before it is written.
func ResidualRMSNorm(normed, residualOut, sum, residual, weight unsafe.Pointer, rows, hidden int, bf16 bool, eps float32) {
	if rows <= 0 || hidden <= 0 {
		return
	}
	w := make([]float32, 3*hidden)
	f, t := w[hidden:2*hidden], w[2*hidden:]
	w = w[:hidden]
	widen(w, cast[uint16](weight, hidden), bf16)
	for r := range rows {
		off := uintptr(r * hidden * 2)
		widen(f, cast[uint16](unsafe.Add(sum, off), hidden), bf16)
		widen(t, cast[uint16](unsafe.Add(residual, off), hidden), bf16)
		for i := range f {
			f[i] += t[i]
		}
		out := cast[uint16](unsafe.Add(residualOut, off), hidden)
		narrow(out, f, bf16)
		widen(f, out, bf16)
		var lanes [8]float32
		for i, v := range f {
			lanes[i&7] += v * v
		}
		ss := ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
		inv := float32(1 / math.Sqrt(float64(ss/float32(hidden)+eps)))
		for i := range f {
			f[i] = f[i] * inv * w[i]
		}
		narrow(cast[uint16](unsafe.Add(normed, off), hidden), f, bf16)
	}
}
