package cuda

/*
#include <stdlib.h>
#include "trampolines.h"
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// Handles are the driver's opaque pointers; device memory is a uintptr
// (CUdeviceptr) in the unified address space.
type (
	Device   int32   // CUdevice
	Context  uintptr // CUcontext
	Module   uintptr // CUmodule
	Function uintptr // CUfunction
	Event    uintptr // CUevent
)

// IPCHandle is a CUipcMemHandle: 64 opaque bytes another process opens.
type IPCHandle [64]byte

// DeviceAttribute is a CUdevice_attribute.
type DeviceAttribute int32

// Device attributes this project reads.
const (
	AttrMultiprocessorCount        DeviceAttribute = 16
	AttrUnifiedAddressing          DeviceAttribute = 41
	AttrComputeCapabilityMajor     DeviceAttribute = 75
	AttrComputeCapabilityMinor     DeviceAttribute = 76
	AttrMaxSharedMemoryPerBlockOpt DeviceAttribute = 97
)

// MemoryType is a CUmemorytype.
type MemoryType int32

// Memory types returned by PointerMemoryType.
const (
	MemoryHost    MemoryType = 1
	MemoryDevice  MemoryType = 2
	MemoryArray   MemoryType = 3
	MemoryUnified MemoryType = 4
)

// Flags and attributes passed through to the driver.
const (
	IPCLazyEnablePeerAccess = 0x1 // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
	HostAllocPortable       = 0x1 // CU_MEMHOSTALLOC_PORTABLE
	HostAllocDeviceMap      = 0x2 // CU_MEMHOSTALLOC_DEVICEMAP
	EventDefault            = 0x0 // CU_EVENT_DEFAULT
	EventDisableTiming      = 0x2 // CU_EVENT_DISABLE_TIMING

	FuncAttrMaxDynamicSharedSizeBytes = 8 // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

	pointerAttrContext       = 1
	pointerAttrMemoryType    = 2
	pointerAttrDeviceOrdinal = 9
	pointerAttrIPCCapable    = 10 // CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
)

// CaptureStatus is a CUstreamCaptureStatus.
type CaptureStatus int32

// Capture states of a stream.
const (
	CaptureNone        CaptureStatus = 0 // not capturing
	CaptureActive      CaptureStatus = 1 // recording into a CUDA graph
	CaptureInvalidated CaptureStatus = 2 // capture broken by an error
)

// ptr turns a driver handle back into the C pointer it came from. Handles
// point to driver memory, never Go memory, so the garbage collector ignores
// them; the indirection keeps vet's uintptr check quiet for that reason.
func ptr(p uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&p)) }

// DeviceCount returns the number of visible GPUs.
func (d *Driver) DeviceCount() (int, error) {
	var n C.int
	err := d.check("cuDeviceGetCount", C.p2p_r_p(d.fn.deviceGetCount, unsafe.Pointer(&n)))
	return int(n), err
}

// Device returns the handle of the GPU with the given ordinal.
func (d *Driver) Device(ordinal int) (Device, error) {
	var dev C.int
	err := d.check("cuDeviceGet", C.p2p_r_p_i(d.fn.deviceGet, unsafe.Pointer(&dev), C.int(ordinal)))
	return Device(dev), err
}

// DeviceAttribute returns one attribute of dev.
func (d *Driver) DeviceAttribute(attr DeviceAttribute, dev Device) (int, error) {
	var v C.int
	err := d.check("cuDeviceGetAttribute",
		C.p2p_r_p_i_i(d.fn.deviceGetAttribute, unsafe.Pointer(&v), C.int(attr), C.int(dev)))
	return int(v), err
}

// ComputeCapability returns dev's SM version as major*10+minor (90 for H100/H200).
func (d *Driver) ComputeCapability(dev Device) (int, error) {
	major, err := d.DeviceAttribute(AttrComputeCapabilityMajor, dev)
	if err != nil {
		return 0, err
	}
	minor, err := d.DeviceAttribute(AttrComputeCapabilityMinor, dev)
	return major*10 + minor, err
}

// DeviceUUID returns dev's 16-byte UUID, the same across processes whatever
// CUDA_VISIBLE_DEVICES says.
func (d *Driver) DeviceUUID(dev Device) ([16]byte, error) {
	var u [16]byte
	err := d.check("cuDeviceGetUuid", C.p2p_r_p_i(d.fn.deviceGetUuid, unsafe.Pointer(&u[0]), C.int(dev)))
	return u, err
}

// DevicePCIBusID returns dev's PCI id, "dddd:bb:dd.f".
func (d *Driver) DevicePCIBusID(dev Device) (string, error) {
	var buf [64]C.char
	if err := d.check("cuDeviceGetPCIBusId",
		C.p2p_r_p_i_i(d.fn.deviceGetPCIBusId, unsafe.Pointer(&buf[0]), C.int(len(buf)), C.int(dev))); err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

// CanAccessPeer reports whether dev can map peer's memory.
func (d *Driver) CanAccessPeer(dev, peer Device) (bool, error) {
	var ok C.int
	err := d.check("cuDeviceCanAccessPeer",
		C.p2p_r_p_i_i(d.fn.deviceCanAccessPeer, unsafe.Pointer(&ok), C.int(dev), C.int(peer)))
	return ok != 0, err
}

// primaryActive reports whether dev's primary context exists (retaining
// it then creates nothing). False when the driver cannot say.
func (d *Driver) primaryActive(dev Device) bool {
	if d.fn.primaryCtxGetState == nil {
		return false
	}
	var flags C.uint
	var active C.int
	err := d.check("cuDevicePrimaryCtxGetState",
		C.p2p_r_i_p_p(d.fn.primaryCtxGetState, C.int(dev), unsafe.Pointer(&flags), unsafe.Pointer(&active)))
	return err == nil && active != 0
}

// retainPrimary retains dev's primary context (cuDevicePrimaryCtxRetain).
func (d *Driver) retainPrimary(dev Device) (Context, error) {
	var c unsafe.Pointer
	err := d.check("cuDevicePrimaryCtxRetain", C.p2p_r_p_i(d.fn.primaryCtxRetain, unsafe.Pointer(&c), C.int(dev)))
	return Context(uintptr(c)), err
}

// CurrentContext returns the calling thread's context, 0 if none.
func (d *Driver) CurrentContext() (Context, error) {
	var c unsafe.Pointer
	err := d.check("cuCtxGetCurrent", C.p2p_r_p(d.fn.ctxGetCurrent, unsafe.Pointer(&c)))
	return Context(uintptr(c)), err
}

// SetCurrentContext binds ctx to the calling OS thread. Goroutines must hold
// runtime.LockOSThread for this to mean anything; see WithContext.
func (d *Driver) SetCurrentContext(ctx Context) error {
	return d.check("cuCtxSetCurrent", C.p2p_r_p(d.fn.ctxSetCurrent, ptr(uintptr(ctx))))
}

// ContextDevice returns the device of the calling thread's current context.
func (d *Driver) ContextDevice() (Device, error) {
	var dev C.int
	err := d.check("cuCtxGetDevice", C.p2p_r_p(d.fn.ctxGetDevice, unsafe.Pointer(&dev)))
	return Device(dev), err
}

// MemAlloc allocates n bytes of device memory in the current context.
func (d *Driver) MemAlloc(n uint64) (uintptr, error) {
	var p C.p2p_dptr
	err := d.check("cuMemAlloc", C.p2p_r_p_z(d.fn.memAlloc, unsafe.Pointer(&p), C.size_t(n)))
	return uintptr(p), err
}

// MemFree frees memory from MemAlloc.
func (d *Driver) MemFree(p uintptr) error {
	return d.check("cuMemFree", C.p2p_r_d(d.fn.memFree, C.p2p_dptr(p)))
}

// MemsetD8Async sets n bytes at p to v, ordered on stream.
func (d *Driver) MemsetD8Async(p uintptr, v byte, n uint64, stream uintptr) error {
	return d.check("cuMemsetD8Async",
		C.p2p_r_d_u8_z_p(d.fn.memsetD8Async, C.p2p_dptr(p), C.uchar(v), C.size_t(n), ptr(stream)))
}

// MemsetD32Async sets n 32-bit words at p (4-byte aligned) to v, ordered on stream.
func (d *Driver) MemsetD32Async(p uintptr, v uint32, n uint64, stream uintptr) error {
	return d.check("cuMemsetD32Async",
		C.p2p_r_d_u_z_p(d.fn.memsetD32Async, C.p2p_dptr(p), C.uint(v), C.size_t(n), ptr(stream)))
}

// MemcpyAsync copies n bytes between any two unified addresses, ordered on stream.
func (d *Driver) MemcpyAsync(dst, src uintptr, n uint64, stream uintptr) error {
	return d.check("cuMemcpyAsync",
		C.p2p_r_d_d_z_p(d.fn.memcpyAsync, C.p2p_dptr(dst), C.p2p_dptr(src), C.size_t(n), ptr(stream)))
}

// MemcpyDtoH copies len(dst) bytes from device address src; it blocks until done.
func (d *Driver) MemcpyDtoH(dst []byte, src uintptr) error {
	if len(dst) == 0 {
		return nil
	}
	return d.check("cuMemcpyDtoH",
		C.p2p_r_p_d_z(d.fn.memcpyDtoH, unsafe.Pointer(&dst[0]), C.p2p_dptr(src), C.size_t(len(dst))))
}

// MemAddressRange returns the allocation that contains p: its base and size.
// For torch tensors this is the caching allocator's whole segment.
func (d *Driver) MemAddressRange(p uintptr) (base uintptr, size uint64, err error) {
	var b C.p2p_dptr
	var s C.size_t
	err = d.check("cuMemGetAddressRange",
		C.p2p_r_p_p_d(d.fn.memGetAddressRange, unsafe.Pointer(&b), unsafe.Pointer(&s), C.p2p_dptr(p)))
	return uintptr(b), uint64(s), err
}

// PointerDeviceOrdinal returns the ordinal of the GPU that holds p.
func (d *Driver) PointerDeviceOrdinal(p uintptr) (int, error) {
	var v C.int
	err := d.check("cuPointerGetAttribute(DEVICE_ORDINAL)",
		C.p2p_r_p_i_d(d.fn.pointerGetAttribute, unsafe.Pointer(&v), pointerAttrDeviceOrdinal, C.p2p_dptr(p)))
	return int(v), err
}

// PointerIPCCapable says whether cuIpcGetMemHandle can export p's
// allocation: not memory from cuMemCreate (torch's expandable segments) or
// from a stream-ordered memory pool.
func (d *Driver) PointerIPCCapable(p uintptr) (bool, error) {
	var v C.int
	err := d.check("cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)",
		C.p2p_r_p_i_d(d.fn.pointerGetAttribute, unsafe.Pointer(&v), pointerAttrIPCCapable, C.p2p_dptr(p)))
	return v != 0, err
}

// PointerMemoryType says whether p is host, device or managed memory.
func (d *Driver) PointerMemoryType(p uintptr) (MemoryType, error) {
	var v C.uint
	err := d.check("cuPointerGetAttribute(MEMORY_TYPE)",
		C.p2p_r_p_i_d(d.fn.pointerGetAttribute, unsafe.Pointer(&v), pointerAttrMemoryType, C.p2p_dptr(p)))
	return MemoryType(v), err
}

// PointerContext returns the context p was allocated in.
func (d *Driver) PointerContext(p uintptr) (Context, error) {
	var c unsafe.Pointer
	err := d.check("cuPointerGetAttribute(CONTEXT)",
		C.p2p_r_p_i_d(d.fn.pointerGetAttribute, unsafe.Pointer(&c), pointerAttrContext, C.p2p_dptr(p)))
	return Context(uintptr(c)), err
}

// IPCGetMemHandle exports the allocation whose base is p.
func (d *Driver) IPCGetMemHandle(p uintptr) (IPCHandle, error) {
	var h IPCHandle
	err := d.check("cuIpcGetMemHandle", C.p2p_r_p_d(d.fn.ipcGetMemHandle, unsafe.Pointer(&h[0]), C.p2p_dptr(p)))
	return h, err
}

// IPCOpenMemHandle maps another process's allocation into the current
// context with lazy peer access, returning its base here. A process may open
// a given handle only once; close it with IPCCloseMemHandle.
func (d *Driver) IPCOpenMemHandle(h IPCHandle) (uintptr, error) {
	var p C.p2p_dptr
	err := d.check("cuIpcOpenMemHandle",
		C.p2p_ipc_open(d.fn.ipcOpenMemHandle, &p, unsafe.Pointer(&h[0]), IPCLazyEnablePeerAccess))
	return uintptr(p), err
}

// IPCCloseMemHandle unmaps a base returned by IPCOpenMemHandle.
func (d *Driver) IPCCloseMemHandle(p uintptr) error {
	return d.check("cuIpcCloseMemHandle", C.p2p_r_d(d.fn.ipcCloseMemHandle, C.p2p_dptr(p)))
}

// MemHostAlloc allocates n bytes of pinned host memory (flags HostAlloc*).
func (d *Driver) MemHostAlloc(n uint64, flags uint32) (unsafe.Pointer, error) {
	var p unsafe.Pointer
	err := d.check("cuMemHostAlloc", C.p2p_r_p_z_u(d.fn.memHostAlloc, unsafe.Pointer(&p), C.size_t(n), C.uint(flags)))
	return p, err
}

// MemHostDevicePointer returns the device address of mapped host memory.
func (d *Driver) MemHostDevicePointer(host unsafe.Pointer) (uintptr, error) {
	var p C.p2p_dptr
	err := d.check("cuMemHostGetDevicePointer",
		C.p2p_r_p_p_u(d.fn.memHostGetDevicePointer, unsafe.Pointer(&p), host, 0))
	return uintptr(p), err
}

// MemFreeHost frees memory from MemHostAlloc.
func (d *Driver) MemFreeHost(host unsafe.Pointer) error {
	return d.check("cuMemFreeHost", C.p2p_r_p(d.fn.memFreeHost, host))
}

// ModuleLoadData loads a CUBIN (or PTX) image into the current context.
func (d *Driver) ModuleLoadData(image []byte) (Module, error) {
	if len(image) == 0 {
		return 0, status.Errorf(status.InvalidArgument, "cuModuleLoadData: empty image")
	}
	// The driver reads the image during the call only; C memory keeps the
	// copy out of reach of the garbage collector's pointer checks.
	cimg := C.CBytes(image)
	defer C.free(cimg)
	var m unsafe.Pointer
	err := d.check("cuModuleLoadData", C.p2p_r_p_p(d.fn.moduleLoadData, unsafe.Pointer(&m), cimg))
	return Module(uintptr(m)), err
}

// ModuleUnload unloads a module from ModuleLoadData; its functions become
// invalid.
func (d *Driver) ModuleUnload(m Module) error {
	return d.check("cuModuleUnload", C.p2p_r_p(d.fn.moduleUnload, ptr(uintptr(m))))
}

// ModuleFunction returns the kernel named name (a mangled or extern "C" name).
func (d *Driver) ModuleFunction(m Module, name string) (Function, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var f unsafe.Pointer
	if err := d.check("cuModuleGetFunction",
		C.p2p_r_p_p_p(d.fn.moduleGetFunction, unsafe.Pointer(&f), ptr(uintptr(m)), unsafe.Pointer(cname))); err != nil {
		return 0, fmt.Errorf("kernel %s: %w", name, err)
	}
	return Function(uintptr(f)), nil
}

// FuncSetAttribute sets a kernel attribute, e.g. FuncAttrMaxDynamicSharedSizeBytes.
func (d *Driver) FuncSetAttribute(f Function, attr, value int) error {
	return d.check("cuFuncSetAttribute",
		C.p2p_r_p_i_i(d.fn.funcSetAttribute, ptr(uintptr(f)), C.int(attr), C.int(value)))
}

// CtxSynchronize blocks until all work of the current context is done, on
// every stream (torch's non-blocking ones too).
func (d *Driver) CtxSynchronize() error {
	return d.check("cuCtxSynchronize", C.p2p_r_(d.fn.ctxSynchronize))
}

// StreamSynchronize blocks until all work on stream is done.
func (d *Driver) StreamSynchronize(stream uintptr) error {
	return d.check("cuStreamSynchronize", C.p2p_r_p(d.fn.streamSynchronize, ptr(stream)))
}

// StreamCaptureStatus says whether stream is recording a CUDA graph.
func (d *Driver) StreamCaptureStatus(stream uintptr) (CaptureStatus, error) {
	var s C.int
	err := d.check("cuStreamIsCapturing", C.p2p_r_p_p(d.fn.streamIsCapturing, ptr(stream), unsafe.Pointer(&s)))
	return CaptureStatus(s), err
}

// StreamCaptureInfo returns stream's capture status and the capture's unique
// id (0 when not capturing). Optional: ErrNotSupported if absent.
func (d *Driver) StreamCaptureInfo(stream uintptr) (CaptureStatus, uint64, error) {
	if d.fn.streamGetCaptureInfo == nil {
		return 0, 0, fmt.Errorf("cuStreamGetCaptureInfo: %w", ErrNotSupported)
	}
	var s C.int
	var id C.uint64_t
	err := d.check("cuStreamGetCaptureInfo", C.p2p_capture_info(d.fn.streamGetCaptureInfo, ptr(stream), &s, &id))
	return CaptureStatus(s), uint64(id), err
}

// EventCreate creates an event (flags Event*). Events are optional entry
// points: every Event method returns ErrNotSupported when they are absent.
func (d *Driver) EventCreate(flags uint32) (Event, error) {
	if d.fn.eventCreate == nil {
		return 0, fmt.Errorf("cuEventCreate: %w", ErrNotSupported)
	}
	var e unsafe.Pointer
	err := d.check("cuEventCreate", C.p2p_r_p_u(d.fn.eventCreate, unsafe.Pointer(&e), C.uint(flags)))
	return Event(uintptr(e)), err
}

// EventRecord records ev on stream.
func (d *Driver) EventRecord(ev Event, stream uintptr) error {
	if d.fn.eventRecord == nil {
		return fmt.Errorf("cuEventRecord: %w", ErrNotSupported)
	}
	return d.check("cuEventRecord", C.p2p_r_p_p(d.fn.eventRecord, ptr(uintptr(ev)), ptr(stream)))
}

// EventSynchronize blocks until ev has completed.
func (d *Driver) EventSynchronize(ev Event) error {
	if d.fn.eventSynchronize == nil {
		return fmt.Errorf("cuEventSynchronize: %w", ErrNotSupported)
	}
	return d.check("cuEventSynchronize", C.p2p_r_p(d.fn.eventSynchronize, ptr(uintptr(ev))))
}

// EventElapsedMs returns the milliseconds between two completed events.
func (d *Driver) EventElapsedMs(start, end Event) (float32, error) {
	if d.fn.eventElapsedTime == nil {
		return 0, fmt.Errorf("cuEventElapsedTime: %w", ErrNotSupported)
	}
	var ms C.float
	err := d.check("cuEventElapsedTime",
		C.p2p_r_p_p_p(d.fn.eventElapsedTime, unsafe.Pointer(&ms), ptr(uintptr(start)), ptr(uintptr(end))))
	return float32(ms), err
}

// EventDestroy destroys ev.
func (d *Driver) EventDestroy(ev Event) error {
	if d.fn.eventDestroy == nil {
		return fmt.Errorf("cuEventDestroy: %w", ErrNotSupported)
	}
	return d.check("cuEventDestroy", C.p2p_r_p(d.fn.eventDestroy, ptr(uintptr(ev))))
}
