package moe

import (
	"encoding/binary"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/shm"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/topo"
	timeline "github.com/p2pcomm/p2pcomm/golib/trace"
	"github.com/p2pcomm/p2pcomm/golib/transport"
	"github.com/p2pcomm/p2pcomm/golib/transport/ucx"
)

// The CPU path across nodes. The backend maps only the buffers of this
// rank's node; a rank of another node is written through UCX instead: each
// rank registers its symmetric buffer, and what a direct write would store
// at an offset of a remote peer's buffer is built in this rank's outbox (or
// already sits at the same offset of its own buffer) and put there. The
// engine's barriers become a round of flags: a local peer's is stored into
// its buffer, a remote peer's is a signal that goes out once every earlier
// put to that peer has landed (SignalFlushed), so a rank past a barrier
// holds every byte its peers wrote into it before the barrier, wherever they
// are.

// Rails (topo.NetRails). Rail 0 is n.t: it carries the barrier's flags and
// blame words in the symmetric buffer and every small put. Each further
// rail is a UCX transport of its own that carries a stripe of every large
// put, and at a barrier a flag of its own per rank, signalled behind its
// stripes (SignalFlushed): a rank past a barrier has every rail's flag from
// every peer, so every stripe they put before it. While a barrier waits,
// a goroutine per further rail progresses it, so that the rails' bytes move
// on several threads at once.
type rail struct {
	t      *ucx.Transport
	self   transport.Local    // the symmetric buffer
	out    transport.Local    // the outbox (nil without one)
	flags  []uint64           // [world]: word s is rank s's barrier count on this rail, written by s only
	mem    []byte             // flags' memory
	remote []transport.Remote // by rank: its symmetric buffer; nil on this node
	rflags []transport.Remote // by rank: its flags of this rail
	bg     *ucx.Background
}

// railStripeMin is the smallest put split across rails: below it one tcp
// send is cheaper than several.
const railStripeMin = 256 << 10

// railYieldPolls is how many idle polls a rail's goroutine yields between
// before it naps between polls, milliseconds' worth.
const railYieldPolls = 1 << 14

// groupBootstrap is the construction's Group as the bootstrap UCX opens
// through (the communicator's own, which this EP does not close).
type groupBootstrap struct{ Group }

func (groupBootstrap) Close() error { return nil }

// netPeers is one rank's reach into the buffers of the other nodes' ranks,
// and the barrier over every rank.
type netPeers struct {
	t           *ucx.Transport
	topo        *topo.Topology
	rank, world int
	timeout     time.Duration
	pace        func(int)
	linger      time.Duration // how long a broken EP's close flushes
	blameWait   time.Duration // how long a timed-out rank listens for whom its awaited rank blames

	self     transport.Local    // this rank's symmetric buffer
	remote   []transport.Remote // by rank: its symmetric buffer; nil on this node
	outbox   []byte             // [boxes][boxBytes]: what goes to one remote rank per call
	out      transport.Local
	boxBytes uint64
	box      []int // by rank: its outbox, -1 on this node

	flagOff uint64     // the barrier flags' offset in every rank's buffer: [W]uint64, word s written by rank s only
	flags   [][]uint64 // by rank on this node: its flags as mapped here (this rank's at [rank])
	blames  [][]uint64 // by rank on this node: its blame words, after its flags, as mapped here
	blamed  uint64     // the blame word this rank last published
	seen    []uint64   // by rank: the newest blame word read from it
	pids    []*uint64  // by rank on this node: the pid it published in its buffer
	entered uint64     // barriers this rank has entered

	broken error
	bg     *ucx.Background // progresses UCX between calls
	rails  []*rail         // rails 1 and up
}

