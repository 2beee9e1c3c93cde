// Package cuda calls the CUDA driver and NVRTC through dlopen, so that the
// library builds and loads on a machine without CUDA.
package cuda

/*
#include <stdlib.h>
#include "trampolines.h"
*/
import "C"

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/dl"
)

// symbols is what the loader needs from an opened library; *dl.Library
// satisfies it, and tests substitute a fake driver.
type symbols interface {
	Sym(name string) (unsafe.Pointer, error)
}

// Flags of cuGetProcAddress: LEGACY_STREAM asks for the variants where stream
// 0 means the legacy default stream (what torch uses), never per-thread.
const getProcLegacyStream = 1

// cuGetProcAddress_v2 status values (CUdriverProcAddressQueryResult).
const (
	procFound              = 0
	procSymbolNotFound     = 1
	procVersionInsufficent = 2
)

// Driver is the loaded CUDA driver. Methods are safe for concurrent use; like
// the driver API itself they act on the calling thread's current context
// (see EnsureContext and WithContext).
type Driver struct {
	fn      driverFuncs
	version int // cuDriverGetVersion, e.g. 13000

	ctxMu   sync.Mutex
	primary map[int]Context // retained primary contexts by ordinal, never released
}

// driverFuncs holds one function pointer per entry point; optional ones may
// be nil and their methods return ErrNotSupported.
type driverFuncs struct {
	init, driverGetVersion, getErrorName, getErrorString                              unsafe.Pointer
	deviceGet, deviceGetCount, deviceGetAttribute, deviceGetUuid, deviceGetPCIBusId   unsafe.Pointer
	deviceCanAccessPeer, primaryCtxRetain, ctxGetCurrent, ctxSetCurrent, ctxGetDevice unsafe.Pointer
	memAlloc, memFree, memsetD8Async, memsetD32Async, memcpyAsync, memcpyDtoH         unsafe.Pointer
	memGetAddressRange, pointerGetAttribute                                           unsafe.Pointer
	ipcGetMemHandle, ipcOpenMemHandle, ipcCloseMemHandle                              unsafe.Pointer
	memHostAlloc, memHostGetDevicePointer, memFreeHost                                unsafe.Pointer
	moduleLoadData, moduleUnload, moduleGetFunction, funcSetAttribute, launchKernel   unsafe.Pointer
	streamSynchronize, streamIsCapturing, streamGetCaptureInfo                        unsafe.Pointer
	eventCreate, eventRecord, eventSynchronize, eventElapsedTime, eventDestroy        unsafe.Pointer
	streamCreate, streamDestroy, streamQuery, streamWriteValue64, streamWaitEvent     unsafe.Pointer
	streamBatchMemOp, launchHostFunc                                                  unsafe.Pointer
	funcGetParamInfo                                                                  unsafe.Pointer
	primaryCtxGetState, ctxSynchronize                                                unsafe.Pointer
}

// entry is one row of the entry-point table. version is the CUDA version
// whose ABI the trampoline assumes: cuGetProcAddress returns the newest
// variant of the symbol introduced at or before it. 12000 selects the
// "_v2" semantics everywhere (cuMemAlloc_v2 with size_t, cuDeviceGetUuid_v2,
// cuIpcOpenMemHandle_v2, cuStreamGetCaptureInfo_v2 with six arguments...) and
// keeps selecting them on a CUDA 13 driver, which serves older ABIs forever.
type entry struct {
	name     string
	version  int
	required bool
	slot     *unsafe.Pointer
}

