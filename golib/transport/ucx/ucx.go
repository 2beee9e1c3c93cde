// Package ucx is the transport between hosts: UCX's UCP, loaded with dlopen
// at run time, carries puts, signals and flushes.
package ucx

/*
#include <stdlib.h>
#include "calls.h"
*/
import "C"

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/procenv"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/trace"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// Options configure Open. The zero value is usable.
type Options struct {
	// Timeout bounds every wait (wireup, flush, close); zero means
	// bootstrap.DefaultTimeout. The communicator passes P2PCOMM_TIMEOUT_MS.
	Timeout time.Duration
	// LibraryDirs are searched for libucp.so.0 after the dynamic loader's
	// path (the Python layer passes the libucx wheel's lib folder).
	LibraryDirs []string
	// Copier, when set, lets puts of device memory be staged through
	// pinned host memory (see Stage); the transport calls it only from the
	// goroutine that calls the transport.
	Copier Copier
	// Stage says when device memory is staged; the zero value reads
	// P2PCOMM_UCX_STAGE (auto, always, never), else auto.
	Stage StageMode
	// ChunkBytes and RingChunks size each peer's staging rings (0:
	// DefaultChunkBytes, DefaultRingChunks); every rank must agree.
	ChunkBytes uint64
	RingChunks int
	// Errors says how endpoints learn of a failed peer; the zero value
	// reads P2PCOMM_UCX_ERRORS (fast, peer), else fast.
	Errors ErrorMode
	// SeparateHosts keeps UCX off the transports that only work within one
	// host (cuda_ipc and shared memory) unless UCX_TLS says otherwise: the
	// ranks share a host that P2PCOMM_LOCAL_SIZE split into nodes, which
	// must reach each other the way separate hosts would.
	SeparateHosts bool
	// OneHost: every rank runs on this host, so UCX needs no network
	// device but the loopback (unless UCX_NET_DEVICES says otherwise). Its
	// endpoints then have a single lane, which lets a put with a signal
	// travel as one message (PutWithSignal).
	OneHost bool
	// Stripes is how many workers, each on a thread of its own, carry the
	// data of a large staged chunk (see StripesEnv); 0 reads StripesEnv,
	// else 1: the transport's own endpoint alone. Ranks settle on the
	// fewest any asks for.
	Stripes int
	// HostOnly: every buffer is host memory, and calls may run where CUDA
	// calls are refused (a host function on a stream, see golib/moe): UCX
	// keeps off its CUDA transports, whatever UCX_TLS says, so that no CUDA
	// memory domain is opened to look up a pointer's memory type.
	HostOnly bool
}

// SeparateHostsTLS is UCX_TLS for ranks that must behave as separate hosts.
const SeparateHostsTLS = "^cuda_ipc,sm"

// cudaTLs are UCX's transports whose memory domains look up pointers'
// memory types through CUDA, and the alias that names them. (gdr_copy's
// domain looks nothing up, and registers CUDA memory only.)
var cudaTLs = []string{"cuda_copy", "cuda_ipc", "cuda"}

// hostOnlyTLS is UCX_TLS without the CUDA transports: the user's list
// (user, set or not) less them, or with them among its exclusions; and
// without shared memory too when separate (see SeparateHosts).
func hostOnlyTLS(user string, set, separate bool) string {
	user = strings.TrimSpace(user)
	if !set || user == "" || user == "all" {
		if separate {
			return "^cuda_copy,cuda_ipc,sm"
		}
		return "^cuda_copy,cuda_ipc"
	}
	if strings.HasPrefix(user, "^") {
		return user + ",cuda_copy,cuda_ipc"
	}
	var kept []string
	for _, tl := range strings.Split(user, ",") {
		if tl = strings.TrimSpace(tl); tl != "" && !slices.Contains(cudaTLs, tl) {
			kept = append(kept, tl)
		}
	}
	if len(kept) == 0 {
		return hostOnlyTLS("", false, separate)
	}
	return strings.Join(kept, ",")
}

// ErrorsEnv names the endpoints' failure handling knob: fast or peer.
const ErrorsEnv = "P2PCOMM_UCX_ERRORS"

