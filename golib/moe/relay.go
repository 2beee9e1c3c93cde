package moe

import (
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/topo"
	timeline "github.com/p2pcomm/p2pcomm/golib/trace"
)

// Relays: across nodes, a token crosses the network once per node that
// holds any of its experts, not once per rank there. Source s sends it to
// one rank of that node, s's relay there (the rank with s's local index,
// modulo the node's size); after a "forward" barrier each rank of the node
// takes from the relay's area (shared memory) the tokens with an expert of
// its own, into the [source, slot] where s's send would have put them.
// Combine goes back the same way: the node's ranks leave their partials
// of s's tokens in their relay areas and, after a "partials" barrier, the
// relay sums them in rank order (float32 from +0, rounded once to the
// transit type) and sends s one partial per (token, node). A node of one
// rank is reached directly: its relay would be itself.
//
// So across nodes a token's result is the float32 sum from +0, in node
// order, of one partial per node, each the transit-rounded float32 sum of
// that node's ranks' partials in rank order (its own node's too); with
// nodes of one rank these are the single-node bits.

// relaying says whether an EP over tp relays: several nodes, one of which
// has several ranks.
func relaying(tp *topo.Topology) bool {
	if !tp.MultiNode() {
		return false
	}
	for _, ranks := range tp.Nodes {
		if len(ranks) > 1 {
			return true
		}
	}
	return false
}

// relays is one rank's part in relaying.
type relays struct {
	tp       *topo.Topology
	node     int       // this rank's node
	local    []int     // its ranks, ascending
	me       int       // this rank's index among them
	localIdx []int     // by rank: its index in its node
	area     [][]byte  // by rank of this node: its relay area as mapped here (nil elsewhere)
	meta     [][]int32 // by rank of this node: its relay metadata [W, Tm, 2K+1], by source
	count    [][]int32 // by rank of this node: its relay counts [W], by source
	nodeSlot []int32   // [nodes, Tm]: the slot of this rank's token t in its box to node n (relayed nodes), -1: none
	fwdSlot  []int32   // [W, len(local), Tm]: for a source of another node, the slot on local rank i of its box's j-th token, -1: none
	fwdCount []int32   // [W]: the tokens of each source's box in the latest dispatch (0: none)
	moves    []rowMove // forward's row copies
}

func newRelays(p *plan, tp *topo.Topology, o *cpuLayout, mapped []uintptr) *relays {
	W, Tm, MW := p.world, p.maxTokens, 2*p.topK+1
	r := &relays{tp: tp, node: tp.Node(), local: tp.Local(), localIdx: make([]int, W),
		area: make([][]byte, W), meta: make([][]int32, W), count: make([][]int32, W)}
	for _, ranks := range tp.Nodes {
		for i, q := range ranks {
			r.localIdx[q] = i
		}
	}
	areaBytes := int64(W) * int64(Tm) * max(p.rowBytes(), int64(p.hidden)*int64(p.transit.Size()))
	for _, q := range r.local {
		r.area[q] = bytesAt(mapped[q]+uintptr(o.relay), areaBytes)
		r.meta[q] = int32sAt(mapped[q]+uintptr(o.relayMeta), int64(W*Tm*MW))
		r.count[q] = int32sAt(mapped[q]+uintptr(o.relayCount), int64(W))
	}
	clear(r.area[p.rank])
	clear(r.meta[p.rank])
	clear(r.count[p.rank])
	r.nodeSlot = make([]int32, len(tp.Nodes)*Tm)
	r.fwdSlot = make([]int32, W*len(r.local)*Tm)
	r.fwdCount = make([]int32, W)
	return r
}

// via is the rank of node m that relays source s's tokens.
func (r *relays) via(s, m int) int {
	ranks := r.tp.Nodes[m]
	return ranks[r.localIdx[s]%len(ranks)]
}

// relayed says whether other nodes reach node m through relays.
func (r *relays) relayed(m int) bool { return len(r.tp.Nodes[m]) > 1 }

// from says whether source s's tokens reach this rank through a relay.
func (r *relays) from(s int) bool { return r.tp.NodeOf[s] != r.node && r.relayed(r.node) }

