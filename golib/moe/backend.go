package moe

import (
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/topo"
)

// PeerMemory is symmetric memory that every rank of the node can address,
// and the barrier that orders accesses to it: what both paths need of a
// backend (gpucoll and hostcoll implement it).
type PeerMemory interface {
	// Alloc collectively allocates zeroed symmetric memory and returns this
	// rank's address; it lives until the communicator closes.
	Alloc(nbytes int64) (uintptr, error)
	// PeerAddress is where this process sees rank's copy of [ptr, ptr+nbytes).
	PeerAddress(ptr uintptr, nbytes int64, rank int) (uintptr, error)
	// StreamBarrier orders a barrier among all ranks on stream (the CPU
	// backend waits on the host), on behalf of call (named when a peer
	// never arrives).
	StreamBarrier(stream uintptr, call collective.Call) error
	// Check returns an error recorded asynchronously, such as a kernel's
	// timeout naming the peer that never arrived.
	Check() error
}

// Host is what the CPU path needs: symmetric host memory (mapped only
// among the ranks of a node), which ranks share a node, and how the
// backend bounds and paces its waits (the path's own waits across nodes
// follow them).
type Host interface {
	PeerMemory
	Topology() *topo.Topology
	// Timeout bounds every wait for a peer (P2PCOMM_TIMEOUT_MS).
	Timeout() time.Duration
	// Pace paces the i-th poll of a wait: spin, yield, then nap.
	Pace(i int)
	// NetRails is the rail count asked for across nodes (topo.NetRails;
	// 0: the default).
	NetRails() int
}

// GPU is what the kernel path needs of the GPU backend (gpucoll, adapted in
// golib/comm): its symmetric memory and barriers, its kernels, the bounds
// of device waits, and the CUDA runtime of its device.
type GPU interface {
	PeerMemory
	// SMCount is the multiprocessors this rank may use.
	SMCount() int
	// WaitInfo is what kernels need to bound their waits like the
	// backend's own: this rank's Signal, the device address of the error
	// word Check reads, and the timeout in nanoseconds.
	WaitInfo() (signal, errWord uintptr, timeoutNs uint64)
	// KernelFunction compiles (once per process) and loads the file of
	// native/kernels that declares expr, and returns that kernel.
	KernelFunction(file, expr string) (cuda.Function, error)
	// LaunchFunction runs fn on a 1-D grid with the bytes of params as its
	// one by-value argument, letting it take sharedBytes of dynamic shared
	// memory.
	LaunchFunction(fn cuda.Function, grid, block, sharedBytes uint32, stream uintptr, params []byte) error
	Runtime
}

// Runtime is the CUDA driver as the kernel path uses it, on the backend's
// device: copies, streams, events and pinned host memory.
type Runtime interface {
	// EnsureContext makes the backend's device current on this thread.
	EnsureContext() error
	MemcpyAsync(dst, src uintptr, n uint64, stream uintptr) error
	MemsetD8Async(p uintptr, v byte, n uint64, stream uintptr) error
	StreamSynchronize(stream uintptr) error
	StreamCreate(flags uint32) (uintptr, error)
	StreamDestroy(stream uintptr) error
	EventCreate(flags uint32) (cuda.Event, error)
	EventRecord(ev cuda.Event, stream uintptr) error
	StreamWaitEvent(stream uintptr, ev cuda.Event) error
	EventSynchronize(ev cuda.Event) error
	EventDestroy(ev cuda.Event) error
	MemHostAlloc(n uint64, flags uint32) (unsafe.Pointer, error)
	MemFreeHost(p unsafe.Pointer) error
}