// ErrorMode is how endpoints learn of a failed peer.
type ErrorMode int

const (
	// ErrorsDefault is ErrorsEnv's value, else ErrorsFast.
	ErrorsDefault ErrorMode = iota
	// ErrorsFast creates endpoints without UCX's peer failure handling: a
	// dead peer shows as a failed operation where the transport reports it
	// (tcp: a reset connection) and otherwise as a timeout naming it. UCP
	// then keeps tcp's zero-copy puts, about 5x the bandwidth of the
	// software-emulated puts it uses with peer failure handling.
	ErrorsFast
	// ErrorsPeer asks UCX for peer failure handling
	// (UCP_ERR_HANDLING_MODE_PEER): failures reach an error callback on
	// every transport, at the cost of emulated puts over tcp.
	ErrorsPeer
)

// ParseErrorMode reads ErrorsEnv's spelling.
func ParseErrorMode(s string) (ErrorMode, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "fast":
		return ErrorsFast, nil
	case "peer":
		return ErrorsPeer, nil
	}
	return 0, status.Errorf(status.InvalidArgument, "%s=%q: want fast or peer", ErrorsEnv, s)
}

func (m ErrorMode) String() string {
	return [...]string{"default", "fast", "peer"}[m]
}

// Transport is one UCP context and worker with an endpoint to every other
// rank. Over transports without remote hardware access (tcp, and atomics
// over shared memory) data and acknowledgements move only while the target
// calls Progress or waits in Flush, so every rank's proxy keeps progressing.
type Transport struct {
	mu       sync.Mutex
	lib      *library
	rank     int
	timeout  time.Duration
	context  unsafe.Pointer
	worker   unsafe.Pointer
	failed   *C.int // per-rank first endpoint failure, written by UCP's error callback
	peers    []peer
	locals   map[*local]struct{}
	remotes  map[*remote]struct{}
	passMemh bool
	stage    *staging             // nil unless some peer's device puts are staged
	landing  unsafe.Pointer       // the staging handler's bounds, freed after the worker
	putsig   *C.p2p_putsig_target // the put-with-signal handler's bounds (nil: not landed here), freed after the worker
	stripes  []*stripe            // workers on threads of their own that carry large staged chunks
	errMode  C.int                // endpoints' failure handling (UCP_ERR_HANDLING_MODE_*)
	closed   bool
}

// peer is this rank's state toward one other rank.
type peer struct {
	ep      unsafe.Pointer // nil for this rank and after a failure closed it
	pending []op
	sums    map[uint64]uint64 // signal word address -> total this rank added
	flushed []flushedSignal   // signals waiting for a flush of the endpoint, oldest first
	err     error             // sticky: the endpoint failed or a wait on it timed out
	// putsig: a put to the peer's host memory with a signal behind it may
	// go as one active message (the peer lands them, and the endpoint has
	// a single lane, so UCP keeps them in order with puts and fences).
	putsig     bool
	putsigSent uint64 // puts with signals sent as one message
	// unordered: a put of device memory went to the peer through UCP
	// itself (not staged) since the last flush; UCP may carry it on a lane
	// of its own (cuda_ipc), which a weak fence does not order.
	unordered bool
}

// op is an outstanding put: its request and the C memory (may be nil) that
// must live until it completes.
type op struct {
	req, mem unsafe.Pointer
}

// cancelPending cancels rank r's outstanding requests, before its remote
// keys and endpoint go.
func (t *Transport) cancelPending(r int) {
	for _, o := range t.peers[r].pending {
		C.p2p_ucx_call_pp(t.lib.fn.requestCancel, t.worker, o.req)
	}
}

// release frees o's request (UCP keeps one still in flight until it
// completes) and its memory once the request is done; memory UCP may still
// read is left to leak rather than be freed under it.
func (t *Transport) release(o op) {
	done := C.p2p_ucx_status_p(t.lib.fn.requestCheckStatus, o.req) != C.P2P_UCS_INPROGRESS
	C.p2p_ucx_call_p(t.lib.fn.requestFree, o.req)
	if o.mem != nil && done {
		C.free(o.mem)
	}
}

