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
	// Completed returns how many of the copies (and stores) queued so far
	// are complete, without blocking.
	Completed() (uint64, error)
}

// CUDACopier is a GPU's Copier: cuMemcpyAsync on a non-blocking stream of
// its own, the copies followed on the stream by a store of their count into
// a mapped host word, so completion is one load instead of an event per
// copy. The count is stored once per batch (the copies queued between two
// Completed calls), a driver call less per copy.
type CUDACopier struct {
	drv     *cuda.Driver
	stream  uintptr
	word    unsafe.Pointer // pinned, mapped host word the stream writes
	wordDev uintptr
	queued  uint64
	marked  uint64              // the count last queued for the word
	mapped  map[uintptr]uintptr // host word -> its device address; 0: not mapped
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
	if err := c.drv.StreamWriteValue64(c.stream, dev, value); err != nil {
		return false, err
	}
	c.queued++
	return true, nil
}

// Completed queues the store of the count if copies were queued since the
// last call, and reads the count the stream last stored.
func (c *CUDACopier) Completed() (uint64, error) {
	if c.marked != c.queued {
		if err := c.drv.StreamWriteValue64(c.stream, c.wordDev, c.queued); err != nil {
			return 0, err
		}
		c.marked = c.queued
	}
	return atomic.LoadUint64((*uint64)(c.word)), nil
}

// Close waits for queued copies and frees the stream and the word.
func (c *CUDACopier) Close() error {
	if c.stream == 0 {
		return nil
	}
	err := c.drv.StreamSynchronize(c.stream)
	if derr := c.drv.StreamDestroy(c.stream); err == nil {
		err = derr
	}
	if ferr := c.drv.MemFreeHost(c.word); err == nil {
		err = ferr
	}
	c.stream = 0
	return err
}