// openNetPeers opens UCX and exchanges keys, collectively. base is this
// rank's symmetric buffer of size bytes, mapped[r] rank r's as this process
// maps it (0 for ranks of other nodes); the flags (then as many blame
// words) and the pid word live at flagOff and pidOff of every rank's. boxBytes is the outbox each remote
// rank needs. Any rank's failure is every rank's.
func openNetPeers(g Group, host Host, base uintptr, size int64, mapped []uintptr, flagOff, pidOff int64, boxBytes uint64) (*netPeers, error) {
	bs := groupBootstrap{g}
	if err := bootstrap.Agree(bs, ucx.Available(nil)); err != nil {
		return nil, fmt.Errorf("ExpertParallel across nodes needs UCX: %w", err)
	}
	tp := host.Topology()
	t, err := ucx.Open(bs, ucx.Options{Timeout: host.Timeout(), Stage: ucx.StageNever, SeparateHosts: tp.SharedHosts, OneHost: tp.OneHost(),
		HostOnly: true})
	if err != nil {
		return nil, fmt.Errorf("ExpertParallel across nodes: %w", err)
	}
	n := &netPeers{t: t, topo: tp, rank: g.Rank(), world: g.Size(), timeout: host.Timeout(), pace: host.Pace,
		remote: make([]transport.Remote, g.Size()), box: make([]int, g.Size()), boxBytes: boxBytes,
		flagOff: uint64(flagOff), flags: make([][]uint64, g.Size()), blames: make([][]uint64, g.Size()),
		seen: make([]uint64, g.Size()), pids: make([]*uint64, g.Size())}
	n.linger = min(n.timeout/8, 500*time.Millisecond)
	n.blameWait = collective.BlameWait(n.timeout)
	boxes := 0
	for r := range n.world {
		n.box[r] = -1
		if tp.SameNode(r) {
			n.flags[r] = unsafe.Slice((*uint64)(hostPtr(mapped[r]+uintptr(flagOff))), n.world)
			n.blames[r] = unsafe.Slice((*uint64)(hostPtr(mapped[r]+uintptr(flagOff)+uintptr(8*n.world))), n.world)
			n.pids[r] = (*uint64)(hostPtr(mapped[r] + uintptr(pidOff)))
		} else {
			n.box[r] = boxes
			boxes++
		}
	}
	atomic.StoreUint64(n.pids[n.rank], uint64(os.Getpid()))
	key, err := n.register(base, size, boxes)
	if err = bootstrap.Agree(bs, err); err != nil {
		n.close()
		return nil, fmt.Errorf("ExpertParallel across nodes: %w", err)
	}
	keys, err := g.AllGather(key)
	if err == nil {
		err = n.connect(keys)
	}
	if err = bootstrap.Agree(bs, err); err != nil {
		n.close()
		return nil, fmt.Errorf("ExpertParallel across nodes: %w", err)
	}
	n.bg = ucx.StartBackground(n.t)
	rails, err := tp.AgreeRails(bs, host.NetRails())
	for k := 1; err == nil && k < rails; k++ {
		err = n.openRail(bs, tp, host.Timeout(), base, size)
	}
	if err != nil {
		n.close()
		return nil, fmt.Errorf("ExpertParallel across nodes: %w", err)
	}
	return n, nil
}

