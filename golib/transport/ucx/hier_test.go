package ucx

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/proxy"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// A pipelined all-reduce across nodes' port-channel traffic in miniature
// (the pattern a GPU kernel would push), on two ranks, pushed from the
// host: a proxy.Service with hierBlocks FIFOs over this transport, one
// pushing goroutine per FIFO standing for a block, each with a channel (and
// semaphore word) of its own. Per call, block 0 puts an 8-byte header with
// a signal; then block b, for its chunks j of the two parts, puts its
// partial j of the peer's part with a signal (after the peer's result
// j-hierRing freed the slot), waits for the peer's partial j of its own
// part, puts its result j with a signal, and at the end waits for every
// result; the waits count signals against a running total kept across
// calls, as a kernel's would. Every byte that lands is checked.
const (
	hierBlocks  = 8
	hierRing    = 2
	hierChunk   = 256 << 10
	hierCalls   = 16 // more with P2PCOMM_TEST_HIER_CALLS
	hierMaxPart = 4<<20 + 8
)

// TestProxyHier runs the pattern over plain UCX puts of host memory; a soak
// run sets P2PCOMM_TEST_HIER_CALLS (and, staged, P2PCOMM_TEST_HIER_DEFAULT_RING
// for the default ring sizes).
func TestProxyHier(t *testing.T) {
	needUCX(t)
	expectOK(t, runJob(t, "hier", 2, 60*time.Second))
}

// TestProxyHierStaged runs it with every put staged through the rings,
// device memory stood for by host memory.
func TestProxyHierStaged(t *testing.T) {
	needUCX(t)
	expectOK(t, runJob(t, "stagedhier", 2, 60*time.Second))
}

// hierSizes are the calls' part sizes in bytes, big and tiny mixed, the
// same sequence on both ranks; in one call of four the second part is half
// the first (empty for 8 bytes), so the blocks' signal counts differ by
// direction as uneven parts make them.
func hierSizes() [][2]uint64 {
	rng := rand.New(rand.NewPCG(7, 11))
	choices := []uint64{8, 8, 4096, 256 << 10, 1 << 20, 4 << 20, 4<<20 + 8}
	calls := hierCalls
	if n, err := strconv.Atoi(os.Getenv("P2PCOMM_TEST_HIER_CALLS")); err == nil {
		calls = n
	}
	out := make([][2]uint64, calls)
	for i := range out {
		a := choices[rng.IntN(len(choices))]
		b := a
		if rng.IntN(4) == 0 {
			b = a / 2 / 8 * 8
		}
		out[i] = [2]uint64{a, b}
	}
	return out
}

// hierChunks is how many chunks of a part of size bytes block b handles.
func hierChunks(size uint64, b int) int {
	chunks := int((size + hierChunk - 1) / hierChunk)
	if chunks <= b {
		return 0
	}
	return (chunks-1-b)/hierBlocks + 1
}

// hierChunkRange is block b's chunk j of a part of size bytes.
func hierChunkRange(size uint64, b, j int) (off, n uint64) {
	off = uint64(b+j*hierBlocks) * hierChunk
	return off, min(hierChunk, size-off)
}

// hierFill is what sender puts as kind (0 partial, 1 result) of block b's
// chunk j in call c.
func hierFill(p []byte, sender, c, kind, b, j int) {
	rng := rand.New(rand.NewPCG(uint64(sender)<<40|uint64(c)<<20|uint64(kind)<<16|uint64(b), uint64(j)))
	for i := 0; i < len(p); i += 8 {
		v := rng.Uint64()
		for k := 0; k < 8 && i+k < len(p); k++ {
			p[i+k] = byte(v >> (8 * k))
		}
	}
}

// hierRank is one rank's buffers, remotes and proxy.
//
//	src: send ring [block][hierRing] of chunks, then results [hierMaxPart],
//	     then the header words [2]
//	dst: receive ring [block][hierRing], results [hierMaxPart], inbox [2]
//	sem: one word per block, host memory
type hierRank struct {
	rank, peer int
	timeout    time.Duration
	src, dst   []byte
	sem        []byte
	svc        *proxy.Service
	fifos      [hierBlocks]*proxy.FIFO
	chans      [hierBlocks]uint32
	lsrc       uint32 // local id
	rdst       uint32 // remote id
	base       [hierBlocks]uint64
	verdict    atomic.Int64 // the last call whose header block 0 saw
}