var (
	_ transport.Transport    = (*Transport)(nil)
	_ transport.InlinePutter = (*Transport)(nil)
)

// Available loads UCP (searching dirs as Options.LibraryDirs) without
// creating anything, so that ranks can agree on it before the collective
// Open. Without UCX the error is status.Unsupported and says how to get it.
func Available(dirs []string) error {
	_, err := load(dirs)
	return err
}

// Open creates the transport of this rank: loads UCP, creates a context and
// a worker, all-gathers worker addresses through bs and connects to every
// other rank. It is collective and returns once every endpoint is wired up,
// or an error naming the rank that was not reached within the timeout.
// Without UCX the error is status.Unsupported and says how to install it.
func Open(bs bootstrap.Bootstrap, opts Options) (*Transport, error) {
	lib, err := load(opts.LibraryDirs)
	if err != nil {
		return nil, err
	}
	t := &Transport{
		lib:      lib,
		rank:     bs.Rank(),
		timeout:  opts.Timeout,
		peers:    make([]peer, bs.Size()),
		locals:   map[*local]struct{}{},
		remotes:  map[*remote]struct{}{},
		passMemh: lib.minor >= memhMinor,
	}
	if t.timeout <= 0 {
		t.timeout = bootstrap.DefaultTimeout
	}
	if err := t.open(bs, opts); err != nil {
		t.Close()
		return nil, fmt.Errorf("UCX transport on rank %d with %s: %w", t.rank, lib, err)
	}
	return t, nil
}

// defaults are UCP settings applied unless the user set the UCX_ variable.
// Buffers here are registered explicitly with their memory type, so UCX
// needs no registration or memory-type cache, nor the memory hooks that
// would feed them (HookModeEnv) in a process that also runs the Go runtime
// and torch's allocators. Fences here only order a staging entry's sequence
// word after its data on one endpoint: a weak fence orders without waiting,
// where the strong one UCX picks for tcp flushes the endpoint, a round trip
// per entry.
var defaults = [][2]string{
	{"RCACHE_ENABLE", "n"},
	{"MEMTYPE_CACHE", "n"},
	{"FENCE_MODE", "weak"},
}

