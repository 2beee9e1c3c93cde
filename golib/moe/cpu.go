package moe

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
)

// cpuEngine runs dispatch and combine in host memory: every source writes
// its tokens' rows and metadata straight into the destinations' symmetric
// buffers, and every expert rank its partials into the sources', ordered by
// the backend's barriers (a start and a middle barrier per call, as on the
// GPU, for the same reasons). The same results as the kernels, bit for bit.
// Across nodes, what goes to a rank of another node travels through UCX to
// the same offsets, and the barriers are net's (nodes.go).
type cpuEngine struct {
	host Host
	p    *plan
	net  *netPeers // nil on one node
	off  cpuLayout

	// Per rank d, d's buffers as this process maps them (nil for ranks of
	// other nodes):
	recvX  [][]byte  // [W, Tm, H] of dtype: [source, slot] rows sent to d
	meta   [][]int32 // [W, Tm, 2K+1]: local expert of each k (-1: not on d) | weight bits | source token
	counts [][]int32 // [W]: tokens each source sent d
	status [][]int32 // [2, W]: each rank's check of an eager call, by call parity
	comb   [][]byte  // [W, Tm, H] of the transit type: [expert rank, slot] partials for d

	sendSlot []int32     // [W, Tm]: slot of this rank's token t on rank d, -1: not sent
	combRows []int32     // [W*Tm, K]: output row of received pair (source, slot, k), -1: none
	lastT    int         // tokens of the latest dispatch
	acc, tmp [][]float32 // [worker][H]: scratch of each worker of split
	perExp   []int64     // [L+1]: rows per local expert, then the next row of each
	moves    []rowMove   // expand's row copies
	sent     []int32     // send's token of each slot

	eagerCalls int
}

// hostPtr turns an address of host memory the caller owns into a pointer
// (the indirection keeps vet's uintptr check quiet: it is not Go memory).
func hostPtr(addr uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&addr)) }

func bytesAt(addr uintptr, n int64) []byte {
	if n <= 0 {
		return nil
	}
	return unsafe.Slice((*byte)(hostPtr(addr)), n)
}

func int32sAt(addr uintptr, n int64) []int32 {
	if n <= 0 {
		return nil
	}
	return unsafe.Slice((*int32)(hostPtr(addr)), n)
}

func newCPUEngine(host Host) *cpuEngine { return &cpuEngine{host: host} }

// cpuLayout is where each piece lives in every rank's symmetric buffer.
type cpuLayout struct {
	recvX, meta, counts, status, comb, flags, pid, size int64
	// Of one remote rank's outbox: rows, metadata and count of a dispatch
	// (at 0, boxMeta, boxCount), or partials of a combine (at 0).
	boxMeta, boxCount, boxBytes int64
}

func newCPULayout(p *plan) cpuLayout {
	W, Tm, K, H := int64(p.world), int64(p.maxTokens), int64(p.topK), int64(p.hidden)
	var l layout
	var o cpuLayout
	o.recvX = l.take(W * Tm * p.rowBytes())
	o.meta = l.take(W * Tm * (2*K + 1) * 4)
	o.counts = l.take(W * 4)
	o.status = l.take(2 * W * 4)
	o.comb = l.take(W * Tm * H * int64(p.transit.Size()))
	o.flags = l.take(2 * W * 8) // the barrier flags, then the blame words (nodes.go)
	o.pid = l.take(8)
	o.size = l.size
	var b layout
	b.take(Tm * p.rowBytes())
	o.boxMeta = b.take(Tm * (2*K + 1) * 4)
	o.boxCount = b.take(4)
	o.boxBytes = (max(b.size, Tm*H*int64(p.transit.Size())) + 255) &^ 255
	return o
}

