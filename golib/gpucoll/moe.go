package gpucoll

import (
	"fmt"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
)

// KernelFunction compiles (once per process, through the disk cache) and
// loads native/kernels/<file> with every kernel it declares, and the
// stream barrier's kernel, and returns the kernel of name expression expr.
// Callers resolve their kernels once, before the ranks line up (a rank
// compiling inside a collective call keeps its peers waiting in their
// kernels), and launch them with LaunchFunction. Not collective.
func (b *Backend) KernelFunction(file, expr string) (cuda.Function, error) {
	if err := b.Check(); err != nil {
		return 0, err
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return 0, err
	}
	fn, err := b.kernels.named(file, expr)
	if err != nil {
		return 0, err
	}
	if _, err := b.kernels.function(collective.OneShot, barrierDType); err != nil { // StreamBarrier's kernel
		return 0, err
	}
	return fn, nil
}

// LaunchFunction runs fn (from KernelFunction) on a 1-D grid with the bytes
// of params as its one by-value argument, ordered on stream, letting it
// take sharedBytes of dynamic shared memory. The caller has made the
// device's context current and checked the backend (once per call of its
// own, not per launch). It does not wait for the GPU.
func (b *Backend) LaunchFunction(fn cuda.Function, grid, block, sharedBytes uint32, stream uintptr, params []byte) error {
	if err := b.kernels.allowShared(fn, sharedBytes); err != nil {
		return fmt.Errorf("allow %d bytes of dynamic shared memory: %w", sharedBytes, err)
	}
	return b.drv.Launch(fn, grid, block, sharedBytes, stream, params)
}
