package ucx

/*
#include <stdlib.h>
#include "calls.h"
*/
import "C"

import (
	"encoding/binary"
	"fmt"
	"slices"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// A key is keyHeaderSize bytes of header, little-endian, then UCP's packed
// remote key:
//
//	0  magic "p2pU"
//	4  owner rank    uint32
//	8  base address  uint64
//	16 size in bytes uint64
//	24 memory        uint32 (transport.Memory)
const (
	keyMagic      = "p2pU"
	keyHeaderSize = 28
)

// local is a range registered with ucp_mem_map.
type local struct {
	t    *Transport
	memh unsafe.Pointer // nil once closed
	addr uintptr
	size uint64
	mem  transport.Memory
	key  []byte
	// closed is set by Close; memh is nil also for device memory only
	// ever staged, which UCX never touches.
	closed bool
}

// remote is a peer's range: its base, size and the unpacked remote key.
type remote struct {
	t    *Transport
	peer int
	rkey unsafe.Pointer // nil once destroyed
	base uint64
	size uint64
	mem  transport.Memory
	// closed is set by Close; rkey is nil also for the peer's staged-only
	// device memory.
	closed bool
}

var (
	_ transport.Local  = (*local)(nil)
	_ transport.Remote = (*remote)(nil)
)

func (l *local) Key() []byte   { return l.key }
func (l *local) Size() uint64  { return l.size }
func (r *remote) Peer() int    { return r.peer }
func (r *remote) Size() uint64 { return r.size }
func (l *local) String() string {
	return fmt.Sprintf("%s range of %d bytes at %#x", l.mem, l.size, l.addr)
}

// Close unregisters the range; puts from or into it must be flushed first.
func (l *local) Close() error {
	l.t.mu.Lock()
	defer l.t.mu.Unlock()
	l.unmap()
	return nil
}

func (l *local) unmap() {
	if l.closed {
		return
	}
	l.closed = true
	if l.t.context != nil && l.memh != nil {
		C.p2p_ucx_status_pp(l.t.lib.fn.memUnmap, l.t.context, l.memh)
	}
	l.memh = nil
	delete(l.t.locals, l)
	if l.mem == transport.HostMemory {
		l.t.landRanges()
	}
}

// Close destroys the remote key after flushing the peer, as UCP requires
// of a key that outstanding operations may use.
func (r *remote) Close() error {
	r.t.mu.Lock()
	defer r.t.mu.Unlock()
	if r.closed {
		return nil
	}
	var err error
	if len(r.t.peers[r.peer].pending) > 0 || r.t.stageSignal(r.peer) {
		err = r.t.flush(r.peer)
	}
	r.destroy()
	return err
}

func (r *remote) destroy() {
	if r.closed {
		return
	}
	r.closed = true
	if r.rkey != nil {
		C.p2p_ucx_call_p(r.t.lib.fn.rkeyDestroy, r.rkey)
	}
	r.rkey = nil
	delete(r.t.remotes, r)
}

// memoryType is UCS's memory type for m.
func memoryType(m transport.Memory) C.int {
	if m == transport.DeviceMemory {
		return C.P2P_UCS_MEMORY_TYPE_CUDA
	}
	return C.P2P_UCS_MEMORY_TYPE_HOST
}

// Register makes [addr, addr+size) a source or destination of puts; mem
// tells UCP the memory type so that it need not detect it.
func (t *Transport) Register(addr uintptr, size uint64, mem transport.Memory) (transport.Local, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, status.Errorf(status.State, "UCX register: transport closed")
	}
	if addr == 0 || size == 0 {
		return nil, status.Errorf(status.InvalidArgument, "UCX register: empty range (address %#x, %d bytes)", addr, size)
	}
	if mem != transport.HostMemory && mem != transport.DeviceMemory {
		return nil, status.Errorf(status.InvalidArgument, "UCX register: unknown memory kind %d", int(mem))
	}
	f := &t.lib.fn
	l := &local{t: t, addr: addr, size: size, mem: mem}
	if mem == transport.DeviceMemory && t.stage != nil && t.stage.all {
		// Every peer stages: UCX never reads or writes this range, so it
		// need not (and over tcp without CUDA support cannot) map it.
		l.key = t.keyHeader(l)
		t.locals[l] = struct{}{}
		return l, nil
	}
	// addr is memory the caller owns outside the Go heap (pinned host,
	// mmap, device); UCP keeps it as an address, never as a Go pointer.
	if s := C.p2p_ucx_mem_map(f.memMap, t.context, C.uint64_t(addr), C.size_t(size), memoryType(mem), &l.memh); s != C.P2P_UCS_OK {
		return nil, status.Errorf(status.InvalidArgument, "UCX register %v: %s", l, t.lib.statusText(s))
	}
	var buf unsafe.Pointer
	var n C.size_t
	if s := C.p2p_ucx_rkey_pack(f.rkeyPack, t.context, l.memh, &buf, &n); s != C.P2P_UCS_OK {
		C.p2p_ucx_status_pp(f.memUnmap, t.context, l.memh)
		return nil, status.Errorf(status.Internal, "UCX pack remote key of %v: %s", l, t.lib.statusText(s))
	}
	l.key = append(t.keyHeader(l), C.GoBytes(buf, C.int(n))...)
	C.p2p_ucx_call_p(f.rkeyBufferRelease, buf)
	t.locals[l] = struct{}{}
	if mem == transport.HostMemory {
		t.landRanges()
	}
	return l, nil
}