// setup allocates the symmetric buffers (collective), maps every rank's of
// this node and, across nodes, reaches the others' through UCX.
func (c *cpuEngine) setup(g Group, p *plan) error {
	c.p = p
	c.off = newCPULayout(p)
	o := &c.off
	W, Tm, K, H := int64(p.world), int64(p.maxTokens), int64(p.topK), int64(p.hidden)
	base, err := c.host.Alloc(o.size)
	if err != nil {
		return fmt.Errorf("ExpertParallel: allocate %d bytes of buffers: %w", o.size, err)
	}
	tp := c.host.Topology()
	mapped := make([]uintptr, p.world)
	for d := range p.world {
		if !tp.SameNode(d) {
			c.recvX, c.meta, c.counts, c.status, c.comb = append(c.recvX, nil), append(c.meta, nil), append(c.counts, nil),
				append(c.status, nil), append(c.comb, nil)
			continue
		}
		pb, err := c.host.PeerAddress(base, o.size, d)
		if err != nil {
			return fmt.Errorf("ExpertParallel: rank %d's buffers: %w", d, err)
		}
		mapped[d] = pb
		c.recvX = append(c.recvX, bytesAt(pb+uintptr(o.recvX), W*Tm*p.rowBytes()))
		c.meta = append(c.meta, int32sAt(pb+uintptr(o.meta), W*Tm*(2*K+1)))
		c.counts = append(c.counts, int32sAt(pb+uintptr(o.counts), W))
		c.status = append(c.status, int32sAt(pb+uintptr(o.status), 2*W))
		c.comb = append(c.comb, bytesAt(pb+uintptr(o.comb), W*Tm*H*int64(p.transit.Size())))
	}
	if tp.MultiNode() {
		if c.net, err = openNetPeers(g, c.host, base, o.size, mapped, o.flags, o.pid, uint64(o.boxBytes)); err != nil {
			return err
		}
	}
	clear(c.recvX[p.rank])
	clear(c.meta[p.rank])
	clear(c.counts[p.rank])
	clear(c.status[p.rank])
	clear(c.comb[p.rank])
	c.sendSlot = make([]int32, W*Tm)
	c.combRows = make([]int32, W*Tm*K)
	for i := range c.sendSlot {
		c.sendSlot[i] = -1
	}
	for i := range c.combRows {
		c.combRows[i] = -1
	}
	c.acc, c.tmp = make([][]float32, maxSplit), make([][]float32, maxSplit)
	for w := range maxSplit {
		c.acc[w], c.tmp[w] = make([]float32, H), make([]float32, H)
	}
	c.perExp = make([]int64, 2*(p.numLocal+1))
	return nil
}

// expertAt is expert id q (flat [T, K] index) of idx, -1 when it is -1 or
// outside [0, E) (capturable mode treats those as -1; eager mode checked).
func expertAt(idx uintptr, idxBytes int, q, experts int) int {
	var v int64
	if idxBytes == 8 {
		v = *(*int64)(unsafe.Add(hostPtr(idx), 8*q))
	} else {
		v = int64(*(*int32)(unsafe.Add(hostPtr(idx), 4*q)))
	}
	if v < 0 || v >= int64(experts) {
		return -1
	}
	return int(v)
}

// idsValid says whether every expert id of idx is -1 or in [0, E).
func idsValid(idx uintptr, idxBytes, n, experts int) bool {
	for q := range n {
		var v int64
		if idxBytes == 8 {
			v = *(*int64)(unsafe.Add(hostPtr(idx), 8*q))
		} else {
			v = int64(*(*int32)(unsafe.Add(hostPtr(idx), 4*q)))
		}
		if v < -1 || v >= int64(experts) {
			return false
		}
	}
	return true
}

// barrier is the engine's start or middle barrier over every rank.
func (c *cpuEngine) barrier(call collective.Call, phase string) error {
	if c.net != nil {
		return c.net.barrier(call, phase)
	}
	return c.host.StreamBarrier(0, call)
}

// agreeChecks posts this rank's check of an eager call into every rank's
// status row of the call's parity, waits at the start barrier and reads
// every rank's into checks; it reports whether all passed.
func (c *cpuEngine) agreeChecks(code int32, call collective.Call, checks []int32) (bool, error) {
	W := c.p.world
	par := c.eagerCalls & 1
	c.eagerCalls++
	c.status[c.p.rank][par*W+c.p.rank] = code
	for d := range W {
		if d == c.p.rank {
			continue
		}
		if c.status[d] != nil {
			c.status[d][par*W+c.p.rank] = code
		} else if err := c.net.putOwn(d, uint64(c.off.status)+uint64(4*(par*W+c.p.rank)), 4, "check of "+call.String()); err != nil {
			return false, err
		}
	}
	if err := c.barrier(call, "start"); err != nil {
		return false, err
	}
	copy(checks, c.status[c.p.rank][par*W:(par+1)*W])
	for _, v := range checks {
		if v != 0 {
			return false, nil
		}
	}
	return true, nil
}

