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
	// Completed returns how many of the copies queued so far are complete,
	// without blocking.
	Completed() (uint64, error)
}

// CUDACopier is a GPU's Copier: cuMemcpyAsync on a non-blocking stream of
// its own, each copy followed on the stream by a store of its count into a
// mapped host word, so completion is one load instead of an event per copy.
type CUDACopier struct {
	drv     *cuda.Driver
	stream  uintptr
	word    unsafe.Pointer // pinned, mapped host word the stream writes
	wordDev uintptr
	queued  uint64
}

var _ Copier = (*CUDACopier)(nil)

// NewCUDACopier creates the copier's stream and completion word in the
// calling thread's current context.
func NewCUDACopier(drv *cuda.Driver) (*CUDACopier, error) {
	c := &CUDACopier{drv: drv}
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

// Copy queues the copy and the store of its count.
func (c *CUDACopier) Copy(dst, src uintptr, size uint64) error {
	if err := c.drv.MemcpyAsync(dst, src, size, c.stream); err != nil {
		return err
	}
	c.queued++
	return c.drv.StreamWriteValue64(c.stream, c.wordDev, c.queued)
}

// Completed reads the count the stream last stored.
func (c *CUDACopier) Completed() (uint64, error) {
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
