package moe

import (
	"fmt"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
)

// The staged path's device half (native/kernels/moe_staged.cu): where the
// configuration allows, the rows cross the PCIe bus once each way. A
// dispatch uploads the received rows packed as they arrived (one per
// token and source) and lays them out in expert-major order on the device
// (K rows per token at most), instead of laying them out on the host and
// uploading every row; a combine computes the weighted partials on the
// device from the expert outputs where they are and downloads only those
// (one per token and source), instead of downloading every expert row and
// summing on the host. The host still decides every position, so results
// keep the host path's bits.

// stagedGrid bounds the kernels' grids (they loop over their rows).
const stagedGrid = 1024

// stagedKernels are the kernels and device buffers of one staged EP.
type stagedKernels struct {
	expand, partials fnOf
	rows             growBuf // on the device: packed received rows (dispatch), then partials (combine)
	index            growBuf // on the device: the expand's row index, or the partials' pair rows then weights
}

// fnOf is a loaded kernel and the name it is reported by.
type fnOf struct {
	fn   cuda.Function
	name string
}

// stagedKernelsUsable says whether the kernels take p's configuration (the
// host does the work otherwise).
func stagedKernelsUsable(p *plan) bool {
	_, ok := cTypes[p.dtype]
	return ok && (p.transit == reduce.Float32 || p.transit == p.dtype) && p.rowBytes()%16 == 0
}

// loadStagedKernels compiles (once per process) and loads the kernels for
// p, or returns nil when they do not take its configuration.
func loadStagedKernels(dev StagedDevice, p *plan) (*stagedKernels, error) {
	if !stagedKernelsUsable(p) {
		return nil, nil
	}
	k := &stagedKernels{rows: growBuf{device: true}, index: growBuf{device: true}}
	expand, partials := stagedExprs(p.dtype, p.transit)
	for _, f := range []struct {
		to   *fnOf
		expr string
	}{{&k.expand, expand}, {&k.partials, partials}} {
		fn, err := dev.KernelFunction(stagedFile, f.expr)
		if err != nil {
			return nil, fmt.Errorf("ExpertParallel across nodes: load %s: %w", f.expr, err)
		}
		*f.to = fnOf{fn, f.expr}
	}
	return k, nil
}

func (k *stagedKernels) launch(dev StagedDevice, f fnOf, items int64, sp *stagedParams, stream uintptr) error {
	if items == 0 {
		return nil
	}
	grid := uint32(min(items, stagedGrid))
	if err := dev.LaunchFunction(f.fn, grid, threads, 0, stream, paramBytes(sp)); err != nil {
		return fmt.Errorf("ExpertParallel across nodes: launch %s: %w", f.name, err)
	}
	return nil
}

func (k *stagedKernels) free(dev StagedDevice) {
	k.rows.free(dev)
	k.index.free(dev)
}

// packedBases is, for each source, where its received rows begin when the
// sources' rows are packed in source order (counts[s] rows each), and the
// total.
func packedBases(counts []int32) ([]int64, int64) {
	bases := make([]int64, len(counts))
	var n int64
	for s, c := range counts {
		bases[s] = n
		n += int64(c)
	}
	return bases, n
}

// expandOnDevice finishes a dispatch on the device: the host path settles
// the order (info, counts and what combine needs) into the pinned buffers,
// laid out for held rows; the received rows go up packed, with each output
// row's packed row, and moe_staged_expand lays them out in out.X.
func (s *stagedEngine) expandOnDevice(cpu *cpuEngine, out Rows, held int64, stream uintptr) error {
	p, k := s.p, s.k
	var items, total int64
	err := s.onHost(func() (err error) {
		items, total, err = s.packForExpand(cpu, held)
		return err
	})
	if err != nil {
		return err
	}
	rb := p.rowBytes()
	if err := k.rows.reserve(s.dev, uint64(max(total, 1)*rb), s.mostPacked(), "the received rows"); err != nil {
		return err
	}
	if err := k.index.reserve(s.dev, uint64(max(items, 1))*4, 8*uint64(p.maxRecvRows), "the rows' order"); err != nil {
		return err
	}
	if total > 0 {
		err = s.dev.MemcpyAsync(k.rows.p, s.rows.addr(), uint64(total*rb), stream)
	}
	if err == nil && items > 0 {
		err = s.dev.MemcpyAsync(k.index.p, s.index.addr(), uint64(items)*4, stream)
	}
	if err == nil {
		sp := &stagedParams{Src: uint64(k.rows.p), Dst: uint64(out.X), Index: uint64(k.index.p),
			Items: items, RowPacks: int32(rb / 16)}
		err = k.launch(s.dev, k.expand, items, sp, stream)
	}
	if err != nil {
		s.dev.StreamSynchronize(stream) // copies may have been queued
		return err
	}
	return s.upload(out, held, false, stream)
}

// mostPacked is the most bytes of received rows, or of partials, a call
// packs: one per token and source.
func (s *stagedEngine) mostPacked() uint64 {
	p := s.p
	return uint64(p.world) * uint64(p.maxTokens) * uint64(max(p.rowBytes(), int64(p.hidden*p.transit.Size())))
}

