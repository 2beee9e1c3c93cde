package ucx

/*
#include <stdlib.h>
#include "calls.h"
*/
import "C"

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// Stripes. Over tcp a worker's bytes move on the thread that progresses
// it (a socket's copies run in its send and receive calls), so one worker
// moves about what one ucx_perftest connection does. A large staged
// chunk's data therefore travels over several workers at once, the
// stripes: each has a thread of its own and an endpoint to the same stripe
// of every staged peer. A stripe puts its share of the chunk straight into
// the chunk's landing slot and flushes its endpoint; once every share
// arrived, the entry's header follows on the transport's own endpoint, as
// for any entry. The receiver sees nothing new: its stripes' threads take
// the shares in, and the sequence word still comes after the data.

// StripesEnv asks for a number of stripes; 1 is none: the transport's own
// endpoint carries every byte.
const StripesEnv = "P2PCOMM_UCX_STRIPES"

// MaxStripes is the most stripes a transport opens.
const MaxStripes = 8

// stripeMinBytes is the smallest chunk the stripes carry: a share ends
// with a flush, a round trip, which a small chunk would not win back. A
// variable for tests.
var stripeMinBytes uint64 = 256 << 10

// ParseStripes reads StripesEnv's spelling: 1 to MaxStripes.
func ParseStripes(s string) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil || n < 1 || n > MaxStripes {
		return 0, status.Errorf(status.InvalidArgument, "%s=%q: want 1 to %d", StripesEnv, s, MaxStripes)
	}
	return n, nil
}

// badCount, as the first byte of a rank's stripe addresses, says its
// StripesEnv (the rest) did not parse.
const badCount = 0xff

// shares tracks one chunk's shares across the stripes.
type shares struct {
	left   atomic.Int32 // shares not yet flushed
	failed atomic.Int32 // the UCS status of the first share that failed, 0 if none
}

// stripeWork is one message to a stripe's thread: a share to put, a peer
// to drop, or a flush of every endpoint to answer.
type stripeWork struct {
	peer  int
	src   uintptr
	memh  unsafe.Pointer
	dst   uint64
	size  uint64
	of    *shares
	drop  bool
	ready chan stripeReady
}

// stripeReady answers a stripe's wire-up: an error, else which ranks it
// reaches with a landing ring key (a key can fail to unpack on a stripe's
// endpoint where the main one's did, cma's in UCX 1.22: chunks to such a
// rank travel whole).
type stripeReady struct {
	err   error
	reach []bool
}

// share is a put in flight on a stripe, with the flush behind it.
type share struct {
	work       stripeWork
	put, flush unsafe.Pointer
}

// stripe is one worker with its endpoints, owned by its thread once
// started.
type stripe struct {
	lib     *library
	index   int
	timeout time.Duration
	worker  unsafe.Pointer
	eps     []unsafe.Pointer // by rank; nil for this rank, unstaged and dropped peers
	keys    [][]byte         // each staged peer's landing rings' key, as packed
	rkeys   []unsafe.Pointer // the same, unpacked on eps once they are wired up
	work    chan stripeWork
	stop    chan struct{}
	done    chan struct{}
	flying  []share
	closing []unsafe.Pointer // endpoint closes under way
}

