package hostcoll

import (
	"fmt"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// All-reduce across nodes (every algorithm name runs this one; see
// docs/DESIGN.md). With L ranks per node and N nodes, the rank of local
// index l owns shard l of the elements; its group (local index l on every
// node) splits shard l into N parts, and the group rank of node m owns part
// m. Each element is reduced as op over the nodes, in node order, of op over
// each node's ranks, in rank order, in the accumulator type (float32 for
// 16-bit floats), rounded once: one fixed expression, computed once by the
// part's owner and copied everywhere, so every rank holds the same bits.
//
//  1. Start: descriptors and the start barrier through shared memory, as on
//     one node; the node's verdict.
//  2. Each rank sends its group a header (its node's verdict, the call's
//     shape, where its results go) and, if its node agreed, its partials:
//     for each part, chunk by chunk, the fold of its node's inputs, put into
//     the part owner's region with a signal per chunk.
//  3. Each rank reads its group's headers: any node's failure or any
//     difference fails the call on every rank of every node alike.
//  4. The owner folds each chunk of its part as the partials arrive, writes
//     the result where its results go and puts it where each group rank's
//     go: the staging area, or, for a call in place on symmetric memory
//     (registered with UCX), the output itself, with no copy after.
//     A small shard is an exchange instead (as on GPUs): every group rank
//     owns all of it, so each sends its node's partial of the whole shard to
//     every other node in step 2 and folds them all itself here, in node
//     order; no results travel, a trip less.
//  5. Once its whole shard has arrived, a rank tells its group
//     it is done and flags the shard to its node; it copies every local
//     shard into its output as each is flagged, waits until its whole group
//     is done (so nothing it sent is still on its way), and meets its node
//     at the end barrier.
func (c *Comm) allReduceNodes(req collective.AllReduce) error {
	if err := c.topo.Uniform("all-reduce"); err != nil {
		return err
	}
	if c.net == nil {
		if err := c.openNetwork(); err != nil {
			return err
		}
	}
	c.net.bg.Enter()
	defer c.net.bg.Leave()
	c.seq++
	seq := c.seq
	me := c.ctl[c.rank]
	d := me.desc(seq)
	*d = descriptor{Seq: seq, Kind: kindAllReduce, DType: int32(req.DType), Op: int32(req.Op),
		Algo: int32(collective.Auto), Count: req.Count, Input: -1}
	nbytes := req.Bytes()
	// The only rank of its node reads its own input where it lies (no local
	// peer reads it from the staging area); from userMinBytes it registers
	// its plain buffers for the call (userBuffers).
	alone := len(c.topo.Local()) == 1
	own := alone && nbytes >= userMinBytes
	localErr := c.prepare(req, d, nbytes, !own)
	if localErr == nil && d.ResultIn == resultInput && c.net.allocs[d.Input] == nil {
		localErr = status.Errorf(status.Internal, "symmetric allocation %d is not registered with the transport", d.Input)
	}
	if localErr == nil && nbytes > c.opts.StagingBytes {
		// The slots for partials are sized by the staging capacity, and
		// results of calls not in place on symmetric memory land there.
		localErr = status.Errorf(status.Capacity,
			"tensor of %d bytes exceeds the staging capacity of %d bytes, which an all-reduce across nodes needs for any input: raise P2PCOMM_STAGING_BYTES",
			nbytes, c.opts.StagingBytes)
	}
	if localErr != nil {
		d.LocalErr = int32(status.CodeOf(localErr))
		copy(d.ErrDetail[:], localErr.Error())
	}
	var user userBuffers
	if localErr == nil && own {
		user = c.registerUser(req, d, nbytes)
	}
	me.store(offArrive, seq)
	if err := c.waitPeers(offArrive, seq, "start"); err != nil {
		return err
	}
	return c.hierarchical(req, seq, c.agree(seq, localErr), user, own)
}

// userMinBytes is the smallest call whose plain buffers the only rank of
// its node registers with the transport for the call: its partials go from
// its input and its results land in its output, instead of through the
// staging area (two copies of the vector). Below it the copies cost less
// than registering, sending a key and flushing before deregistering. A
// variable for tests.
var userMinBytes int64 = 1 << 20

// userAlloc in a header's DstAlloc: the sender's results go to its output
// registered for this call, whose key follows in the header.
const userAlloc = -2

// userBuffers are a call's plain buffers registered with the transport for
// that call; either may be nil (symmetric memory, the same buffer, or a
// registration that failed: then the staging area serves).
type userBuffers struct {
	src, dst transport.Local
}

// registerUser registers the output where results would land in the
// staging area (and its key fits a header), and a plain input.
func (c *Comm) registerUser(req collective.AllReduce, d *descriptor, nbytes int64) userBuffers {
	n := c.net
	var u userBuffers
	if d.ResultIn == resultStaging {
		if l, err := n.t.Register(req.Dst, uint64(nbytes), transport.HostMemory); err == nil {
			if len(l.Key()) <= len(header{}.Detail) {
				u.dst = l
			} else {
				l.Close()
			}
		}
	}
	// A 16-bit input travels as float32 partials folded into the send
	// slots, never from where it lies.
	if d.Input < 0 && reduce.AccType(req.DType).Size() == req.DType.Size() && (req.Src != req.Dst || u.dst == nil) {
		if l, err := n.t.Register(req.Src, uint64(nbytes), transport.HostMemory); err == nil {
			u.src = l
		}
	}
	return u
}

// release deregisters the call's buffers once every put from or into them
// has completed: peers' into them landed before their signals, and this
// rank's are flushed here, for up to within per peer. After a failure that
// broke the communicator within is the linger: a peer still in the call may
// put results there until then, and this rank's puts may still read them
// (the keys of peers' outputs then stay with the transport until Close:
// destroying one flushes its peer, which may have stopped).
func (u userBuffers) release(c *Comm, within time.Duration) {
	if u.src == nil && u.dst == nil {
		return
	}
	n := c.net
	for m, r := range n.group {
		if m != n.node {
			n.t.FlushWithin(r, within) // a failure shows in the next call
		}
	}
	for _, l := range []transport.Local{u.src, u.dst} {
		if l != nil {
			l.Close()
		}
	}
}

// plan is how one call's elements divide: this rank's shard, its parts,
// chunks.
type plan struct {
	lo, hi   int64   // this rank's shard
	parts    []int64 // part m is [parts[m], parts[m+1]) of the shard, relative to lo
	es, as   int64   // bytes per element and per accumulator
	perChunk int64   // elements per chunk of partials
	// in: the node's inputs by rank, this rank's where it lies. inL is this
	// rank's input's registration with the transport (nil: none), inOff
	// element 0's offset in it.
	in    []unsafe.Pointer
	inL   transport.Local
	inOff uint64
	// Where this rank's results go: its output itself where that is its
	// input in symmetric memory (descriptor.ResultIn; the allocation is
	// registered with the transport) or a plain output registered for the
	// call (userBuffers), and its header tells its group to put them there
	// (landed); else its staging area. base is element 0 there, outL its
	// registration and outOff element 0's offset in it.
	landed bool
	base   unsafe.Pointer
	outL   transport.Local
	outOff uint64
	// fromInput: this rank's partials are its input as it lies, registered
	// (the only rank of its node, and an accumulator of the element's own
	// type), so they go from there without a fold into the send slots, and
	// its own part is reduced from there. Where the input is the output, a
	// chunk's results come back only after its owner received this rank's
	// chunk. Never in an exchange, which sends the own part's partial as
	// well, while the own fold may overwrite the input in place.
	fromInput bool
	// x: the call is an exchange; part node is the whole shard, the others
	// are empty.
	x bool
}

// exchangeBytes is the most partials (of one shard) an exchange sends each
// other node: every rank then folds the whole shard, twice the work of its
// part on two nodes, which small calls do not notice.
const exchangeBytes = 64 << 10

func (c *Comm) plan(req collective.AllReduce) plan {
	local, nodes := len(c.topo.Local()), len(c.topo.Nodes)
	p := plan{es: int64(req.DType.Size()), as: int64(reduce.AccType(req.DType).Size())}
	p.lo, p.hi = slice(req.Count, local, c.topo.LocalRank())
	p.parts = make([]int64, nodes+1)
	shard := (p.hi - p.lo) * p.as
	p.x = shard <= exchangeBytes && shard <= int64(c.net.lay.slot)
	for m := range nodes {
		switch {
		case !p.x:
			_, p.parts[m+1] = slice(p.hi-p.lo, nodes, m)
		case m >= c.net.node:
			p.parts[m+1] = p.hi - p.lo
		}
	}
	p.perChunk = max(c.net.chunk/p.as, 1)
	return p
}

func (p plan) chunks(m int) int64 {
	return (p.parts[m+1] - p.parts[m] + p.perChunk - 1) / p.perChunk
}

// hierarchical runs steps 2-5; nodeErr is the node's verdict from step 1.
func (c *Comm) hierarchical(req collective.AllReduce, seq uint64, nodeErr error, user userBuffers, own bool) (err error) {
	n := c.net
	n.calls++
	if nodeErr != nil {
		user.release(c, c.opts.Timeout)
		user = userBuffers{}
	}
	defer func() {
		if err != nil {
			user.release(c, n.linger)
		}
	}()
	if err := c.sendHeaders(req, seq, nodeErr, user); err != nil {
		return err
	}
	var p plan // only for calls whose arguments passed (a bad dtype has no size)
	if nodeErr == nil {
		p = c.plan(req)
		c.placeCall(&p, req, seq, user, own)
		if err := c.sendPartials(req, seq, p); err != nil {
			return err
		}
	}
	verdict, err := c.readHeaders(req, seq, nodeErr)
	if err != nil {
		return err // the communicator is broken
	}
	// On a failed verdict nobody reduces: every rank of every node reached
	// the same one, and partials already sent are ignored.
	if verdict == nil {
		if err := c.reduceOwnPart(req, seq, p); err != nil {
			return err
		}
		if err := c.awaitResults(seq, p); err != nil {
			return err
		}
	}
	if err := c.sendDone(seq); err != nil {
		return err
	}
	if verdict == nil {
		c.ctl[c.rank].store(offReduced, seq)
		if err := c.gatherShards(req, seq, p); err != nil {
			return err
		}
	}
	if err := c.awaitDone(seq); err != nil {
		return err
	}
	n.releaseCallRemotes()
	user.release(c, c.opts.Timeout)
	user = userBuffers{} // released: nothing left for the deferred release
	return c.finish(seq, verdict)
}

// placeCall fills where p's input lies and where its results go. own: the
// input was not copied into the staging area (prepare).
func (c *Comm) placeCall(p *plan, req collective.AllReduce, seq uint64, user userBuffers, own bool) {
	n := c.net
	d := c.ctl[c.rank].desc(seq)
	p.in = c.inputs(seq)
	switch {
	case d.ResultIn == resultInput:
		na := n.allocs[d.Input]
		p.landed, p.base, p.outL, p.outOff = true, p.in[c.rank], na.local, uint64(d.InOffset)
	case user.dst != nil:
		p.landed, p.base, p.outL = true, hostPtr(req.Dst), user.dst
	default:
		p.base, p.outL = unsafe.Pointer(&c.staging[c.rank][0]), n.stagingL
	}
	switch {
	case d.Input >= 0:
		if na := n.allocs[d.Input]; na != nil {
			p.inL, p.inOff = na.local, uint64(d.InOffset)
		}
	case own:
		p.in[c.rank] = hostPtr(req.Src)
		p.inL = user.src
		if p.inL == nil && req.Src == req.Dst {
			p.inL = user.dst
		}
	default:
		p.inL = n.stagingL // the input copied there
	}
	p.fromInput = len(c.topo.Local()) == 1 && p.as == p.es && p.inL != nil && !p.x
}

// sendDone tells the group that this rank holds everything it needs of
// this call. Its signal goes out once all this rank sent to that rank has
// landed (SignalFlushed), so a rank that has every group rank's done knows
// that nothing it sent in the call is still on its way: the staging area
// and the send slots are free for the next call, and no group rank waits
// for this one any more when it returns (and perhaps closes).
func (c *Comm) sendDone(seq uint64) error {
	n := c.net
	for m := range n.group {
		if m != n.node {
			if err := n.t.SignalFlushed(n.regionR[m], n.lay.word(c.rank, wordDone), 1); err != nil {
				return c.netFailure(n.group[m], fmt.Sprintf("could not be sent its end of call #%d: %v", seq, err), true)
			}
		}
	}
	return nil
}

func (c *Comm) awaitDone(seq uint64) error {
	n := c.net
	for m, r := range n.group {
		if m == n.node {
			continue
		}
		if err := c.await(r, fmt.Sprintf("the end of all-reduce call #%d", seq), func() bool {
			return n.load(r, wordDone) >= n.calls
		}); err != nil {
			return err
		}
	}
	return nil
}

// sendHeaders tells every rank of the group this node's verdict and where
// this call's data signals start.
func (c *Comm) sendHeaders(req collective.AllReduce, seq uint64, nodeErr error, user userBuffers) error {
	n := c.net
	for m, r := range n.group {
		if m == n.node {
			continue
		}
		// A header of call s+2 reuses the outbox of call s only after r read
		// that one: r's header of call s+1, which this rank waited for in
		// call s+1, left r after r had read all of call s's.
		out := n.lay.outbox(n.calls, c.size, r)
		h := (*header)(n.at(out))
		*h = header{Call: n.calls, Count: req.Count, DataBase: n.dataSent[m], DType: int32(req.DType), Op: int32(req.Op),
			DstAlloc: -1}
		if d := c.ctl[c.rank].desc(seq); nodeErr == nil && d.ResultIn == resultInput {
			h.DstAlloc, h.DstOffset = d.Input, d.InOffset
		} else if user.dst != nil {
			h.DstAlloc, h.KeyLen = userAlloc, int32(copy(h.Detail[:], user.dst.Key()))
		}
		if nodeErr != nil {
			h.Code = int32(status.CodeOf(nodeErr))
			copy(h.Detail[:len(h.Detail)-1], nodeErr.Error())
		}
		in := n.lay.header(n.calls, c.size, c.rank)
		if err := c.put(m, n.regionR[m], in, n.regionL, out, headerBytes, wordHeader, fmt.Sprintf("header of call #%d", n.calls)); err != nil {
			return err
		}
	}
	return nil
}

// sendPartials folds this node's inputs part by part, chunk by chunk, and
// puts each chunk of another node's part into that node's group rank (in an
// exchange, the whole shard's into every other node's). The own part comes
// last, so the owner's step starts right after.
func (c *Comm) sendPartials(req collective.AllReduce, seq uint64, p plan) error {
	n := c.net
	local := c.topo.Local()
	srcs := make([]unsafe.Pointer, len(local))
	nodes := len(n.group)
	for step := 1; step <= nodes; step++ {
		m := (n.node + step) % nodes
		if p.fromInput && m == n.node {
			continue
		}
		a, b := p.parts[m], p.parts[m+1]
		for lo := a; lo < b; lo += p.perChunk {
			cnt := min(p.perChunk, b-lo)
			src, off := n.regionL, n.lay.send+uint64(m)*n.lay.slot+uint64((lo-a)*p.as)
			if p.fromInput {
				src, off = p.inL, p.inOff+uint64((p.lo+lo)*p.es)
			} else {
				for i, q := range local {
					srcs[i] = unsafe.Add(p.in[q], (p.lo+lo)*p.es)
				}
				reduce.HostPartial(n.at(off), srcs, int(cnt), req.DType, req.Op)
			}
			dst := n.lay.recv + uint64(n.node)*n.lay.slot + uint64((lo-a)*p.as)
			// To part m's owner; in an exchange (part m is this node's whole
			// shard) to every other node.
			for to := range nodes {
				if to == n.node || (!p.x && to != m) {
					continue
				}
				if err := c.put(to, n.regionR[to], dst, src, off, uint64(cnt*p.as), wordData,
					fmt.Sprintf("partials of call #%d", seq)); err != nil {
					return err
				}
				n.dataSent[to]++
			}
			c.progress()
		}
	}
	return nil
}

// readHeaders waits for every group rank's header and returns the call's
// verdict (the same on every rank of every node), or err when the wait
// failed (the communicator is broken then).
func (c *Comm) readHeaders(req collective.AllReduce, seq uint64, nodeErr error) (verdict, err error) {
	n := c.net
	verdict = nodeErr
	for m, r := range n.group {
		if m == n.node {
			continue
		}
		if err := c.await(r, fmt.Sprintf("its header of all-reduce call #%d", seq), func() bool {
			return n.load(r, wordHeader) >= n.calls
		}); err != nil {
			return nil, err
		}
		h := *(*header)(n.at(n.lay.header(n.calls, c.size, r)))
		if h.Call != n.calls {
			return nil, c.protocolFailure(r, fmt.Sprintf("sent the header of its inter-node call %d during call %d", h.Call, n.calls))
		}
		n.dataBase[m] = h.DataBase
		n.resultR[m], n.resultOff[m] = n.stagingR[m], 0
		if h.DstAlloc == userAlloc && h.Code == 0 {
			if h.KeyLen <= 0 || int(h.KeyLen) > len(h.Detail) {
				return nil, c.protocolFailure(r, fmt.Sprintf("sent a key of %d bytes for its output", h.KeyLen))
			}
			// All of Detail, zeros past the key: UCX reads as much of it as
			// its own format says, never past the copy.
			rem, err := n.t.Remote(r, h.Detail[:])
			if err != nil {
				return nil, c.protocolFailure(r, fmt.Sprintf("sent a key for its output that this rank cannot use: %v", err))
			}
			n.callRemotes = append(n.callRemotes, rem)
			n.resultR[m] = rem
		} else if h.DstAlloc >= 0 {
			na := n.allocs[h.DstAlloc]
			if na == nil || h.DstOffset < 0 {
				return nil, c.protocolFailure(r, fmt.Sprintf("asked for its results in symmetric allocation %d at %d, which this rank has not registered",
					h.DstAlloc, h.DstOffset))
			}
			n.resultR[m], n.resultOff[m] = na.remote[m], uint64(h.DstOffset)
		}
		if verdict != nil {
			continue
		}
		switch {
		case h.Code != 0:
			detail := string(h.Detail[:])
			for i, b := range h.Detail {
				if b == 0 {
					detail = string(h.Detail[:i])
					break
				}
			}
			verdict = status.Errorf(status.Mismatch, "rank %d on node %d failed this call: %s", r, m, detail)
		case h.Count != req.Count || h.DType != int32(req.DType) || h.Op != int32(req.Op):
			verdict = status.Errorf(status.Mismatch, "ranks disagree: rank %d has %d x %s op %s, rank %d has %d x %s op %s",
				c.rank, req.Count, req.DType, req.Op, r, h.Count, reduce.DType(h.DType), reduce.Op(h.Op))
		}
	}
	return verdict, nil
}

// reduceOwnPart folds each chunk of this rank's part as every node's
// partial of it arrives, in node order, into the staging area, and puts the
// result into the same place of every group rank's staging area (but in an
// exchange, where every group rank folds the whole shard itself).
func (c *Comm) reduceOwnPart(req collective.AllReduce, seq uint64, p plan) error {
	n := c.net
	a, b := p.parts[n.node], p.parts[n.node+1]
	srcs := make([]unsafe.Pointer, len(n.group))
	what := fmt.Sprintf("results of call #%d", seq)
	for k, lo := uint64(0), a; lo < b; k, lo = k+1, lo+p.perChunk {
		cnt := min(p.perChunk, b-lo)
		slotOff := uint64((lo - a) * p.as)
		for m, r := range n.group {
			if m == n.node && p.fromInput {
				srcs[m] = unsafe.Add(p.in[c.rank], (p.lo+lo)*p.es) // where the output is the input, overwritten in place below
				continue
			}
			if m == n.node {
				srcs[m] = n.at(n.lay.send + uint64(m)*n.lay.slot + slotOff)
				continue
			}
			want := n.dataBase[m] + k + 1
			if err := c.await(r, fmt.Sprintf("chunk %d of its partials of all-reduce call #%d", k, seq), func() bool {
				return n.load(r, wordData) >= want
			}); err != nil {
				return err
			}
			srcs[m] = n.at(n.lay.recv + uint64(m)*n.lay.slot + slotOff)
		}
		out := uint64((p.lo + lo) * p.es)
		reduce.HostFinish(unsafe.Add(p.base, out), srcs, int(cnt), req.DType, req.Op, c.size)
		for m := range n.group {
			if m == n.node || p.x {
				continue
			}
			if err := c.put(m, n.resultR[m], n.resultOff[m]+out, p.outL, p.outOff+out, uint64(cnt*p.es), wordResult, what); err != nil {
				return err
			}
		}
		c.progress()
	}
	return nil
}

// awaitResults waits until every other part of this rank's shard is in its
// staging area.
func (c *Comm) awaitResults(seq uint64, p plan) error {
	n := c.net
	for m, r := range n.group {
		if m == n.node {
			continue
		}
		n.results[m] += uint64(p.chunks(m))
		want := n.results[m]
		if err := c.await(r, fmt.Sprintf("its results of all-reduce call #%d", seq), func() bool {
			return n.load(r, wordResult) >= want
		}); err != nil {
			return err
		}
	}
	return nil
}

// gatherShards copies each local rank's finished shard from where it left
// it (its staging area, or its output in symmetric memory) into this rank's
// output, as each is flagged.
func (c *Comm) gatherShards(req collective.AllReduce, seq uint64, p plan) error {
	local := c.topo.Local()
	es := int64(req.DType.Size())
	for i, q := range local {
		if q == c.rank && p.landed {
			continue // its results landed in its output
		}
		if q != c.rank {
			v := c.ctl[q]
			if err := c.await(q, fmt.Sprintf("its shard of all-reduce call #%d", seq), func() bool {
				return v.load(offReduced) >= seq
			}); err != nil {
				return err
			}
		}
		lo, hi := slice(req.Count, len(local), i)
		if from, to := c.resultAt(seq, q, p.in, lo*es), unsafe.Add(hostPtr(req.Dst), lo*es); hi > lo && from != to {
			copy(unsafe.Slice((*byte)(to), (hi-lo)*es), unsafe.Slice((*byte)(from), (hi-lo)*es))
		}
	}
	return nil
}
