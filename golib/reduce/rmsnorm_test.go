package reduce

import (
	"math"
	"math/rand"
	"testing"
	"unsafe"
)

// TestResidualRMSNorm checks the host RMSNorm against a float64 reference:
// residualOut bit for bit (one float32 add, rounded once), normed within
// half a unit in the last place plus 1e-4 relative; and the same bits when
// residualOut is residual and normed is sum.
func TestResidualRMSNorm(t *testing.T) {
	tests := []struct {
		name         string
		rows, hidden int
		bf16         bool
		eps          float32
	}{
		{"bf16 one row", 1, 4096, true, 1e-6},
		{"bf16 rows", 7, 64, true, 1e-5},
		{"fp16 rows", 5, 16384, false, 1e-6},
		{"fp16 large eps", 3, 8, false, 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := tt.rows * tt.hidden
			rng := rand.New(rand.NewSource(int64(n)))
			round := func(f float32) uint16 {
				if tt.bf16 {
					return FloatToBF16(f)
				}
				return FloatToHalf(f)
			}
			widen1 := func(h uint16) float32 {
				if tt.bf16 {
					return BF16ToFloat(h)
				}
				return HalfToFloat(h)
			}
			fill := func(n int, scale float64) []uint16 {
				out := make([]uint16, n)
				for i := range out {
					out[i] = round(float32(rng.NormFloat64() * scale))
				}
				return out
			}
			sum, res, w := fill(n, 3), fill(n, 1), fill(tt.hidden, 1)
			normed, resOut := make([]uint16, n), make([]uint16, n)
			p := func(s []uint16) unsafe.Pointer { return unsafe.Pointer(&s[0]) }
			ResidualRMSNorm(p(normed), p(resOut), p(sum), p(res), p(w), tt.rows, tt.hidden, tt.bf16, tt.eps)
			eps := 1.0 / 128
			if !tt.bf16 {
				eps = 1.0 / 1024
			}
			for r := range tt.rows {
				ss := 0.0
				for i := range tt.hidden {
					k := r*tt.hidden + i
					if want := round(widen1(sum[k]) + widen1(res[k])); resOut[k] != want {
						t.Fatalf("residual_out[%d][%d] = %#04x, want %#04x", r, i, resOut[k], want)
					}
					v := float64(widen1(resOut[k]))
					ss += v * v
				}
				inv := 1 / math.Sqrt(ss/float64(tt.hidden)+float64(tt.eps))
				for i := range tt.hidden {
					k := r*tt.hidden + i
					want := float64(widen1(resOut[k])) * inv * float64(widen1(w[i]))
					got := float64(widen1(normed[k]))
					if d := math.Abs(got - want); d > (eps/2+1e-4)*math.Abs(want)+1e-7 {
						t.Fatalf("normed[%d][%d] = %g, want %g (off by %g)", r, i, got, want, d)
					}
				}
			}
			// In place: residual_out into residual, the sum's buffer reused for normed.
			inRes, inSum := append([]uint16(nil), res...), append([]uint16(nil), sum...)
			ResidualRMSNorm(p(inSum), p(inRes), p(inSum), p(inRes), p(w), tt.rows, tt.hidden, tt.bf16, tt.eps)
			for k := range n {
				if inRes[k] != resOut[k] || inSum[k] != normed[k] {
					t.Fatalf("in place: element %d differs (residual %#04x vs %#04x, normed %#04x vs %#04x)",
						k, inRes[k], resOut[k], inSum[k], normed[k])
				}
			}
		})
	}
}