// keyHeader is l's key without UCP's packed key.
func (t *Transport) keyHeader(l *local) []byte {
	key := make([]byte, keyHeaderSize)
	copy(key, keyMagic)
	binary.LittleEndian.PutUint32(key[4:], uint32(t.rank))
	binary.LittleEndian.PutUint64(key[8:], uint64(l.addr))
	binary.LittleEndian.PutUint64(key[16:], l.size)
	binary.LittleEndian.PutUint32(key[24:], uint32(l.mem))
	return key
}

// Remote turns the key of a range that peer registered into a destination
// of puts. A key from another rank is status.Mismatch; addressing oneself
// is status.InvalidArgument (a rank's own memory is not a UCX peer's).
func (t *Transport) Remote(peer int, key []byte) (transport.Remote, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if peer == t.rank {
		return nil, status.Errorf(status.InvalidArgument, "UCX remote: rank %d cannot address its own memory through UCX", peer)
	}
	if err := t.check(peer, "remote key"); err != nil {
		return nil, err
	}
	if len(key) < keyHeaderSize || string(key[:4]) != keyMagic {
		return nil, status.Errorf(status.InvalidArgument, "UCX remote: rank %d's key (%d bytes) is not a UCX key", peer, len(key))
	}
	if owner := int(binary.LittleEndian.Uint32(key[4:])); owner != peer {
		return nil, status.Errorf(status.Mismatch, "UCX remote: key for rank %d belongs to rank %d", peer, owner)
	}
	r := &remote{
		t:    t,
		peer: peer,
		base: binary.LittleEndian.Uint64(key[8:]),
		size: binary.LittleEndian.Uint64(key[16:]),
		mem:  transport.Memory(binary.LittleEndian.Uint32(key[24:])),
	}
	if len(key) == keyHeaderSize {
		// Staged-only device memory: reachable only through the rings.
		if r.mem != transport.DeviceMemory || !t.staged(r, nil) {
			return nil, status.Errorf(status.Mismatch, "UCX remote: rank %d's %s range has no UCX key, and puts to it are not staged", peer, r.mem)
		}
		t.remotes[r] = struct{}{}
		return r, nil
	}
	packed := C.CBytes(key[keyHeaderSize:])
	defer C.free(packed)
	if s := C.p2p_ucx_rkey_unpack(t.lib.fn.rkeyUnpack, t.peers[peer].ep, packed, &r.rkey); s != C.P2P_UCS_OK {
		return nil, status.Errorf(status.InvalidArgument, "UCX remote: unpack rank %d's key: %s", peer, t.lib.statusText(s))
	}
	t.remotes[r] = struct{}{}
	return r, nil
}