const (
	hierRingBytes = hierBlocks * hierRing * hierChunk
	hierResults   = hierRingBytes
	hierHeader    = hierResults + hierMaxPart
	hierBytes     = hierHeader + 16
)

func childHier(tr *Transport, bs bootstrap.Bootstrap, timeout time.Duration, mem transport.Memory) error {
	h := &hierRank{rank: bs.Rank(), peer: 1 - bs.Rank(), timeout: timeout}
	h.src, h.dst, h.sem = mmapBytes(hierBytes), mmapBytes(hierBytes), mmapBytes(8*hierBlocks)
	lsrc, err := tr.Register(addrOf(h.src), hierBytes, mem)
	if err != nil {
		return err
	}
	ldst, err := tr.Register(addrOf(h.dst), hierBytes, mem)
	if err != nil {
		return err
	}
	lsem, err := tr.Register(addrOf(h.sem), uint64(len(h.sem)), transport.HostMemory)
	if err != nil {
		return err
	}
	keys, err := bs.AllGather(append(append([]byte(nil), ldst.Key()...), lsem.Key()...))
	if err != nil {
		return err
	}
	peerKeys := keys[h.peer]
	n := len(ldst.Key()) // both ranks' keys have the same lengths
	rdst, err := tr.Remote(h.peer, peerKeys[:n])
	if err != nil {
		return err
	}
	rsem, err := tr.Remote(h.peer, peerKeys[n:])
	if err != nil {
		return err
	}
	h.svc, err = proxy.New(tr, &proxy.HostAllocator{}, proxy.Options{Timeout: timeout, Slots: 16})
	if err != nil {
		return err
	}
	defer h.svc.Close()
	if h.lsrc, err = h.svc.AddLocal(lsrc); err != nil {
		return err
	}
	if h.rdst, err = h.svc.AddRemote(rdst); err != nil {
		return err
	}
	for b := range hierBlocks {
		if h.fifos[b], err = h.svc.NewFIFO(); err != nil {
			return err
		}
		if h.chans[b], err = h.svc.AddChannel(h.peer, rsem, uint64(8*b)); err != nil {
			return err
		}
	}
	if err := bs.Barrier(); err != nil {
		return err
	}
	h.verdict.Store(-1)
	sizes := hierSizes()
	var wg sync.WaitGroup
	errs := make([]error, hierBlocks)
	for b := range hierBlocks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for c, sz := range sizes {
				if err := h.call(b, c, sz); err != nil {
					errs[b] = fmt.Errorf("rank %d block %d call %d (parts of %d and %d bytes): %w", h.rank, b, c, sz[0], sz[1], err)
					return
				}
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	// Every signal was awaited, so every put landed; flush so that the
	// peer's last puts are not cancelled by this rank's close.
	if err := h.fifos[0].Flush(h.chans[0]); err != nil {
		return err
	}
	if err := bs.Barrier(); err != nil {
		return err
	}
	return h.svc.Close()
}

// put pushes a put with a signal on block b's channel.
func (h *hierRank) put(b int, dst, src, n uint64) error {
	_, err := h.fifos[b].Push(proxy.Op{Type: proxy.TriggerPut | proxy.TriggerSignal, Channel: h.chans[b],
		DstMemory: h.rdst, SrcMemory: h.lsrc, DstOffset: dst, SrcOffset: src, Size: n})
	return err
}

// await polls block b's semaphore until it reaches want.
func (h *hierRank) await(b int, want uint64, what string) error {
	w := (*uint64)(unsafe.Pointer(&h.sem[8*b]))
	deadline := time.Now().Add(h.timeout)
	for spin := 0; ; spin++ {
		v := atomic.LoadUint64(w)
		if v >= want {
			return nil
		}
		if err := h.svc.Err(); err != nil {
			return err
		}
		if spin&63 == 63 {
			if time.Now().After(deadline) {
				return fmt.Errorf("wait for a signal from peer %d (%s) timed out: waited for count %d, saw %d", h.peer, what, want, v)
			}
			proxy.Nap()
		}
	}
}

// check compares n bytes at off of dst with what the peer put.
func (h *hierRank) check(off, n uint64, c, kind, b, j int) error {
	want := make([]byte, n)
	hierFill(want, h.peer, c, kind, b, j)
	got := h.dst[off : off+n]
	for i := range want {
		if got[i] != want[i] {
			return fmt.Errorf("byte %d of %d of the peer's %s %d: %#x, want %#x",
				i, n, [2]string{"partial", "result"}[kind], j, got[i], want[i])
		}
	}
	return nil
}

// call is block b's part of call c; sz[m] is part m's size, this rank's
// own part being sz[rank].
func (h *hierRank) call(b, c int, sz [2]uint64) error {
	mineSize, theirSize := sz[h.rank], sz[h.peer]
	mine := hierChunks(mineSize, b)    // the peer's partials of this rank's part
	theirs := hierChunks(theirSize, b) // the peer's results of its part
	base := h.base[b]
	hdr := uint64(0)
	par := c & 1
	if b == 0 {
		hdr = 1
		hv := (*uint64)(unsafe.Pointer(&h.src[hierHeader+8*par]))
		*hv = uint64(c)<<1 | uint64(h.rank)
		if err := h.put(0, hierHeader+uint64(8*par), hierHeader+uint64(8*par), 8); err != nil {
			return err
		}
		if err := h.await(0, base+1, "header"); err != nil {
			return err
		}
		got := atomic.LoadUint64((*uint64)(unsafe.Pointer(&h.dst[hierHeader+8*par])))
		if got != uint64(c)<<1|uint64(h.peer) {
			return fmt.Errorf("header %#x, want %#x", got, uint64(c)<<1|uint64(h.peer))
		}
		h.verdict.Store(int64(c))
	} else {
		deadline := time.Now().Add(h.timeout)
		for h.verdict.Load() < int64(c) {
			if time.Now().After(deadline) {
				return fmt.Errorf("block 0's verdict on call %d did not come", c)
			}
			proxy.Nap()
		}
		hdr = 0
	}
	// Signals from the peer before iteration j: header, min(j, mine)
	// partials and min(j, theirs) results.
	before := func(j int) uint64 { return base + hdr + uint64(min(j, mine)) + uint64(min(j, theirs)) }
	ringOff := func(j int) uint64 { return uint64((b*hierRing + j%hierRing) * hierChunk) }
	for j := 0; j < max(mine, theirs); j++ {
		if j < theirs { // this rank's partial j of the peer's part
			if j >= hierRing {
				// The peer's result j-hierRing says it read that slot.
				if err := h.await(b, before(j-hierRing)+uint64(min(j-hierRing+1, mine))-uint64(min(j-hierRing, mine))+1, "result freeing a slot"); err != nil {
					return err
				}
			}
			_, n := hierChunkRange(theirSize, b, j)
			hierFill(h.src[ringOff(j):ringOff(j)+n], h.rank, c, 0, b, j)
			if err := h.put(b, ringOff(j), ringOff(j), n); err != nil {
				return err
			}
		}
		if j < mine { // the peer's partial j of this rank's part, then the result
			if err := h.await(b, before(j)+1, fmt.Sprintf("partial %d", j)); err != nil {
				return err
			}
			off, n := hierChunkRange(mineSize, b, j)
			if err := h.check(ringOff(j), n, c, 0, b, j); err != nil {
				return err
			}
			hierFill(h.src[hierResults+off:hierResults+off+n], h.rank, c, 1, b, j)
			if err := h.put(b, hierResults+off, hierResults+off, n); err != nil {
				return err
			}
		}
	}
	total := base + hdr + uint64(mine) + uint64(theirs)
	if err := h.await(b, total, "the last results"); err != nil {
		return err
	}
	for j := range theirs {
		off, n := hierChunkRange(theirSize, b, j)
		if err := h.check(hierResults+off, n, c, 1, b, j); err != nil {
			return err
		}
	}
	h.base[b] = total
	return nil
}