// openRail opens one more rail: a transport, this rank's buffer, outbox and
// flags registered with it, and every remote rank's. Collective; any rank's
// failure is every rank's.
func (n *netPeers) openRail(bs bootstrap.Bootstrap, tp *topo.Topology, timeout time.Duration, base uintptr, size int64) error {
	t, err := ucx.Open(bs, ucx.Options{Timeout: timeout, Stage: ucx.StageNever, SeparateHosts: tp.SharedHosts, OneHost: tp.OneHost(),
		HostOnly: true})
	if err = bootstrap.Agree(bs, err); err != nil {
		if t != nil {
			t.Close()
		}
		return err
	}
	l := &rail{t: t, remote: make([]transport.Remote, n.world), rflags: make([]transport.Remote, n.world)}
	n.rails = append(n.rails, l)
	var key []byte
	err = func() error {
		if l.self, err = t.Register(base, uint64(size), transport.HostMemory); err != nil {
			return err
		}
		if n.out != nil {
			if l.out, err = t.Register(uintptr(unsafe.Pointer(&n.outbox[0])), uint64(len(n.outbox)), transport.HostMemory); err != nil {
				return err
			}
		}
		if l.mem, err = unix.Mmap(-1, 0, 8*n.world, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
			l.mem = nil
			return status.Errorf(status.Capacity, "map a rail's barrier flags: %v", err)
		}
		l.flags = unsafe.Slice((*uint64)(unsafe.Pointer(&l.mem[0])), n.world)
		flags, err := t.Register(uintptr(unsafe.Pointer(&l.mem[0])), uint64(len(l.mem)), transport.HostMemory)
		if err != nil {
			return err
		}
		key = transport.AppendKeys(nil, l.self.Key(), flags.Key())
		return nil
	}()
	if err = bootstrap.Agree(bs, err); err != nil {
		return err
	}
	keys, err := bs.AllGather(key)
	for r, k := range keys {
		if err != nil || n.box[r] < 0 {
			continue
		}
		two, ok := transport.SplitKeys(k, 2)
		if !ok {
			err = status.Errorf(status.Bootstrap, "rank %d sent truncated rail keys", r)
			break
		}
		if l.remote[r], err = t.Remote(r, two[0]); err == nil {
			l.rflags[r], err = t.Remote(r, two[1])
		}
	}
	if err = bootstrap.Agree(bs, err); err != nil {
		return err
	}
	l.bg = ucx.StartBackground(t)
	return nil
}

// stripes calls put for each rail's share of bytes, in order and covering
// each byte once: all of them on rail 0 below railStripeMin, else stripes
// of a whole number of pages, at most one per rail.
func (n *netPeers) stripes(bytes uint64, put func(k int, at, size uint64) error) error {
	if len(n.rails) == 0 || bytes < railStripeMin {
		return put(0, 0, bytes)
	}
	parts := uint64(len(n.rails) + 1)
	stripe := ((bytes+parts-1)/parts + 4095) &^ 4095
	for k, at := 0, uint64(0); at < bytes; k, at = k+1, at+stripe {
		if err := put(k, at, min(stripe, bytes-at)); err != nil {
			return err
		}
	}
	return nil
}

// spinRails progresses every further rail on a goroutine of its own until
// the returned func is called (and has waited for them).
func (n *netPeers) spinRails() func() {
	if len(n.rails) == 0 {
		return func() {}
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	for _, l := range n.rails {
		l.bg.Enter()
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Yield, not nap, through the short lulls of a call: a rail
			// napping when its bytes arrive holds the whole barrier up.
			for idle := 0; !stop.Load(); {
				if active, _ := l.t.Progress(); active {
					idle = 0
				} else if idle++; idle < railYieldPolls {
					runtime.Gosched()
				} else {
					time.Sleep(20 * time.Microsecond)
				}
			}
		}()
	}
	return func() {
		stop.Store(true)
		wg.Wait()
		for _, l := range n.rails {
			l.bg.Leave()
		}
	}
}

// register registers this rank's buffer and maps and registers the outbox;
// it returns the buffer's key.
func (n *netPeers) register(base uintptr, size int64, boxes int) ([]byte, error) {
	var err error
	if n.self, err = n.t.Register(base, uint64(size), transport.HostMemory); err != nil {
		return nil, err
	}
	if boxes > 0 && n.boxBytes > 0 {
		if n.outbox, err = unix.Mmap(-1, 0, int(uint64(boxes)*n.boxBytes), unix.PROT_READ|unix.PROT_WRITE,
			unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
			n.outbox = nil
			return nil, status.Errorf(status.Capacity, "map %d bytes of outbox for %d ranks of other nodes: %v", uint64(boxes)*n.boxBytes, boxes, err)
		}
		if n.out, err = n.t.Register(uintptr(unsafe.Pointer(&n.outbox[0])), uint64(len(n.outbox)), transport.HostMemory); err != nil {
			return nil, err
		}
	}
	return binary.LittleEndian.AppendUint64(n.self.Key(), uint64(size)), nil
}

