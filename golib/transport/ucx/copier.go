package ucx

import (
	"fmt"
	"sync/atomic"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
)

// Copier moves bytes between device memory and pinned host memory for
// staged puts. Copies run in the order queued. The transport calls it only
// from the goroutine that calls the transport (the proxy's, whose thread
// holds the CUDA context).
type Copier interface {
	// AllocHost returns size bytes of pinned host memory, the staging
	// rings' backing.
	AllocHost(size uint64) (uintptr, error)
	// FreeHost frees memory from AllocHost.
	FreeHost(addr uintptr) error
	// Copy queues a copy of size bytes from src to dst, after every copy
	// queued before it; either side may be device or pinned host memory.
	Copy(dst, src uintptr, size uint64) error
	// Store queues a store of value into the 64-bit host word at addr,
	// after every copy queued before it; Completed counts it as a copy. It
	// reports false, queueing nothing, when the copier cannot reach the
	// word; the caller then stores it once Completed covers those copies.
	Store(addr uintptr, value uint64) (bool, error)
	// Write queues stores of the size bytes at src (pinned host memory,
	// read now) into dst, after every copy queued before it; Completed
	// counts it as a copy. It reports false, queueing nothing, when it
	// cannot (dst or size not a multiple of 8 bytes, size above
	// WriteMaxBytes, no such stores): the caller copies instead.
	Write(dst, src uintptr, size uint64) (bool, error)
	// Completed returns how many of the copies (and stores) queued so far
	// are complete, without blocking.
	Completed() (uint64, error)
}

// WriteMaxBytes is the most a Copier's Write takes: a landed entry this
// small reaches device memory as a few stores on the stream, in the same
// driver call as its signal, instead of a copy engine's round trip.
const WriteMaxBytes = 64

// writable reports whether Write takes size bytes to dst.
func writable(dst uintptr, size uint64) bool {
	return dst%8 == 0 && size%8 == 0 && size > 0 && size <= WriteMaxBytes
}

// CUDACopier is a GPU's Copier: cuMemcpyAsync on a non-blocking stream of
// its own, the copies followed on the stream by a store of their count into
// a mapped host word, so completion is one load instead of an event per
// copy. The count is stored once per batch (the copies queued between two
// Completed calls), a driver call less per copy. Stores (Write's, Store's,
// the count's) wait in pending and go to the stream in one driver call,
// before the next copy or at Completed.
type CUDACopier struct {
	drv     *cuda.Driver
	stream  uintptr
	word    unsafe.Pointer // pinned, mapped host word the stream writes
	wordDev uintptr
	queued  uint64
	marked  uint64              // the count last queued for the word
	mapped  map[uintptr]uintptr // host word -> its device address; 0: not mapped
	pending []cuda.WriteOp
}

var _ Copier = (*CUDACopier)(nil)

// NewCUDACopier creates the copier's stream and completion word in the
// calling thread's current context.
func NewCUDACopier(drv *cuda.Driver) (*CUDACopier, error) {
	c := &CUDACopier{drv: drv, mapped: map[uintptr]uintptr{}}
	var err error
	if c.word, err = drv.MemHostAlloc(8, cuda.HostAllocDeviceMap|cuda.HostAllocPortable); err != nil {
		return nil, fmt.Errorf("UCX staging copier: completion word: %w", err)
	}
	*(*uint64)(c.word) = 0
	if c.wordDev, err = drv.MemHostDevicePointer(c.word); err != nil {
		drv.MemFreeHost(c.word)
		return nil, fmt.Errorf("UCX staging copier: completion word: %w", err)
	}
	if c.stream, err = drv.StreamCreate(cuda.StreamNonBlocking); err != nil {
		drv.MemFreeHost(c.word)
		return nil, fmt.Errorf("UCX staging copier: stream: %w", err)
	}
	return c, nil
}

// AllocHost allocates portable pinned host memory.
func (c *CUDACopier) AllocHost(size uint64) (uintptr, error) {
	p, err := c.drv.MemHostAlloc(size, cuda.HostAllocPortable)
	return uintptr(p), err
}

// FreeHost frees memory from AllocHost.
func (c *CUDACopier) FreeHost(addr uintptr) error {
	return c.drv.MemFreeHost(*(*unsafe.Pointer)(unsafe.Pointer(&addr)))
}

// Copy queues the copy; Completed queues the store of the count.
func (c *CUDACopier) Copy(dst, src uintptr, size uint64) error {
	if err := c.submit(); err != nil {
		return err
	}
	if err := c.drv.MemcpyAsync(dst, src, size, c.stream); err != nil {
		return err
	}
	c.queued++
	return nil
}

// Store queues the store on the stream when addr is mapped host memory
// (pinned with cuMemHostAlloc's DEVICEMAP, as signal words are): the
// stream's write carries a memory barrier, so a kernel that sees the value
// sees the copies before it, without a round trip through this thread.
func (c *CUDACopier) Store(addr uintptr, value uint64) (bool, error) {
	dev, ok := c.mapped[addr]
	if !ok {
		// An error just means the word is not mapped: the caller stores it.
		dev, _ = c.drv.MemHostDevicePointer(addrPtr(addr))
		c.mapped[addr] = dev
	}
	if dev == 0 {
		return false, nil
	}
	if err := c.store(dev, value); err != nil {
		return false, err
	}
	c.queued++
	return true, nil
}

// Write queues the bytes as 8-byte stores, read from src now.
func (c *CUDACopier) Write(dst, src uintptr, size uint64) (bool, error) {
	if !writable(dst, size) || !c.drv.HasWriteValues() {
		return false, nil
	}
	for i := uint64(0); i < size; i += 8 {
		c.pending = append(c.pending, cuda.WriteOp{Addr: dst + uintptr(i), Value: *(*uint64)(addrPtr(src + uintptr(i)))})
	}
	c.queued++
	return true, nil
}

// store queues one store: with the pending ones where the driver batches
// them, else at once.
func (c *CUDACopier) store(addr uintptr, value uint64) error {
	if !c.drv.HasWriteValues() {
		return c.drv.StreamWriteValue64(c.stream, addr, value)
	}
	c.pending = append(c.pending, cuda.WriteOp{Addr: addr, Value: value})
	return nil
}

// submit hands the pending stores to the stream.
func (c *CUDACopier) submit() error {
	ops := c.pending
	c.pending = c.pending[:0]
	for len(ops) > 0 {
		n := min(len(ops), cuda.MaxWriteOps)
		if err := c.drv.StreamWriteValues64(c.stream, ops[:n]); err != nil {
			return err
		}
		ops = ops[n:]
	}
	return nil
}

// Completed queues the store of the count if copies were queued since the
// last call, and reads the count the stream last stored.
func (c *CUDACopier) Completed() (uint64, error) {
	if c.marked != c.queued {
		if err := c.store(c.wordDev, c.queued); err != nil {
			return 0, err
		}
		c.marked = c.queued
	}
	if err := c.submit(); err != nil {
		return 0, err
	}
	return atomic.LoadUint64((*uint64)(c.word)), nil
}

// Close waits for queued copies and frees the stream and the word.
func (c *CUDACopier) Close() error {
	if c.stream == 0 {
		return nil
	}
	err := c.submit()
	if serr := c.drv.StreamSynchronize(c.stream); err == nil {
		err = serr
	}
	if derr := c.drv.StreamDestroy(c.stream); err == nil {
		err = derr
	}
	if ferr := c.drv.MemFreeHost(c.word); err == nil {
		err = ferr
	}
	c.stream = 0
	return err
}