// openStripes opens want stripes (fewer if a peer wants fewer; none below
// two) toward every staged peer and wires them up. It is collective: every
// rank calls it once, after openStaging, staging or not. bad, when set, is
// this rank's StripesEnv that did not parse: every rank's error.
func (t *Transport) openStripes(bs bootstrap.Bootstrap, want int, bad string) error {
	staged := t.stage != nil
	if !staged || want < 2 || bad != "" {
		want = min(want, 1)
	}
	var workers []unsafe.Pointer
	destroy := func(ws []unsafe.Pointer) {
		for _, w := range ws {
			C.p2p_ucx_call_p(t.lib.fn.workerDestroy, w)
		}
	}
	blob := []byte{byte(max(want, 0))}
	var err error
	for k := 0; k < want && want > 1; k++ {
		var w unsafe.Pointer
		if s := C.p2p_ucx_worker_create(t.lib.fn.workerCreate, t.context, &w); s != C.P2P_UCS_OK {
			err = t.ucsError(s, fmt.Sprintf("create stripe %d's worker", k))
			break
		}
		workers = append(workers, w)
		var addr unsafe.Pointer
		var n C.size_t
		if s := C.p2p_ucx_worker_address(t.lib.fn.workerQuery, w, &addr, &n); s != C.P2P_UCS_OK {
			err = t.ucsError(s, fmt.Sprintf("query stripe %d's address", k))
			break
		}
		blob = binary.LittleEndian.AppendUint32(blob, uint32(n))
		blob = append(blob, C.GoBytes(addr, C.int(n))...)
		C.p2p_ucx_call_pp(t.lib.fn.workerReleaseAddress, w, addr)
	}
	if err != nil {
		blob = []byte{0} // the peers open none either
	}
	if bad != "" {
		blob = append([]byte{badCount}, bad...)
	}
	all, gerr := t.allGather(bs, blob)
	if err == nil {
		err = gerr
	}
	for r := range all {
		if err == nil && len(all[r]) > 0 && all[r][0] == badCount {
			_, err = ParseStripes(string(all[r][1:]))
			err = fmt.Errorf("rank %d: %w", r, err)
		}
	}
	agreed := len(workers)
	addrs := make([][][]byte, len(all))
	for r := range all {
		if err != nil {
			break
		}
		if len(all[r]) == 0 {
			err = status.Errorf(status.Mismatch, "rank %d sent no stripe count", r)
			break
		}
		agreed = min(agreed, int(all[r][0]))
		for rest := all[r][1:]; len(rest) > 0; {
			n := uint64(0)
			if len(rest) >= 4 {
				n = uint64(binary.LittleEndian.Uint32(rest))
			}
			if len(rest) < 4 || uint64(len(rest)-4) < n {
				err = status.Errorf(status.Mismatch, "rank %d sent a bad stripe address", r)
				break
			}
			addrs[r] = append(addrs[r], rest[4:4+n])
			rest = rest[4+n:]
		}
	}
	if err != nil || agreed < 2 {
		destroy(workers)
		return err
	}
	destroy(workers[agreed:])
	workers = workers[:agreed]
	// Every stripe is in t.stripes before anything can fail, so that Close
	// destroys every worker; a failure to connect is this rank's error
	// once the stripes have wired up, since its peers' stripes wait for
	// this rank's to answer.
	for k, w := range workers {
		s := &stripe{lib: t.lib, index: k, timeout: t.timeout, worker: w, eps: make([]unsafe.Pointer, len(t.peers)),
			keys: make([][]byte, len(t.peers)), rkeys: make([]unsafe.Pointer, len(t.peers)), stop: make(chan struct{}), done: make(chan struct{})}
		// Every chunk in flight has a share on every stripe; peers dropped
		// and a wire-up flush take a message each.
		s.work = make(chan stripeWork, (t.stage.slots+1)*len(t.peers)+1)
		t.stripes = append(t.stripes, s)
	}
	for k, s := range t.stripes {
		for r := range t.peers {
			st := &t.stage.peers[r]
			if r == t.rank || !st.on {
				continue
			}
			if len(addrs[r]) <= k {
				err = cmp.Or(err, status.Errorf(status.Mismatch, "rank %d sent %d stripe addresses, want %d", r, len(addrs[r]), agreed))
				continue
			}
			caddr := C.CBytes(addrs[r][k])
			s2 := C.p2p_ucx_ep_create(t.lib.fn.epCreate, s.worker, caddr, t.errMode, t.slot(r), &s.eps[r])
			C.free(caddr)
			if s2 != C.P2P_UCS_OK {
				s.eps[r] = nil
				err = cmp.Or(err, t.ucsError(s2, fmt.Sprintf("connect stripe %d to rank %d", k, r)))
				continue
			}
			s.keys[r] = st.ringKey
		}
	}
	for _, s := range t.stripes {
		go s.run()
	}
	// Endpoints wire up lazily: a flush of each finds an unreachable peer
	// now, and spares the first chunk the handshake. Keys unpack only on
	// an endpoint wired up.
	answers := make([]chan stripeReady, len(t.stripes))
	for k, s := range t.stripes {
		answers[k] = make(chan stripeReady, 1)
		s.work <- stripeWork{ready: answers[k]}
	}
	for r := range t.stage.peers {
		t.stage.peers[r].striping = t.stage.peers[r].on
	}
	for _, a := range answers {
		got := <-a
		if got.err != nil && err == nil {
			err = got.err
		}
		for r, ok := range got.reach {
			t.stage.peers[r].striping = t.stage.peers[r].striping && ok
		}
	}
	return err
}

