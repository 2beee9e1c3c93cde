package kernels_test

import (
	"fmt"

	"github.com/p2pcomm/p2pcomm/native/kernels"
)

func ExampleInstantiations() {
	src := `#include "p2p_common.cuh"
// p2pcomm:instantiate allreduce_oneshot<float>
// p2pcomm:instantiate allreduce_oneshot<bf16>
template <typename T> __global__ void allreduce_oneshot(const Args args) {}
`
	fmt.Println(kernels.Instantiations(src))
	// Output: [allreduce_oneshot<float> allreduce_oneshot<bf16>]
}