// ranges checks that dst and src are live ranges of this transport.
func (t *Transport) ranges(op string, dst transport.Remote, src transport.Local) (*remote, *local, error) {
	r, ok := dst.(*remote)
	if !ok || r.t != t {
		return nil, nil, status.Errorf(status.InvalidArgument, "UCX %s: destination %T is not a range of this transport", op, dst)
	}
	if r.closed {
		if err := t.peers[r.peer].err; err != nil {
			return nil, nil, err // closed because its peer failed: that is what the caller must hear
		}
		return nil, nil, status.Errorf(status.State, "UCX %s to rank %d: remote range closed", op, r.peer)
	}
	if src == nil {
		return r, nil, nil
	}
	l, ok := src.(*local)
	if !ok || l.t != t {
		return nil, nil, status.Errorf(status.InvalidArgument, "UCX %s: source %T is not a range of this transport", op, src)
	}
	if l.closed {
		return nil, nil, status.Errorf(status.State, "UCX %s to rank %d: source range closed", op, r.peer)
	}
	return r, l, nil
}

// within reports whether [off, off+n) lies in [0, size), without overflow.
func within(off, n, size uint64) bool { return off <= size && n <= size-off }

// Put starts copying size bytes from src at srcOff to dst at dstOff. A range
// past either end is status.InvalidArgument and nothing is sent.
func (t *Transport) Put(dst transport.Remote, dstOff uint64, src transport.Local, srcOff, size uint64) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.put(dst, dstOff, src, srcOff, size)
}

func (t *Transport) put(dst transport.Remote, dstOff uint64, src transport.Local, srcOff, size uint64) error {
	if src == nil {
		return status.Errorf(status.InvalidArgument, "UCX put: no source range")
	}
	r, l, err := t.putTarget(dst, dstOff, src, size)
	if err != nil {
		return err
	}
	if !within(srcOff, size, l.size) {
		return status.Errorf(status.InvalidArgument, "UCX put to rank %d: source [%d, %d+%d) is past the end of the local %d-byte range",
			r.peer, srcOff, srcOff, size, l.size)
	}
	if size == 0 {
		return nil
	}
	if t.staged(r, l) {
		return t.stagePut(r, dstOff, l, srcOff, size)
	}
	if r.rkey == nil || l.memh == nil {
		return status.Errorf(status.InvalidArgument, "UCX put to rank %d: a range registered for staging only, and this put is not staged", r.peer)
	}
	var memh unsafe.Pointer
	if t.passMemh {
		memh = l.memh
	}
	if l.mem == transport.DeviceMemory || r.mem == transport.DeviceMemory {
		t.peers[r.peer].unordered = true
	}
	t.putDirect(r.peer)
	var s C.int
	req := C.p2p_ucx_put(t.lib.fn.putNbx, t.peers[r.peer].ep, C.uint64_t(uint64(l.addr)+srcOff), C.size_t(size),
		C.uint64_t(r.base+dstOff), r.rkey, memh, memoryType(l.mem), &s)
	return t.started(r.peer, "put", op{req: req}, s)
}

// putTarget checks a put's destination range and its peer, and returns the
// ranges.
func (t *Transport) putTarget(dst transport.Remote, dstOff uint64, src transport.Local, size uint64) (*remote, *local, error) {
	r, l, err := t.ranges("put", dst, src)
	if err != nil {
		return nil, nil, err
	}
	if !within(dstOff, size, r.size) {
		return nil, nil, status.Errorf(status.InvalidArgument, "UCX put to rank %d: [%d, %d+%d) is past the end of its %d-byte range",
			r.peer, dstOff, dstOff, size, r.size)
	}
	return r, l, t.check(r.peer, "put")
}

// PutInline starts copying data, the caller's until it returns, to dst at
// dstOff (transport.InlinePutter). Staged, it is one ring entry whose
// bytes go into the send slot, queued: the Signal, Flush or Progress that
// follows issues it, so a signal right behind it rides in its header.
func (t *Transport) PutInline(dst transport.Remote, dstOff uint64, data []byte) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	size := uint64(len(data))
	r, _, err := t.putTarget(dst, dstOff, nil, size)
	if err != nil {
		return err
	}
	if size == 0 {
		return nil
	}
	if t.staged(r, nil) && size <= t.stage.chunk {
		st := &t.stage.peers[r.peer]
		st.queue = append(st.queue, chunk{inline: slices.Clone(data), dst: r.base + dstOff, size: size})
		return nil
	}
	if r.rkey == nil {
		return status.Errorf(status.InvalidArgument, "UCX put to rank %d: a range registered for staging only, and this put is not staged", r.peer)
	}
	if r.mem == transport.DeviceMemory {
		t.peers[r.peer].unordered = true
	}
	t.putDirect(r.peer)
	mem := C.malloc(C.size_t(size))
	copy(unsafe.Slice((*byte)(mem), size), data)
	return t.putC(r.peer, "put", mem, r.base+dstOff, int(size), r.rkey)
}