// run is a stripe's thread: it starts the shares it is handed, progresses
// its worker (which also takes in the peers' shares) and counts the shares
// whose flush completed.
func (s *stripe) run() {
	runtime.LockOSThread() // UCP's worker is used from this thread alone
	defer close(s.done)
	// Paced as an idle proxy is: every rank runs a thread per stripe, and
	// spinning between transfers would take a core each.
	idle := idler{doze: time.Second}
	for {
		select {
		case w := <-s.work:
			s.take(w)
			idle.after(1)
		case <-s.stop:
			s.shutdown()
			return
		default:
		}
		events := C.p2p_ucx_progress(s.lib.fn.workerProgress, s.worker)
		if len(s.flying) > 0 {
			s.reap()
			events++ // a share in flight: keep spinning
		}
		if len(s.closing) > 0 {
			s.reapClosing()
		}
		idle.after(events)
	}
}

// take acts on one message.
func (s *stripe) take(w stripeWork) {
	switch {
	case w.ready != nil:
		ready := stripeReady{err: s.flushAll()}
		if ready.err == nil {
			ready.reach = s.unpackKeys()
		}
		w.ready <- ready
	case w.drop:
		s.dropPeer(w.peer)
	default:
		s.start(w)
	}
}

// start puts a share and flushes behind it.
func (s *stripe) start(w stripeWork) {
	ep := s.eps[w.peer]
	if ep == nil {
		s.finish(w, C.P2P_UCS_ERR_LAST)
		return
	}
	var st C.int
	put := C.p2p_ucx_put(s.lib.fn.putNbx, ep, C.uint64_t(w.src), C.size_t(w.size), C.uint64_t(w.dst), s.rkeys[w.peer],
		w.memh, C.P2P_UCS_MEMORY_TYPE_HOST, &st)
	if st != C.P2P_UCS_OK && st != C.P2P_UCS_INPROGRESS {
		s.finish(w, st)
		return
	}
	flush := C.p2p_ucx_ep_flush(s.lib.fn.epFlushNbx, ep, &st)
	if st != C.P2P_UCS_OK && st != C.P2P_UCS_INPROGRESS {
		s.abandon(put)
		s.finish(w, st)
		return
	}
	if flush == nil { // the put completed at once, and with it the flush
		if put != nil {
			if ps := C.p2p_ucx_status_p(s.lib.fn.requestCheckStatus, put); ps < 0 {
				st = ps
			}
		}
		s.release(put)
		s.finish(w, st)
		return
	}
	s.flying = append(s.flying, share{work: w, put: put, flush: flush})
}

// reap finishes the shares whose flush completed.
func (s *stripe) reap() {
	kept := s.flying[:0]
	for _, sh := range s.flying {
		st := C.p2p_ucx_status_p(s.lib.fn.requestCheckStatus, sh.flush)
		if st == C.P2P_UCS_INPROGRESS {
			kept = append(kept, sh)
			continue
		}
		C.p2p_ucx_call_p(s.lib.fn.requestFree, sh.flush)
		if st == C.P2P_UCS_OK && sh.put != nil {
			if ps := C.p2p_ucx_status_p(s.lib.fn.requestCheckStatus, sh.put); ps < 0 {
				st = ps
			}
		}
		s.abandon(sh.put)
		s.finish(sh.work, st)
	}
	clear(s.flying[len(kept):])
	s.flying = kept
}

