package reduce

import (
	"fmt"
	"testing"
	"unsafe"
)

func BenchmarkHost(b *testing.B) {
	const n = 1 << 20
	for _, d := range []DType{Float32, BFloat16, Float16} {
		for _, world := range []int{2, 4} {
			b.Run(fmt.Sprintf("%v/world%d", d, world), func(b *testing.B) {
				bufs := make([][]byte, world)
				srcs := make([]unsafe.Pointer, world)
				for r := range bufs {
					bufs[r] = make([]byte, n*d.Size())
					srcs[r] = unsafe.Pointer(&bufs[r][0])
				}
				dst := make([]byte, n*d.Size())
				b.SetBytes(int64(n * d.Size() * world))
				for range b.N {
					Host(unsafe.Pointer(&dst[0]), srcs, n, d, Sum)
				}
			})
		}
	}
}
