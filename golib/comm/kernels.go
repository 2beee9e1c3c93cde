package comm

import (
	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/gpucoll"
)

// KernelLauncher is a backend that runs native/kernels' kernels for
// collectives built outside it (MoE dispatch and combine): the GPU backend.
// The kernels must not wait on peers unless they bound their waits with
// WaitInfo; order them with collective.PeerMemory's StreamBarrier.
type KernelLauncher interface {
	// Prepare compiles and loads the file of native/kernels holding kernel
	// expr, and the stream barrier's kernel, ahead of the first launch.
	Prepare(file, expr string) error
	// Launch runs kernel expr of native/kernels/<file> on stream with
	// params as its one by-value argument.
	Launch(file, expr string, grid, block, sharedBytes uint32, stream uintptr, params []byte) error
	// WaitInfo is what launched kernels need to bound their waits like the
	// backend's own: this rank's signal block, the device address of the
	// error word that Check reads, and the timeout in nanoseconds.
	WaitInfo() (signal, errWord uintptr, timeoutNs uint64)
	// SMCount is the multiprocessors this rank may count on.
	SMCount() int
}

// UserKernels is a backend that compiles and runs callers' own kernels,
// with native/kernels' headers on the include path: the GPU backend.
type UserKernels interface {
	// CompileKernel compiles source and returns an id for the kernel that
	// the name expression name stands for.
	CompileKernel(source, name string) (uint64, error)
	// KernelParams returns where each parameter of kernel id lies in the
	// packed parameter buffer LaunchKernel takes.
	KernelParams(id uint64) ([]cuda.Param, error)
	// LaunchKernel runs kernel id on cfg with its parameters packed in
	// params.
	LaunchKernel(id uint64, cfg cuda.LaunchConfig, params []byte) error
}

var (
	_ KernelLauncher = (*gpucoll.Backend)(nil)
	_ UserKernels    = (*gpucoll.Backend)(nil)
)