// finish counts a share done, with its status.
func (s *stripe) finish(w stripeWork, st C.int) {
	if st != C.P2P_UCS_OK {
		w.of.failed.CompareAndSwap(0, int32(st))
	}
	w.of.left.Add(-1)
}

// release frees a completed request (nil: none).
func (s *stripe) release(req unsafe.Pointer) {
	if req != nil {
		C.p2p_ucx_call_p(s.lib.fn.requestFree, req)
	}
}

// abandon cancels a request (nil: none) and frees it; UCP keeps it until
// it completes.
func (s *stripe) abandon(req unsafe.Pointer) {
	if req == nil {
		return
	}
	if C.p2p_ucx_status_p(s.lib.fn.requestCheckStatus, req) == C.P2P_UCS_INPROGRESS {
		C.p2p_ucx_call_pp(s.lib.fn.requestCancel, s.worker, req)
	}
	C.p2p_ucx_call_p(s.lib.fn.requestFree, req)
}

// flushAll flushes every endpoint, within the timeout.
func (s *stripe) flushAll() error {
	deadline := time.Now().Add(s.timeout)
	for r, ep := range s.eps {
		if ep == nil {
			continue
		}
		var st C.int
		req := C.p2p_ucx_ep_flush(s.lib.fn.epFlushNbx, ep, &st)
		var idle idler
		for req != nil && st == C.P2P_UCS_INPROGRESS {
			if st = C.p2p_ucx_status_p(s.lib.fn.requestCheckStatus, req); st != C.P2P_UCS_INPROGRESS {
				break
			}
			if time.Now().After(deadline) {
				s.abandon(req)
				return status.Errorf(status.Timeout, "UCX stripe %d: wiring up to rank %d did not complete within %v",
					s.index, r, s.timeout)
			}
			idle.after(C.p2p_ucx_progress(s.lib.fn.workerProgress, s.worker))
		}
		if req != nil {
			C.p2p_ucx_call_p(s.lib.fn.requestFree, req)
		}
		if st != C.P2P_UCS_OK {
			return status.Errorf(status.Timeout, "UCX stripe %d: wiring up to rank %d failed: %s", s.index, r,
				s.lib.statusText(st))
		}
	}
	return nil
}

// unpackKeys unpacks every staged peer's ring key on its endpoint and
// reports the ranks whose key it holds.
func (s *stripe) unpackKeys() []bool {
	reach := make([]bool, len(s.keys))
	for r, k := range s.keys {
		if k == nil || s.eps[r] == nil {
			continue
		}
		key := C.CBytes(k)
		st := C.p2p_ucx_rkey_unpack(s.lib.fn.rkeyUnpack, s.eps[r], key, &s.rkeys[r])
		C.free(key)
		if st != C.P2P_UCS_OK {
			s.rkeys[r] = nil
		}
		reach[r] = s.rkeys[r] != nil
	}
	return reach
}

// dropPeer gives up rank r's shares in flight and closes its endpoint.
func (s *stripe) dropPeer(r int) {
	kept := s.flying[:0]
	for _, sh := range s.flying {
		if sh.work.peer != r {
			kept = append(kept, sh)
			continue
		}
		s.abandon(sh.flush)
		s.abandon(sh.put)
		s.finish(sh.work, C.P2P_UCS_ERR_LAST)
	}
	clear(s.flying[len(kept):])
	s.flying = kept
	s.closePeer(r)
}

// closePeer destroys rank r's key and force-closes its endpoint; the close
// completes in the background (reapClosing), so that a dead peer's
// endpoint does not hold up the shares to the others. Without peer failure
// handling UCP refuses a forced close: the endpoint then goes with the
// worker.
func (s *stripe) closePeer(r int) {
	if s.rkeys[r] != nil {
		C.p2p_ucx_call_p(s.lib.fn.rkeyDestroy, s.rkeys[r])
		s.rkeys[r] = nil
	}
	if s.eps[r] == nil {
		return
	}
	var st C.int
	req := C.p2p_ucx_ep_close(s.lib.fn.epCloseNbx, s.eps[r], &st)
	s.eps[r] = nil
	if req != nil {
		s.closing = append(s.closing, req)
	}
}