func (c *cpuEngine) dispatch(a *DispatchArgs, checks []int32) (int64, error) {
	p := c.p
	if !a.Capturable {
		code := a.Check
		if code == 0 && !idsValid(a.TopkIdx, a.IdxBytes, a.NumTokens*p.topK, p.numExperts) {
			code = checkInvalidArg
		}
		ok, err := c.agreeChecks(code, collective.CallMoeDispatch, checks)
		if !ok || err != nil {
			return 0, err
		}
	} else if err := c.barrier(collective.CallMoeDispatch, "start"); err != nil {
		return 0, err
	}
	if err := c.send(a); err != nil {
		return 0, err
	}
	if err := c.barrier(collective.CallMoeDispatch, "middle"); err != nil {
		return 0, err
	}
	rows := c.countRows()
	if a.Capturable && !a.orderOnly {
		return p.maxRecvRows, c.expand(a.Out)
	}
	if a.Capturable {
		return p.maxRecvRows, nil
	}
	return rows, nil
}

// send writes, for every destination d (from rank + 1 on, so that ranks
// that copy at once write into different peers), the rows and metadata of
// the tokens with an expert on d, in token order, into d's [rank, slot],
// and their count. For a rank of another node they are built in its outbox
// and put at the same offsets.
func (c *cpuEngine) send(a *DispatchArgs) error {
	p := c.p
	W, K, L, Tm, T := p.world, p.topK, p.numLocal, p.maxTokens, a.NumTokens
	rb := int(p.rowBytes())
	x := bytesAt(a.X, int64(T)*p.rowBytes())
	w := int32sAt(a.TopkWeights, int64(T*K))
	MW := 2*K + 1
	for o := 1; o <= W; o++ {
		d := (p.rank + o) % W
		var rows []byte
		var meta []int32
		var box []byte
		if c.recvX[d] != nil {
			rows, meta = c.recvX[d][p.rank*Tm*rb:], c.meta[d][p.rank*Tm*MW:]
		} else {
			box = c.net.boxOf(d)
			rows = box[:Tm*rb]
			meta = unsafe.Slice((*int32)(unsafe.Pointer(&box[c.off.boxMeta])), Tm*MW)
		}
		slot := 0
		bySlot := c.sent[:0] // the token of each slot
		for t := range T {
			sent := false
			for k := range K {
				if e := expertAt(a.TopkIdx, a.IdxBytes, t*K+k, p.numExperts); e >= 0 && e/L == d {
					sent = true
					break
				}
			}
			if !sent {
				c.sendSlot[d*Tm+t] = -1
				continue
			}
			bySlot = append(bySlot, int32(t))
			m := meta[slot*MW : (slot+1)*MW]
			for k := range K {
				m[k] = -1
				if e := expertAt(a.TopkIdx, a.IdxBytes, t*K+k, p.numExperts); e >= 0 && e/L == d {
					m[k] = int32(e % L)
				}
				m[K+k] = w[t*K+k]
			}
			m[2*K] = int32(t)
			c.sendSlot[d*Tm+t] = int32(slot)
			slot++
		}
		c.sent = bySlot
		split(slot, workers(slot, int64(rb)), func(_, lo, hi int) {
			for i, t := range bySlot[lo:hi] {
				copy(rows[(lo+i)*rb:(lo+i+1)*rb], x[int(t)*rb:(int(t)+1)*rb])
			}
		})
		if box == nil {
			c.counts[d][p.rank] = int32(slot)
			continue
		}
		*(*int32)(unsafe.Pointer(&box[c.off.boxCount])) = int32(slot)
		if err := c.putDispatch(d, slot); err != nil {
			return err
		}
	}
	c.lastT = T
	return nil
}

