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

// WriteOp is one 64-bit store of StreamWriteValues64.
type WriteOp struct {
	Addr  uintptr
	Value uint64
}

// MaxWriteOps is how many stores one StreamWriteValues64 call takes.
const MaxWriteOps = 256

// CUstreamBatchMemOpParams as a write: 48 bytes, the operation at 0, the
// address at 8, the value at 16, the flags at 24 (0: a memory barrier
// before the store, as StreamWriteValue64's).
const (
	memOpWords        = 6
	memOpWriteValue64 = 5 // CU_STREAM_MEM_OP_WRITE_VALUE_64
)

// HasWriteValues reports whether StreamWriteValues64 is available.
func (d *Driver) HasWriteValues() bool { return d.fn.streamBatchMemOp != nil }

// StreamWriteValues64 queues ops (at most MaxWriteOps) on stream in one
// driver call (cuStreamBatchMemOp), in order, each as StreamWriteValue64
// would: after the stream's earlier work, with a memory barrier before it.
func (d *Driver) StreamWriteValues64(stream uintptr, ops []WriteOp) error {
	if d.fn.streamBatchMemOp == nil {
		return fmt.Errorf("cuStreamBatchMemOp: %w", ErrNotSupported)
	}
	if len(ops) == 0 || len(ops) > MaxWriteOps {
		return fmt.Errorf("cuStreamBatchMemOp: %d stores, want 1..%d", len(ops), MaxWriteOps)
	}
	params := make([]uint64, memOpWords*len(ops))
	for i, op := range ops {
		p := params[memOpWords*i:]
		p[0], p[1], p[2] = memOpWriteValue64, uint64(op.Addr), op.Value
	}
	return d.check("cuStreamBatchMemOp",
		C.p2p_r_p_u_p_u(d.fn.streamBatchMemOp, ptr(stream), C.uint(len(ops)), unsafe.Pointer(&params[0]), 0))
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
