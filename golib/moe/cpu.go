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
type cpuEngine struct {
	host Host
	p    *plan

	// Per rank d, d's buffers as this process maps them:
	recvX  [][]byte  // [W, Tm, H] of dtype: [source, slot] rows sent to d
	meta   [][]int32 // [W, Tm, 2K+1]: local expert of each k (-1: not on d) | weight bits | source token
	counts [][]int32 // [W]: tokens each source sent d
	status [][]int32 // [2, W]: each rank's check of an eager call, by call parity
	comb   [][]byte  // [W, Tm, H] of the transit type: [expert rank, slot] partials for d

	sendSlot []int32 // [W, Tm]: slot of this rank's token t on rank d, -1: not sent
	combRows []int32 // [W*Tm, K]: output row of received pair (source, slot, k), -1: none
	lastT    int     // tokens of the latest dispatch
	acc, tmp []float32
	perExp   []int64 // [L+1]: rows per local expert, then the next row of each

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

// setup allocates the symmetric buffers (collective) and maps every rank's.
func (c *cpuEngine) setup(p *plan) error {
	c.p = p
	W, Tm, K, H := int64(p.world), int64(p.maxTokens), int64(p.topK), int64(p.hidden)
	var l layout
	recvX := l.take(W * Tm * p.rowBytes())
	meta := l.take(W * Tm * (2*K + 1) * 4)
	counts := l.take(W * 4)
	status := l.take(2 * W * 4)
	comb := l.take(W * Tm * H * int64(p.transit.Size()))
	base, err := c.host.Alloc(l.size)
	if err != nil {
		return fmt.Errorf("ExpertParallel: allocate %d bytes of buffers: %w", l.size, err)
	}
	for d := range p.world {
		pb, err := c.host.PeerAddress(base, l.size, d)
		if err != nil {
			return fmt.Errorf("ExpertParallel: rank %d's buffers: %w", d, err)
		}
		c.recvX = append(c.recvX, bytesAt(pb+uintptr(recvX), W*Tm*p.rowBytes()))
		c.meta = append(c.meta, int32sAt(pb+uintptr(meta), W*Tm*(2*K+1)))
		c.counts = append(c.counts, int32sAt(pb+uintptr(counts), W))
		c.status = append(c.status, int32sAt(pb+uintptr(status), 2*W))
		c.comb = append(c.comb, bytesAt(pb+uintptr(comb), W*Tm*H*int64(p.transit.Size())))
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
	c.acc, c.tmp = make([]float32, H), make([]float32, H)
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

// agreeChecks posts this rank's check of an eager call into every rank's
// status row of the call's parity, waits at the start barrier and reads
// every rank's into checks; it reports whether all passed.
func (c *cpuEngine) agreeChecks(code int32, call collective.Call, checks []int32) (bool, error) {
	W := c.p.world
	par := c.eagerCalls & 1
	c.eagerCalls++
	for d := range W {
		c.status[d][par*W+c.p.rank] = code
	}
	if err := c.host.StreamBarrier(0, call); err != nil {
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
	} else if err := c.host.StreamBarrier(0, collective.CallMoeDispatch); err != nil { // start barrier
		return 0, err
	}
	c.send(a)
	if err := c.host.StreamBarrier(0, collective.CallMoeDispatch); err != nil { // middle barrier
		return 0, err
	}
	rows := c.countRows()
	if a.Capturable {
		return p.maxRecvRows, c.expand(a.Out)
	}
	return rows, nil
}

// send writes, for every destination d (from rank + 1 on, so that ranks
// that copy at once write into different peers), the rows and metadata of
// the tokens with an expert on d, in token order, into d's [rank, slot],
// and their count.
func (c *cpuEngine) send(a *DispatchArgs) {
	p := c.p
	W, K, L, Tm, T := p.world, p.topK, p.numLocal, p.maxTokens, a.NumTokens
	rb := int(p.rowBytes())
	x := bytesAt(a.X, int64(T)*p.rowBytes())
	w := int32sAt(a.TopkWeights, int64(T*K))
	MW := 2*K + 1
	for o := 1; o <= W; o++ {
		d := (p.rank + o) % W
		rows := c.recvX[d][p.rank*Tm*rb:]
		meta := c.meta[d][p.rank*Tm*MW:]
		slot := 0
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
			copy(rows[slot*rb:(slot+1)*rb], x[t*rb:(t+1)*rb])
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
		c.counts[d][p.rank] = int32(slot)
	}
	c.lastT = T
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

// expand writes the received rows into out in expert-major order: by local
// expert, then source, slot (token order) and k, with their metadata, and
// notes each pair's row for combine.
func (c *cpuEngine) expand(out Rows) error {
	p := c.p
	K, L, Tm, MW := p.topK, p.numLocal, p.maxTokens, 2*p.topK+1
	rb := int(p.rowBytes())
	cnt, next := c.perExp[:L], c.perExp[L+1:2*L+1]
	var rows int64
	for e, n := range cnt {
		next[e] = rows
		rows += n
	}
	if rows > out.Rows {
		return fmt.Errorf("ExpertParallel: %d rows received, room for %d", rows, out.Rows)
	}
	x := bytesAt(out.X, out.Rows*int64(rb))
	info := int32sAt(out.Info, 4*out.Rows)
	counts := int32sAt(out.Counts, int64(L+1))
	own, meta := c.recvX[p.rank], c.meta[p.rank]
	c.pairs(func(s, slot, k, lid int) {
		i := (s*Tm+slot)*K + k
		if lid < 0 {
			c.combRows[i] = -1
			return
		}
		row := next[lid]
		next[lid]++
		c.combRows[i] = int32(row)
		src := (s*Tm + slot) * rb
		copy(x[row*int64(rb):(row+1)*int64(rb)], own[src:src+rb])
		m := meta[(s*Tm+slot)*MW:]
		info[row], info[out.Rows+row], info[2*out.Rows+row], info[3*out.Rows+row] = int32(lid), int32(s), m[2*K], m[K+k]
	})
	for e, n := range cnt {
		counts[e] = int32(n)
	}
	counts[L] = int32(rows)
	return nil
}

func (c *cpuEngine) combine(a *CombineArgs, checks []int32) error {
	p := c.p
	if !a.Capturable {
		ok, err := c.agreeChecks(a.Check, collective.CallMoeCombine, checks)
		if !ok || err != nil {
			return err
		}
	} else if err := c.host.StreamBarrier(0, collective.CallMoeCombine); err != nil { // start barrier
		return err
	}
	c.partials(bytesAt(a.ExpertOut, a.ExpertRows*p.rowBytes()))
	if err := c.host.StreamBarrier(0, collective.CallMoeCombine); err != nil { // middle barrier
		return err
	}
	c.reduce(bytesAt(a.Y, int64(a.NumTokens)*p.rowBytes()), a.NumTokens)
	return nil
}

// partials writes, for every source s (from rank + 1 on) and every token
// it sent here, the float32 sum over k ascending of weight * expert row
// (each product rounded to float32, added from +0), rounded once to the
// transit type, into s's comb[rank, slot].
func (c *cpuEngine) partials(out []byte) {
	p := c.p
	W, K, Tm, MW := p.world, p.topK, p.maxTokens, 2*p.topK+1
	rb, cb := int(p.rowBytes()), p.hidden*p.transit.Size()
	meta, counts := c.meta[p.rank], c.counts[p.rank]
	for o := 1; o <= W; o++ {
		s := (p.rank + o) % W
		dst := c.comb[s][p.rank*Tm*cb:]
		for slot := range int(counts[s]) {
			clear(c.acc)
			for k := range K {
				row := int(c.combRows[(s*Tm+slot)*K+k])
				if row < 0 {
					continue
				}
				w := math.Float32frombits(uint32(meta[(s*Tm+slot)*MW+K+k]))
				widen(c.tmp, out[row*rb:(row+1)*rb], p.dtype)
				for i, v := range c.tmp {
					c.acc[i] += float32(w * v) // the conversion rounds the product: no fused multiply-add
				}
			}
			narrow(dst[slot*cb:(slot+1)*cb], c.acc, p.transit)
		}
	}
}

// reduce sums, for each of this rank's T tokens, the partials of the ranks
// it went to in rank order, in float32 from +0, and rounds once into y.
func (c *cpuEngine) reduce(y []byte, T int) {
	p := c.p
	Tm, rb, cb := p.maxTokens, int(p.rowBytes()), p.hidden*p.transit.Size()
	comb := c.comb[p.rank]
	for t := range T {
		clear(c.acc)
		for d := range p.world {
			slot := int(c.sendSlot[d*Tm+t])
			if slot < 0 {
				continue
			}
			at := (d*Tm + slot) * cb
			widen(c.tmp, comb[at:at+cb], p.transit)
			for i, v := range c.tmp {
				c.acc[i] += v
			}
		}
		narrow(y[t*rb:(t+1)*rb], c.acc, p.dtype)
	}
}

func (c *cpuEngine) close() error { return nil }

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
		for i, v := range src {
			out[i] = reduce.FloatToBF16(v)
		}
	case reduce.Float16:
		out := unsafe.Slice((*uint16)(unsafe.Pointer(&dst[0])), n)
		for i, v := range src {
			out[i] = reduce.FloatToHalf(v)
		}
	}
}