func (t *Transport) open(bs bootstrap.Bootstrap, opts Options) error {
	f := &t.lib.fn
	errMode := opts.Errors
	if errMode == ErrorsDefault {
		var err error
		if errMode, err = ParseErrorMode(procenv.Get(ErrorsEnv)); err != nil {
			return err
		}
	}
	cErrMode := C.int(C.P2P_UCP_ERR_HANDLING_MODE_NONE)
	if errMode == ErrorsPeer {
		cErrMode = C.P2P_UCP_ERR_HANDLING_MODE_PEER
	}
	t.errMode = cErrMode
	// A bad StripesEnv is every rank's error, found in the stripes'
	// exchange below.
	stripes, badStripes := min(opts.Stripes, MaxStripes), ""
	stage := opts.Stage
	if stage == StageDefault {
		stage, _ = ParseStageMode(procenv.Get(StageEnv)) // a bad value is openStaging's error
	}
	if opts.Copier == nil || stage == StageNever {
		stripes = 1 // nothing is staged: StripesEnv is not this transport's
	} else if stripes <= 0 {
		stripes = 1
		if v, ok := procenv.Lookup(StripesEnv); ok && v != "" {
			if n, err := ParseStripes(v); err != nil {
				badStripes = v
			} else {
				stripes = n
			}
		}
	}
	var config unsafe.Pointer
	if s := C.p2p_ucx_config_read(f.configRead, &config); s != C.P2P_UCS_OK {
		return t.ucsError(s, "read UCX configuration")
	}
	settings := defaults
	if opts.SeparateHosts {
		settings = append(settings[:len(settings):len(settings)], [2]string{"TLS", SeparateHostsTLS})
	}
	if opts.OneHost {
		settings = append(settings[:len(settings):len(settings)], [2]string{"NET_DEVICES", "lo"})
	}
	if opts.HostOnly {
		user, set := procenv.Lookup("UCX_TLS")
		tls := hostOnlyTLS(user, set, opts.SeparateHosts)
		settings = append(settings[:len(settings):len(settings)], [2]string{"TLS", tls})
	}
	for _, kv := range settings {
		if _, set := procenv.Lookup("UCX_" + kv[0]); set && !(opts.HostOnly && kv[0] == "TLS") {
			continue
		}
		name, value := C.CString(kv[0]), C.CString(kv[1])
		C.p2p_ucx_config_modify(f.configModify, config, name, value) // an older UCX without the option keeps its default
		C.free(unsafe.Pointer(name))
		C.free(unsafe.Pointer(value))
	}
	name := C.CString(fmt.Sprintf("p2pcomm-rank%d", t.rank))
	defer C.free(unsafe.Pointer(name))
	s := C.p2p_ucx_init(f.init, C.uint(minMajor), C.uint(minMinor), config, C.size_t(len(t.peers)), name,
		C.int(b2byte(stripes > 1)), &t.context)
	C.p2p_ucx_call_p(f.configRelease, config)
	if s != C.P2P_UCS_OK {
		t.context = nil
		return t.ucsError(s, "create UCP context")
	}
	if s := C.p2p_ucx_worker_create(f.workerCreate, t.context, &t.worker); s != C.P2P_UCS_OK {
		t.worker = nil
		return t.ucsError(s, "create UCP worker")
	}
	var addr unsafe.Pointer
	var addrLen C.size_t
	if s := C.p2p_ucx_worker_address(f.workerQuery, t.worker, &addr, &addrLen); s != C.P2P_UCS_OK {
		return t.ucsError(s, "query the worker's address")
	}
	// The first byte says whether this rank lands puts with signals sent
	// as active messages (the rest is the worker's address).
	lands := t.landPutSignals()
	mine := append([]byte{b2byte(lands)}, C.GoBytes(addr, C.int(addrLen))...)
	C.p2p_ucx_call_pp(f.workerReleaseAddress, t.worker, addr)
	all, err := bs.AllGather(mine)
	if err != nil {
		return fmt.Errorf("exchange worker addresses: %w", err)
	}
	t.failed = (*C.int)(C.calloc(C.size_t(len(t.peers)), C.size_t(unsafe.Sizeof(C.int(0)))))
	for r := range t.peers {
		if r == t.rank {
			continue
		}
		if len(all[r]) < 2 {
			return status.Errorf(status.Mismatch, "rank %d sent an empty worker address", r)
		}
		caddr := C.CBytes(all[r][1:])
		s := C.p2p_ucx_ep_create(f.epCreate, t.worker, caddr, cErrMode, t.slot(r), &t.peers[r].ep)
		C.free(caddr)
		if s != C.P2P_UCS_OK {
			t.peers[r].ep = nil
			return t.ucsError(s, fmt.Sprintf("connect to rank %d", r))
		}
	}
	// Endpoints wire up lazily; flushing them all now finds an unreachable
	// rank at Open. The barrier runs while progressing, since a peer still
	// flushing needs this rank's acknowledgements.
	if err := t.flushAll("wire up"); err != nil {
		return err
	}
	for r := range t.peers {
		t.peers[r].putsig = r != t.rank && lands && all[r][0] == 1 && t.singleLane(r)
	}
	// Open ends with the ranks' agreement on its outcome (it is their
	// barrier too): one that failed after the exchanges above, taking a
	// peer's ring keys say, must not leave the others waiting for it.
	stageErr := t.openStaging(bs, opts)
	if stageErr != nil {
		stripes = 0 // every rank still takes part in the stripes' exchange
	}
	stripeErr := t.openStripes(bs, stripes, badStripes)
	failed, err := t.allGather(bs, []byte{b2byte(stageErr != nil || stripeErr != nil)})
	if stageErr != nil || stripeErr != nil || err != nil {
		return cmp.Or(stageErr, stripeErr, err)
	}
	for r := range failed {
		if len(failed[r]) == 1 && failed[r][0] != 0 {
			return status.Errorf(status.State, "UCX: rank %d could not open its transport (its own error says why)", r)
		}
	}
	return nil
}

