package ucx

/*
#include <stdlib.h>
#include "calls.h"
*/
import "C"

import (
	"strings"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// A put into a peer's host memory with a signal behind it (a port
// channel's putWithSignal, how kernels hand partials between nodes) is, as
// Put then Signal, two messages: the data, then the signal word's total
// behind a fence. Over tcp each is a send on the proxy's thread. Where the
// endpoint has a single lane, both go as one active message whose handler
// (calls.h) copies the data and then stores the total: one send. A single
// lane keeps active messages in order with each other and, behind a
// fence, with puts and signals before and after them, as the
// two-message way relies on.

// putSigMax bounds the data of a put with signal sent as one message: UCP
// sends it eagerly (in fragments past the lane's segment) and the
// receiver's handler copies it once more.
const putSigMax = 64 << 10

var _ transport.PutSignaler = (*Transport)(nil)

// landPutSignals registers the handler that lands puts with signals and
// reports whether it did.
func (t *Transport) landPutSignals() bool {
	f := &t.lib.fn
	if f.workerSetAMRecvHandler == nil || f.amSendNbx == nil {
		return false
	}
	t.putsig = (*C.p2p_putsig_target)(C.calloc(1, C.size_t(unsafe.Sizeof(C.p2p_putsig_target{}))))
	if C.p2p_ucx_set_am_putsig(f.workerSetAMRecvHandler, t.worker, t.putsig) != C.P2P_UCS_OK {
		C.free(unsafe.Pointer(t.putsig))
		t.putsig = nil
		return false
	}
	return true
}

// landRanges gives the handler this rank's registered host memory, the only
// memory it writes. Called with t.mu held, as progress (where handlers
// run) is.
func (t *Transport) landRanges() {
	if t.putsig == nil {
		return
	}
	var pairs []uint64
	for l := range t.locals {
		if l.mem == transport.HostMemory && l.memh != nil {
			pairs = append(pairs, uint64(l.addr), l.size)
		}
	}
	rs := (*C.p2p_ranges)(C.calloc(1, C.size_t(8+8*len(pairs))))
	rs.n = C.uint64_t(len(pairs) / 2)
	copy(unsafe.Slice((*uint64)(unsafe.Add(unsafe.Pointer(rs), 8)), len(pairs)), pairs)
	old := t.putsig.ranges
	t.putsig.ranges = rs
	C.free(unsafe.Pointer(old))
}

// singleLane reports whether every message to rank r takes one tcp lane.
// An older UCP that names no transports of an endpoint (1.13) gets false.
func (t *Transport) singleLane(r int) bool {
	lanes := 0
	for _, n := range t.laneNames(r) {
		switch {
		case n == "cuda_copy" || n == "rocm_copy":
			// copies between memory types, not a lane to the peer
		case n == "tcp":
			lanes++
		default:
			return false
		}
	}
	return lanes == 1
}

// laneNames are the transports of the endpoint to rank r, as UCP reports
// them (none where it cannot).
func (t *Transport) laneNames(r int) []string {
	if t.lib.fn.epQuery == nil || t.peers[r].ep == nil {
		return nil
	}
	var buf [512]C.char
	if C.p2p_ucx_ep_transports(t.lib.fn.epQuery, t.peers[r].ep, &buf[0], C.size_t(len(buf))) != C.P2P_UCS_OK {
		return nil
	}
	names := strings.TrimSuffix(C.GoString(&buf[0]), ",")
	if names == "" {
		return nil
	}
	return strings.Split(names, ",")
}

// PutWithSignal is Put, then Signal of value to the word at semOff of sem, to
// the same peer (transport.PutSignaler): one active message where it can be,
// else the two calls.
func (t *Transport) PutWithSignal(dst transport.Remote, dstOff uint64, src transport.Local, srcOff, size uint64,
	sem transport.Remote, semOff, value uint64) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	r, l, word, ok := t.oneMessage(dst, dstOff, src, srcOff, size, sem, semOff)
	if !ok {
		if err := t.put(dst, dstOff, src, srcOff, size); err != nil {
			return err
		}
		return t.signal(sem, semOff, value)
	}
	// Behind every earlier put to the peer, as Signal's total would be.
	if err := t.fence(r.peer); err != nil {
		return err
	}
	p := &t.peers[r.peer]
	p.sums[word] += value
	t.putDirect(r.peer)
	h := (*C.p2p_putsig_header)(C.malloc(C.size_t(unsafe.Sizeof(C.p2p_putsig_header{}))))
	h.dst, h.word, h.total = C.uint64_t(r.base+dstOff), C.uint64_t(word), C.uint64_t(p.sums[word])
	var memh unsafe.Pointer
	if t.passMemh {
		memh = l.memh
	}
	var s C.int
	req := C.p2p_ucx_am_putsig_send(t.lib.fn.amSendNbx, p.ep, unsafe.Pointer(h),
		C.uint64_t(uint64(l.addr)+srcOff), C.size_t(size), memh, &s)
	if s != C.P2P_UCS_INPROGRESS {
		C.free(unsafe.Pointer(h))
	}
	if s == C.P2P_UCS_OK || s == C.P2P_UCS_INPROGRESS {
		p.putsigSent++
	}
	return t.started(r.peer, "put with signal", op{req, unsafe.Pointer(h)}, s)
}

// oneMessage reports whether a put with its signal may go as one message,
// with the put's ranges and the word's address: host memory on both sides,
// valid ranges (else the two calls report the error), one peer that lands
// them over a single lane, and nothing before it that must land by other
// means (see Signal).
func (t *Transport) oneMessage(dst transport.Remote, dstOff uint64, src transport.Local, srcOff, size uint64,
	sem transport.Remote, semOff uint64) (*remote, *local, uint64, bool) {
	r, l, err := t.putTarget(dst, dstOff, src, size)
	if err != nil || l == nil || size == 0 || size > putSigMax || sem == nil || sem.Peer() != r.peer ||
		!t.peers[r.peer].putsig || l.mem != transport.HostMemory || r.mem != transport.HostMemory ||
		l.memh == nil || r.rkey == nil || !within(srcOff, size, l.size) || t.staged(r, l) {
		return nil, nil, 0, false
	}
	_, p, word, err := t.signalWord(sem, semOff)
	if err != nil || t.stageSignal(r.peer) || p.unordered || len(p.flushed) > 0 {
		return nil, nil, 0, false
	}
	return r, l, word, true
}

func b2byte(b bool) byte {
	if b {
		return 1
	}
	return 0
}
