package proxy

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
)

// Memory is one allocation: Host is where this process reads and writes it
// (nil when the host cannot), Device where kernels do.
type Memory struct {
	Host   unsafe.Pointer
	Device uintptr
	Size   uint64
}

// Allocator provides a FIFO's memory, zeroed.
type Allocator interface {
	// Mapped returns memory both the host and the device reach: the ring
	// and the words the proxy writes.
	Mapped(n uint64) (Memory, error)
	// Device returns memory the device's atomics stay local on: the
	// pushers' head. Host may be nil.
	Device(n uint64) (Memory, error)
	Free(m Memory) error
}

// HostAllocator serves plain host memory for both kinds, Device == Host:
// FIFOs tested without a GPU, pushed from the host. Its zero value is ready.
type HostAllocator struct {
	mu   sync.Mutex
	live map[uintptr][]uint64 // keeps each allocation reachable until Free
}

func (a *HostAllocator) alloc(n uint64) (Memory, error) {
	if n == 0 {
		return Memory{}, fmt.Errorf("host alloc of 0 bytes")
	}
	// uint64 words: 8-byte aligned for the atomics; 128-byte alignment of
	// the layouts matters only to the device.
	buf := make([]uint64, (n+7)/8)
	p := unsafe.Pointer(&buf[0])
	a.mu.Lock()
	if a.live == nil {
		a.live = map[uintptr][]uint64{}
	}
	a.live[uintptr(p)] = buf
	a.mu.Unlock()
	return Memory{Host: p, Device: uintptr(p), Size: n}, nil
}

// Mapped returns zeroed host memory.
func (a *HostAllocator) Mapped(n uint64) (Memory, error) { return a.alloc(n) }

// Device returns zeroed host memory the host may also touch.
func (a *HostAllocator) Device(n uint64) (Memory, error) { return a.alloc(n) }

// Free releases m.
func (a *HostAllocator) Free(m Memory) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.live[uintptr(m.Host)]; !ok {
		return fmt.Errorf("free %#x: not allocated here", uintptr(m.Host))
	}
	delete(a.live, uintptr(m.Host))
	return nil
}

// CUDADriver is the part of *cuda.Driver CUDAAllocator uses.
type CUDADriver interface {
	MemHostAlloc(n uint64, flags uint32) (unsafe.Pointer, error)
	MemHostDevicePointer(host unsafe.Pointer) (uintptr, error)
	MemFreeHost(host unsafe.Pointer) error
	MemAlloc(n uint64) (uintptr, error)
	MemFree(p uintptr) error
	MemsetD8Async(p uintptr, v byte, n uint64, stream uintptr) error
	StreamSynchronize(stream uintptr) error
}

var _ CUDADriver = (*cuda.Driver)(nil)

// CUDAAllocator serves pinned host memory mapped into the device (portable
// to every context) and device memory; the caller's thread must have the
// GPU's context current.
type CUDAAllocator struct {
	Driver CUDADriver
}

// Mapped returns zeroed pinned host memory with its device address.
func (a CUDAAllocator) Mapped(n uint64) (Memory, error) {
	host, err := a.Driver.MemHostAlloc(n, cuda.HostAllocDeviceMap|cuda.HostAllocPortable)
	if err != nil {
		return Memory{}, fmt.Errorf("FIFO: mapped host alloc of %d bytes: %w", n, err)
	}
	clear(unsafe.Slice((*byte)(host), n))
	dev, err := a.Driver.MemHostDevicePointer(host)
	if err != nil {
		_ = a.Driver.MemFreeHost(host)
		return Memory{}, fmt.Errorf("FIFO: device address of mapped host memory: %w", err)
	}
	return Memory{Host: host, Device: dev, Size: n}, nil
}

// Device returns zeroed device memory (Host nil).
func (a CUDAAllocator) Device(n uint64) (Memory, error) {
	p, err := a.Driver.MemAlloc(n)
	if err != nil {
		return Memory{}, fmt.Errorf("FIFO: device alloc of %d bytes: %w", n, err)
	}
	err = a.Driver.MemsetD8Async(p, 0, n, 0)
	if err == nil {
		err = a.Driver.StreamSynchronize(0)
	}
	if err != nil {
		_ = a.Driver.MemFree(p)
		return Memory{}, fmt.Errorf("FIFO: zero device memory: %w", err)
	}
	return Memory{Device: p, Size: n}, nil
}

// Free releases memory from Mapped or Device.
func (a CUDAAllocator) Free(m Memory) error {
	if m.Host != nil {
		return a.Driver.MemFreeHost(m.Host)
	}
	return a.Driver.MemFree(m.Device)
}