// allGather is bs.AllGather while this rank progresses its worker, as a
// peer still wiring up or flushing needs its acknowledgements.
func (t *Transport) allGather(bs bootstrap.Bootstrap, mine []byte) ([][]byte, error) {
	var all [][]byte
	err := t.progressWhile(func() error {
		var err error
		all, err = bs.AllGather(mine)
		return err
	})
	return all, err
}

// slot is the address of rank r's failure status.
func (t *Transport) slot(r int) *C.int {
	return (*C.int)(unsafe.Add(unsafe.Pointer(t.failed), r*int(unsafe.Sizeof(C.int(0)))))
}

// flushAll flushes every endpoint at once and waits for all.
func (t *Transport) flushAll(op string) error {
	reqs := make([]unsafe.Pointer, len(t.peers))
	for r := range t.peers {
		if r == t.rank {
			continue
		}
		var s C.int
		reqs[r] = C.p2p_ucx_ep_flush(t.lib.fn.epFlushNbx, t.peers[r].ep, &s)
		if s != C.P2P_UCS_OK && s != C.P2P_UCS_INPROGRESS {
			return t.peerError(r, op, s)
		}
	}
	deadline := time.Now().Add(t.timeout)
	for r, req := range reqs {
		if req == nil {
			continue
		}
		if err := t.wait(req, r, op, deadline); err != nil {
			for _, other := range reqs[r+1:] {
				if other != nil {
					t.abandon(other)
				}
			}
			return err
		}
	}
	return nil
}

// progressWhile runs fn in another goroutine and progresses the worker
// until it returns.
func (t *Transport) progressWhile(fn func() error) error {
	done := make(chan error, 1)
	go func() { done <- fn() }()
	var idle idler
	for {
		select {
		case err := <-done:
			return err
		default:
		}
		idle.after(C.p2p_ucx_progress(t.lib.fn.workerProgress, t.worker))
	}
}

// idler spins while progress finds work and sleeps only after idleSpin
// without any: a proxy's flush round trip is microseconds, which a sleep
// would multiply, while a rank waiting long for a slow peer should leave
// the cores to it. A wait naps at every 64th empty look; a thread that
// lives idle between transfers (doze set: a stripe) naps at every one, and
// past doze sleeps a millisecond per look, as an idle proxy does.
type idler struct {
	empty int
	since time.Time     // when the current idle stretch began
	doze  time.Duration // 0: a wait's pacing
}

// idleSpin is how long a wait busy-polls before it starts to sleep.
const idleSpin = time.Millisecond

func (i *idler) after(events C.uint) {
	if events != 0 {
		i.empty = 0
		return
	}
	i.empty++
	if i.empty < 64 || (i.doze == 0 && i.empty%64 != 0) {
		return
	}
	// No runtime.Gosched: waits run on the proxy's locked thread, where it
	// costs a thread handoff through futexes, tens of microseconds.
	now := time.Now()
	if i.empty == 64 {
		i.since = now
		return
	}
	switch idle := now.Sub(i.since); {
	case i.doze > 0 && idle >= i.doze:
		ts := unix.Timespec{Nsec: int64(time.Millisecond)}
		_ = unix.Nanosleep(&ts, nil)
	case idle >= idleSpin:
		nap()
	}
}

// nap sleeps about 20 microseconds in the kernel: time.Sleep of so little
// can take the runtime's timer granularity (up to a millisecond), which
// would set the pace of a peer's transfer that needs this rank's progress.
func nap() {
	ts := unix.Timespec{Nsec: 20_000}
	_ = unix.Nanosleep(&ts, nil)
}