// connect turns the keys of the other nodes' ranks into remote buffers.
func (n *netPeers) connect(keys [][]byte) error {
	mine := n.self.Size()
	for r, k := range keys {
		if n.box[r] < 0 {
			continue
		}
		if len(k) < 8 {
			return status.Errorf(status.Bootstrap, "rank %d sent no key of its buffers", r)
		}
		if size := binary.LittleEndian.Uint64(k[len(k)-8:]); size != mine {
			return status.Errorf(status.Mismatch, "rank %d's buffers are %d bytes, this rank's %d", r, size, mine)
		}
		var err error
		if n.remote[r], err = n.t.Remote(r, k[:len(k)-8]); err != nil {
			return err
		}
	}
	return nil
}

// boxOf is the outbox of remote rank r.
func (n *netPeers) boxOf(r int) []byte {
	b := uint64(n.box[r])
	return n.outbox[b*n.boxBytes : (b+1)*n.boxBytes]
}

// put copies bytes of rank r's outbox at boxOff to off of r's buffer.
func (n *netPeers) put(r int, off, boxOff, bytes uint64, what string) error {
	if bytes == 0 {
		return nil
	}
	from := uint64(n.box[r])*n.boxBytes + boxOff
	err := n.stripes(bytes, func(k int, at, size uint64) error {
		if k == 0 {
			return n.t.Put(n.remote[r], off+at, n.out, from+at, size)
		}
		l := n.rails[k-1]
		return l.t.Put(l.remote[r], off+at, l.out, from+at, size)
	})
	if err != nil {
		return n.fail(r, fmt.Sprintf("could not be sent its %s: %v", what, err))
	}
	return nil
}

// putOwn copies bytes at off of this rank's buffer to the same offset of
// rank r's (what this rank stores into every rank's copy of a word).
func (n *netPeers) putOwn(r int, off, bytes uint64, what string) error {
	if err := n.t.Put(n.remote[r], off, n.self, off, bytes); err != nil {
		return n.fail(r, fmt.Sprintf("could not be sent its %s: %v", what, err))
	}
	return nil
}

// barrier returns once every rank has entered it, and with it every byte
// any rank wrote into this rank's buffer before entering. It waits at most
// the timeout, progressing UCX (peers' puts land only while this rank
// progresses), and names the rank that never arrived.
func (n *netPeers) barrier(call collective.Call, phase string) error {
	if n.broken != nil {
		return n.broken
	}
	n.bg.Enter()
	defer n.bg.Leave()
	if timeline.On() {
		timeline.Mark("moe barrier " + phase)
		defer timeline.Mark("moe barrier " + phase + " passed")
	}
	n.entered++
	want := n.entered
	mine := n.flagOff + 8*uint64(n.rank)
	// Arrive at every rank this rank can reach, even past one it cannot:
	// a rank that stopped short would look to the others like the culprit.
	var unsent error
	for o := 1; o < n.world; o++ {
		r := (n.rank + o) % n.world
		if n.remote[r] == nil {
			atomic.StoreUint64(&n.flags[r][n.rank], want) // after this rank's direct writes into r
			continue
		}
		if err := n.t.SignalFlushed(n.remote[r], mine, 1); err != nil && unsent == nil {
			unsent = n.fail(r, fmt.Sprintf("could not be sent the %s barrier of %s: %v", phase, call, err))
		}
		for _, l := range n.rails {
			if err := l.t.SignalFlushed(l.rflags[r], 8*uint64(n.rank), 1); err != nil && unsent == nil {
				unsent = n.fail(r, fmt.Sprintf("could not be sent the %s barrier of %s on a rail: %v", phase, call, err))
			}
		}
	}
	if unsent != nil {
		return unsent
	}
	// The rails' goroutines start once the signals went out: they would
	// take turns with them at each rail's transport.
	defer n.spinRails()()
	start := time.Now()
	for o := 1; o < n.world; o++ {
		r := (n.rank + o) % n.world
		for i := 0; !n.arrived(r, want); i++ {
			n.t.Progress() // its only error is a device copier's, and there is none here
			n.pace(i)
			if i%64 != 63 {
				continue
			}
			// A rank that settled whom to blame has the answer; else any
			// missing rank known to have failed is the one to name, not
			// merely the first one still awaited.
			if b, ok := n.settledBlame(); ok {
				return n.adopt(b, phase, call)
			}
			for q := 0; q < n.world; q++ {
				if q == n.rank || n.arrived(q, want) {
					continue
				}
				if gone := n.gone(q); gone != "" {
					n.publish(makeBlame(q, n.rank, blameGone, true))
					return n.fail(q, fmt.Sprintf("%s before the %s barrier of %s", gone, phase, call))
				}
			}
			if time.Since(start) > n.timeout {
				return n.late(r, phase, call)
			}
		}
	}
	return nil
}

