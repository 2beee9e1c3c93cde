package main

/*
#include <stdint.h>

// The MoE calls' argument blocks, which Python packs (moe.py's
// _DISPATCH_ARGS, _EXPAND_ARGS, _COMBINE_ARGS): one block costs less to
// pass than a dozen ctypes arguments, on a path whose small calls are
// bound by host time.
typedef struct {
	uint64_t ep, x, scales, topk_idx, topk_w;
	int64_t num_tokens;
	int32_t idx_bytes, check, capturable, reserved;
	uint64_t out_x, out_scales, out_info, out_counts;
	int64_t out_rows;
	uint64_t stream;
	int32_t* checks;
	int64_t* rows;
} p2p_moe_dispatch_args;

typedef struct {
	uint64_t ep, out_x, out_scales, out_info, out_counts;
	int64_t rows;
	uint64_t stream;
} p2p_moe_expand_args;

typedef struct {
	uint64_t ep, expert_out;
	int64_t expert_rows;
	uint64_t y;
	int64_t num_tokens;
	int32_t check, capturable;
	uint64_t stream;
	int32_t* checks;
} p2p_moe_combine_args;
*/
import "C"

import (
	"encoding/json"
	"sync"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/comm"
	"github.com/p2pcomm/p2pcomm/golib/moe"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// MoE's exports: an ExpertParallel is created once (collectively), then
// each eager dispatch is two calls (p2p_moe_dispatch, which says how many
// rows arrive, and p2p_moe_expand into outputs of that size), each
// capturable dispatch and each combine one.

// p2p_moe_create builds an ExpertParallel on communicator h, collectively.
// config is moe.Config as JSON; *ep receives its handle and info (room for
// info_cap bytes) moe.Info as JSON with a terminating zero.
//
//export p2p_moe_create
func p2p_moe_create(h C.uint64_t, config *C.char, ep *C.uint64_t, info *C.char, infoCap C.int64_t) C.int {
	return withComm(h, func(c *comm.Comm) error {
		if config == nil || ep == nil || info == nil {
			return status.Errorf(status.InvalidArgument, "moe create: null argument")
		}
		var cfg moe.Config
		if err := json.Unmarshal([]byte(C.GoString(config)), &cfg); err != nil {
			return status.Errorf(status.InvalidArgument, "moe create: bad config: %v", err)
		}
		e, err := c.NewMoE(cfg)
		if err != nil {
			return err
		}
		text, err := json.Marshal(e.Info())
		if err == nil && int64(len(text)) >= int64(infoCap) {
			err = status.Errorf(status.Capacity, "moe create: %d bytes of info, room for %d", len(text)+1, infoCap)
		}
		if err != nil {
			_ = e.Close()
			return err
		}
		out := unsafe.Slice((*byte)(unsafe.Pointer(info)), len(text)+1)
		copy(out, text)
		out[len(text)] = 0
		*ep = C.uint64_t(eps.add(c, e))
		return nil
	})
}

// The blocks' sizes are what Python packs.
var (
	_ = [1]struct{}{}[unsafe.Sizeof(C.p2p_moe_dispatch_args{})-128]
	_ = [1]struct{}{}[unsafe.Sizeof(C.p2p_moe_expand_args{})-56]
	_ = [1]struct{}{}[unsafe.Sizeof(C.p2p_moe_combine_args{})-64]
)

// p2p_moe_dispatch dispatches this rank's num_tokens tokens: x [T, H] of
// the ep's dtype (float8 for an fp8 ep, with scales [T, H/128] float32;
// else scales is 0), topk_idx [T, K] of idx_bytes-byte integers, topk_w
// [T, K] float32, contiguous; check is this rank's verdict on them (0:
// passed, else its error's status code: the call then only takes part). A
// capturable call runs entirely into out_x [out_rows, H] (and out_scales
// [out_rows, H/128]), out_info [4, out_rows] and out_counts [L+1]
// (out_rows: the ep's max_recv_rows) and never waits on the host. An eager
// one writes every rank's verdict into checks (world size entries) and,
// when all passed, the rows this rank receives into *rows: then
// p2p_moe_expand must follow with outputs of that size. The block is read
// before the call returns.
//
//export p2p_moe_dispatch
func p2p_moe_dispatch(a *C.p2p_moe_dispatch_args) C.int {
	if a == nil {
		return guard(func() error { return status.Errorf(status.InvalidArgument, "moe dispatch: null arguments") })
	}
	return withMoE(a.ep, func(e *moe.EP) error {
		d := moe.DispatchArgs{X: uintptr(a.x), Scales: uintptr(a.scales), TopkIdx: uintptr(a.topk_idx),
			TopkWeights: uintptr(a.topk_w), NumTokens: int(a.num_tokens), IdxBytes: int(a.idx_bytes), Check: int32(a.check),
			Capturable: a.capturable != 0, Stream: uintptr(a.stream), Out: moe.Rows{X: uintptr(a.out_x),
				Scales: uintptr(a.out_scales), Info: uintptr(a.out_info), Counts: uintptr(a.out_counts), Rows: int64(a.out_rows)}}
		n, err := e.Dispatch(&d)
		if a.rows != nil {
			*a.rows = C.int64_t(n)
		}
		copyChecks(e, a.checks)
		return err
	})
}

// p2p_moe_expand finishes an eager dispatch into out_x [rows, H] (and
// out_scales [rows, H/128] for an fp8 ep), out_info [4, rows] and
// out_counts [L+1], rows being what p2p_moe_dispatch said.
//
//export p2p_moe_expand
func p2p_moe_expand(a *C.p2p_moe_expand_args) C.int {
	if a == nil {
		return guard(func() error { return status.Errorf(status.InvalidArgument, "moe expand: null arguments") })
	}
	return withMoE(a.ep, func(e *moe.EP) error {
		return e.Expand(moe.Rows{X: uintptr(a.out_x), Scales: uintptr(a.out_scales), Info: uintptr(a.out_info),
			Counts: uintptr(a.out_counts), Rows: int64(a.rows)}, uintptr(a.stream))
	})
}

// p2p_moe_combine combines expert_out [expert_rows, H] (the latest
// dispatch's row order) into y [num_tokens, H] of the ep's dtype on the
// ranks that dispatched; check and checks as in p2p_moe_dispatch (eager).
//
//export p2p_moe_combine
func p2p_moe_combine(a *C.p2p_moe_combine_args) C.int {
	if a == nil {
		return guard(func() error { return status.Errorf(status.InvalidArgument, "moe combine: null arguments") })
	}
	return withMoE(a.ep, func(e *moe.EP) error {
		c := moe.CombineArgs{ExpertOut: uintptr(a.expert_out), ExpertRows: int64(a.expert_rows), Y: uintptr(a.y),
			NumTokens: int(a.num_tokens), Check: int32(a.check), Capturable: a.capturable != 0, Stream: uintptr(a.stream)}
		err := e.Combine(&c)
		copyChecks(e, a.checks)
		return err
	})
}

// p2p_moe_destroy releases the ep's own resources (streams, events, pinned
// memory; its symmetric buffers live until the communicator closes) and
// its handle. Not collective. It does not wait for the communicator's
// lock: Python's garbage collector may run it inside a torch.distributed
// callback of a call that holds it.
//
//export p2p_moe_destroy
func p2p_moe_destroy(ep C.uint64_t) C.int {
	return guard(func() error {
		h, err := eps.take(uint64(ep))
		if err != nil {
			return err
		}
		return h.ep.Close()
	})
}

// p2p_moe_trace writes, as JSON into buf (room for capacity bytes, with a
// terminating zero), the kernel path's steps since the previous call
// (moe.Launch: kernels, their grids and streams, and staging copies), for
// tests; *length receives the text's length.
//
//export p2p_moe_trace
func p2p_moe_trace(ep C.uint64_t, buf *C.char, capacity C.int64_t, length *C.int64_t) C.int {
	return withMoE(ep, func(e *moe.EP) error {
		text, err := json.Marshal(e.Trace())
		if err != nil {
			return err
		}
		if length != nil {
			*length = C.int64_t(len(text))
		}
		if buf == nil || int64(len(text)) >= int64(capacity) {
			return status.Errorf(status.Capacity, "moe trace: %d bytes, room for %d", len(text)+1, capacity)
		}
		out := unsafe.Slice((*byte)(unsafe.Pointer(buf)), len(text)+1)
		copy(out, text)
		out[len(text)] = 0
		return nil
	})
}

// copyChecks writes every rank's verdict of the latest eager call into out
// (world size entries).
func copyChecks(e *moe.EP, out *C.int32_t) {
	if out == nil {
		return
	}
	got := e.Checks()
	copy(unsafe.Slice((*int32)(unsafe.Pointer(out)), len(got)), got)
}

// withMoE runs f on the ep of handle h, serialized with its communicator's
// calls.
func withMoE(h C.uint64_t, f func(*moe.EP) error) C.int {
	return guard(func() error {
		e, err := eps.get(uint64(h))
		if err != nil {
			return err
		}
		return e.comm.Do(func(collective.Backend) error { return f(e.ep) })
	})
}

// moeHandle is an ep and the communicator it runs on.
type moeHandle struct {
	comm *comm.Comm
	ep   *moe.EP
}

// moeTable maps opaque handles to eps: C never holds a Go pointer.
type moeTable struct {
	mu   sync.Mutex
	next uint64
	m    map[uint64]moeHandle
}

var eps = moeTable{m: map[uint64]moeHandle{}}

// closeOf closes the eps of communicator c (their handles stay until
// p2p_moe_destroy; calls on them fail with status.State): an ep across
// nodes holds UCX registrations of c's symmetric memory, which must end
// before that memory is unmapped.
func (t *moeTable) closeOf(c *comm.Comm) {
	t.mu.Lock()
	var mine []*moe.EP
	for _, h := range t.m {
		if h.comm == c {
			mine = append(mine, h.ep)
		}
	}
	t.mu.Unlock()
	for _, e := range mine {
		e.Close() // not collective; a failed flush toward a peer leaves nothing to save
	}
}

func (t *moeTable) add(c *comm.Comm, e *moe.EP) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.next++
	t.m[t.next] = moeHandle{c, e}
	return t.next
}

func (t *moeTable) get(h uint64) (moeHandle, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.m[h]; ok {
		return e, nil
	}
	return moeHandle{}, status.Errorf(status.State, "ExpertParallel handle %d is not open (closed or never created)", h)
}

func (t *moeTable) take(h uint64) (moeHandle, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.m[h]
	if !ok {
		return moeHandle{}, status.Errorf(status.State, "ExpertParallel handle %d is not open (closed or never created)", h)
	}
	delete(t.m, h)
	return e, nil
}