// sendNode builds in the outbox of f, this rank's relay on node m, the
// rows of this rank's tokens with an expert on m, in token order, with
// their metadata (the global ids of the experts on m, -1 for the others;
// the weights; the token) and count, and puts them into f's relay area at
// [rank, slot].
func (c *cpuEngine) sendNode(a *DispatchArgs, f, m int) error {
	p, rl := c.p, c.rl
	K, L, Tm, T, MW := p.topK, p.numLocal, p.maxTokens, a.NumTokens, 2*p.topK+1
	rb := int(p.rowBytes())
	x := bytesAt(a.X, int64(T)*p.rowBytes())
	w := int32sAt(a.TopkWeights, int64(T*K))
	box := c.net.boxOf(f)
	rows := box[:Tm*rb]
	meta := unsafe.Slice((*int32)(unsafe.Pointer(&box[c.off.boxMeta])), Tm*MW)
	slots := rl.nodeSlot[m*Tm : (m+1)*Tm]
	bySlot := c.sent[:0]
	for t := range T {
		slots[t] = -1
		mt := meta[len(bySlot)*MW : (len(bySlot)+1)*MW] // a later token overwrites it unless t goes
		on := false
		for k := range K {
			mt[k] = -1
			if e := expertAt(a.TopkIdx, a.IdxBytes, t*K+k, p.numExperts); e >= 0 && rl.tp.NodeOf[e/L] == m {
				mt[k], on = int32(e), true
			}
			mt[K+k] = w[t*K+k]
		}
		if on {
			mt[2*K] = int32(t)
			slots[t] = int32(len(bySlot))
			bySlot = append(bySlot, int32(t))
		}
	}
	c.sent = bySlot
	n := len(bySlot)
	split(n, workers(n, int64(rb)), func(_, lo, hi int) {
		for i, t := range bySlot[lo:hi] {
			copy(rows[(lo+i)*rb:(lo+i+1)*rb], x[int(t)*rb:(int(t)+1)*rb])
		}
	})
	*(*int32)(unsafe.Pointer(&box[c.off.boxCount])) = int32(n)
	o, nt := &c.off, c.net
	at, rbu, mb := uint64(p.rank*Tm), uint64(rb), uint64(MW)*4
	if err := nt.put(f, uint64(o.relay)+at*rbu, 0, uint64(n)*rbu, "relayed rows"); err != nil {
		return err
	}
	if err := nt.put(f, uint64(o.relayMeta)+at*mb, uint64(o.boxMeta), uint64(n)*mb, "relayed metadata"); err != nil {
		return err
	}
	if err := nt.put(f, uint64(o.relayCount)+4*uint64(p.rank), uint64(o.boxCount), 4, "relayed count"); err != nil {
		return err
	}
	nt.t.Progress()
	return nil
}

// forward takes, after the dispatch's forward barrier, what the relays of
// this node received for it: for each source of another node, the tokens
// of its box (in the area of its relay here) with an expert on this rank,
// in box (token) order, into this rank's [source, slot] as the source's
// send would have written them (row, metadata, count). It notes for
// combine the slot of every box token on every rank of the node.
func (c *cpuEngine) forward() error {
	p, rl := c.p, c.rl
	K, L, E, Tm, MW := p.topK, p.numLocal, p.numExperts, p.maxTokens, 2*p.topK+1
	rb, nl := int64(p.rowBytes()), len(rl.local)
	if timeline.On() {
		timeline.Mark("moe forward")
		defer timeline.Mark("moe forward done")
	}
	moves := c.moves[:0]
	for s := range p.world {
		rl.fwdCount[s] = 0
		if !rl.from(s) {
			continue
		}
		f := rl.via(s, rl.node)
		n := int(rl.count[f][s])
		if n < 0 || n > Tm {
			return status.Errorf(status.Internal, "ExpertParallel across nodes: rank %d relayed %d tokens of rank %d (at most %d)", f, n, s, Tm)
		}
		rl.fwdCount[s] = int32(n)
		box := rl.meta[f][s*Tm*MW:]
		for i, d := range rl.local {
			fs := rl.fwdSlot[(s*nl+i)*Tm : (s*nl+i+1)*Tm]
			slot := 0
			for j := range n {
				bm := box[j*MW : (j+1)*MW]
				fs[j] = -1
				for k := range K {
					if e := int(bm[k]); e >= 0 && e < E && e/L == d {
						fs[j] = int32(slot)
						slot++
						break
					}
				}
				if d != p.rank || fs[j] < 0 {
					continue
				}
				m := c.meta[d][(s*Tm+int(fs[j]))*MW : (s*Tm+int(fs[j])+1)*MW]
				for k := range K {
					m[k] = -1
					if e := int(bm[k]); e >= 0 && e < E && e/L == d {
						m[k] = int32(e % L)
					}
					m[K+k] = bm[K+k]
				}
				m[2*K] = bm[2*K]
				moves = append(moves, rowMove{int64(s*Tm+j) * rb, int64(s*Tm) + int64(fs[j])}) // to row [s, slot]
			}
			if d == p.rank {
				c.counts[d][s] = int32(slot)
			}
		}
	}
	c.moves = moves
	own := c.recvX[p.rank]
	split(len(moves), workers(len(moves), rb), func(_, lo, hi int) {
		for _, m := range moves[lo:hi] {
			f := rl.via(int(m.dst)/Tm, rl.node) // the relay of the row's source
			copy(own[m.dst*rb:(m.dst+1)*rb], rl.area[f][m.src:m.src+rb])
		}
	})
	return nil
}

