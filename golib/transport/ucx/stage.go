package ucx

/*
#include <stdlib.h>
#include "calls.h"
*/
import "C"

import (
	"encoding/binary"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// Staged puts. Where UCX reaches device memory only through cuda_copy
// bounce buffers (tcp), a put whose source or destination is device memory
// travels through pinned host memory instead, in chunks:
//
//	sender:   device source --Copier--> send slot (pinned, per peer)
//	          send slot or host source --ucp_put--> receiver's landing slot
//	          header put, fence, sequence word put
//	receiver: Progress sees the sequence word, copies the landing slot into
//	          the device destination, and once the copy completed returns
//	          the slot as a credit (a put of its consumed count)
//
// A device source with a host destination skips the landing ring. A Signal
// while staged work toward the peer is queued or not yet credited travels
// as a ring entry too, so the receiver applies it only after every earlier
// chunk reached device memory. The receiver's side runs in Progress and in
// every wait: its proxy must keep calling Progress, from the thread that
// holds the CUDA context.

// StageEnv names the staging knob: auto, always or never.
const StageEnv = "P2PCOMM_UCX_STAGE"

// StageMode says when device memory is staged through pinned host memory.
type StageMode int

const (
	// StageDefault is StageEnv's value, else StageAuto.
	StageDefault StageMode = iota
	// StageAuto stages toward a peer when this context reaches no device
	// memory or the endpoint has no transport that reaches it directly
	// (rc, dc, cuda_ipc, gdr_copy).
	StageAuto
	StageAlways
	StageNever
)

// ParseStageMode reads StageEnv's spelling.
func ParseStageMode(s string) (StageMode, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "auto":
		return StageAuto, nil
	case "always":
		return StageAlways, nil
	case "never":
		return StageNever, nil
	}
	return 0, status.Errorf(status.InvalidArgument, "%s=%q: want auto, always or never", StageEnv, s)
}

func (m StageMode) String() string {
	return [...]string{"default", "auto", "always", "never"}[m]
}

// Ring defaults: four 1 MiB chunks per peer and direction keep a copy, a
// put and a landing copy in flight at once.
const (
	DefaultChunkBytes = 1 << 20
	DefaultRingChunks = 4
)

// A landing slot's header, after the ring's data: the sequence word is put
// last, after a fence, so a receiver that sees it sees the rest.
//
//	0  sequence  uint64 (entry number, from 1)
//	8  address   uint64 (receiver's device destination, or signal word)
//	16 size      uint64 (bytes, or the signal's new total)
//	24 kind      uint64
const (
	headerSize  = 32
	entryData   = 1
	entrySignal = 2
)

// chunk is one piece of staged work toward a peer, kept in order.
type chunk struct {
	src      uintptr // source address (device, or registered host)
	srcMemh  unsafe.Pointer
	device   bool // src is device memory: copy it to a send slot first
	dst      uint64
	rkey     unsafe.Pointer // dst's key when it is host memory, else nil
	size     uint64
	signal   bool // a ring entry storing size at dst
	ticket   uint64
	sendSlot int
}

// landed is a ring entry taken in by the receiver, waiting for its copy.
type landed struct {
	ticket uint64
	word   uintptr // a signal's word, 0 for data
	total  uint64
}

// stager is this rank's staging state toward and from one peer.
type stager struct {
	on     bool    // device puts to the peer are staged
	ring   *remote // the peer's landing ring for this rank
	credit *remote // the peer's credit words; this rank's at rank*8

	send    uintptr          // send slots toward the peer, pinned
	sendReq []unsafe.Pointer // each slot's put still reading it
	sendN   uint64           // send slots taken so far (copies queued)
	sendPut uint64           // of those, slots whose put was issued
	queue   []chunk
	entries uint64 // ring entries handed to UCP

	land     uintptr // the peer's landing ring here
	next     uint64  // ring entries taken in
	landed   []landed
	consumed uint64 // entries copied out (credits owed to the peer)
	credited uint64 // consumed count last put to the peer
}