// started keeps an operation's request until it completes, or fails the
// peer when the operation failed at once.
func (t *Transport) started(peer int, name string, o op, s C.int) error {
	switch s {
	case C.P2P_UCS_OK:
		return nil
	case C.P2P_UCS_INPROGRESS:
		p := &t.peers[peer]
		p.pending = append(p.pending, o)
		if len(p.pending) >= 256 {
			return t.reap(peer)
		}
		return nil
	}
	err := t.peerError(peer, name, s)
	t.fail(peer, err)
	return err
}

// signalWord checks a signal's target (a word of host memory: 8-byte
// aligned, within the range) and the peer, and returns the range, the peer
// and the word's address, with the peer's running totals ready.
func (t *Transport) signalWord(dst transport.Remote, dstOff uint64) (*remote, *peer, uint64, error) {
	r, _, err := t.ranges("signal", dst, nil)
	if err != nil {
		return nil, nil, 0, err
	}
	if r.mem != transport.HostMemory || r.rkey == nil {
		return nil, nil, 0, status.Errorf(status.InvalidArgument,
			"UCX signal to rank %d: the word must be in host memory, not %s memory", r.peer, r.mem)
	}
	if dstOff%8 != 0 || !within(dstOff, 8, r.size) {
		return nil, nil, 0, status.Errorf(status.InvalidArgument,
			"UCX signal to rank %d: offset %d is not an aligned word of its %d-byte range", r.peer, dstOff, r.size)
	}
	if err := t.check(r.peer, "signal"); err != nil {
		return nil, nil, 0, err
	}
	p := &t.peers[r.peer]
	if p.sums == nil {
		p.sums = map[uint64]uint64{}
	}
	return r, p, r.base + dstOff, nil
}

// Signal adds value to the 64-bit word at dstOff of dst after every earlier
// Put to that peer. The word must be 8-byte aligned in host memory, where
// GPU kernels poll it through a mapping, start at zero, and have this rank
// as its only writer: UCP offers no atomics over tcp or shared memory once
// peer failures are handled, so the sum is kept here and each Signal puts
// the new total after a fence, or, behind a put of device memory that UCP
// carried itself, once a flush of the endpoint completed.
func (t *Transport) Signal(dst transport.Remote, dstOff uint64, value uint64) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.signal(dst, dstOff, value)
}

func (t *Transport) signal(dst transport.Remote, dstOff uint64, value uint64) error {
	r, p, word, err := t.signalWord(dst, dstOff)
	if err != nil {
		return err
	}
	if t.stageSignal(r.peer) {
		p.sums[word] += value
		return t.ringSignal(r, p, word)
	}
	if p.unordered || len(p.flushed) > 0 {
		// Device memory that UCP reaches itself (cuda_ipc between GPUs of a
		// host) travels on another lane than this host word, and a weak
		// fence orders only within a lane: the total goes out once a flush
		// of the endpoint completed, behind any signal queued so.
		p.sums[word] += value
		return t.signalAfterFlush(r, p, word)
	}
	if err := t.fence(r.peer); err != nil {
		return err
	}
	// A later ring entry's total must not land before this one: over
	// another lane (an active message) it could, and this put would then
	// take the word back.
	t.putDirect(r.peer)
	p.sums[word] += value
	// The total travels from C memory of its own, freed when the put
	// completes, so a later Signal cannot change what an earlier one sends.
	total := C.malloc(8)
	*(*uint64)(total) = p.sums[word]
	return t.putC(r.peer, "signal", total, word, 8, r.rkey)
}

// fence orders what goes to peer next behind everything before it; a
// failure fails the peer.
func (t *Transport) fence(peer int) error {
	if s := C.p2p_ucx_status_p(t.lib.fn.workerFence, t.worker); s != C.P2P_UCS_OK {
		err := t.peerError(peer, "signal fence", s)
		t.fail(peer, err)
		return err
	}
	return nil
}