// arrived reports whether rank r's want-th barrier flag came, on every rail.
func (n *netPeers) arrived(r int, want uint64) bool {
	if atomic.LoadUint64(&n.flags[n.rank][r]) < want {
		return false
	}
	if n.remote[r] == nil {
		return true
	}
	for _, l := range n.rails {
		if atomic.LoadUint64(&l.flags[r]) < want {
			return false
		}
	}
	return true
}

// A blame word says whom a rank holds responsible for its failure: the
// culprit + 1 (bits 0-15), the rank that saw it first + 1 (bits 16-31),
// how (bits 32-33), whether it is settled (bit 34), and from bit 40 how
// many this rank has published, so that a later word is a larger one and a
// reader keeps the largest it has seen (two puts of one peer may land out
// of order). Every rank's word
// sits in every rank's buffer after the flags, written by that rank only:
// stored on its node, a SignalFlushed of the difference across nodes (the
// word's running total is the value). A rank that times out waiting for
// another may only be waiting for a rank that waits in turn: it publishes
// a tentative blame, listens a little while for the awaited rank's, and
// settles on whom that one blames, so that every survivor names the rank
// that stopped, not a neighbour that gave up before it.
const (
	blameLate  = 1 // never arrived within the timeout
	blameGone  = 2 // exited, or its endpoint failed
	blameFinal = 1 << 34
	blameSeq   = 1 << 40
)

func makeBlame(culprit, seer, how int, final bool) uint64 {
	b := uint64(culprit+1) | uint64(seer+1)<<16 | uint64(how)<<32
	if final {
		b |= blameFinal
	}
	return b
}

func blameCulprit(b uint64) int { return int(b&0xffff) - 1 }
func blameSeer(b uint64) int    { return int(b>>16&0xffff) - 1 }
func blameHow(b uint64) int     { return int(b >> 32 & 3) }

// publish makes b this rank's blame word wherever ranks look for it.
func (n *netPeers) publish(b uint64) {
	b = b&(blameSeq-1) | (n.blamed/blameSeq+1)*blameSeq
	for r := range n.world {
		if n.remote[r] == nil {
			atomic.StoreUint64(&n.blames[r][n.rank], b)
		} else if n.t.PeerError(r) == nil {
			n.t.SignalFlushed(n.remote[r], n.flagOff+8*uint64(n.world+n.rank), b-n.blamed) // a failed peer hears nothing anyway
		}
	}
	n.blamed = b
}

// blameOf is rank q's newest blame word as this rank has it (0: none).
func (n *netPeers) blameOf(q int) uint64 {
	n.seen[q] = max(n.seen[q], atomic.LoadUint64(&n.blames[n.rank][q]))
	return n.seen[q]
}

// settledBlame returns a settled blame of another rank that names someone
// other than this rank.
func (n *netPeers) settledBlame() (uint64, bool) {
	for q := range n.world {
		if b := n.blameOf(q); q != n.rank && b&blameFinal != 0 && blameCulprit(b) != n.rank {
			return b, true
		}
	}
	return 0, false
}

