package cuda

/*
#include "trampolines.h"
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// Stream flags.
const (
	StreamNonBlocking = 0x1 // CU_STREAM_NON_BLOCKING: no implicit sync with the legacy default stream
)

// StreamCreate creates a stream (flags Stream*) in the current context.
// Streams are optional entry points: these methods return ErrNotSupported
// when they are absent.
func (d *Driver) StreamCreate(flags uint32) (uintptr, error) {
	if d.fn.streamCreate == nil {
		return 0, fmt.Errorf("cuStreamCreate: %w", ErrNotSupported)
	}
	var s unsafe.Pointer
	err := d.check("cuStreamCreate", C.p2p_r_p_u(d.fn.streamCreate, unsafe.Pointer(&s), C.uint(flags)))
	return uintptr(s), err
}

// StreamDestroy destroys a stream from StreamCreate once its work is done.
func (d *Driver) StreamDestroy(stream uintptr) error {
	if d.fn.streamDestroy == nil {
		return fmt.Errorf("cuStreamDestroy: %w", ErrNotSupported)
	}
	return d.check("cuStreamDestroy", C.p2p_r_p(d.fn.streamDestroy, ptr(stream)))
}

// StreamDone reports whether all work queued on stream has completed,
// without blocking: the building block of bounded waits.
func (d *Driver) StreamDone(stream uintptr) (bool, error) {
	if d.fn.streamQuery == nil {
		return false, fmt.Errorf("cuStreamQuery: %w", ErrNotSupported)
	}
	r := C.p2p_r_p(d.fn.streamQuery, ptr(stream))
	if r == errNotReady {
		return false, nil
	}
	return true, d.check("cuStreamQuery", r)
}

// StreamWriteValue64 queues a 64-bit store of value to addr (device memory,
// a peer's included, or mapped host memory) on stream, after the stream's
// earlier work and with a memory barrier before it.
func (d *Driver) StreamWriteValue64(stream uintptr, addr uintptr, value uint64) error {
	if d.fn.streamWriteValue64 == nil {
		return fmt.Errorf("cuStreamWriteValue64: %w", ErrNotSupported)
	}
	return d.check("cuStreamWriteValue64",
		C.p2p_r_p_d_u64_u(d.fn.streamWriteValue64, ptr(stream), C.p2p_dptr(addr), C.uint64_t(value), 0))
}

// StreamWaitEvent makes work queued on stream after this call wait for the
// completion of ev's latest record (on any stream). Ordered on the device;
// the host does not wait. Inside a stream capture it adds the dependency to
// the graph (a fork or join of streams).
func (d *Driver) StreamWaitEvent(stream uintptr, ev Event) error {
	if d.fn.streamWaitEvent == nil {
		return fmt.Errorf("cuStreamWaitEvent: %w", ErrNotSupported)
	}
	return d.check("cuStreamWaitEvent", C.p2p_r_p_p_u(d.fn.streamWaitEvent, ptr(stream), ptr(uintptr(ev)), 0))
}