// staging is the transport's staging state; nil when off.
type staging struct {
	all        bool // every peer is staged
	copier     Copier
	chunk      uint64
	slots      int
	copies     uint64    // copies queued on copier
	landBase   uintptr   // every sender's landing ring, pinned
	creditBase []byte    // one credit word per peer, written by peers
	host       []uintptr // pinned allocations to free
	regs       []*local  // registrations of the above
	peers      []stager
}

func (s *staging) ringBytes() uint64 { return uint64(s.slots) * (s.chunk + headerSize) }

// deviceReach says whether UCX reaches device memory toward rank r without
// bouncing it through host memory; ok is false when UCP cannot tell.
func (t *Transport) deviceReach(r int) (direct, ok bool) {
	var types C.uint64_t
	if s := C.p2p_ucx_memory_types(t.lib.fn.contextQuery, t.context, &types); s != C.P2P_UCS_OK {
		return false, false
	}
	if types&(1<<C.P2P_UCS_MEMORY_TYPE_CUDA) == 0 {
		return false, true
	}
	if t.lib.fn.epQuery == nil {
		return false, false
	}
	var buf [512]C.char
	if s := C.p2p_ucx_ep_transports(t.lib.fn.epQuery, t.peers[r].ep, &buf[0], C.size_t(len(buf))); s != C.P2P_UCS_OK {
		return false, false
	}
	names := C.GoString(&buf[0])
	if names == "" {
		return false, false
	}
	for _, n := range strings.Split(strings.TrimSuffix(names, ","), ",") {
		for _, p := range []string{"rc", "dc", "cuda_ipc", "gdr"} {
			if strings.HasPrefix(n, p) {
				return true, true
			}
		}
	}
	return false, true
}

// openStaging decides which peers are staged, builds the rings and
// exchanges their keys. It is collective (one all-gather, progressed).
func (t *Transport) openStaging(bs bootstrap.Bootstrap, opts Options) error {
	mode := opts.Stage
	if mode == StageDefault {
		var err error
		if mode, err = ParseStageMode(os.Getenv(StageEnv)); err != nil {
			return err
		}
	}
	if mode == StageAlways && opts.Copier == nil {
		return status.Errorf(status.InvalidArgument, "UCX staging %s needs a Copier", mode)
	}
	want := make([]bool, len(t.peers))
	anyWanted := false
	for r := range t.peers {
		if r == t.rank || opts.Copier == nil || mode == StageNever {
			continue
		}
		direct, _ := t.deviceReach(r) // unknown counts as not direct
		want[r] = mode == StageAlways || !direct
		anyWanted = anyWanted || want[r]
	}
	var blob []byte
	if anyWanted {
		s := &staging{copier: opts.Copier, chunk: opts.ChunkBytes, slots: opts.RingChunks, peers: make([]stager, len(t.peers))}
		if s.chunk == 0 {
			s.chunk = DefaultChunkBytes
		}
		if s.slots <= 0 {
			s.slots = DefaultRingChunks
		}
		t.stage = s
		var err error
		if blob, err = t.buildRings(); err != nil {
			return err
		}
	}
	if t.stage != nil {
		t.stage.all = true
		for r := range want {
			t.stage.all = t.stage.all && (r == t.rank || want[r])
		}
	}
	var all [][]byte
	err := t.progressWhile(func() error {
		var err error
		all, err = bs.AllGather(blob)
		return err
	})
	if err != nil || t.stage == nil {
		return err
	}
	for r := range t.peers {
		if !want[r] || len(all[r]) == 0 {
			// A peer without rings takes device memory through UCX.
			t.stage.all = t.stage.all && r == t.rank
			continue
		}
		if err := t.stagePeer(r, all[r]); err != nil {
			return err
		}
	}
	return nil
}

