package ucx

/*
#include <stdlib.h>
#include "calls.h"
*/
import "C"

import (
	"encoding/binary"
	"fmt"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/procenv"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/trace"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// Staged puts. Where UCX reaches device memory only through cuda_copy
// bounce buffers (tcp), a put whose source or destination is device memory
// travels through pinned host memory instead, in chunks:
//
//	sender:   device source --Copier--> send slot (pinned, per peer), after
//	          the slot's header
//	          header and data --one ucp_put--> receiver's landing slot,
//	          fence, sequence word put
//	receiver: Progress sees the sequence word, queues the copy of the
//	          landing slot into the device destination and, for a signal,
//	          the store of its total behind it on the copier's stream; once
//	          the copy completed it returns the slot as a credit: its
//	          consumed count, in the next entry it sends the peer, else
//	          as a put
//
// A put with a signal behind it is one ring entry: the signal rides in the
// header of the put's last chunk. A device source with a host destination
// skips the landing ring. A Signal while staged work toward the peer is
// queued or not yet credited travels as a ring entry too, so the receiver
// applies it only after every earlier chunk reached device memory. The
// receiver's side runs in Progress and in every wait: its proxy must keep
// calling Progress, from the thread that holds the CUDA context.
//
// A ring entry of at most amMaxBytes whose data is in its send slot (or
// that has none) travels instead as one active message to a handler of the
// receiver's (calls.h), which writes it into the landing slot, sequence
// word last: one send instead of two puts around a fence, and no put
// acknowledgement back. An entry behind a put to the peer outside the ring
// (a device source for a host destination, or any unstaged put) still
// takes the puts, whose fence orders it behind that put.
//
// Ordering relies on what UCP gives over one endpoint: a fence (weak is
// enough) makes every put issued before it visible at the target before
// any put issued after it. Nothing is assumed about the order of bytes
// within one put, which is why the sequence word travels on its own.

// StageEnv names the staging knob: auto, always or never.
const StageEnv = "P2PCOMM_UCX_STAGE"

// StageMode says when device memory is staged through pinned host memory.
type StageMode int

const (
	// StageDefault is StageEnv's value, else StageAuto.
	StageDefault StageMode = iota
	// StageAuto stages between two ranks when either one's context reaches
	// no device memory or its endpoint has no transport that reaches it
	// directly (rc, dc, cuda_ipc, gdr_copy).
	StageAuto
	// StageAlways stages toward every peer that can stage.
	StageAlways
	// StageNever stages toward no peer, and no peer stages toward it.
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

// Send and landing slots are a header, then up to a chunk of data, so that
// header and data travel in one put. The sequence word is put last, after
// a fence, so a receiver that sees it sees the rest.
//
//	0  sequence  uint64 (entry number, from 1)
//	8  address   uint64 (receiver's device destination; data entries)
//	16 size      uint64 (bytes of data)
//	24 kind      uint64 (entryData | entrySignal)
//	32 word      uint64 (the signal's word; signal entries)
//	40 total     uint64 (the signal's new total)
//	48 landing   uint64 (the landing slot's address: an active message's header)
//	56 credit    uint64 (the sender's count of the receiver's entries it copied out)
//
// The header is 64 bytes, which keeps the data aligned. Its credit spares a
// peer that sends entries back the credit put of its own (sendCredits): a
// put over tcp holds both proxies' threads for several microseconds, on
// the path of a ping-pong's reply.
const (
	headerSize   = 64
	entryData    = 1
	entrySignal  = 2
	amMaxBytes   = 8 << 10 // header and data of an entry sent as an active message
	amHeaderWord = 6       // the header word that holds the landing address
	creditWord   = 7       // the header word that carries a credit
)

// chunk is one piece of staged work toward a peer, kept in order: data, a
// signal, or data with a signal behind it.
type chunk struct {
	src     uintptr // source address (device, or registered host)
	srcMemh unsafe.Pointer
	device  bool   // src is device memory: copy it to a send slot first
	inline  []byte // the data itself (an inline put): into the send slot as it is claimed
	dst     uint64
	rkey    unsafe.Pointer // dst's key when it is host memory, else nil
	size    uint64         // bytes of data, 0 for a bare signal
	signal  bool           // store total at word once the data landed
	word    uint64
	total   uint64
	ticket  uint64 // the copy into the send slot
	claimed bool   // holds send slot sendSlot
	slot    int
	shares  *shares // the stripes carry the data (nil: the entry does)
}

// ring reports whether c travels as a landing ring entry.
func (c *chunk) ring() bool { return c.signal || c.rkey == nil }

// inSlot reports whether c's data travels from its send slot.
func (c *chunk) inSlot() bool { return c.device || c.inline != nil }

// landed is a ring entry taken in by the receiver, waiting for its copy.
type landed struct {
	ticket uint64
	word   uintptr // a signal the transport stores itself, else 0
	total  uint64
}

// stager is this rank's staging state toward and from one peer.
type stager struct {
	on      bool    // device puts to the peer are staged
	ring    *remote // the peer's landing ring for this rank
	ringKey []byte  // its key as packed, for the stripes' endpoints
	// striping: every stripe reaches the peer's ring (see stripeReady)
	striping bool
	credit   *remote // the peer's credit words; this rank's at rank*8

	send    uintptr             // send slots toward the peer, pinned
	sendReg *local              // their registration
	sendReq [][2]unsafe.Pointer // each slot's puts still reading it
	sendN   uint64              // send slots claimed so far
	sendPut uint64              // of those, slots whose chunk was issued
	queue   []chunk
	entries uint64 // ring entries handed to UCP
	am      bool   // the peer lands entries sent as active messages
	amSent  uint64 // of the entries, those sent so
	direct  bool   // a put outside the ring went out since the last fenced entry

	land     uintptr // the peer's landing ring here
	next     uint64  // ring entries taken in
	landed   []landed
	consumed uint64    // entries copied out (credits owed to the peer)
	credited uint64    // consumed count last sent to the peer (put, or in an entry)
	owed     time.Time // when consumed last passed credited
	// carried: the peer's credit for this rank's entries, from the peer's
	// ring entries. A word of its own beside the one the peer's credit puts
	// write, which UCP may deliver after a later entry: the credit is the
	// larger of the two, and neither goes back.
	carried    uint64
	creditPuts uint64 // credits sent as puts of their own
	striped    uint64 // chunks whose data the stripes carried
}

// staging is the transport's staging state; nil when off.
type staging struct {
	all        bool // every peer is staged
	copier     Copier
	chunk      uint64
	slots      int
	copies     uint64         // copies queued on copier
	traced     uint64         // the completed count last traced
	landBase   uintptr        // every sender's landing ring, pinned
	landing    *C.p2p_landing // the active message handler's bounds (C memory)
	creditBase []byte         // one credit word per peer, written by peers
	host       []uintptr      // pinned allocations to free
	regs       []*local       // registrations of the above
	peers      []stager
}

// creditDelay is how long Progress holds back a credit for less than half
// the ring: a credit put is a tcp send on the proxy's thread, and sent the
// moment a copy completes it lands in front of the waiting kernel's next
// trigger (its reply, in a ping-pong), whose entry can carry the credit
// instead. The peer's flush waits up to this much longer for its last
// credit; this rank's own waits (a flush, which may be its last progress
// for a while) send what it owes at once. A variable for tests.
var creditDelay = 20 * time.Microsecond

func (s *staging) stride() uint64    { return headerSize + s.chunk }
func (s *staging) ringBytes() uint64 { return uint64(s.slots) * s.stride() }

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

// reachHook, when set (tests), replaces deviceReach: which peers UCX
// reaches in device memory, as this rank sees them.
var reachHook func(rank, peer int) (direct, ok bool)

// Each rank's view of staging toward a peer, as the ranks exchange it.
const (
	stageCannot = iota // no Copier, or staging never
	stageCan           // UCX reaches the peer's device memory itself
	stageWants         // it does not, or staging always
)

// openStaging decides which peers are staged, builds the rings and
// exchanges their keys. It is collective (two all-gathers, progressed).
func (t *Transport) openStaging(bs bootstrap.Bootstrap, opts Options) error {
	mode := opts.Stage
	if mode == StageDefault {
		var err error
		if mode, err = ParseStageMode(procenv.Get(StageEnv)); err != nil {
			return err
		}
	}
	if mode == StageAlways && opts.Copier == nil {
		return status.Errorf(status.InvalidArgument, "UCX staging %s needs a Copier", mode)
	}
	view := make([]byte, len(t.peers))
	for r := range t.peers {
		if r == t.rank || opts.Copier == nil || mode == StageNever {
			continue
		}
		var direct bool // unknown counts as not direct
		if reachHook != nil {
			direct, _ = reachHook(t.rank, r)
		} else {
			direct, _ = t.deviceReach(r)
		}
		view[r] = stageCan
		if mode == StageAlways || !direct {
			view[r] = stageWants
		}
	}
	// A pair stages when either side wants it and both can: a rank that
	// sees a device-capable lane toward a peer (an RDMA fabric's, learnt
	// late) while the peer sees none back must still serve the rings the
	// peer writes into, and credit them.
	views, err := t.allGather(bs, view)
	if err != nil {
		return err
	}
	want := make([]bool, len(t.peers))
	anyWanted := false
	for r := range t.peers {
		if len(views[r]) != len(t.peers) {
			return status.Errorf(status.Mismatch, "UCX staging: rank %d sent views of %d ranks, this job has %d",
				r, len(views[r]), len(t.peers))
		}
		if r == t.rank {
			continue
		}
		theirs := views[r][t.rank]
		want[r] = min(view[r], theirs) >= stageCan && max(view[r], theirs) == stageWants
		anyWanted = anyWanted || want[r]
	}
	var blob []byte
	var buildErr error
	if anyWanted {
		s := &staging{copier: opts.Copier, chunk: opts.ChunkBytes, slots: opts.RingChunks, peers: make([]stager, len(t.peers))}
		if s.chunk == 0 {
			s.chunk = DefaultChunkBytes
		}
		if s.slots <= 0 {
			s.slots = DefaultRingChunks
		}
		t.stage = s
		if blob, buildErr = t.buildRings(); buildErr != nil {
			// Still take part in the exchange below: the peers learn of
			// it there instead of waiting for keys that never come.
			blob = []byte{blobFailed}
		}
	}
	if t.stage != nil {
		t.stage.all = true
		for r := range want {
			t.stage.all = t.stage.all && (r == t.rank || want[r])
		}
	}
	all, err := t.allGather(bs, blob)
	if buildErr != nil {
		return buildErr
	}
	if err != nil {
		return err
	}
	for r := range all {
		// Every rank stops here, paired with the failed one or not.
		if len(all[r]) == 1 && all[r][0] == blobFailed {
			return status.Errorf(status.State, "UCX staging: rank %d could not build its landing rings (its own error says why)", r)
		}
	}
	if stagePeerHook != nil {
		if err := stagePeerHook(t.rank); err != nil {
			return err
		}
	}
	for r := range t.peers {
		if t.stage == nil {
			break
		}
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

// stagePeerHook, when set (tests), fails a rank's taking of ring keys.
var stagePeerHook func(rank int) error

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
	if credit == nil {
		return nil, status.Errorf(status.Capacity, "UCX staging: %d bytes of credit words", 8*n)
	}
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
		if st.send, st.sendReg, err = pinned(s.ringBytes()); err != nil {
			return nil, err
		}
		st.sendReq = make([][2]unsafe.Pointer, s.slots)
	}
	// The handler is in place before the keys go out, so before any peer
	// can send it an entry.
	var flags byte
	s.landing = (*C.p2p_landing)(C.calloc(1, C.size_t(unsafe.Sizeof(C.p2p_landing{}))))
	if s.landing == nil {
		return nil, status.Errorf(status.Capacity, "UCX staging: the landing handler's state")
	}
	s.landing.base, s.landing.size = C.uint64_t(land), C.uint64_t(n*s.ringBytes())
	if st := C.p2p_ucx_set_am_land(t.lib.fn.workerSetAMRecvHandler, t.worker, s.landing); st == C.P2P_UCS_OK {
		flags |= blobAM
	}
	blob := []byte{flags}
	blob = binary.LittleEndian.AppendUint32(blob, uint32(len(landReg.key)))
	blob = append(blob, landReg.key...)
	return append(blob, creditReg.Key()...), nil
}

// blobAM, in the first byte of a rank's ring keys, says it lands entries
// sent as active messages.
const blobAM = 1

// blobFailed, as a rank's whole ring keys, says it could not build its rings.
const blobFailed = 0xff

// stagePeer unpacks rank r's ring keys and turns staging toward it on.
func (t *Transport) stagePeer(r int, blob []byte) error {
	if len(blob) < 5 || uint64(len(blob)-5) < uint64(binary.LittleEndian.Uint32(blob[1:])) {
		return status.Errorf(status.Mismatch, "UCX staging: rank %d sent a %d-byte ring key", r, len(blob))
	}
	am := blob[0]&blobAM != 0
	blob = blob[1:]
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
	st.ring, st.credit, st.am = ring.(*remote), credit.(*remote), am
	st.ringKey = append([]byte(nil), blob[4:4+n]...)
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

// queueSignal queues a staged signal storing total at word: in the header
// of the last queued chunk when that is a data entry not yet sent, else as
// an entry of its own.
func (t *Transport) queueSignal(r int, word, total uint64) error {
	st := &t.stage.peers[r]
	if n := len(st.queue); n > 0 && !st.queue[n-1].signal && st.queue[n-1].rkey == nil {
		c := &st.queue[n-1]
		c.signal, c.word, c.total = true, word, total
	} else {
		st.queue = append(st.queue, chunk{signal: true, word: word, total: total})
	}
	return t.pump(r)
}

// creditOf is how many ring entries rank r has copied out.
func (t *Transport) creditOf(r int) uint64 {
	return max(atomic.LoadUint64((*uint64)(unsafe.Pointer(&t.stage.creditBase[8*r]))), t.stage.peers[r].carried)
}

// pump starts staged work toward rank r in order, as far as send slots,
// copies and landing credits allow, without blocking.
func (t *Transport) pump(r int) error {
	s := t.stage
	st := &s.peers[r]
	if len(st.queue) == 0 {
		return nil
	}
	// Slots (and copies into them) first, as many as there are, to overlap
	// with the puts.
	for i := range st.queue {
		c := &st.queue[i]
		if c.claimed {
			continue
		}
		slot := int(st.sendN % uint64(s.slots))
		if st.sendN-st.sendPut >= uint64(s.slots) || !t.sendSlotFree(st, slot) {
			break
		}
		if c.device {
			if err := s.copier.Copy(t.sendSlot(st, slot)+headerSize, c.src, c.size); err != nil {
				return t.stageFail(r, "staging copy to host", err)
			}
			s.copies++
			c.ticket = s.copies
		} else if c.inline != nil {
			copy(unsafe.Slice((*byte)(addrPtr(t.sendSlot(st, slot)+headerSize)), len(c.inline)), c.inline)
		}
		st.sendN++
		c.claimed, c.slot = true, slot
	}
	done, err := s.copier.Completed()
	if err != nil {
		return t.stageFail(r, "staging copy to host", err)
	}
	if len(t.stripes) > 0 {
		t.startStriped(r, done)
	}
	n := 0
	for ; n < len(st.queue); n++ {
		c := &st.queue[n]
		if !c.claimed || (c.device && c.ticket > done) {
			break
		}
		if c.ring() && st.entries-t.creditOf(r) >= uint64(s.slots) {
			break
		}
		if c.shares != nil {
			if c.shares.left.Load() > 0 {
				break
			}
			if f := c.shares.failed.Load(); f != 0 {
				st.queue = st.queue[n+1:]
				err := t.peerError(r, "staged put (a stripe's share)", C.int(f))
				t.fail(r, err)
				return err
			}
		} else if t.striped(r, c) {
			break // its landing slot is not free yet
		}
		if err := t.issue(r, c); err != nil {
			if len(st.queue) > n { // a failure toward r already dropped the queue
				st.queue = st.queue[n+1:]
			}
			return err
		}
	}
	st.queue = st.queue[n:]
	return nil
}

// startStriped hands the stripes the data of the queued chunks they carry
// whose copies completed (done) and whose landing slots are free, ahead of
// the entries queued in front of them: their headers still go in order.
func (t *Transport) startStriped(r int, done uint64) {
	s := t.stage
	st := &s.peers[r]
	credit := t.creditOf(r)
	entry := st.entries // the entry number of the next ring chunk
	for i := range st.queue {
		c := &st.queue[i]
		if !c.claimed || (c.device && c.ticket > done) || (c.ring() && entry-credit >= uint64(s.slots)) {
			return
		}
		if !c.ring() {
			continue
		}
		if c.shares == nil && t.striped(r, c) {
			t.startShares(r, c, t.landingSlot(st, entry))
		}
		entry++
	}
}

// landingSlot is the address, at st's peer, of the landing slot of this
// rank's ring entry e.
func (t *Transport) landingSlot(st *stager, e uint64) uint64 {
	s := t.stage
	return st.ring.base + uint64(t.rank)*s.ringBytes() + (e%uint64(s.slots))*s.stride()
}

// putDirect notes a put to rank r outside the ring: the ring entries behind
// it take the fenced puts until one has gone out, since an active message
// is not ordered behind a put.
func (t *Transport) putDirect(r int) {
	if t.stage != nil && t.stage.peers[r].on {
		t.stage.peers[r].direct = true
	}
}

// sendMemh is the send slots' registration for UCP, which then looks
// nothing up per put; nil where UCP takes no handles.
func (t *Transport) sendMemh(st *stager) unsafe.Pointer {
	if !t.passMemh || st.sendReg == nil {
		return nil
	}
	return st.sendReg.memh
}

// sendSlot is the address of send slot i toward st's peer.
func (t *Transport) sendSlot(st *stager, i int) uintptr {
	return st.send + uintptr(uint64(i)*t.stage.stride())
}

// sendSlotFree reports whether slot's last puts completed, releasing them.
func (t *Transport) sendSlotFree(st *stager, slot int) bool {
	for k, req := range st.sendReq[slot] {
		if req == nil {
			continue
		}
		if C.p2p_ucx_status_p(t.lib.fn.requestCheckStatus, req) == C.P2P_UCS_INPROGRESS {
			return false
		}
		C.p2p_ucx_call_p(t.lib.fn.requestFree, req)
		st.sendReq[slot][k] = nil
	}
	return true
}

// sendSlotsBusy frees the requests of rank r's send slots whose puts
// completed and reports whether any is still under way.
func (t *Transport) sendSlotsBusy(r int) bool {
	if t.stage == nil {
		return false
	}
	st := &t.stage.peers[r]
	busy := false
	for slot := range st.sendReq {
		busy = !t.sendSlotFree(st, slot) || busy
	}
	return busy
}

// issue hands one chunk to UCP. Data for a host destination is one put.
// A ring entry is the header with the data after it in one put (data from
// a host source goes in a put of its own first), a fence, and the
// sequence word.
func (t *Transport) issue(r int, c *chunk) error {
	s := t.stage
	st := &s.peers[r]
	st.sendPut++
	send := t.sendSlot(st, c.slot)
	reqs := &st.sendReq[c.slot]
	if !c.ring() {
		src, memh := c.src, c.srcMemh
		if c.inSlot() {
			src, memh = send+headerSize, t.sendMemh(st)
		}
		t.putDirect(r)
		return t.putSlot(r, "staged put", src, c.size, c.dst, c.rkey, memh, &reqs[0])
	}
	landing := t.landingSlot(st, st.entries)
	h := unsafe.Slice((*uint64)(addrPtr(send)), headerSize/8)
	h[0], h[1], h[2], h[3], h[4], h[5] = st.entries+1, c.dst, c.size, 0, c.word, c.total
	h[creditWord] = st.consumed
	st.credited = max(st.credited, st.consumed)
	if c.size > 0 {
		h[3] |= entryData
	}
	if c.signal {
		h[3] |= entrySignal
	}
	// The data travels in the entry unless the stripes put it in the
	// landing slot already.
	data := c.size
	if c.shares != nil {
		data = 0
	}
	if st.am && !st.direct && (data == 0 || c.inSlot()) && headerSize+data <= amMaxBytes {
		// The message's header, the landing address, lives in the slot too.
		h[amHeaderWord] = landing
		var s C.int
		reqs[0] = C.p2p_ucx_am_land_send(t.lib.fn.amSendNbx, t.peers[r].ep, C.uint64_t(send+8*amHeaderWord),
			C.uint64_t(send), C.size_t(headerSize+data), t.sendMemh(st), &s)
		if s != C.P2P_UCS_OK && s != C.P2P_UCS_INPROGRESS {
			err := t.peerError(r, "staged entry", s)
			t.fail(r, err)
			return err
		}
		st.entries++
		st.amSent++
		return nil
	}
	st.direct = false
	body := uint64(headerSize - 8)
	if data > 0 && c.inSlot() {
		body += data
	} else if data > 0 {
		var status C.int
		req := C.p2p_ucx_put(t.lib.fn.putNbx, t.peers[r].ep, C.uint64_t(c.src), C.size_t(c.size), C.uint64_t(landing+headerSize),
			st.ring.rkey, c.srcMemh, C.P2P_UCS_MEMORY_TYPE_HOST, &status)
		if err := t.started(r, "staged put", op{req: req}, status); err != nil {
			return err
		}
	}
	if err := t.putSlot(r, "staged put", send+8, body, landing+8, st.ring.rkey, t.sendMemh(st), &reqs[0]); err != nil {
		return err
	}
	if s := C.p2p_ucx_status_p(t.lib.fn.workerFence, t.worker); s != C.P2P_UCS_OK {
		err := t.peerError(r, "staged fence", s)
		t.fail(r, err)
		return err
	}
	if err := t.putSlot(r, "staged sequence", send, 8, landing, st.ring.rkey, t.sendMemh(st), &reqs[1]); err != nil {
		return err
	}
	st.entries++
	return nil
}

// putSlot starts a put of n bytes from src, memory that lives until *req
// (the put's request, nil once it completed) says UCP is done with it.
func (t *Transport) putSlot(r int, name string, src uintptr, n, dst uint64, rkey, memh unsafe.Pointer, req *unsafe.Pointer) error {
	var s C.int
	*req = C.p2p_ucx_put(t.lib.fn.putNbx, t.peers[r].ep, C.uint64_t(src), C.size_t(n), C.uint64_t(dst), rkey, memh,
		C.P2P_UCS_MEMORY_TYPE_HOST, &s)
	if s == C.P2P_UCS_OK || s == C.P2P_UCS_INPROGRESS {
		return nil
	}
	err := t.peerError(r, name, s)
	t.fail(r, err)
	return err
}

// putC puts n bytes of C memory to dst and frees mem once UCP is done with
// it.
func (t *Transport) putC(r int, name string, mem unsafe.Pointer, dst uint64, n int, rkey unsafe.Pointer) error {
	var s C.int
	req := C.p2p_ucx_put(t.lib.fn.putNbx, t.peers[r].ep, C.uint64_t(uintptr(mem)), C.size_t(n), C.uint64_t(dst), rkey, nil,
		C.P2P_UCS_MEMORY_TYPE_HOST, &s)
	if s != C.P2P_UCS_INPROGRESS {
		C.free(mem)
	}
	return t.started(r, name, op{req, mem}, s)
}

// serviceRings is the receiver's side: landRings, then sendCredits (with
// hold, credits for less than half the ring only after creditDelay; it then
// reports whether one is still held). It never blocks.
func (t *Transport) serviceRings(hold bool) (bool, error) {
	if err := t.landRings(); err != nil || t.stage == nil {
		return false, err
	}
	return t.sendCredits(hold), nil
}

// landRings takes in landed entries, queues their copies into device memory
// (and their signals' stores behind them), stores signals the copier
// cannot, and counts the entries whose copies completed as owed credits.
func (t *Transport) landRings() error {
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
	if trace.On() && done != s.traced {
		s.traced = done
		trace.Mark("staged copies completed")
	}
	for r := range s.peers {
		st := &s.peers[r]
		k := 0
		for ; k < len(st.landed) && st.landed[k].ticket <= done; k++ {
			if w := st.landed[k].word; w != 0 {
				atomic.StoreUint64((*uint64)(addrPtr(w)), st.landed[k].total)
			}
			if st.consumed == st.credited {
				st.owed = time.Time{}
			}
			st.consumed++
		}
		st.landed = st.landed[k:]
	}
	return nil
}

// sendCredits puts each peer the count of its entries copied out, where it
// grew; with hold, a count less than half the ring ahead of the last one
// sent waits until it is creditDelay old; it reports whether one still
// waits. UCX calls only, so Close may call it from any thread.
func (t *Transport) sendCredits(hold bool) (held bool) {
	s := t.stage
	var now time.Time
	for r := range s.peers {
		st := &s.peers[r]
		if st.consumed <= st.credited || t.peers[r].ep == nil || t.peers[r].err != nil || st.credit == nil {
			continue
		}
		if hold && st.consumed-st.credited < uint64(s.slots)/2 {
			if now.IsZero() {
				now = time.Now()
			}
			if st.owed.IsZero() {
				st.owed = now
			}
			if now.Sub(st.owed) < creditDelay {
				held = true
				continue
			}
		}
		word := C.malloc(8)
		*(*uint64)(word) = st.consumed
		cr := st.credit
		if err := t.putC(r, "staging credit", word, cr.base+uint64(8*t.rank), 8, cr.rkey); err != nil {
			continue // the peer failed; its next operation says so
		}
		st.credited = st.consumed
		st.creditPuts++
	}
	return held
}

// takeIn takes in rank r's landed entries, in order.
func (t *Transport) takeIn(r int, st *stager) error {
	s := t.stage
	for {
		slot := st.land + uintptr((st.next%uint64(s.slots))*s.stride())
		if atomic.LoadUint64((*uint64)(addrPtr(slot))) != st.next+1 {
			return nil
		}
		h := unsafe.Slice((*uint64)(addrPtr(slot)), headerSize/8)
		addr, size, kind, word, total := h[1], h[2], h[3], h[4], h[5]
		if c := h[creditWord]; c > st.carried && c <= st.entries {
			st.carried = c
		}
		if kind == 0 || kind&^(entryData|entrySignal) != 0 || (kind&entryData != 0) != (size > 0) {
			return t.badEntry(r, fmt.Sprintf("unknown entry kind %#x of %d bytes", kind, size))
		}
		// The peer names the destination and the word; write only into
		// memory this rank registered, whatever arrives.
		if kind&entryData != 0 && (size > s.chunk || !t.owns(addr, size)) {
			return t.badEntry(r, fmt.Sprintf("data of %d bytes for %#x, outside every registered range", size, addr))
		}
		if kind&entrySignal != 0 && (word%8 != 0 || !t.owns(word, 8)) {
			return t.badEntry(r, fmt.Sprintf("signal word %#x outside every registered range", word))
		}
		if kind&entryData != 0 {
			written, err := s.copier.Write(uintptr(addr), slot+headerSize, size)
			if err == nil && !written {
				err = s.copier.Copy(uintptr(addr), slot+headerSize, size)
			}
			if err != nil {
				return t.stageFail(r, "staging copy to device", err)
			}
			s.copies++
		}
		in := landed{}
		if kind&entrySignal != 0 {
			// A stored signal counts as a copy: its credit (after which
			// the peer may put a larger total directly) waits for it.
			stored, err := s.copier.Store(uintptr(word), total)
			if err != nil {
				return t.stageFail(r, "staging signal store", err)
			}
			if stored {
				s.copies++
			} else {
				in.word, in.total = uintptr(word), total
			}
		}
		in.ticket = s.copies
		st.landed = append(st.landed, in)
		st.next++
		if trace.On() {
			trace.Mark("staged entry taken in") // its copies and stores queued, submitted below
		}
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
	for t.sendSlotsBusy(r) {
		if err := t.stageWait(r, "staged flush (send slot)", deadline, &idle); err != nil {
			return err
		}
	}
	return nil
}

// stageWait is one step of a staged wait: progress, serve this rank's own
// rings (the peer may be waiting on them), and check the peer and time.
func (t *Transport) stageWait(r int, op string, deadline time.Time, idle *idler) error {
	idle.after(C.p2p_ucx_progress(t.lib.fn.workerProgress, t.worker))
	if _, err := t.serviceRings(false); err != nil {
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

// dropStaged forgets rank r's staged work after a failure, or at Close,
// freeing the send slots' requests (cancelling the puts still under way).
func (t *Transport) dropStaged(r int) {
	if t.stage == nil {
		return
	}
	st := &t.stage.peers[r]
	st.queue = nil
	for i := range st.sendReq {
		for k, req := range st.sendReq[i] {
			if req != nil {
				t.abandon(req)
				st.sendReq[i][k] = nil
			}
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
	if s.landing != nil {
		// The worker outlives this: a late message finds nowhere to land.
		s.landing.base, s.landing.size = 0, 0
		t.landing = unsafe.Pointer(s.landing)
	}
	t.stage = nil
}

// addrPtr turns an address of memory outside the Go heap (pinned rings,
// registered ranges) into a pointer; the garbage collector never owns it.
func addrPtr(p uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&p)) }