// NEVER add cuMulticastCreate (or any NVLS multicast object) to this table:
// creating multicast objects has taken shared multi-GPU machines down. The
// kernels use plain peer loads and stores over IPC mappings instead.
func (f *driverFuncs) table() []entry {
	const v = 12000
	return []entry{
		{"cuInit", v, true, &f.init},
		{"cuDriverGetVersion", v, true, &f.driverGetVersion},
		{"cuGetErrorName", v, true, &f.getErrorName},
		{"cuGetErrorString", v, true, &f.getErrorString},
		{"cuDeviceGet", v, true, &f.deviceGet},
		{"cuDeviceGetCount", v, true, &f.deviceGetCount},
		{"cuDeviceGetAttribute", v, true, &f.deviceGetAttribute},
		{"cuDeviceGetUuid", v, true, &f.deviceGetUuid},
		{"cuDeviceGetPCIBusId", v, true, &f.deviceGetPCIBusId},
		{"cuDeviceCanAccessPeer", v, true, &f.deviceCanAccessPeer},
		{"cuDevicePrimaryCtxRetain", v, true, &f.primaryCtxRetain},
		{"cuDevicePrimaryCtxGetState", v, false, &f.primaryCtxGetState},
		{"cuCtxGetCurrent", v, true, &f.ctxGetCurrent},
		{"cuCtxSetCurrent", v, true, &f.ctxSetCurrent},
		{"cuCtxGetDevice", v, true, &f.ctxGetDevice},
		{"cuCtxSynchronize", v, true, &f.ctxSynchronize},
		{"cuMemAlloc", v, true, &f.memAlloc},
		{"cuMemFree", v, true, &f.memFree},
		{"cuMemsetD8Async", v, true, &f.memsetD8Async},
		{"cuMemsetD32Async", v, true, &f.memsetD32Async},
		{"cuMemcpyAsync", v, true, &f.memcpyAsync},
		{"cuMemcpyDtoH", v, true, &f.memcpyDtoH},
		{"cuMemGetAddressRange", v, true, &f.memGetAddressRange},
		{"cuPointerGetAttribute", v, true, &f.pointerGetAttribute},
		{"cuIpcGetMemHandle", v, true, &f.ipcGetMemHandle},
		{"cuIpcOpenMemHandle", v, true, &f.ipcOpenMemHandle},
		{"cuIpcCloseMemHandle", v, true, &f.ipcCloseMemHandle},
		{"cuMemHostAlloc", v, true, &f.memHostAlloc},
		{"cuMemHostGetDevicePointer", v, true, &f.memHostGetDevicePointer},
		{"cuMemFreeHost", v, true, &f.memFreeHost},
		{"cuModuleLoadData", v, true, &f.moduleLoadData},
		{"cuModuleUnload", v, true, &f.moduleUnload},
		{"cuModuleGetFunction", v, true, &f.moduleGetFunction},
		{"cuFuncSetAttribute", v, true, &f.funcSetAttribute},
		{"cuLaunchKernel", v, true, &f.launchKernel},
		{"cuFuncGetParamInfo", 12040, false, &f.funcGetParamInfo}, // introduced in CUDA 12.4
		{"cuStreamSynchronize", v, true, &f.streamSynchronize},
		{"cuStreamIsCapturing", v, true, &f.streamIsCapturing},
		{"cuStreamGetCaptureInfo", v, false, &f.streamGetCaptureInfo},
		{"cuEventCreate", v, false, &f.eventCreate},
		{"cuEventRecord", v, false, &f.eventRecord},
		{"cuEventSynchronize", v, false, &f.eventSynchronize},
		{"cuEventElapsedTime", v, false, &f.eventElapsedTime},
		{"cuEventDestroy", v, false, &f.eventDestroy},
		{"cuStreamCreate", v, false, &f.streamCreate},
		{"cuStreamDestroy", v, false, &f.streamDestroy},
		{"cuStreamQuery", v, false, &f.streamQuery},
		{"cuStreamWriteValue64", v, false, &f.streamWriteValue64},
		{"cuStreamBatchMemOp", v, false, &f.streamBatchMemOp},
		{"cuStreamWaitEvent", v, false, &f.streamWaitEvent},
		{"cuLaunchHostFunc", v, false, &f.launchHostFunc},
	}
}

// DriverLibrary is the soname Load opens.
const DriverLibrary = "libcuda.so.1"

var (
	loadOnce  sync.Once
	loaded    *Driver
	loadError error
)

// Load opens libcuda.so.1, resolves the entry-point table and calls cuInit.
// It does so once per process; later calls return the same driver or the
// same error. The error unwraps to ErrNoDriver when the library is absent or
// too old, or is an *Error when cuInit fails (no device, driver mismatch).
func Load() (*Driver, error) {
	loadOnce.Do(func() {
		lib, err := dl.Open(DriverLibrary, dl.Now|dl.Local)
		if err != nil {
			loadError = &LoadError{Lib: DriverLibrary, Tried: []string{err.Error()}, kind: ErrNoDriver}
			return
		}
		loaded, loadError = newDriver(lib)
	})
	return loaded, loadError
}