// putDispatch puts the slots rows, their metadata and the count built in
// remote rank d's outbox where send would have written them.
func (c *cpuEngine) putDispatch(d, slots int) error {
	p, o, n := c.p, &c.off, c.net
	rb, mb, s := uint64(p.rowBytes()), uint64(2*p.topK+1)*4, uint64(slots)
	at := uint64(p.rank * p.maxTokens)
	if err := n.put(d, uint64(o.recvX)+at*rb, 0, s*rb, "dispatched rows"); err != nil {
		return err
	}
	if err := n.put(d, uint64(o.meta)+at*mb, uint64(o.boxMeta), s*mb, "dispatch metadata"); err != nil {
		return err
	}
	if err := n.put(d, uint64(o.counts)+4*uint64(p.rank), uint64(o.boxCount), 4, "dispatch count"); err != nil {
		return err
	}
	n.t.Progress()
	return nil
}

// pairs calls f for every pair this rank received, in (source, slot, k)
// order, with its local expert (-1: none here).
func (c *cpuEngine) pairs(f func(s, slot, k, local int)) {
	p := c.p
	K, L, Tm, MW := p.topK, p.numLocal, p.maxTokens, 2*p.topK+1
	meta, counts := c.meta[p.rank], c.counts[p.rank]
	for s := range p.world {
		for slot := range int(counts[s]) {
			m := meta[(s*Tm+slot)*MW:]
			for k := range K {
				lid := int(m[k])
				if lid < 0 || lid >= L {
					lid = -1
				}
				f(s, slot, k, lid)
			}
		}
	}
}

// countRows counts the received pairs per local expert into perExp[:L] and
// returns their total R.
func (c *cpuEngine) countRows() int64 {
	L := c.p.numLocal
	cnt := c.perExp[:L]
	clear(cnt)
	c.pairs(func(_, _, _, lid int) {
		if lid >= 0 {
			cnt[lid]++
		}
	})
	var rows int64
	for _, n := range cnt {
		rows += n
	}
	return rows
}

// received is the rows the latest dispatch that moved data brought here.
func (c *cpuEngine) received() int64 {
	var rows int64
	for _, n := range c.perExp[:c.p.numLocal] {
		rows += n
	}
	return rows
}

// rowMove is one row expand copies: from byte src of the own received
// rows to output row dst.
type rowMove struct{ src, dst int64 }

// expand writes the received rows into out in expert-major order: by local
// expert, then source, slot (token order) and k, with their metadata, and
// notes each pair's row for combine. The order is settled first (order);
// the rows are copied after, split among workers.
func (c *cpuEngine) expand(out Rows) error {
	moves, err := c.order(out)
	if err != nil {
		return err
	}
	rb := c.p.rowBytes()
	x, own := bytesAt(out.X, out.Rows*rb), c.recvX[c.p.rank]
	split(len(moves), workers(len(moves), rb), func(_, lo, hi int) {
		for _, m := range moves[lo:hi] {
			copy(x[m.dst*rb:(m.dst+1)*rb], own[m.src:m.src+rb])
		}
	})
	return nil
}

// order settles expand's order: out's metadata and counts (out.X is not
// touched), each pair's row for combine, and the row copies it takes, in
// pair order (valid until the next call).
func (c *cpuEngine) order(out Rows) ([]rowMove, error) {
	p := c.p
	K, L, Tm, MW := p.topK, p.numLocal, p.maxTokens, 2*p.topK+1
	rb := int64(p.rowBytes())
	cnt, next := c.perExp[:L], c.perExp[L+1:2*L+1]
	var rows int64
	for e, n := range cnt {
		next[e] = rows
		rows += n
	}
	if rows > out.Rows {
		return nil, fmt.Errorf("ExpertParallel: %d rows received, room for %d", rows, out.Rows)
	}
	info := int32sAt(out.Info, 4*out.Rows)
	counts := int32sAt(out.Counts, int64(L+1))
	meta := c.meta[p.rank]
	moves := c.moves[:0]
	c.pairs(func(s, slot, k, lid int) {
		i := (s*Tm+slot)*K + k
		if lid < 0 {
			c.combRows[i] = -1
			return
		}
		row := next[lid]
		next[lid]++
		c.combRows[i] = int32(row)
		moves = append(moves, rowMove{int64(s*Tm+slot) * rb, row})
		m := meta[(s*Tm+slot)*MW:]
		info[row], info[out.Rows+row], info[2*out.Rows+row], info[3*out.Rows+row] = int32(lid), int32(s), m[2*K], m[K+k]
	})
	c.moves = moves
	for e, n := range cnt {
		counts[e] = int32(n)
	}
	counts[L] = int32(rows)
	return moves, nil
}

