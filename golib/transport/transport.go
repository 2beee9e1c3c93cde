// Package transport is what the proxy's puts, signals and flushes travel on:
// UCX between hosts (transport/ucx), the copy engine over CUDA IPC inside one
// (transport/cudaipc). A kernel never sees a transport; it pushes triggers
// into a FIFO, and the proxy turns each into one of these calls.
package transport

// Memory says where a registered range lives.
type Memory int

const (
	HostMemory   Memory = iota // pageable or pinned host memory
	DeviceMemory               // CUDA device memory of the communicator's GPU
)

func (m Memory) String() string {
	if m == DeviceMemory {
		return "device"
	}
	return "host"
}

// Local is a range of this process's memory registered with a transport.
type Local interface {
	// Key is what a peer passes to Transport.Remote to address this range
	// (exchanged through the bootstrap).
	Key() []byte
	Size() uint64
	Close() error
}

// Remote is a peer's registered range, built from its key.
type Remote interface {
	Peer() int
	Size() uint64
	Close() error
}

// Transport moves bytes and signals from this rank to its peers. Calls are
// made from one goroutine at a time (the proxy's). Put and Signal are
// asynchronous; Flush completes them. Every wait is bounded by the
// transport's timeout and its error names the peer and the operation.
type Transport interface {
	Name() string
	// Register makes [addr, addr+size) a source or destination of puts.
	Register(addr uintptr, size uint64, mem Memory) (Local, error)
	// Remote turns a peer's key into a range this rank can put into.
	Remote(peer int, key []byte) (Remote, error)
	// Put copies size bytes from src at srcOff to dst at dstOff.
	Put(dst Remote, dstOff uint64, src Local, srcOff, size uint64) error
	// Signal adds value to the 64-bit word at dstOff of dst, visible to the
	// peer only after every earlier Put to that peer. This rank must be the
	// word's only writer and the word must start at 0: a transport without
	// remote atomics (UCX over tcp) puts the running total instead.
	Signal(dst Remote, dstOff uint64, value uint64) error
	// Flush returns once every earlier Put and Signal to peer is complete:
	// sources reusable, data visible at the peer.
	Flush(peer int) error
	// Progress advances outstanding operations without blocking; the proxy
	// calls it when it has nothing else to do. active reports that something
	// moved or is still under way (the proxy keeps polling then, instead of
	// napping: a receiver's data may need it).
	Progress() (active bool, err error)
	Close() error
}

// InlinePutter is a Transport that also takes puts of bytes it is handed
// (a kernel's inline put, popped from the FIFO): data is the caller's only
// until PutInline returns, and its copy is ordered with the peer's other
// puts and signals as Put's would be.
type InlinePutter interface {
	PutInline(dst Remote, dstOff uint64, data []byte) error
}

// PutSignaler is a Transport that also runs a put and the Signal behind it
// in one call (a port channel's putWithSignal), which may cost it fewer
// messages; the effect is Put's, then Signal's.
type PutSignaler interface {
	PutWithSignal(dst Remote, dstOff uint64, src Local, srcOff, size uint64, sem Remote, semOff, value uint64) error
}