// buildRings allocates and registers the landing rings, credit words and
// send slots, and returns the key blob the peers need: the landing key's
// length, the landing key, the credit key.
func (t *Transport) buildRings() ([]byte, error) {
	s := t.stage
	n := uint64(len(t.peers))
	pinned := func(size uint64) (uintptr, *local, error) {
		p, err := s.copier.AllocHost(size)
		if err != nil {
			return 0, nil, fmt.Errorf("UCX staging: pinned %d bytes: %w", size, err)
		}
		s.host = append(s.host, p)
		l, err := t.Register(p, size, transport.HostMemory)
		if err != nil {
			return 0, nil, err
		}
		s.regs = append(s.regs, l.(*local))
		return p, l.(*local), nil
	}
	land, landReg, err := pinned(n * s.ringBytes())
	if err != nil {
		return nil, err
	}
	// A fresh ring must not look like a landed entry.
	clear(unsafe.Slice((*byte)(addrPtr(land)), n*s.ringBytes()))
	s.landBase = land
	credit := C.calloc(C.size_t(n), 8)
	s.creditBase = unsafe.Slice((*byte)(credit), 8*n)
	creditReg, err := t.Register(uintptr(credit), 8*n, transport.HostMemory)
	if err != nil {
		return nil, err
	}
	s.regs = append(s.regs, creditReg.(*local))
	for r := range s.peers {
		if r == t.rank {
			continue
		}
		st := &s.peers[r]
		st.land = land + uintptr(uint64(r)*s.ringBytes())
		if st.send, _, err = pinned(uint64(s.slots) * s.chunk); err != nil {
			return nil, err
		}
		st.sendReq = make([]unsafe.Pointer, s.slots)
	}
	blob := binary.LittleEndian.AppendUint32(nil, uint32(len(landReg.key)))
	blob = append(blob, landReg.key...)
	return append(blob, creditReg.Key()...), nil
}

// stagePeer unpacks rank r's ring keys and turns staging toward it on.
func (t *Transport) stagePeer(r int, blob []byte) error {
	if len(blob) < 4 || uint64(len(blob)-4) < uint64(binary.LittleEndian.Uint32(blob)) {
		return status.Errorf(status.Mismatch, "UCX staging: rank %d sent a %d-byte ring key", r, len(blob))
	}
	n := binary.LittleEndian.Uint32(blob)
	ring, err := t.Remote(r, blob[4:4+n])
	if err != nil {
		return fmt.Errorf("UCX staging: %w", err)
	}
	credit, err := t.Remote(r, blob[4+n:])
	if err != nil {
		return fmt.Errorf("UCX staging: %w", err)
	}
	st := &t.stage.peers[r]
	st.ring, st.credit = ring.(*remote), credit.(*remote)
	if st.ring.size != uint64(len(t.peers))*t.stage.ringBytes() {
		return status.Errorf(status.Mismatch, "UCX staging: rank %d's rings are %d bytes, want %d (same chunk size and count on every rank)",
			r, st.ring.size, uint64(len(t.peers))*t.stage.ringBytes())
	}
	st.on = true
	return nil
}

// staged reports whether a put between l (may be nil) and r goes through
// host memory.
func (t *Transport) staged(r *remote, l *local) bool {
	return t.stage != nil && t.stage.peers[r.peer].on &&
		(r.mem == transport.DeviceMemory || (l != nil && l.mem == transport.DeviceMemory))
}

// stagePut queues a staged put in chunks and starts what it can.
func (t *Transport) stagePut(r *remote, dstOff uint64, l *local, srcOff, size uint64) error {
	s := t.stage
	st := &s.peers[r.peer]
	for off := uint64(0); off < size; off += s.chunk {
		c := chunk{
			src:    l.addr + uintptr(srcOff+off),
			device: l.mem == transport.DeviceMemory,
			dst:    r.base + dstOff + off,
			size:   min(s.chunk, size-off),
		}
		if t.passMemh && !c.device {
			c.srcMemh = l.memh
		}
		if r.mem != transport.DeviceMemory {
			c.rkey = r.rkey
		}
		st.queue = append(st.queue, c)
	}
	return t.pump(r.peer)
}

// stageSignal reports whether a Signal to rank r must travel through the
// ring: staged work toward r is queued or not yet credited.
func (t *Transport) stageSignal(r int) bool {
	if t.stage == nil || !t.stage.peers[r].on {
		return false
	}
	st := &t.stage.peers[r]
	return len(st.queue) > 0 || st.entries > t.creditOf(r)
}