// wait progresses the worker until req completes or deadline passes; req
// is released either way. On timeout the request is cancelled and the
// peer's endpoint closed, so that nothing of it completes later.
func (t *Transport) wait(req unsafe.Pointer, r int, op string, deadline time.Time) error {
	f := &t.lib.fn
	var idle idler
	for i := 0; ; i++ {
		if s := C.p2p_ucx_status_p(f.requestCheckStatus, req); s != C.P2P_UCS_INPROGRESS {
			C.p2p_ucx_call_p(f.requestFree, req)
			if s != C.P2P_UCS_OK {
				return t.peerError(r, op, s)
			}
			return nil
		}
		idle.after(C.p2p_ucx_progress(f.workerProgress, t.worker))
		if i%64 == 0 && time.Now().After(deadline) {
			t.abandon(req)
			err := status.Errorf(status.Timeout, "UCX %s to rank %d did not complete within %v", op, r, t.timeout)
			t.fail(r, err)
			return err
		}
	}
}

// abandon cancels req and releases it; UCP frees it once it completes.
func (t *Transport) abandon(req unsafe.Pointer) {
	C.p2p_ucx_call_pp(t.lib.fn.requestCancel, t.worker, req)
	C.p2p_ucx_call_p(t.lib.fn.requestFree, req)
}

// fail records err as rank r's sticky error, cancels its outstanding
// requests and closes its endpoint without flushing.
func (t *Transport) fail(r int, err error) {
	p := &t.peers[r]
	if p.err == nil {
		p.err = err
	}
	t.cancelPending(r)
	t.dropStaged(r)
	t.dropStripes(r)
	t.dropFlushed(r)
	t.closeEndpoint(r)
	for _, o := range p.pending {
		t.release(o)
	}
	p.pending = nil
}

// closeEndpoint force-closes rank r's endpoint, waiting a bounded time for
// UCP to release it. Remote keys unpacked on it are destroyed first, as UCP
// requires.
func (t *Transport) closeEndpoint(r int) {
	p := &t.peers[r]
	if p.ep == nil {
		return
	}
	for rm := range t.remotes {
		if rm.peer == r {
			rm.destroy()
		}
	}
	var s C.int
	req := C.p2p_ucx_ep_close(t.lib.fn.epCloseNbx, p.ep, &s)
	p.ep = nil
	if req == nil {
		return
	}
	deadline := time.Now().Add(min(t.timeout, 5*time.Second))
	var idle idler
	for C.p2p_ucx_status_p(t.lib.fn.requestCheckStatus, req) == C.P2P_UCS_INPROGRESS && time.Now().Before(deadline) {
		idle.after(C.p2p_ucx_progress(t.lib.fn.workerProgress, t.worker))
	}
	C.p2p_ucx_call_p(t.lib.fn.requestFree, req)
}

// check returns rank r's sticky error, turning a failure UCP reported into
// one (and closing the endpoint) the first time it is seen.
func (t *Transport) check(r int, op string) error {
	if t.closed {
		return status.Errorf(status.State, "UCX %s to rank %d: transport closed", op, r)
	}
	if r < 0 || r >= len(t.peers) {
		return status.Errorf(status.InvalidArgument, "UCX %s: rank %d out of range [0, %d)", op, r, len(t.peers))
	}
	p := &t.peers[r]
	if p.err != nil {
		return p.err
	}
	if s := C.p2p_ucx_slot(t.failed, C.int(r)); s != 0 {
		t.fail(r, t.peerError(r, "endpoint", s))
		return p.err
	}
	return nil
}

// reap releases rank r's requests that completed, oldest first, and fails
// the peer on the first error among them.
func (t *Transport) reap(r int) error {
	p := &t.peers[r]
	n := 0
	for _, o := range p.pending {
		s := C.p2p_ucx_status_p(t.lib.fn.requestCheckStatus, o.req)
		if s == C.P2P_UCS_INPROGRESS {
			break
		}
		t.release(o)
		n++
		if s != C.P2P_UCS_OK {
			p.pending = p.pending[n:]
			err := t.peerError(r, "put", s)
			t.fail(r, err)
			return err
		}
	}
	p.pending = p.pending[n:]
	return nil
}

// peerError is a failed UCP operation toward rank r. A peer that died or
// cannot be reached never arrives, so the code is status.Timeout.
func (t *Transport) peerError(r int, op string, s C.int) error {
	return status.Errorf(status.Timeout, "UCX %s to rank %d failed: %s", op, r, t.lib.statusText(s))
}