func (c *cpuEngine) combine(a *CombineArgs, checks []int32) error {
	return c.combineWith(a, checks, nil)
}

// combineWith is combine, with fill (when not nil) writing this rank's
// partials for the n tokens source s sent it into dst instead of computing
// them from a.ExpertOut (the staged path's kernels made them).
func (c *cpuEngine) combineWith(a *CombineArgs, checks []int32, fill func(s, n int, dst []byte)) error {
	p := c.p
	if !a.Capturable {
		ok, err := c.agreeChecks(a.Check, collective.CallMoeCombine, checks)
		if !ok || err != nil {
			return err
		}
	} else if err := c.barrier(collective.CallMoeCombine, "start"); err != nil {
		return err
	}
	if fill == nil {
		out := bytesAt(a.ExpertOut, a.ExpertRows*p.rowBytes())
		fill = func(s, n int, dst []byte) { c.partialsOf(s, n, out, dst) }
	}
	if err := c.partials(fill); err != nil {
		return err
	}
	if err := c.barrier(collective.CallMoeCombine, "middle"); err != nil {
		return err
	}
	c.reduce(bytesAt(a.Y, int64(a.NumTokens)*p.rowBytes()), a.NumTokens)
	return nil
}

// partials has fill write, for every source s (from rank + 1 on), this
// rank's partials of the tokens s sent it into s's comb[rank, slot] (for a
// rank of another node, into its outbox, then put there). A partial is the
// float32 sum over k ascending of weight * expert row (each product
// rounded to float32, added from +0), rounded once to the transit type.
func (c *cpuEngine) partials(fill func(s, n int, dst []byte)) error {
	p := c.p
	W, Tm := p.world, p.maxTokens
	cb := p.hidden * p.transit.Size()
	counts := c.counts[p.rank]
	for o := 1; o <= W; o++ {
		s := (p.rank + o) % W
		var dst []byte
		if c.comb[s] != nil {
			dst = c.comb[s][p.rank*Tm*cb:]
		} else {
			dst = c.net.boxOf(s)
		}
		n := int(counts[s])
		fill(s, n, dst[:n*cb])
		if c.comb[s] == nil {
			at := uint64(c.off.comb) + uint64(p.rank*Tm*cb)
			if err := c.net.put(s, at, 0, uint64(n*cb), "combine partials"); err != nil {
				return err
			}
			c.net.t.Progress()
		}
	}
	return nil
}

// partialsOf computes this rank's partials of the n tokens source s sent
// it from the expert rows out into dst, split among workers.
func (c *cpuEngine) partialsOf(s, n int, out, dst []byte) {
	p := c.p
	K, Tm, MW := p.topK, p.maxTokens, 2*p.topK+1
	rb, cb := int(p.rowBytes()), p.hidden*p.transit.Size()
	meta := c.meta[p.rank]
	split(n, workers(n, int64(K)*int64(rb)), func(wk, lo, hi int) {
		acc, tmp := c.acc[wk], c.tmp[wk]
		for slot := lo; slot < hi; slot++ {
			clear(acc)
			for k := range K {
				row := int(c.combRows[(s*Tm+slot)*K+k])
				if row < 0 {
					continue
				}
				w := math.Float32frombits(uint32(meta[(s*Tm+slot)*MW+K+k]))
				addWeighted(acc, tmp, w, out[row*rb:(row+1)*rb], p.dtype)
			}
			narrow(dst[slot*cb:(slot+1)*cb], acc, p.transit)
		}
	})
}

