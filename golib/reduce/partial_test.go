package reduce

import (
	"bytes"
	"fmt"
	"math/rand"
	"testing"
	"unsafe"
)

// randomInputs returns world inputs of n elements of d, as bytes.
func randomInputs(rng *rand.Rand, world, n int, d DType) [][]byte {
	out := make([][]byte, world)
	for r := range out {
		b := make([]byte, n*d.Size())
		for i := range n {
			p := unsafe.Pointer(&b[i*d.Size()])
			v := rng.NormFloat64()
			switch d {
			case Float32:
				*(*float32)(p) = float32(v)
			case Float64:
				*(*float64)(p) = v
			case Float16:
				*(*uint16)(p) = FloatToHalf(float32(v))
			case BFloat16:
				*(*uint16)(p) = FloatToBF16(float32(v))
			case Int32:
				*(*int32)(p) = int32(rng.Intn(21) - 10)
			case Int64:
				*(*int64)(p) = int64(rng.Intn(21) - 10)
			}
		}
		out[r] = b
	}
	return out
}

func bytePtrs(bs [][]byte) []unsafe.Pointer {
	out := make([]unsafe.Pointer, len(bs))
	for i := range bs {
		out[i] = unsafe.Pointer(&bs[i][0])
	}
	return out
}

// staged reduces inputs in groups of size group: HostPartial per group,
// then HostFinish over the partials.
func staged(inputs [][]byte, group, n int, d DType, op Op) []byte {
	acc := AccType(d)
	var partials [][]byte
	for lo := 0; lo < len(inputs); lo += group {
		p := make([]byte, n*acc.Size())
		HostPartial(unsafe.Pointer(&p[0]), bytePtrs(inputs[lo:min(lo+group, len(inputs))]), n, d, op)
		partials = append(partials, p)
	}
	out := make([]byte, n*d.Size())
	HostFinish(unsafe.Pointer(&out[0]), bytePtrs(partials), n, d, op, len(inputs))
	return out
}

// With one group, or groups of one, the staged reduction is the flat one
// bit for bit: the expression per element is the same.
func TestStagedReductionMatchesHost(t *testing.T) {
	const n = 2500 // over two accumulation chunks
	for d := Float32; d < numDTypes; d++ {
		for op := Sum; op < numOps; op++ {
			for _, world := range []int{1, 2, 5} {
				t.Run(fmt.Sprintf("%v/%v/world%d", d, op, world), func(t *testing.T) {
					rng := rand.New(rand.NewSource(int64(world)*100 + int64(d)*10 + int64(op)))
					in := randomInputs(rng, world, n, d)
					want := make([]byte, n*d.Size())
					Host(unsafe.Pointer(&want[0]), bytePtrs(in), n, d, op)
					for _, group := range []int{1, world} {
						if got := staged(in, group, n, d, op); !bytes.Equal(got, want) {
							t.Fatalf("groups of %d: staged result differs from Host", group)
						}
					}
				})
			}
		}
	}
}

// Groups of two over four inputs compute ((a+b)+(c+d)) in the accumulator
// type and round once.
func TestStagedReductionFoldsGroupsInOrder(t *testing.T) {
	const n = 1500
	rng := rand.New(rand.NewSource(7))
	for _, d := range []DType{Float32, BFloat16, Float16} {
		for _, op := range []Op{Sum, Avg, Prod} {
			in := randomInputs(rng, 4, n, d)
			got := staged(in, 2, n, d, op)
			for i := range n {
				x := make([]float32, 4)
				for r := range x {
					switch d {
					case Float32:
						x[r] = *(*float32)(unsafe.Pointer(&in[r][4*i]))
					case BFloat16:
						x[r] = BF16ToFloat(*(*uint16)(unsafe.Pointer(&in[r][2*i])))
					default:
						x[r] = HalfToFloat(*(*uint16)(unsafe.Pointer(&in[r][2*i])))
					}
				}
				o := op
				if o == Avg {
					o = Sum
				}
				v := apply(apply(x[0], x[1], o), apply(x[2], x[3], o), o)
				if op == Avg {
					v /= 4
				}
				var ok bool
				switch d {
				case Float32:
					ok = *(*float32)(unsafe.Pointer(&got[4*i])) == v
				case BFloat16:
					ok = *(*uint16)(unsafe.Pointer(&got[2*i])) == FloatToBF16(v)
				default:
					ok = *(*uint16)(unsafe.Pointer(&got[2*i])) == FloatToHalf(v)
				}
				if !ok {
					t.Fatalf("%v %v [%d]: staged result is not ((a op b) op (c op d)) rounded once", d, op, i)
				}
			}
		}
	}
}

func TestIntegerAvgOfPartialsFloorsOnce(t *testing.T) {
	in := [][]byte{make([]byte, 8), make([]byte, 8), make([]byte, 8)}
	for r, v := range []int64{-7, 3, 1} { // sum -3, floor(-3/3) = -1
		*(*int64)(unsafe.Pointer(&in[r][0])) = v
	}
	got := staged(in, 2, 1, Int64, Avg)
	if v := *(*int64)(unsafe.Pointer(&got[0])); v != -1 {
		t.Fatalf("avg = %d, want -1", v)
	}
}