// creditOf is how many ring entries rank r has copied out.
func (t *Transport) creditOf(r int) uint64 {
	return atomic.LoadUint64((*uint64)(unsafe.Pointer(&t.stage.creditBase[8*r])))
}

// pump starts staged work toward rank r in order, as far as send slots,
// copies and landing credits allow, without blocking.
func (t *Transport) pump(r int) error {
	s := t.stage
	st := &s.peers[r]
	if len(st.queue) == 0 {
		return nil
	}
	// Copies first, as many as send slots allow, to overlap with the puts.
	for i := range st.queue {
		c := &st.queue[i]
		if !c.device || c.ticket != 0 {
			continue
		}
		slot := int(st.sendN % uint64(s.slots))
		if st.sendN-st.sendPut >= uint64(s.slots) || !t.sendSlotFree(st, slot) {
			break
		}
		addr := st.send + uintptr(uint64(slot)*s.chunk)
		if err := s.copier.Copy(addr, c.src, c.size); err != nil {
			return t.stageFail(r, "staging copy to host", err)
		}
		s.copies++
		st.sendN++
		c.ticket, c.sendSlot = s.copies, slot
	}
	done, err := s.copier.Completed()
	if err != nil {
		return t.stageFail(r, "staging copy to host", err)
	}
	n := 0
	for ; n < len(st.queue); n++ {
		c := &st.queue[n]
		if c.device && (c.ticket == 0 || c.ticket > done) {
			break
		}
		ring := c.signal || c.rkey == nil
		if ring && st.entries-t.creditOf(r) >= uint64(s.slots) {
			break
		}
		if err := t.issue(r, c, ring); err != nil {
			if len(st.queue) > n { // a failure toward r already dropped the queue
				st.queue = st.queue[n+1:]
			}
			return err
		}
	}
	st.queue = st.queue[n:]
	return nil
}

// sendSlotFree reports whether slot's last put completed, releasing it.
func (t *Transport) sendSlotFree(st *stager, slot int) bool {
	req := st.sendReq[slot]
	if req == nil {
		return true
	}
	if C.p2p_ucx_status_p(t.lib.fn.requestCheckStatus, req) == C.P2P_UCS_INPROGRESS {
		return false
	}
	C.p2p_ucx_call_p(t.lib.fn.requestFree, req)
	st.sendReq[slot] = nil
	return true
}

// issue hands one chunk to UCP: its data, and for a ring entry the header
// and, after a fence, the sequence word.
func (t *Transport) issue(r int, c *chunk, ring bool) error {
	s := t.stage
	st := &s.peers[r]
	ep := t.peers[r].ep
	src, memh := c.src, c.srcMemh
	if c.device {
		src, memh = st.send+uintptr(uint64(c.sendSlot)*s.chunk), nil
		st.sendPut++
	}
	slot := st.entries % uint64(s.slots)
	slotBase := st.ring.base + uint64(t.rank)*s.ringBytes()
	if !c.signal {
		dst, rkey := c.dst, c.rkey
		if ring {
			dst, rkey = slotBase+slot*s.chunk, st.ring.rkey
		}
		var status C.int
		req := C.p2p_ucx_put(t.lib.fn.putNbx, ep, C.uint64_t(src), C.size_t(c.size), C.uint64_t(dst), rkey, memh,
			C.P2P_UCS_MEMORY_TYPE_HOST, &status)
		if c.device && status == C.P2P_UCS_INPROGRESS {
			st.sendReq[c.sendSlot] = req
		} else if err := t.started(r, "staged put", op{req: req}, status); err != nil {
			return err
		}
		if !ring {
			return nil
		}
	}
	kind, size := uint64(entryData), c.size
	if c.signal {
		kind = entrySignal
	}
	header := C.malloc(headerSize)
	h := unsafe.Slice((*byte)(header), headerSize)
	binary.LittleEndian.PutUint64(h[0:], st.entries+1)
	binary.LittleEndian.PutUint64(h[8:], c.dst)
	binary.LittleEndian.PutUint64(h[16:], size)
	binary.LittleEndian.PutUint64(h[24:], kind)
	at := slotBase + uint64(s.slots)*s.chunk + slot*headerSize
	if err := t.putC(r, "staged header", header, at+8, 24, st.ring.rkey, false); err != nil {
		return err
	}
	if s := C.p2p_ucx_status_p(t.lib.fn.workerFence, t.worker); s != C.P2P_UCS_OK {
		err := t.peerError(r, "staged fence", s)
		t.fail(r, err)
		return err
	}
	seq := C.malloc(8)
	*(*uint64)(seq) = st.entries + 1
	if err := t.putC(r, "staged sequence", seq, at, 8, st.ring.rkey, true); err != nil {
		return err
	}
	st.entries++
	return nil
}