// reduce sums, for each of this rank's T tokens, the partials of the ranks
// it went to in rank order, in float32 from +0, and rounds once into y.
func (c *cpuEngine) reduce(y []byte, T int) {
	p := c.p
	Tm, rb, cb := p.maxTokens, int(p.rowBytes()), p.hidden*p.transit.Size()
	comb := c.comb[p.rank]
	split(T, workers(T, int64(p.world)*int64(cb)), func(wk, lo, hi int) {
		acc, tmp := c.acc[wk], c.tmp[wk]
		for t := lo; t < hi; t++ {
			clear(acc)
			for d := range p.world {
				slot := int(c.sendSlot[d*Tm+t])
				if slot < 0 {
					continue
				}
				at := (d*Tm + slot) * cb
				addWidened(acc, tmp, comb[at:at+cb], p.transit)
			}
			narrow(y[t*rb:(t+1)*rb], acc, p.dtype)
		}
	})
}

func (c *cpuEngine) close() error {
	if c.net != nil {
		return c.net.close()
	}
	return nil
}

// check returns what broke the engine across nodes, if anything.
func (c *cpuEngine) check() error {
	if c.net != nil && c.net.broken != nil {
		return c.net.broken
	}
	return c.host.Check()
}

// widen writes the elements of src (of type d) into dst as float32 (exact
// for the 16-bit types; float64 rounds to nearest).
func widen(dst []float32, src []byte, d reduce.DType) {
	if len(dst) == 0 {
		return
	}
	n := len(dst)
	switch d {
	case reduce.Float32:
		copy(dst, unsafe.Slice((*float32)(unsafe.Pointer(&src[0])), n))
	case reduce.Float64:
		for i, v := range unsafe.Slice((*float64)(unsafe.Pointer(&src[0])), n) {
			dst[i] = float32(v)
		}
	case reduce.BFloat16:
		for i, v := range unsafe.Slice((*uint16)(unsafe.Pointer(&src[0])), n) {
			dst[i] = reduce.BF16ToFloat(v)
		}
	case reduce.Float16:
		for i, v := range unsafe.Slice((*uint16)(unsafe.Pointer(&src[0])), n) {
			dst[i] = reduce.HalfToFloat(v)
		}
	}
}

// addWidened adds the elements of src (of type d, as widen reads them)
// to acc, element by element; tmp is scratch of acc's length. float32 and
// bfloat16 are read in place, eight at a time: the same adds, without a
// pass through tmp.
func addWidened(acc, tmp []float32, src []byte, d reduce.DType) {
	n := len(acc)
	if n == 0 {
		return
	}
	switch d {
	case reduce.Float32:
		s := unsafe.Slice((*float32)(unsafe.Pointer(&src[0])), n)
		i := 0
		for ; i+8 <= n; i += 8 {
			a, b := acc[i:i+8:i+8], s[i:i+8:i+8]
			a[0], a[1], a[2], a[3] = a[0]+b[0], a[1]+b[1], a[2]+b[2], a[3]+b[3]
			a[4], a[5], a[6], a[7] = a[4]+b[4], a[5]+b[5], a[6]+b[6], a[7]+b[7]
		}
		for ; i < n; i++ {
			acc[i] += s[i]
		}
	case reduce.BFloat16:
		s := unsafe.Slice((*uint16)(unsafe.Pointer(&src[0])), n)
		i := 0
		for ; i+8 <= n; i += 8 {
			a, b := acc[i:i+8:i+8], s[i:i+8:i+8]
			a[0], a[1] = a[0]+reduce.BF16ToFloat(b[0]), a[1]+reduce.BF16ToFloat(b[1])
			a[2], a[3] = a[2]+reduce.BF16ToFloat(b[2]), a[3]+reduce.BF16ToFloat(b[3])
			a[4], a[5] = a[4]+reduce.BF16ToFloat(b[4]), a[5]+reduce.BF16ToFloat(b[5])
			a[6], a[7] = a[6]+reduce.BF16ToFloat(b[6]), a[7]+reduce.BF16ToFloat(b[7])
		}
		for ; i < n; i++ {
			acc[i] += reduce.BF16ToFloat(s[i])
		}
	default:
		widen(tmp, src, d)
		for i, v := range tmp {
			acc[i] += v
		}
	}
}