// nodeSums sends, after the combine's partials barrier, each source this
// rank relays one partial per token of its box: the float32 sum from +0
// of this node's ranks' partials in rank order, rounded once to the
// transit type, into the source's partials at [this rank, box slot].
func (c *cpuEngine) nodeSums() error {
	p, rl := c.p, c.rl
	W, Tm, nl := p.world, p.maxTokens, len(rl.local)
	cb := p.hidden * p.transit.Size()
	if timeline.On() {
		timeline.Mark("moe node sums")
		defer timeline.Mark("moe node sums sent")
	}
	for o := 1; o <= W; o++ {
		s := (p.rank + o) % W
		if !rl.from(s) || rl.via(s, rl.node) != p.rank {
			continue
		}
		n := int(rl.fwdCount[s])
		box := c.net.boxOf(s)
		split(n, workers(n, int64(nl)*int64(cb)), func(wk, lo, hi int) {
			acc, tmp := c.acc[wk], c.tmp[wk]
			for j := lo; j < hi; j++ {
				clear(acc)
				for i, d := range rl.local {
					slot := int(rl.fwdSlot[(s*nl+i)*Tm+j])
					if slot < 0 {
						continue
					}
					from := (s*Tm + slot) * cb
					widen(tmp, rl.area[d][from:from+cb], p.transit)
					for q, v := range tmp {
						acc[q] += v
					}
				}
				narrow(box[j*cb:(j+1)*cb], acc, p.transit)
			}
		})
		if err := c.net.put(s, uint64(c.off.comb)+uint64(p.rank*Tm*cb), 0, uint64(n*cb), "node's combine partials"); err != nil {
			return err
		}
		c.net.t.Progress()
	}
	return nil
}

// reduceNodes is reduce across nodes with relays: for each of this rank's
// T tokens, the float32 sum from +0, in node order, of one partial per
// node it went to: a relayed node's as its relay sent it; this node's the
// float32 sum of its ranks' partials in rank order, rounded once to the
// transit type (as a relay rounds); a node of one rank's as it came.
func (c *cpuEngine) reduceNodes(y []byte, T int) {
	p, rl := c.p, c.rl
	Tm, rb, cb := p.maxTokens, int(p.rowBytes()), p.hidden*p.transit.Size()
	comb := c.comb[p.rank]
	add := func(acc, tmp []float32, at int) {
		widen(tmp, comb[at:at+cb], p.transit)
		for i, v := range tmp {
			acc[i] += v
		}
	}
	split(T, workers(T, int64(p.world)*int64(cb)), func(wk, lo, hi int) {
		acc, tmp, part := c.acc[wk], c.tmp[wk], c.part[wk]
		for t := lo; t < hi; t++ {
			clear(acc)
			for m, ranks := range rl.tp.Nodes {
				switch {
				case m == rl.node:
					clear(part)
					sent := false
					for _, d := range ranks {
						if slot := int(c.sendSlot[d*Tm+t]); slot >= 0 {
							add(part, tmp, (d*Tm+slot)*cb)
							sent = true
						}
					}
					if sent {
						roundTo(part, p.transit)
						for i, v := range part {
							acc[i] += v
						}
					}
				case rl.relayed(m):
					if j := int(rl.nodeSlot[m*Tm+t]); j >= 0 {
						add(acc, tmp, (rl.via(p.rank, m)*Tm+j)*cb)
					}
				default:
					if slot := int(c.sendSlot[ranks[0]*Tm+t]); slot >= 0 {
						add(acc, tmp, (ranks[0]*Tm+slot)*cb)
					}
				}
			}
			narrow(y[t*rb:(t+1)*rb], acc, p.dtype)
		}
	})
}

// roundTo rounds each element of v to type d and back (to nearest even).
func roundTo(v []float32, d reduce.DType) {
	switch d {
	case reduce.BFloat16:
		for i, x := range v {
			v[i] = reduce.BF16ToFloat(reduce.FloatToBF16(x))
		}
	case reduce.Float16:
		for i, x := range v {
			v[i] = reduce.HalfToFloat(reduce.FloatToHalf(x))
		}
	}
}