// putC puts n bytes of C memory to dst and frees mem once UCP is done with
// it: all of mem when whole, else the header's body after its sequence
// word (which travels separately, from memory of its own).
func (t *Transport) putC(r int, name string, mem unsafe.Pointer, dst uint64, n int, rkey unsafe.Pointer, whole bool) error {
	src := mem
	if !whole {
		src = unsafe.Add(mem, 8)
	}
	var s C.int
	req := C.p2p_ucx_put(t.lib.fn.putNbx, t.peers[r].ep, C.uint64_t(uintptr(src)), C.size_t(n), C.uint64_t(dst), rkey, nil,
		C.P2P_UCS_MEMORY_TYPE_HOST, &s)
	if s != C.P2P_UCS_INPROGRESS {
		C.free(mem)
	}
	return t.started(r, name, op{req, mem}, s)
}

// serviceRings is the receiver's side: it takes in landed entries, queues
// their copies into device memory, applies signals and returns credits
// once copies completed. It never blocks.
func (t *Transport) serviceRings() error {
	s := t.stage
	if s == nil {
		return nil
	}
	for r := range s.peers {
		st := &s.peers[r]
		if st.land == 0 || t.peers[r].err != nil {
			continue
		}
		if err := t.takeIn(r, st); err != nil {
			return err
		}
	}
	done, err := s.copier.Completed()
	if err != nil {
		return status.Errorf(status.Internal, "UCX staging: copy completion: %v", err)
	}
	for r := range s.peers {
		st := &s.peers[r]
		k := 0
		for ; k < len(st.landed) && st.landed[k].ticket <= done; k++ {
			if w := st.landed[k].word; w != 0 {
				atomic.StoreUint64((*uint64)(addrPtr(w)), st.landed[k].total)
			}
			st.consumed++
		}
		st.landed = st.landed[k:]
		if st.consumed > st.credited && t.peers[r].ep != nil && t.peers[r].err == nil {
			word := C.malloc(8)
			*(*uint64)(word) = st.consumed
			cr := st.credit
			if cr == nil {
				C.free(word)
				continue
			}
			if err := t.putC(r, "staging credit", word, cr.base+uint64(8*t.rank), 8, cr.rkey, true); err != nil {
				continue // the peer failed; its next operation says so
			}
			st.credited = st.consumed
		}
	}
	return nil
}

// takeIn takes in rank r's landed entries, in order.
func (t *Transport) takeIn(r int, st *stager) error {
	s := t.stage
	for {
		slot := st.next % uint64(s.slots)
		h := st.land + uintptr(uint64(s.slots)*s.chunk+slot*headerSize)
		if atomic.LoadUint64((*uint64)(addrPtr(h))) != st.next+1 {
			return nil
		}
		hdr := unsafe.Slice((*byte)(addrPtr(h)), headerSize)
		addr := binary.LittleEndian.Uint64(hdr[8:])
		size := binary.LittleEndian.Uint64(hdr[16:])
		switch binary.LittleEndian.Uint64(hdr[24:]) {
		case entryData:
			// The peer names the destination; write only into memory
			// this rank registered, whatever arrives.
			if size > s.chunk || !t.owns(addr, size) {
				return t.badEntry(r, fmt.Sprintf("data of %d bytes for %#x, outside every registered range", size, addr))
			}
			if err := s.copier.Copy(uintptr(addr), st.land+uintptr(slot*s.chunk), size); err != nil {
				return t.stageFail(r, "staging copy to device", err)
			}
			s.copies++
			st.landed = append(st.landed, landed{ticket: s.copies})
		case entrySignal:
			if addr%8 != 0 || !t.owns(addr, 8) {
				return t.badEntry(r, fmt.Sprintf("signal word %#x outside every registered range", addr))
			}
			st.landed = append(st.landed, landed{ticket: s.copies, word: uintptr(addr), total: size})
		default:
			return t.badEntry(r, "unknown entry kind")
		}
		st.next++
	}
}