// newDriver resolves the table from lib and initializes the driver.
func newDriver(lib symbols) (*Driver, error) {
	fail := func(reasons ...string) error {
		return &LoadError{Lib: DriverLibrary, Tried: reasons, kind: ErrNoDriver}
	}
	resolve, err := procResolver(lib)
	if err != nil {
		return nil, fail(err.Error())
	}
	d := &Driver{primary: map[int]Context{}}
	var missing []string
	for _, e := range d.fn.table() {
		p, err := resolve(e.name, e.version)
		if err != nil && e.required {
			missing = append(missing, err.Error())
		}
		*e.slot = p
	}
	if len(missing) > 0 {
		return nil, fail(missing...)
	}
	if err := d.check("cuInit", C.p2p_r_u(d.fn.init, 0)); err != nil {
		return nil, err
	}
	var v C.int
	if err := d.check("cuDriverGetVersion", C.p2p_r_p(d.fn.driverGetVersion, unsafe.Pointer(&v))); err != nil {
		return nil, err
	}
	d.version = int(v)
	return d, nil
}

// procResolver returns a lookup through cuGetProcAddress_v2 (CUDA 12.0+),
// or the CUDA 11.3 cuGetProcAddress when only that exists.
func procResolver(lib symbols) (func(name string, version int) (unsafe.Pointer, error), error) {
	if gpa, err := lib.Sym("cuGetProcAddress_v2"); err == nil {
		return func(name string, version int) (unsafe.Pointer, error) {
			cname := C.CString(name)
			defer C.free(unsafe.Pointer(cname))
			var p unsafe.Pointer
			var found C.int
			r := C.p2p_get_proc_v2(gpa, cname, &p, C.int(version), getProcLegacyStream, &found)
			// The driver answers CUDA_ERROR_NOT_FOUND together with the
			// reason in found; report the reason.
			switch {
			case found == procVersionInsufficent:
				return nil, fmt.Errorf("%s: driver too old for the CUDA %d ABI", name, version)
			case found == procSymbolNotFound:
				return nil, fmt.Errorf("%s: not found in the driver", name)
			case r != 0 || p == nil:
				return nil, fmt.Errorf("cuGetProcAddress(%s, %d): CUresult %d", name, version, int(r))
			}
			return p, nil
		}, nil
	}
	gpa, err := lib.Sym("cuGetProcAddress")
	if err != nil {
		return nil, fmt.Errorf("driver has no cuGetProcAddress (needs CUDA 11.3 or newer): %w", err)
	}
	return func(name string, version int) (unsafe.Pointer, error) {
		cname := C.CString(name)
		defer C.free(unsafe.Pointer(cname))
		var p unsafe.Pointer
		if r := C.p2p_get_proc_v1(gpa, cname, &p, C.int(version), getProcLegacyStream); r != 0 || p == nil {
			return nil, fmt.Errorf("cuGetProcAddress(%s, %d): CUresult %d", name, version, int(r))
		}
		return p, nil
	}, nil
}

// Version returns the driver's CUDA version, e.g. 13000 for 13.0.
func (d *Driver) Version() int { return d.version }

// check turns a CUresult into nil or an *Error named by the driver.
func (d *Driver) check(call string, r C.int) error {
	if r == 0 {
		return nil
	}
	return &Error{Code: int(r), Name: d.ErrorName(int(r)), Call: call}
}

// ErrorName returns the driver's name for a CUresult ("CUDA_ERROR_..."),
// falling back to a built-in table, then to "".
func (d *Driver) ErrorName(code int) string {
	if d != nil && d.fn.getErrorName != nil {
		var s *C.char
		if C.p2p_r_i_p(d.fn.getErrorName, C.int(code), unsafe.Pointer(&s)) == 0 && s != nil {
			return C.GoString(s)
		}
	}
	return knownNames[code]
}

// ErrorString returns the driver's description of a CUresult, or "".
func (d *Driver) ErrorString(code int) string {
	if d != nil && d.fn.getErrorString != nil {
		var s *C.char
		if C.p2p_r_i_p(d.fn.getErrorString, C.int(code), unsafe.Pointer(&s)) == 0 && s != nil {
			return C.GoString(s)
		}
	}
	return ""
}
