// Package cudaipc is the transport that runs a proxy's puts and signals on
// the GPU's copy engine, between device memory mapped over CUDA IPC.
package cudaipc

import (
	"encoding/binary"
	"fmt"
	"os"
	"runtime"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// Driver is the part of *cuda.Driver the transport uses.
type Driver interface {
	MemAddressRange(p uintptr) (base uintptr, size uint64, err error)
	IPCGetMemHandle(p uintptr) (cuda.IPCHandle, error)
	MemcpyAsync(dst, src uintptr, n uint64, stream uintptr) error
	StreamCreate(flags uint32) (uintptr, error)
	StreamDestroy(stream uintptr) error
	StreamDone(stream uintptr) (bool, error)
	StreamWriteValue64(stream uintptr, addr uintptr, value uint64) error
}

var _ Driver = (*cuda.Driver)(nil)

// Opener maps a peer's exported allocation once per process; *symm.Space
// is one, so the transport shares the communicator's mappings.
type Opener interface {
	OpenPeer(rank int, h cuda.IPCHandle) (uintptr, error)
}

// DefaultTimeout bounds Flush when New is given none.
const DefaultTimeout = 60 * time.Second

// keySize: IPC handle, allocation base, offset, size, exporting process id.
const keySize = 64 + 4*8

// Transport copies with cuMemcpyAsync on a stream of its own and signals
// with cuStreamWriteValue64 on the same stream, so a signal lands after
// every earlier put: the stream orders them, and the write's default memory
// barrier makes the puts' data visible first. A semaphore word is written,
// not added to: the transport keeps each word's count and stores the new
// total, which equals an add because one channel (one sender) owns the word.
// Calls must come from threads whose current context is the one New ran
// in (the proxy's goroutines bind it).
type Transport struct {
	drv     Driver
	opener  Opener
	stream  uintptr
	timeout time.Duration
	pid     uint64
	counts  map[uintptr]uint64 // each semaphore word's count so far
	// queued: work went on the stream since a flush last saw it idle. A
	// flush with nothing queued skips the stream query (a microsecond or
	// two), which a bare flush trigger would otherwise pay every time.
	queued bool
}

// New creates the transport's stream in the calling thread's context. A
// timeout of 0 means DefaultTimeout.
func New(drv Driver, opener Opener, timeout time.Duration) (*Transport, error) {
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	s, err := drv.StreamCreate(cuda.StreamNonBlocking)
	if err != nil {
		return nil, fmt.Errorf("cudaipc: copy stream: %w", err)
	}
	return &Transport{drv: drv, opener: opener, stream: s, timeout: timeout, pid: uint64(os.Getpid()),
		counts: map[uintptr]uint64{}}, nil
}

// Name is "cudaipc".
func (t *Transport) Name() string { return "cudaipc" }

// Concurrent is false: calls share one stream and the signal counts.
func (t *Transport) Concurrent() bool { return false }

// local is a registered range of this GPU's memory.
type local struct {
	addr uintptr
	size uint64
	key  []byte
}

func (l *local) Key() []byte  { return l.key }
func (l *local) Size() uint64 { return l.size }
func (l *local) Close() error { return nil }

// remote is a peer's range mapped into this process.
type remote struct {
	peer int
	addr uintptr
	size uint64
}

func (r *remote) Peer() int    { return r.peer }
func (r *remote) Size() uint64 { return r.size }

// Close does nothing: the mapping belongs to the Opener (until its Close).
func (r *remote) Close() error { return nil }

// Register exports [addr, addr+size) of device memory: its key carries the
// allocation's IPC handle, the offset and size, and this process's id.
func (t *Transport) Register(addr uintptr, size uint64, mem transport.Memory) (transport.Local, error) {
	if mem != transport.DeviceMemory {
		return nil, status.Errorf(status.Unsupported, "cudaipc: register %#x: %s memory has no CUDA IPC handle", addr, mem)
	}
	base, total, err := t.drv.MemAddressRange(addr)
	if err != nil {
		return nil, fmt.Errorf("cudaipc: register %#x: %w", addr, err)
	}
	off := uint64(addr - base)
	if size == 0 || off+size > total {
		return nil, status.Errorf(status.InvalidArgument, "cudaipc: register %#x: %d bytes do not fit its %d-byte allocation at offset %d",
			addr, size, total, off)
	}
	h, err := t.drv.IPCGetMemHandle(base)
	if err != nil {
		return nil, fmt.Errorf("cudaipc: register %#x: %w", addr, err)
	}
	key := append([]byte(nil), h[:]...)
	for _, v := range []uint64{uint64(base), off, size, t.pid} {
		key = binary.LittleEndian.AppendUint64(key, v)
	}
	return &local{addr: addr, size: size, key: key}, nil
}

// Remote maps a peer's range. A key from this same process (ranks as
// threads, or a test) is used in place: a process cannot open its own
// IPC handles, and it needs not.
func (t *Transport) Remote(peer int, key []byte) (transport.Remote, error) {
	if len(key) != keySize {
		return nil, status.Errorf(status.InvalidArgument, "cudaipc: rank %d's key is %d bytes, want %d", peer, len(key), keySize)
	}
	var h cuda.IPCHandle
	copy(h[:], key)
	base := binary.LittleEndian.Uint64(key[64:])
	off := binary.LittleEndian.Uint64(key[72:])
	size := binary.LittleEndian.Uint64(key[80:])
	pid := binary.LittleEndian.Uint64(key[88:])
	if pid == t.pid {
		return &remote{peer: peer, addr: uintptr(base + off), size: size}, nil
	}
	if t.opener == nil {
		return nil, status.Errorf(status.State, "cudaipc: no IPC opener to map rank %d's memory", peer)
	}
	mapped, err := t.opener.OpenPeer(peer, h)
	if err != nil {
		return nil, fmt.Errorf("cudaipc: open IPC handle of rank %d: %w", peer, err)
	}
	return &remote{peer: peer, addr: mapped + uintptr(off), size: size}, nil
}

// Put queues a copy engine copy of size bytes.
func (t *Transport) Put(dst transport.Remote, dstOff uint64, src transport.Local, srcOff, size uint64) error {
	d, ok1 := dst.(*remote)
	s, ok2 := src.(*local)
	if !ok1 || !ok2 {
		return status.Errorf(status.InvalidArgument, "cudaipc: put between ranges of another transport")
	}
	if dstOff+size > d.size || srcOff+size > s.size {
		return status.Errorf(status.InvalidArgument, "cudaipc: put of %d bytes to rank %d: past the end (source %d at %d, destination %d at %d)",
			size, d.peer, s.size, srcOff, d.size, dstOff)
	}
	if err := t.drv.MemcpyAsync(d.addr+uintptr(dstOff), s.addr+uintptr(srcOff), size, t.stream); err != nil {
		return fmt.Errorf("cudaipc: put of %d bytes to rank %d: %w", size, d.peer, err)
	}
	t.queued = true
	return nil
}

// Signal queues, after every earlier put, a store of the word's new count.
func (t *Transport) Signal(dst transport.Remote, dstOff uint64, value uint64) error {
	d, ok := dst.(*remote)
	if !ok {
		return status.Errorf(status.InvalidArgument, "cudaipc: signal to a range of another transport")
	}
	if dstOff%8 != 0 || dstOff+8 > d.size {
		return status.Errorf(status.InvalidArgument, "cudaipc: signal to rank %d at offset %d of %d bytes", d.peer, dstOff, d.size)
	}
	addr := d.addr + uintptr(dstOff)
	n := t.counts[addr] + value
	if err := t.drv.StreamWriteValue64(t.stream, addr, n); err != nil {
		return fmt.Errorf("cudaipc: signal to rank %d: %w", d.peer, err)
	}
	t.counts[addr] = n
	t.queued = true
	return nil
}

// Flush waits, up to the timeout, until every queued put and signal is
// complete (one stream serves every peer, so it completes them all).
func (t *Transport) Flush(peer int) error {
	if !t.queued {
		return nil
	}
	deadline := time.Now().Add(t.timeout)
	for spin := 0; ; spin++ {
		done, err := t.drv.StreamDone(t.stream)
		if err != nil {
			return fmt.Errorf("cudaipc: flush of rank %d: %w", peer, err)
		}
		if done {
			t.queued = false
			return nil
		}
		if spin&63 == 63 {
			if time.Now().After(deadline) {
				return status.Errorf(status.Timeout, "cudaipc: flush of rank %d: copies not complete after %v (P2PCOMM_TIMEOUT_MS)", peer, t.timeout)
			}
			runtime.Gosched()
		}
	}
}

// Progress does nothing: the copy engine needs no help.
func (t *Transport) Progress() (bool, error) { return false, nil }

// Close waits for queued work (bounded) and destroys the stream.
func (t *Transport) Close() error {
	if t.stream == 0 {
		return nil
	}
	err := t.Flush(-1)
	if derr := t.drv.StreamDestroy(t.stream); err == nil {
		err = derr
	}
	t.stream = 0
	return err
}