func (t *Transport) ucsError(s C.int, op string) error {
	return status.Errorf(status.Internal, "%s: %s", op, t.lib.statusText(s))
}

// Name returns "ucx".
func (t *Transport) Name() string { return "ucx" }

// Library says which UCX library and version the transport uses.
func (t *Transport) Library() string { return t.lib.String() }

// Rank returns this rank.
func (t *Transport) Rank() int { return t.rank }

// Flush returns once every earlier Put and Signal to peer completed at the
// peer. An error is status.Timeout naming the rank when the peer failed or
// did not answer within the timeout; the peer is then unusable.
func (t *Transport) Flush(peer int) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.flush(peer)
}

// FlushWithin is Flush with its own bound instead of the transport's
// timeout: for a rank about to close, which should not wait out the full
// timeout for a peer that stopped.
func (t *Transport) FlushWithin(peer int, timeout time.Duration) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.flushBy(peer, time.Now().Add(timeout))
}

// CloseAfterFlush flushes what this rank sent each of peers that has not
// failed, each for up to linger (at least 100 ms), then closes: a peer may
// still wait for the last of it, and closing would cut it off unsent. A
// failed flush leaves nothing to save, so only Close's error is returned.
func (t *Transport) CloseAfterFlush(peers []int, linger time.Duration) error {
	return CloseAllAfterFlush([]*Transport{t}, peers, linger)
}

// CloseAllAfterFlush is CloseAfterFlush for several transports to the same
// peers (rails): every one is flushed, within one linger per peer, before
// any closes, since a peer still waiting on one of them would take the
// loss of another for this rank's failure.
func CloseAllAfterFlush(ts []*Transport, peers []int, linger time.Duration) error {
	for _, r := range peers {
		deadline := time.Now().Add(max(linger, 100*time.Millisecond))
		for _, t := range ts {
			if r != t.rank && t.PeerError(r) == nil {
				t.FlushWithin(r, max(time.Until(deadline), time.Millisecond))
			}
		}
	}
	var errs []error
	for _, t := range ts {
		errs = append(errs, t.Close())
	}
	return errors.Join(errs...)
}

func (t *Transport) flush(peer int) error { return t.flushBy(peer, time.Now().Add(t.timeout)) }

func (t *Transport) flushBy(peer int, deadline time.Time) error {
	if peer == t.rank && !t.closed {
		return nil // nothing travels to oneself
	}
	if err := t.check(peer, "flush"); err != nil {
		return err
	}
	staged := t.stage != nil && t.stage.peers[peer].on
	if staged {
		if err := t.drainStaged(peer, deadline); err != nil {
			return err
		}
	}
	if err := t.drainFlushed(peer, deadline); err != nil {
		return err
	}
	var s C.int
	req := C.p2p_ucx_ep_flush(t.lib.fn.epFlushNbx, t.peers[peer].ep, &s)
	switch s {
	case C.P2P_UCS_OK:
	case C.P2P_UCS_INPROGRESS:
		if err := t.wait(req, peer, "flush", deadline); err != nil {
			return err
		}
	default:
		err := t.peerError(peer, "flush", s)
		t.fail(peer, err)
		return err
	}
	t.peers[peer].unordered = false
	if staged {
		if err := t.awaitCredit(peer, deadline); err != nil {
			return err
		}
		// A flush may be this rank's last progress for a while: the
		// credits Progress held back go now.
		t.sendCredits(false)
	}
	if err := t.reap(peer); err != nil {
		return err
	}
	return t.check(peer, "flush")
}

