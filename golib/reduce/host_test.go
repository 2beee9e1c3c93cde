package reduce

import (
	"math"
	"math/rand"
	"testing"
	"unsafe"
)

func TestHalfRoundTripsEveryPattern(t *testing.T) {
	for h := 0; h < 1<<16; h++ {
		f := HalfToFloat(uint16(h))
		if f != f {
			if g := FloatToHalf(f); g&0x7c00 != 0x7c00 || g&0x3ff == 0 {
				t.Fatalf("FloatToHalf(NaN from %#04x) = %#04x, want a NaN", h, g)
			}
			continue
		}
		if g := FloatToHalf(f); g != uint16(h) {
			t.Fatalf("FloatToHalf(HalfToFloat(%#04x)=%g) = %#04x", h, f, g)
		}
	}
}

func TestBF16RoundTripsEveryPattern(t *testing.T) {
	for h := 0; h < 1<<16; h++ {
		f := BF16ToFloat(uint16(h))
		if f != f {
			continue
		}
		if g := FloatToBF16(f); g != uint16(h) {
			t.Fatalf("FloatToBF16(BF16ToFloat(%#04x)=%g) = %#04x", h, f, g)
		}
	}
}

// Midpoints between neighbouring representable values round to the even
// one; anything past the midpoint rounds to the nearer one.
func TestNarrowingRoundsToNearestEven(t *testing.T) {
	for _, tc := range []struct {
		name   string
		toF    func(uint16) float32
		fromF  func(float32) uint16
		maxPos uint16
	}{
		{"half", HalfToFloat, FloatToHalf, 0x7bff},
		{"bf16", BF16ToFloat, FloatToBF16, 0x7f7f},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for h := uint16(0); h < tc.maxPos; h++ {
				lo, hi := float64(tc.toF(h)), float64(tc.toF(h+1))
				mid := float32((lo + hi) / 2)
				if float64(mid) != (lo+hi)/2 {
					continue // midpoint not exact in float32
				}
				want := h
				if h&1 == 1 {
					want = h + 1
				}
				if got := tc.fromF(mid); got != want {
					t.Fatalf("from(%g) midway %#04x..%#04x = %#04x, want %#04x", mid, h, h+1, got, want)
				}
				above := math.Nextafter32(mid, float32(math.Inf(1)))
				if got := tc.fromF(above); got != h+1 {
					t.Fatalf("from(%g) just above midway = %#04x, want %#04x", above, got, h+1)
				}
				below := math.Nextafter32(mid, float32(math.Inf(-1)))
				if got := tc.fromF(below); got != h {
					t.Fatalf("from(%g) just below midway = %#04x, want %#04x", below, got, h)
				}
			}
		})
	}
}

func ptrs[T any](xs [][]T) []unsafe.Pointer {
	out := make([]unsafe.Pointer, len(xs))
	for i := range xs {
		out[i] = unsafe.Pointer(&xs[i][0])
	}
	return out
}

func TestHostMatchesFloat64Reference(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	const n, world = 3001, 3
	for op := Sum; op < numOps; op++ {
		t.Run(op.String(), func(t *testing.T) {
			f32 := make([][]float32, world)
			i64 := make([][]int64, world)
			h16 := make([][]uint16, world)
			for r := range world {
				f32[r], i64[r], h16[r] = make([]float32, n), make([]int64, n), make([]uint16, n)
				for i := range n {
					f32[r][i] = float32(rng.NormFloat64())
					i64[r][i] = rng.Int63n(41) - 20
					h16[r][i] = FloatToHalf(float32(rng.NormFloat64()))
				}
			}
			outF := make([]float32, n)
			Host(unsafe.Pointer(&outF[0]), ptrs(f32), n, Float32, op)
			// In place into the last source: aliasing must not change results.
			Host(unsafe.Pointer(&i64[world-1][0]), ptrs(i64), n, Int64, op)
			outH := make([]uint16, n)
			Host(unsafe.Pointer(&outH[0]), ptrs(h16), n, Float16, op)
			for i := range n {
				var wantF float32 = f32[0][i]
				var accH float32 = HalfToFloat(h16[0][i])
				for r := 1; r < world; r++ {
					wantF = apply(wantF, f32[r][i], op)
					accH = apply(accH, HalfToFloat(h16[r][i]), op)
				}
				if op == Avg {
					wantF /= world
					accH /= world
				}
				if outF[i] != wantF {
					t.Fatalf("float32 %v [%d] = %g, want %g", op, i, outF[i], wantF)
				}
				if outH[i] != FloatToHalf(accH) {
					t.Fatalf("float16 %v [%d] = %#04x, want %#04x", op, i, outH[i], FloatToHalf(accH))
				}
			}
		})
	}
}

func apply(a, b float32, op Op) float32 {
	switch op {
	case Prod:
		return a * b
	case Min:
		return min(a, b)
	case Max:
		return max(a, b)
	}
	return a + b
}

func TestIntegerAvgFloors(t *testing.T) {
	srcs := [][]int32{{-7, 7, -6, 0}, {0, 0, 0, -1}}
	out := make([]int32, 4)
	Host(unsafe.Pointer(&out[0]), ptrs(srcs), 4, Int32, Avg)
	want := []int32{-4, 3, -3, -1} // floor(-7/2), floor(7/2), floor(-6/2), floor(-1/2)
	for i := range want {
		if out[i] != want[i] {
			t.Errorf("avg[%d] = %d, want %d", i, out[i], want[i])
		}
	}
}