// addWeighted adds fl32(w * v) for each element v of src (of type d) to
// acc, element by element (the conversion rounds each product: no fused
// multiply-add); tmp is scratch of acc's length. float32 and bfloat16 rows
// are read in place, eight at a time.
func addWeighted(acc, tmp []float32, w float32, src []byte, d reduce.DType) {
	n := len(acc)
	if n == 0 {
		return
	}
	if d == reduce.Float32 {
		s := unsafe.Slice((*float32)(unsafe.Pointer(&src[0])), n)
		i := 0
		for ; i+8 <= n; i += 8 {
			a, b := acc[i:i+8:i+8], s[i:i+8:i+8]
			a[0], a[1], a[2], a[3] = a[0]+float32(w*b[0]), a[1]+float32(w*b[1]), a[2]+float32(w*b[2]), a[3]+float32(w*b[3])
			a[4], a[5], a[6], a[7] = a[4]+float32(w*b[4]), a[5]+float32(w*b[5]), a[6]+float32(w*b[6]), a[7]+float32(w*b[7])
		}
		for ; i < n; i++ {
			acc[i] += float32(w * s[i])
		}
		return
	}
	if d == reduce.BFloat16 {
		s := unsafe.Slice((*uint16)(unsafe.Pointer(&src[0])), n)
		i := 0
		for ; i+8 <= n; i += 8 {
			a, b := acc[i:i+8:i+8], s[i:i+8:i+8]
			a[0], a[1] = a[0]+float32(w*reduce.BF16ToFloat(b[0])), a[1]+float32(w*reduce.BF16ToFloat(b[1]))
			a[2], a[3] = a[2]+float32(w*reduce.BF16ToFloat(b[2])), a[3]+float32(w*reduce.BF16ToFloat(b[3]))
			a[4], a[5] = a[4]+float32(w*reduce.BF16ToFloat(b[4])), a[5]+float32(w*reduce.BF16ToFloat(b[5]))
			a[6], a[7] = a[6]+float32(w*reduce.BF16ToFloat(b[6])), a[7]+float32(w*reduce.BF16ToFloat(b[7]))
		}
		for ; i < n; i++ {
			acc[i] += float32(w * reduce.BF16ToFloat(s[i]))
		}
		return
	}
	widen(tmp, src, d)
	for i, v := range tmp {
		acc[i] += float32(w * v)
	}
}

// narrow writes src into dst as type d, rounded to nearest even (exact for
// float32 and float64).
func narrow(dst []byte, src []float32, d reduce.DType) {
	if len(src) == 0 {
		return
	}
	n := len(src)
	switch d {
	case reduce.Float32:
		copy(unsafe.Slice((*float32)(unsafe.Pointer(&dst[0])), n), src)
	case reduce.Float64:
		out := unsafe.Slice((*float64)(unsafe.Pointer(&dst[0])), n)
		for i, v := range src {
			out[i] = float64(v)
		}
	case reduce.BFloat16:
		out := unsafe.Slice((*uint16)(unsafe.Pointer(&dst[0])), n)
		i := 0
		for ; i+8 <= n; i += 8 {
			o, s := out[i:i+8:i+8], src[i:i+8:i+8]
			o[0], o[1] = reduce.FloatToBF16(s[0]), reduce.FloatToBF16(s[1])
			o[2], o[3] = reduce.FloatToBF16(s[2]), reduce.FloatToBF16(s[3])
			o[4], o[5] = reduce.FloatToBF16(s[4]), reduce.FloatToBF16(s[5])
			o[6], o[7] = reduce.FloatToBF16(s[6]), reduce.FloatToBF16(s[7])
		}
		for ; i < n; i++ {
			out[i] = reduce.FloatToBF16(src[i])
		}
	case reduce.Float16:
		out := unsafe.Slice((*uint16)(unsafe.Pointer(&dst[0])), n)
		for i, v := range src {
			out[i] = reduce.FloatToHalf(v)
		}
	}
}
