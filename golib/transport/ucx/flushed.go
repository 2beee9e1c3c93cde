package ucx

/*
#include <stdlib.h>
#include "calls.h"
*/
import "C"

import (
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// flushedSignal is a signal waiting for the flush of its peer's endpoint
// (flush is nil when the flush completed at once).
type flushedSignal struct {
	flush unsafe.Pointer
	rkey  unsafe.Pointer
	word  uint64 // remote address
	total uint64
}

// SignalFlushed adds value to the 64-bit word at dstOff of dst, like
// Signal, once every earlier Put to that peer has landed, but orders them
// without a fence: it starts a flush of the peer's endpoint and puts the
// new total when that flush completes (Progress, Drain and Flush move it
// on), and returns at once. Behind staged puts it travels as Signal does,
// through the ring. Signals of one peer go out in the order made.
// Signal's fence (ucp_worker_fence) is, with UCP's protocols v2, a blocking
// flush of every endpoint of the worker, which does not return while any
// peer has stopped; this waits for nothing and for no other peer. The same
// rules hold for the word: host memory, 8-byte aligned, starting at zero,
// this rank its only writer (shared with Signal's totals).
func (t *Transport) SignalFlushed(dst transport.Remote, dstOff uint64, value uint64) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	r, p, word, err := t.signalWord(dst, dstOff)
	if err != nil {
		return err
	}
	p.sums[word] += value
	if t.stageSignal(r.peer) {
		return t.ringSignal(r, p, word) // a flush does not wait for staged copies
	}
	return t.signalAfterFlush(r, p, word)
}

// ringSignal sends word's total to r's peer through the staging ring,
// behind the staged chunks queued or not yet credited: the peer applies it
// once they reached device memory. Totals still waiting for a flush go out
// first, and the entry then as fenced puts behind them (see pumpFlushed),
// so that its larger total cannot land first and be overwritten.
func (t *Transport) ringSignal(r *remote, p *peer, word uint64) error {
	if len(p.flushed) > 0 {
		if err := t.drainFlushed(r.peer, time.Now().Add(t.timeout)); err != nil {
			return err
		}
	}
	return t.queueSignal(r.peer, word, p.sums[word])
}

// signalAfterFlush starts a flush of r's endpoint and queues the word's
// current total to go out once it completes, behind the peer's earlier
// queued signals.
func (t *Transport) signalAfterFlush(r *remote, p *peer, word uint64) error {
	var s C.int
	req := C.p2p_ucx_ep_flush(t.lib.fn.epFlushNbx, p.ep, &s)
	switch s {
	case C.P2P_UCS_OK:
		req = nil
	case C.P2P_UCS_INPROGRESS:
	default:
		err := t.peerError(r.peer, "signal flush", s)
		t.fail(r.peer, err)
		return err
	}
	p.unordered = false // the flush covers every earlier put
	p.flushed = append(p.flushed, flushedSignal{flush: req, rkey: r.rkey, word: word, total: p.sums[word]})
	return t.pumpFlushed(r.peer)
}

// pumpFlushed puts the totals of rank r's signals whose flushes completed,
// in order.
func (t *Transport) pumpFlushed(r int) error {
	p := &t.peers[r]
	for len(p.flushed) > 0 {
		f := &p.flushed[0]
		if f.flush != nil {
			s := C.p2p_ucx_status_p(t.lib.fn.requestCheckStatus, f.flush)
			if s == C.P2P_UCS_INPROGRESS {
				return nil
			}
			C.p2p_ucx_call_p(t.lib.fn.requestFree, f.flush)
			f.flush = nil
			if s != C.P2P_UCS_OK {
				err := t.peerError(r, "signal flush", s)
				t.fail(r, err)
				return err
			}
		}
		t.putDirect(r) // as Signal's own put
		// The total travels from C memory of its own, freed when the put
		// completes.
		total := C.malloc(8)
		*(*uint64)(total) = f.total
		var s C.int
		req := C.p2p_ucx_put(t.lib.fn.putNbx, p.ep, C.uint64_t(uintptr(total)), 8, C.uint64_t(f.word), f.rkey, nil,
			C.P2P_UCS_MEMORY_TYPE_HOST, &s)
		if s != C.P2P_UCS_INPROGRESS {
			C.free(total)
		}
		p.flushed = p.flushed[1:]
		if err := t.started(r, "signal", op{req, total}, s); err != nil {
			return err
		}
	}
	return nil
}

// dropFlushed abandons rank r's queued signals after a failure.
func (t *Transport) dropFlushed(r int) {
	p := &t.peers[r]
	for _, f := range p.flushed {
		if f.flush != nil {
			t.abandon(f.flush)
		}
	}
	p.flushed = nil
}

// drainFlushed waits until rank r's queued signals have gone out.
func (t *Transport) drainFlushed(r int, deadline time.Time) error {
	var idle idler
	for i := 0; len(t.peers[r].flushed) > 0; i++ {
		if err := t.pumpFlushed(r); err != nil {
			return err
		}
		idle.after(C.p2p_ucx_progress(t.lib.fn.workerProgress, t.worker))
		if i%64 != 63 {
			continue
		}
		if err := t.check(r, "signal flush"); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			err := status.Errorf(status.Timeout, "UCX flush before a signal to rank %d did not complete within %v", r, t.timeout)
			t.fail(r, err)
			return err
		}
	}
	return nil
}

// Drain returns once every Put and Signal issued to peer so far has left
// this rank: UCP completed it locally (its source may be reused), and each
// SignalFlushed's flush is done and its total sent; with a bound of
// timeout. It waits for the peer only as far as those flushes do, never for
// the acknowledgement of what follows the last of them, as Flush does. An
// error is status.Timeout naming the peer; the peer is then unusable.
func (t *Transport) Drain(peer int, timeout time.Duration) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if peer == t.rank && !t.closed {
		return nil
	}
	if err := t.check(peer, "drain"); err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	if t.stage != nil && t.stage.peers[peer].on {
		if err := t.drainStaged(peer, deadline); err != nil {
			return err
		}
	}
	var idle idler
	for i := 0; ; i++ {
		if err := t.pumpFlushed(peer); err != nil {
			return err
		}
		if err := t.reap(peer); err != nil {
			return err
		}
		if len(t.peers[peer].pending) == 0 && len(t.peers[peer].flushed) == 0 {
			return nil
		}
		idle.after(C.p2p_ucx_progress(t.lib.fn.workerProgress, t.worker))
		if i%64 != 63 {
			continue
		}
		if err := t.check(peer, "drain"); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			err := status.Errorf(status.Timeout, "UCX sends to rank %d did not leave this rank within %v", peer, timeout)
			t.fail(peer, err)
			return err
		}
	}
}

// PeerError returns the error that made peer unusable (its endpoint failed,
// or a wait on it timed out), or nil. It makes no call into UCP: errors
// that UCP reports arrive while the worker progresses (Progress, waits).
func (t *Transport) PeerError(peer int) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if peer == t.rank && !t.closed {
		return nil
	}
	return t.check(peer, "endpoint")
}