// packForExpand is the host's half of a dispatch's expand: it settles the
// order (info and counts, laid out for held rows) into the pinned buffers,
// packs the received rows in source order into s.rows and each output
// row's packed row into s.index, and returns the output rows and the
// packed ones. No CUDA call: it also runs as a host function.
func (s *stagedEngine) packForExpand(cpu *cpuEngine, held int64) (items, packed int64, err error) {
	p := s.p
	if err := s.reserveMeta(held); err != nil {
		return 0, 0, err
	}
	moves, err := cpu.order(Rows{Info: s.info.addr(), Counts: s.counts.addr(), Rows: held})
	if err != nil {
		return 0, 0, err
	}
	s.lastRows = int64(len(moves))
	rb, Tm := p.rowBytes(), int64(p.maxTokens)
	counts := cpu.counts[p.rank]
	bases, total := packedBases(counts)
	if err := s.rows.reserve(s.dev, uint64(max(total, 1)*rb), s.mostPacked(), "the received rows"); err != nil {
		return 0, 0, err
	}
	if err := s.index.reserve(s.dev, uint64(max(len(moves), 1))*4, 8*uint64(p.maxRecvRows), "the rows' order"); err != nil {
		return 0, 0, err
	}
	own := cpu.recvX[p.rank]
	packedRows := bytesAt(s.rows.addr(), total*rb)
	for src, c := range counts {
		n := int(c)
		from, to := int64(src)*Tm*rb, bases[src]*rb
		split(n, workers(n, rb), func(_, lo, hi int) {
			copy(packedRows[to+int64(lo)*rb:to+int64(hi)*rb], own[from+int64(lo)*rb:from+int64(hi)*rb])
		})
	}
	index := int32sAt(s.index.addr(), int64(len(moves)))
	for _, m := range moves {
		q := m.src / rb // s*Tm + slot
		index[m.dst] = int32(bases[q/Tm] + q%Tm)
	}
	return int64(len(moves)), total, nil
}

// partialsOnDevice computes, from the expertRows rows at expertOut
// (device), this rank's partial for every token it received, packed in
// source order, and downloads them into s.rows; it returns where each
// source's begin (in partials). A pair whose row lies past expertRows
// counts as none, as in the single-node kernels. The caller synchronizes
// the stream before reading.
func (s *stagedEngine) partialsOnDevice(cpu *cpuEngine, expertOut uintptr, expertRows int64, stream uintptr) ([]int64, error) {
	p, k := s.p, s.k
	var bases []int64
	var n int64
	err := s.onHost(func() (err error) {
		bases, n, err = s.pairsForPartials(cpu, expertRows, false)
		return err
	})
	if err != nil {
		return nil, err
	}
	pairs := uint64(n) * uint64(p.topK)
	cb := int64(p.hidden * p.transit.Size())
	if err := k.index.reserve(s.dev, max(pairs, 1)*8, 8*uint64(p.maxRecvRows), "the pairs' rows and weights"); err != nil {
		return nil, err
	}
	if err := k.rows.reserve(s.dev, uint64(max(n, 1)*cb), s.mostPacked(), "the partials"); err != nil {
		return nil, err
	}
	if err := s.rows.reserve(s.dev, uint64(max(n, 1)*cb), s.mostPacked(), "the partials"); err != nil {
		return nil, err
	}
	if pairs > 0 {
		err = s.dev.MemcpyAsync(k.index.p, s.index.addr(), pairs*8, stream)
	}
	if err == nil {
		sp := &stagedParams{Src: uint64(expertOut), Dst: uint64(k.rows.p), Index: uint64(k.index.p),
			Weights: uint64(k.index.p) + pairs*4, Items: n, RowPacks: int32(p.rowBytes() / 16), TopK: int32(p.topK)}
		err = k.launch(s.dev, k.partials, n, sp, stream)
	}
	if err == nil {
		err = s.download(s.rows.addr(), k.rows.p, uint64(n*cb), stream)
	}
	return bases, err
}

// pairsForPartials is the host's half of a combine's partials: for every
// token this rank received, packed in source order, the expert rows of its
// K pairs (-1: none, or past expertRows) into s.index, then their weights,
// right after the rows or (fixedWeights) at weightsAt, where a launch
// recorded before the count was known finds them. It returns where each
// source's tokens begin and their number. No CUDA call: it also runs as a
// host function.
func (s *stagedEngine) pairsForPartials(cpu *cpuEngine, expertRows int64, fixedWeights bool) ([]int64, int64, error) {
	p := s.p
	K, Tm, MW := p.topK, p.maxTokens, 2*p.topK+1
	counts, meta := cpu.counts[p.rank], cpu.meta[p.rank]
	bases, n := packedBases(counts)
	pairs := uint64(n) * uint64(K)
	if err := s.index.reserve(s.dev, max(pairs, 1)*8, 8*uint64(p.maxRecvRows), "the pairs' rows and weights"); err != nil {
		return nil, 0, err
	}
	wAt := int64(pairs)
	if fixedWeights {
		wAt = s.weightsAt() / 4
	}
	rows := int32sAt(s.index.addr(), wAt+int64(pairs))
	for src, c := range counts {
		for slot := range int(c) {
			i := (bases[src] + int64(slot)) * int64(K)
			at := (src*Tm + slot) * K
			for k, row := range cpu.combRows[at : at+K] {
				if int64(row) >= expertRows {
					row = -1
				}
				rows[i+int64(k)] = row
			}
			copy(rows[wAt+i:wAt+i+int64(K)], meta[(src*Tm+slot)*MW+K:(src*Tm+slot)*MW+2*K])
		}
	}
	return bases, n, nil
}

// weightsAt is where the pairs' weights begin in s.index for launches
// recorded before the count is known: past room for every pair's row.
func (s *stagedEngine) weightsAt() int64 { return 4 * s.p.maxRecvRows }
