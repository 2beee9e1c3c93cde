package gpucoll

import (
	"encoding/binary"
	"fmt"
	"runtime"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/symm"
)

// graphSlots tracks two-shot calls captured into CUDA graphs with inputs
// the kernel stages, so that RegisterGraphBuffers can let their replays read
// the inputs in place (GraphSlot in p2p_common.cuh).
type graphSlots struct {
	table   *symm.Buffer // maxGraphSlots GraphSlots, zero (not ready) until registered
	used    int          // slots handed out
	pending []graphInput // inputs captured since the last registration, in first-call order
	// bySrc: the slot of each input captured and not yet registered; calls
	// on the same input share it (one registration, one slot).
	bySrc map[[2]uint64]int
}

type graphInput struct {
	src    uintptr
	nbytes int64
	slot   int
}

// slotFor returns a fresh slot's device address if stream is capturing a
// graph, else 0 (the call stages as usual).
func (g *graphSlots) slotFor(drv *cuda.Driver, src uintptr, nbytes int64, stream uintptr) uintptr {
	if g.table == nil || g.used == maxGraphSlots {
		return 0
	}
	if st, err := drv.StreamCaptureStatus(stream); err != nil || st != cuda.CaptureActive {
		return 0
	}
	key := [2]uint64{uint64(src), uint64(nbytes)}
	slot, ok := g.bySrc[key]
	if !ok {
		if g.bySrc == nil {
			g.bySrc = map[[2]uint64]int{}
		}
		slot = g.used
		g.used++
		g.bySrc[key] = slot
		g.pending = append(g.pending, graphInput{src: src, nbytes: nbytes, slot: slot})
	}
	return g.table.Local + uintptr(slot)*graphSlotBytes
}

// RegisterGraphBuffers is collective: it maps the inputs of the two-shot
// calls captured since the last time (every rank must have captured the
// same calls) on every rank and readies their slots, so graph replays read
// those inputs in place instead of staging them; calls outside the graphs
// still stage them. Returns how many distinct inputs it mapped: an input
// freed since its capture, or that CUDA IPC cannot export, on any rank is
// skipped. Each call takes the pending inputs once, even if it fails. Call
// it after capture and before replaying, on every rank.
func (b *Backend) RegisterGraphBuffers() (int, error) {
	if err := b.usable(); err != nil {
		return 0, err
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return 0, err
	}
	// Whatever happens next, these inputs are done with: one that fails to
	// register keeps its slot not ready (its replays stage, which is always
	// right) instead of failing every later registration too.
	pending := b.graph.pending
	b.graph.pending, b.graph.bySrc = nil, nil
	counts, err := b.bs.AllGather(binary.LittleEndian.AppendUint64(nil, uint64(len(pending))))
	if err != nil {
		return 0, fmt.Errorf("register graph buffers: %w", err)
	}
	for r, c := range counts {
		if n := binary.LittleEndian.Uint64(c); n != uint64(len(pending)) {
			return 0, status.Errorf(status.Mismatch,
				"register_graph_buffers: rank %d captured two-shot all-reduces on %d unregistered tensors, rank %d on %d",
				b.rank, len(pending), r, n)
		}
	}
	if len(pending) == 0 {
		return 0, nil
	}
	// An input freed since its capture (its graph is gone too), or one that
	// CUDA IPC cannot export (torch's expandable segments), cannot be
	// mapped: skipped on every rank, so its replays keep staging it.
	live := make([]bool, len(pending))
	for i, in := range pending {
		live[i] = b.space.Shareable(in.src, uint64(in.nbytes))
	}
	if live, err = liveOnEveryRank(b.bs, live); err != nil {
		return 0, fmt.Errorf("register graph buffers: %w", err)
	}
	slots := make([]byte, len(pending)*graphSlotBytes) // consecutive slots; a zero one is not ready
	registered := 0
	for i, in := range pending {
		if !live[i] {
			continue
		}
		// Mapped, not registered: only this graph's replays may read it in
		// place. Once the graph is gone its memory is the caching
		// allocator's again, and an eager call on a tensor there must not
		// read the peers' old counterparts (each rank's tensor is its own).
		buf, err := b.space.Map(in.src, uint64(in.nbytes)) // collective
		if err != nil {
			return 0, fmt.Errorf("register graph buffer %d of %d: %w", i+1, len(pending), err)
		}
		registered++
		rec := slots[i*graphSlotBytes:]
		binary.LittleEndian.PutUint64(rec, 1)
		off := in.src - buf.Local
		for r := range b.size {
			binary.LittleEndian.PutUint64(rec[8+8*r:], uint64(buf.Peers[r]+off))
		}
	}
	first := b.graph.table.Local + uintptr(pending[0].slot)*graphSlotBytes
	err = b.drv.MemcpyAsync(first, uintptr(unsafe.Pointer(&slots[0])), uint64(len(slots)), 0)
	if err == nil {
		err = b.drv.StreamSynchronize(0)
	}
	runtime.KeepAlive(slots)
	// No rank may replay before every rank's slots are ready: a ready rank
	// stops staging what a peer that is not ready yet would read.
	if err = bootstrap.Agree(b.bs, err); err != nil {
		return 0, fmt.Errorf("register graph buffers: %w", err)
	}
	return registered, nil
}

// liveOnEveryRank all-gathers which of the inputs each rank still has
// allocated (every rank has as many) and keeps those that all have.
func liveOnEveryRank(bs bootstrap.Bootstrap, live []bool) ([]bool, error) {
	mine := make([]byte, len(live))
	for i, ok := range live {
		if ok {
			mine[i] = 1
		}
	}
	all, err := bs.AllGather(mine)
	if err != nil {
		return nil, err
	}
	out := make([]bool, len(live))
	for i := range out {
		out[i] = true
		for _, rec := range all {
			out[i] = out[i] && len(rec) == len(live) && rec[i] == 1
		}
	}
	return out, nil
}