// Progress advances outstanding operations without blocking and releases
// those that completed. With staging it also starts queued staged chunks
// and serves this rank's landing rings: copies landed chunks into device
// memory and applies signals behind them, so the caller must hold the
// Copier's CUDA context, and peers' staged puts advance only while this
// rank calls Progress or waits in Flush. Failures toward one peer are
// reported by the next operation on it; an error here is the Copier's, or
// a landed entry no sender of this protocol would write.
func (t *Transport) Progress() (bool, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false, status.Errorf(status.State, "UCX progress: transport closed")
	}
	active := C.p2p_ucx_progress(t.lib.fn.workerProgress, t.worker) != 0
	if active && trace.On() {
		trace.Mark("ucx progressed") // something arrived or completed
	}
	// Landed entries first: the credits they carry free ring slots that
	// queued chunks below may take at once. Credits owed go after those
	// chunks, whose entries carry them.
	err := t.landRings()
	for r := range t.peers {
		if t.peers[r].err != nil {
			continue
		}
		if t.stage != nil && t.stage.peers[r].on {
			t.pump(r)
			st := &t.stage.peers[r]
			active = active || len(st.queue) > 0 || len(st.landed) > 0
		}
		if len(t.peers[r].flushed) > 0 {
			t.pumpFlushed(r)
			active = true
		}
		if len(t.peers[r].pending) > 0 {
			t.reap(r)
			active = active || len(t.peers[r].pending) > 0
		}
	}
	if err != nil || t.stage == nil {
		return active, err
	}
	// A credit held back needs a later call: stay active until it went.
	return t.sendCredits(true) || active, nil
}

// closeGrace bounds how long Close progresses to let operations already
// under way finish (a staging receiver's credit puts, say): a zero-copy put
// cancelled in flight stays with UCP past the worker's end.
const closeGrace = 200 * time.Millisecond

// settle progresses until no healthy peer has operations pending or staged
// puts reading a send slot, for at most closeGrace, then gives UCP back
// every staged put's request, abandoning those still under way: a request
// kept past the worker is one UCP warns of at exit.
func (t *Transport) settle() {
	deadline := time.Now().Add(min(closeGrace, t.timeout))
	if t.stage != nil {
		t.sendCredits(false) // those held back: a peer may be flushing
	}
	for {
		busy := false
		for r := range t.peers {
			if t.peers[r].err != nil {
				continue
			}
			if len(t.peers[r].pending) > 0 {
				t.reap(r)
				busy = busy || len(t.peers[r].pending) > 0
			}
			busy = busy || t.sendSlotsBusy(r)
		}
		if !busy || time.Now().After(deadline) {
			break
		}
		C.p2p_ucx_progress(t.lib.fn.workerProgress, t.worker)
	}
	for r := range t.peers {
		t.dropStaged(r)
	}
}

// closeHook, when set (tests), sees the transport in Close once its
// requests should all be back with UCP, before its memory and worker go.
var closeHook func(*Transport)

// Close releases every registration, remote key, endpoint, the worker and
// the context. Outstanding operations are cancelled; call Flush first to
// complete them. Close is idempotent.
func (t *Transport) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	f := &t.lib.fn
	t.settle()
	// The stripes stop before the memory their shares read and write goes.
	if !t.closeStripes() {
		return status.Errorf(status.Timeout, "UCX close: a stripe's thread did not stop within the timeout; "+
			"its worker, the context and the staging memory are left to the process's end")
	}
	for r := range t.peers {
		p := &t.peers[r]
		t.cancelPending(r)
		t.dropFlushed(r)
		t.closeEndpoint(r)
		for _, o := range p.pending {
			t.release(o)
		}
		p.pending = nil
	}
	if closeHook != nil {
		closeHook(t)
	}
	for rm := range t.remotes {
		rm.destroy()
	}
	for l := range t.locals {
		l.unmap()
	}
	t.closeStaging()
	if t.worker != nil {
		C.p2p_ucx_call_p(f.workerDestroy, t.worker)
		t.worker = nil
	}
	if t.putsig != nil {
		C.free(unsafe.Pointer(t.putsig.ranges))
		C.free(unsafe.Pointer(t.putsig))
		t.putsig = nil
	}
	if t.landing != nil {
		C.free(t.landing)
		t.landing = nil
	}
	if t.context != nil {
		C.p2p_ucx_call_p(f.cleanup, t.context)
		t.context = nil
	}
	if t.failed != nil {
		C.free(unsafe.Pointer(t.failed))
		t.failed = nil
	}
	return nil
}