// owns reports whether [addr, addr+n) lies in a range this rank registered.
func (t *Transport) owns(addr, n uint64) bool {
	for l := range t.locals {
		if !l.closed && addr >= uint64(l.addr) && within(addr-uint64(l.addr), n, l.size) {
			return true
		}
	}
	return false
}

func (t *Transport) badEntry(r int, what string) error {
	err := status.Errorf(status.Internal, "UCX staging: rank %d sent a bad ring entry: %s", r, what)
	t.fail(r, err)
	return err
}

func (t *Transport) stageFail(r int, op string, cause error) error {
	err := status.Errorf(status.Internal, "UCX %s for rank %d: %v", op, r, cause)
	t.fail(r, err)
	return err
}

// drainStaged hands every queued chunk toward rank r to UCP; the caller
// then flushes the endpoint and awaits the peer's credit.
func (t *Transport) drainStaged(r int, deadline time.Time) error {
	st := &t.stage.peers[r]
	var idle idler
	for len(st.queue) > 0 {
		if err := t.pump(r); err != nil {
			return err
		}
		if err := t.stageWait(r, "staged put", deadline, &idle); err != nil {
			return err
		}
	}
	return nil
}

// awaitCredit waits until rank r copied out every ring entry sent to it,
// and every send slot's put completed.
func (t *Transport) awaitCredit(r int, deadline time.Time) error {
	st := &t.stage.peers[r]
	var idle idler
	for t.creditOf(r) < st.entries {
		if err := t.stageWait(r, "staged flush (copy into device memory)", deadline, &idle); err != nil {
			return err
		}
	}
	for slot := range st.sendReq {
		for !t.sendSlotFree(st, slot) {
			if err := t.stageWait(r, "staged flush (send slot)", deadline, &idle); err != nil {
				return err
			}
		}
	}
	return nil
}

// stageWait is one step of a staged wait: progress, serve this rank's own
// rings (the peer may be waiting on them), and check the peer and time.
func (t *Transport) stageWait(r int, op string, deadline time.Time, idle *idler) error {
	idle.after(C.p2p_ucx_progress(t.lib.fn.workerProgress, t.worker))
	if err := t.serviceRings(); err != nil {
		return err
	}
	if err := t.reap(r); err != nil {
		return err
	}
	if err := t.check(r, op); err != nil {
		return err
	}
	if time.Now().After(deadline) {
		err := status.Errorf(status.Timeout, "UCX %s to rank %d did not complete within %v", op, r, t.timeout)
		t.fail(r, err)
		return err
	}
	return nil
}

// dropStaged forgets rank r's staged work after a failure, cancelling the
// send slots' puts.
func (t *Transport) dropStaged(r int) {
	if t.stage == nil {
		return
	}
	st := &t.stage.peers[r]
	st.queue = nil
	for i, req := range st.sendReq {
		if req != nil {
			t.abandon(req)
			st.sendReq[i] = nil
		}
	}
	st.landed = nil
}

// closeStaging frees the rings after the endpoints are gone.
func (t *Transport) closeStaging() {
	s := t.stage
	if s == nil {
		return
	}
	for _, l := range s.regs {
		l.unmap()
	}
	for _, p := range s.host {
		s.copier.FreeHost(p)
	}
	if len(s.creditBase) > 0 {
		C.free(unsafe.Pointer(&s.creditBase[0]))
	}
	t.stage = nil
}

// addrPtr turns an address of memory outside the Go heap (pinned rings,
// registered ranges) into a pointer; the garbage collector never owns it.
func addrPtr(p uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&p)) }
