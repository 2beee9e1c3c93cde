package cuda

/*
#include "trampolines.h"
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// MaxParams is the most kernel parameters LaunchParams accepts.
const MaxParams = C.P2P_MAX_PARAMS

// Launch runs fn on a 1-D grid of grid blocks of block threads, with
// sharedBytes of dynamic shared memory, ordered on stream. The kernel takes
// one parameter, a struct by value (`__global__ void k(const Args args)`);
// args holds that struct's bytes exactly as the device lays it out.
//
// No copy and no lock: args is Go memory without Go pointers, which cgo lets
// C read during the call, and cuLaunchKernel copies parameters before it
// returns. The parameter array itself lives on the C stack.
func (d *Driver) Launch(fn Function, grid, block uint32, sharedBytes uint32, stream uintptr, args []byte) error {
	if len(args) == 0 {
		return status.Errorf(status.InvalidArgument, "launch: empty kernel argument struct")
	}
	return d.check("cuLaunchKernel", C.p2p_launch1(d.fn.launchKernel, ptr(uintptr(fn)),
		C.uint(grid), 1, 1, C.uint(block), 1, 1, C.uint(sharedBytes), ptr(stream),
		(*C.char)(unsafe.Pointer(&args[0]))))
}

// LaunchConfig is a 3-D launch shape for LaunchParams.
type LaunchConfig struct {
	Grid, Block [3]uint32 // zero dimensions count as 1
	SharedBytes uint32
	Stream      uintptr
}

// LaunchParams runs fn with a raw parameter list: params[i] holds the bytes
// of the kernel's i-th parameter. It costs one small allocation more than
// Launch; use it for kernels with several scalar parameters.
func (d *Driver) LaunchParams(fn Function, cfg LaunchConfig, params ...[]byte) error {
	if len(params) > MaxParams {
		return status.Errorf(status.InvalidArgument, "launch: %d parameters, at most %d", len(params), MaxParams)
	}
	// Pack every parameter into one blob, each 8-byte aligned, so C gets a
	// single pointer-free Go buffer and an offset table.
	var offsets [MaxParams]uint32
	size := 0
	for i, p := range params {
		if len(p) == 0 {
			return status.Errorf(status.InvalidArgument, "launch: parameter %d is empty", i)
		}
		offsets[i] = uint32(size)
		size += (len(p) + 7) &^ 7
	}
	blob := make([]byte, size+8)
	for i, p := range params {
		copy(blob[offsets[i]:], p)
	}
	dim := func(v uint32) C.uint {
		if v == 0 {
			return 1
		}
		return C.uint(v)
	}
	r := C.p2p_launch(d.fn.launchKernel, ptr(uintptr(fn)),
		dim(cfg.Grid[0]), dim(cfg.Grid[1]), dim(cfg.Grid[2]),
		dim(cfg.Block[0]), dim(cfg.Block[1]), dim(cfg.Block[2]),
		C.uint(cfg.SharedBytes), ptr(cfg.Stream),
		(*C.char)(unsafe.Pointer(&blob[0])), (*C.uint32_t)(unsafe.Pointer(&offsets[0])), C.int(len(params)))
	if err := d.check("cuLaunchKernel", r); err != nil {
		return fmt.Errorf("launch with %d parameters: %w", len(params), err)
	}
	return nil
}

// Param is where one kernel parameter lies in the parameter buffer the
// kernel's signature lays out (cuFuncGetParamInfo).
type Param struct {
	Offset, Size uint64
}

// FuncParams returns the layout of fn's parameters, in order. It needs
// cuFuncGetParamInfo (CUDA 12.4 drivers and newer): without it the error
// is ErrNotSupported.
func (d *Driver) FuncParams(fn Function) ([]Param, error) {
	if d.fn.funcGetParamInfo == nil {
		return nil, fmt.Errorf("cuFuncGetParamInfo (CUDA 12.4+): %w", ErrNotSupported)
	}
	var out []Param
	for i := 0; i <= MaxParams; i++ {
		var off, size C.size_t
		r := C.p2p_r_p_z_p_p(d.fn.funcGetParamInfo, ptr(uintptr(fn)), C.size_t(i), unsafe.Pointer(&off), unsafe.Pointer(&size))
		if r == errInvalidValue {
			return out, nil // past the last parameter
		}
		if err := d.check("cuFuncGetParamInfo", r); err != nil {
			return nil, err
		}
		out = append(out, Param{Offset: uint64(off), Size: uint64(size)})
	}
	return nil, status.Errorf(status.Unsupported, "kernel has more than %d parameters", MaxParams)
}