// reapClosing frees the endpoint closes that completed.
func (s *stripe) reapClosing() {
	kept := s.closing[:0]
	for _, req := range s.closing {
		if C.p2p_ucx_status_p(s.lib.fn.requestCheckStatus, req) == C.P2P_UCS_INPROGRESS {
			kept = append(kept, req)
			continue
		}
		C.p2p_ucx_call_p(s.lib.fn.requestFree, req)
	}
	clear(s.closing[len(kept):])
	s.closing = kept
}

// shutdown ends the stripe on its thread: shares in flight are given up,
// endpoints closed, the worker destroyed.
func (s *stripe) shutdown() {
	for _, sh := range s.flying {
		s.abandon(sh.flush)
		s.abandon(sh.put)
		s.finish(sh.work, C.P2P_UCS_ERR_LAST)
	}
	s.flying = nil
	for r := range s.eps {
		s.closePeer(r)
	}
	// UCP lets a closed endpoint go within a bounded time, dead peer or not.
	deadline := time.Now().Add(min(s.timeout, 5*time.Second))
	var idle idler
	for len(s.closing) > 0 && time.Now().Before(deadline) {
		idle.after(C.p2p_ucx_progress(s.lib.fn.workerProgress, s.worker))
		s.reapClosing()
	}
	for _, req := range s.closing {
		C.p2p_ucx_call_p(s.lib.fn.requestFree, req) // UCP frees it once done
	}
	s.closing = nil
	C.p2p_ucx_call_p(s.lib.fn.workerDestroy, s.worker)
	s.worker = nil
}

// startShares hands chunk c's data, in its send slot, to the stripes,
// bound for landing slot landing at rank r.
func (t *Transport) startShares(r int, c *chunk, landing uint64) {
	st := &t.stage.peers[r]
	k := uint64(len(t.stripes))
	each := (c.size + k - 1) / k
	each = (each + 63) &^ 63 // whole cache lines
	c.shares = &shares{}
	st.striped++
	c.shares.left.Store(int32((c.size + each - 1) / each))
	src := t.sendSlot(st, c.slot) + headerSize
	for i, off := 0, uint64(0); off < c.size; i, off = i+1, off+each {
		t.stripes[i].work <- stripeWork{peer: r, src: src + uintptr(off), memh: t.sendMemh(st),
			dst: landing + headerSize + off, size: min(each, c.size-off), of: c.shares}
	}
}

// striped reports whether chunk c's data goes to its landing slot through
// the stripes.
func (t *Transport) striped(r int, c *chunk) bool {
	return len(t.stripes) > 0 && t.stage.peers[r].striping && c.ring() && c.inSlot() && c.size >= stripeMinBytes
}

// dropStripes tells the stripes that rank r failed.
func (t *Transport) dropStripes(r int) {
	for _, s := range t.stripes {
		select {
		case <-s.done:
		case s.work <- stripeWork{peer: r, drop: true}:
		}
	}
}

// closeStripes stops the stripes' threads and waits for them, a bounded
// time, and reports whether all stopped: a stripe stuck in UCP is left to
// the process's end, with the memory and context it may still use.
func (t *Transport) closeStripes() bool {
	for _, s := range t.stripes {
		close(s.stop)
	}
	// A stripe's shutdown waits for its endpoints' closes, within 5 s.
	deadline := time.After(min(t.timeout, 5*time.Second) + time.Second)
	stopped := true
	for _, s := range t.stripes {
		select {
		case <-s.done:
		case <-deadline:
			stopped = false
		}
	}
	t.stripes = nil
	return stopped
}

// Stripes is how many stripes carry large staged chunks (0: none).
func (t *Transport) Stripes() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.stripes)
}