// late ends this rank's wait for rank r at the timeout: it publishes a
// tentative blame, follows r's own for up to blameWait, and breaks the EP
// naming whom the chain ends at.
func (n *netPeers) late(r int, phase string, call collective.Call) error {
	b := makeBlame(r, n.rank, blameLate, false)
	n.publish(b)
	deadline := time.Now().Add(n.blameWait)
	for i := 0; time.Now().Before(deadline); i++ {
		n.t.Progress()
		n.pace(4096 + i)
		if got, ok := n.settledBlame(); ok {
			return n.adopt(got, phase, call)
		}
		if got := n.blameOf(blameCulprit(b)); got != 0 && blameCulprit(got) != n.rank {
			b = got &^ blameFinal & (blameSeq - 1)
			if got&blameFinal != 0 {
				break
			}
		}
	}
	return n.adopt(b, phase, call)
}

// adopt settles on blame b as this rank's own, passes it on and breaks the
// EP naming its culprit.
func (n *netPeers) adopt(b uint64, phase string, call collective.Call) error {
	n.publish(b | blameFinal)
	c := blameCulprit(b)
	why := fmt.Sprintf("never arrived at the %s barrier of %s within %v (P2PCOMM_TIMEOUT_MS)", phase, call, n.timeout)
	if blameHow(b) == blameGone {
		why = fmt.Sprintf("failed before the %s barrier of %s", phase, call)
	}
	if seer := blameSeer(b); seer != n.rank {
		why += fmt.Sprintf(", as rank %d saw it", seer)
	}
	return n.fail(c, why)
}

// gone says how rank r is known to have failed, or "".
func (n *netPeers) gone(r int) string {
	if n.remote[r] == nil {
		if pid := int(atomic.LoadUint64(n.pids[r])); pid != 0 && !shm.Alive(pid) {
			return fmt.Sprintf("exited (pid %d)", pid)
		}
		return ""
	}
	if err := n.t.PeerError(r); err != nil {
		return fmt.Sprintf("failed (%v)", err)
	}
	for _, l := range n.rails {
		if err := l.t.PeerError(r); err != nil {
			return fmt.Sprintf("failed (%v)", err)
		}
	}
	return ""
}

// fail breaks the EP with an error naming rank r (why completes "rank 3
// (node 1) ...").
func (n *netPeers) fail(r int, why string) error {
	n.broken = status.Errorf(status.Timeout, "ExpertParallel across nodes: rank %d (node %d) %s; seen by rank %d; the ExpertParallel cannot continue",
		r, n.topo.NodeOf[r], why, n.rank)
	return n.broken
}

// close releases UCX (and with it every registration), then the outbox.
// Not collective. It first flushes what this rank sent each remote rank,
// for a bounded time: a peer may still wait in the last barrier for a
// signal of this rank's, and closing would cut it off unsent. A healthy EP
// waits up to the timeout for that (on a host with more threads than
// cores a peer's rail may not progress for a long while, and it would
// count this rank as failed); a broken one, whose peers may be gone, only
// lingers.
func (n *netPeers) close() error {
	var remote []int
	for r, rem := range n.remote {
		if rem != nil {
			remote = append(remote, r)
		}
	}
	ts := []*ucx.Transport{}
	if n.t != nil {
		ts = append(ts, n.t)
	}
	for _, l := range n.rails {
		ts = append(ts, l.t)
	}
	wait := n.linger
	if n.broken == nil {
		wait = n.timeout
	}
	// The background loops go on progressing every transport meanwhile:
	// a peer flushing one of them toward this rank waits for this rank to
	// progress it, while this rank flushes another toward that peer.
	err := ucx.CloseAllAfterFlush(ts, remote, wait)
	n.bg.Stop()
	n.bg = nil
	for _, l := range n.rails {
		l.bg.Stop()
	}
	for _, l := range n.rails {
		if l.mem != nil {
			unix.Munmap(l.mem)
		}
	}
	n.t, n.rails = nil, nil
	if n.outbox != nil {
		unix.Munmap(n.outbox)
		n.outbox = nil
	}
	if n.broken == nil {
		n.broken = status.Errorf(status.State, "ExpertParallel is closed")
	}
	return err
}
