package cuda

import (
	"fmt"
	"strings"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// Sentinels callers branch on with errors.Is.
var (
	// ErrNoDriver: libcuda.so.1 could not be loaded or lacks what this
	// package needs. The wrapped *LoadError keeps every reason.
	ErrNoDriver = status.Errorf(status.Unsupported, "CUDA driver unavailable")
	// ErrNoNVRTC: no usable NVRTC library was found.
	ErrNoNVRTC = status.Errorf(status.Unsupported, "NVRTC unavailable")
	// ErrNotSupported: an optional driver entry point is missing, or the
	// driver answered CUDA_ERROR_NOT_SUPPORTED.
	ErrNotSupported = status.Errorf(status.Unsupported, "not supported by this CUDA driver")
	// ErrPeerUnavailable: the driver refused peer access between two GPUs.
	ErrPeerUnavailable = status.Errorf(status.PeerUnavailable, "peer access unavailable")
)

// CUresult values this package branches on or names without the driver.
const (
	errInvalidValue          = 1
	errOutOfMemory           = 2
	errNotInitialized        = 3
	errDeinitialized         = 4
	errNoDevice              = 100
	errInvalidDevice         = 101
	errInvalidImage          = 200
	errInvalidContext        = 201
	errNoBinaryForGPU        = 209
	errAlreadyMapped         = 208
	errPeerAccessUnsupported = 217
	errUnsupportedPTXVersion = 222
	errInvalidHandle         = 400
	errNotFound              = 500
	errNotReady              = 600
	errIllegalAddress        = 700
	errLaunchOutOfResources  = 701
	errLaunchTimeout         = 702
	errPeerAccessNotEnabled  = 705
	errLaunchFailed          = 719
	errNotPermitted          = 800
	errNotSupported          = 801
	errStreamCaptureUnsupp   = 900
	errUnknown               = 999
)

// knownNames lets an Error print a name when the driver cannot be asked
// (not loaded, or cuGetErrorName itself failed). CUresult numbers are ABI.
var knownNames = map[int]string{
	0: "CUDA_SUCCESS", errInvalidValue: "CUDA_ERROR_INVALID_VALUE", errOutOfMemory: "CUDA_ERROR_OUT_OF_MEMORY",
	errNotInitialized: "CUDA_ERROR_NOT_INITIALIZED", errDeinitialized: "CUDA_ERROR_DEINITIALIZED",
	errNoDevice: "CUDA_ERROR_NO_DEVICE", errInvalidDevice: "CUDA_ERROR_INVALID_DEVICE",
	errInvalidImage: "CUDA_ERROR_INVALID_IMAGE", errInvalidContext: "CUDA_ERROR_INVALID_CONTEXT",
	errAlreadyMapped: "CUDA_ERROR_ALREADY_MAPPED", errNoBinaryForGPU: "CUDA_ERROR_NO_BINARY_FOR_GPU",
	errPeerAccessUnsupported: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", errUnsupportedPTXVersion: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
	errInvalidHandle: "CUDA_ERROR_INVALID_HANDLE", errNotFound: "CUDA_ERROR_NOT_FOUND", errNotReady: "CUDA_ERROR_NOT_READY",
	errIllegalAddress: "CUDA_ERROR_ILLEGAL_ADDRESS", errLaunchOutOfResources: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
	errLaunchTimeout: "CUDA_ERROR_LAUNCH_TIMEOUT", errPeerAccessNotEnabled: "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
	errLaunchFailed: "CUDA_ERROR_LAUNCH_FAILED", errNotPermitted: "CUDA_ERROR_NOT_PERMITTED",
	errNotSupported: "CUDA_ERROR_NOT_SUPPORTED", errStreamCaptureUnsupp: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
	errUnknown: "CUDA_ERROR_UNKNOWN",
}

// Error is a failed CUDA driver call. It carries status.CUDA for the C ABI.
type Error struct {
	Code int    // the CUresult
	Name string // e.g. "CUDA_ERROR_OUT_OF_MEMORY"; empty if unknown
	Call string // the driver function, e.g. "cuMemAlloc"
}

func (e *Error) Error() string {
	name := e.Name
	if name == "" {
		name = knownNames[e.Code]
	}
	if name == "" {
		return fmt.Sprintf("%s: CUresult %d", e.Call, e.Code)
	}
	return fmt.Sprintf("%s: %s (%d)", e.Call, name, e.Code)
}

// StatusCode reports status.CUDA, or status.Unsupported / PeerUnavailable
// for the codes that mean exactly that, so status.CodeOf maps it for Python.
func (e *Error) StatusCode() status.Code {
	switch e.Code {
	case errNotSupported:
		return status.Unsupported
	case errPeerAccessUnsupported:
		return status.PeerUnavailable
	}
	return status.CUDA
}

// Is makes errors.Is(err, ErrNotSupported) and ErrPeerUnavailable hold for
// the driver codes with that meaning.
func (e *Error) Is(target error) bool {
	switch target {
	case ErrNotSupported:
		return e.Code == errNotSupported
	case ErrPeerUnavailable:
		return e.Code == errPeerAccessUnsupported
	}
	return false
}

// LoadError is a failed library load: which library, and every place tried
// with dlopen/dlsym's own text. It unwraps to ErrNoDriver or ErrNoNVRTC.
type LoadError struct {
	Lib   string   // "libcuda.so.1" or "NVRTC"
	Tried []string // "candidate: reason", in search order
	kind  error
}

func (e *LoadError) Error() string {
	return fmt.Sprintf("load %s: %s", e.Lib, strings.Join(e.Tried, "; "))
}

func (e *LoadError) Unwrap() error { return e.kind }

// StatusCode reports status.Unsupported: without the library this process
// cannot use the GPU path at all.
func (e *LoadError) StatusCode() status.Code { return status.Unsupported }
