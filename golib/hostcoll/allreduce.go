package hostcoll

import (
	"fmt"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/shm"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// AllReduce reduces req.Count elements across ranks. Every rank publishes a
// descriptor of its call first, so ranks that disagree (sizes, dtypes, ops)
// or that failed local validation all return an error together instead of
// computing garbage or waiting forever.
func (c *Comm) AllReduce(req collective.AllReduce) error {
	if err := c.usable(); err != nil {
		return err
	}
	if c.topo.MultiNode() {
		return c.allReduceNodes(req)
	}
	c.seq++
	seq := c.seq
	me := c.ctl[c.rank]
	d := me.desc(seq)
	*d = descriptor{Seq: seq, Kind: kindAllReduce, DType: int32(req.DType), Op: int32(req.Op),
		Algo: int32(c.pickAlgo(req)), Count: req.Count, Input: -1}
	nbytes := req.Bytes()
	localErr := c.prepare(req, d, nbytes, true)
	if localErr != nil {
		d.LocalErr = int32(status.CodeOf(localErr))
		copy(d.ErrDetail[:], localErr.Error())
	}
	me.store(offArrive, seq)
	if err := c.waitPeers(offArrive, seq, "start"); err != nil {
		return err
	}
	if err := c.agree(seq, localErr); err != nil {
		// Nobody read anyone's data; one more barrier keeps the next call's
		// descriptor from overwriting one a peer may still be comparing.
		return c.finish(seq, err)
	}
	in := c.inputs(seq)
	if collective.Algorithm(d.Algo) == collective.OneShot {
		return c.oneShot(req, seq, in, nbytes)
	}
	return c.twoShot(req, seq, in)
}

// Barrier blocks until every rank has entered it: through shared memory on
// one node, through the bootstrap across nodes.
func (c *Comm) Barrier() error {
	if err := c.usable(); err != nil {
		return err
	}
	if c.topo.MultiNode() {
		return c.bs.Barrier()
	}
	c.seq++
	seq := c.seq
	me := c.ctl[c.rank]
	*me.desc(seq) = descriptor{Seq: seq, Kind: kindBarrier}
	me.store(offArrive, seq)
	if err := c.waitPeers(offArrive, seq, "barrier"); err != nil {
		return err
	}
	return c.finish(seq, c.agree(seq, nil))
}

func (c *Comm) pickAlgo(req collective.AllReduce) collective.Algorithm {
	switch req.Algo {
	case collective.OneShot, collective.TwoShot:
		return req.Algo
	case collective.OneShotLL, collective.OneShotPush, collective.OneShotLL128, collective.OneShotLamport:
		return collective.OneShot // GPU protocols; shared memory has the one-shot shape
	case collective.TwoShotLL, collective.TwoShotPush, collective.TwoShotLamport:
		return collective.TwoShot
	case collective.Auto:
		if req.Bytes() <= c.opts.OneShotMaxBytes || c.size == 1 {
			return collective.OneShot
		}
	}
	// Ring and recursive doubling exist for GPUs without full connectivity;
	// shared memory is fully connected, so two-shot serves them.
	return collective.TwoShot
}

// prepare validates the call locally and stages the input (unless
// copyIn is false: no peer reads it from the staging area). It fills where
// the input is and where the reduced slice will be left.
func (c *Comm) prepare(req collective.AllReduce, d *descriptor, nbytes int64, copyIn bool) error {
	if req.Reject != nil {
		return req.Reject
	}
	if err := reduce.Check(req.DType, req.Op); err != nil {
		return err
	}
	if !req.Algo.Valid() {
		return status.Errorf(status.Unsupported, "unknown algorithm code %d", req.Algo)
	}
	if req.Count < 0 || (req.Count > 0 && (req.Src == 0 || req.Dst == 0)) {
		return status.Errorf(status.InvalidArgument, "bad buffer: count %d src %#x dst %#x", req.Count, req.Src, req.Dst)
	}
	a, off := c.find(req.Src, nbytes)
	inPlace := req.Src == req.Dst
	staging := nbytes // what this call needs of this rank's staging area
	switch {
	case a != nil:
		d.Input, d.InOffset = a.id, off
		d.ResultIn = resultInput
		staging = 0
		if !inPlace {
			d.ResultIn = resultStaging // the caller's input must stay intact
			staging = nbytes
		}
	default:
		d.ResultIn = resultStaging
	}
	if staging > c.opts.StagingBytes {
		return status.Errorf(status.Capacity,
			"tensor of %d bytes exceeds the staging capacity of %d bytes: allocate it with comm.empty() or raise P2PCOMM_STAGING_BYTES",
			nbytes, c.opts.StagingBytes)
	}
	if a == nil && nbytes > 0 && copyIn {
		copy(c.staging[c.rank][:nbytes], unsafe.Slice((*byte)(hostPtr(req.Src)), nbytes))
	}
	return nil
}

// agree compares every rank's descriptor with this rank's.
func (c *Comm) agree(seq uint64, localErr error) error {
	mine := c.ctl[c.rank].desc(seq)
	for _, r := range c.topo.Local() {
		if r == c.rank {
			continue
		}
		p := c.ctl[r].desc(seq)
		if p.Seq != seq {
			return status.Errorf(status.Internal, "rank %d published call #%d, expected #%d", r, p.Seq, seq)
		}
		if p.Kind != mine.Kind {
			return status.Errorf(status.Mismatch, "rank %d called %s while rank %d called %s",
				r, kindName(p.Kind), c.rank, kindName(mine.Kind))
		}
		if localErr == nil && p.LocalErr != 0 {
			detail := string(p.ErrDetail[:])
			for i, b := range p.ErrDetail {
				if b == 0 {
					detail = string(p.ErrDetail[:i])
					break
				}
			}
			return status.Errorf(status.Mismatch, "rank %d rejected its arguments (%s: %s...)",
				r, status.Code(p.LocalErr), detail)
		}
		if localErr != nil {
			continue
		}
		if p.Count != mine.Count || p.DType != mine.DType || p.Op != mine.Op {
			return status.Errorf(status.Mismatch,
				"ranks disagree: rank %d has %d x %s op %s, rank %d has %d x %s op %s",
				c.rank, mine.Count, reduce.DType(mine.DType), reduce.Op(mine.Op),
				r, p.Count, reduce.DType(p.DType), reduce.Op(p.Op))
		}
		if p.Algo != mine.Algo {
			return status.Errorf(status.Mismatch, "ranks disagree on the algorithm: rank %d %s, rank %d %s",
				c.rank, collective.Algorithm(mine.Algo), r, collective.Algorithm(p.Algo))
		}
		// Inputs may be staged on some ranks and symmetric on others, but a
		// symmetric input must be the same allocation and offset everywhere.
		if p.Input >= 0 && mine.Input >= 0 && (p.Input != mine.Input || p.InOffset != mine.InOffset) {
			return status.Errorf(status.Mismatch, "ranks pass different symmetric buffers: rank %d (allocation %d + %d bytes), rank %d (allocation %d + %d bytes)",
				c.rank, mine.Input, mine.InOffset, r, p.Input, p.InOffset)
		}
	}
	return localErr
}

func kindName(k uint32) string {
	if k == kindBarrier {
		return "barrier"
	}
	return "all_reduce"
}

// inputs returns the input address of every rank of this node for call
// seq (nil for ranks of other nodes).
func (c *Comm) inputs(seq uint64) []unsafe.Pointer {
	in := make([]unsafe.Pointer, c.size)
	for _, r := range c.topo.Local() {
		d := c.ctl[r].desc(seq)
		if d.Input < 0 {
			in[r] = unsafe.Pointer(&c.staging[r][0])
			continue
		}
		in[r] = unsafe.Add(c.allocByID(d.Input, r), d.InOffset)
	}
	return in
}

func (c *Comm) allocByID(id int64, r int) unsafe.Pointer {
	for _, a := range c.allocs {
		if a.id == id {
			return unsafe.Pointer(&a.segs[r].Data[0])
		}
	}
	return nil
}

// oneShot: every rank reduces the whole vector from every input.
func (c *Comm) oneShot(req collective.AllReduce, seq uint64, in []unsafe.Pointer, nbytes int64) error {
	dst := hostPtr(req.Dst)
	// Peers read this rank's input until the end barrier, so a result that
	// overwrites it must wait in private scratch.
	direct := c.ctl[c.rank].desc(seq).Input < 0 || req.Dst != req.Src
	target := dst
	if !direct {
		if int64(len(c.scratch)) < nbytes {
			c.scratch = make([]byte, nbytes)
		}
		target = unsafe.Pointer(&c.scratch[0])
	}
	reduce.Host(target, in, int(req.Count), req.DType, req.Op)
	err := c.finish(seq, nil)
	if err == nil && !direct {
		copy(unsafe.Slice((*byte)(dst), nbytes), c.scratch[:nbytes])
	}
	return err
}

// twoShot: rank r reduces slice r from every input and leaves it where its
// descriptor says, then every rank copies every slice into its output.
func (c *Comm) twoShot(req collective.AllReduce, seq uint64, in []unsafe.Pointer) error {
	es := int64(req.DType.Size())
	lo, hi := slice(req.Count, c.size, c.rank)
	srcs := make([]unsafe.Pointer, c.size)
	for r := range srcs {
		srcs[r] = unsafe.Add(in[r], lo*es)
	}
	reduce.Host(c.resultAt(seq, c.rank, in, lo*es), srcs, int(hi-lo), req.DType, req.Op)
	c.ctl[c.rank].store(offReduced, seq)
	if err := c.waitPeers(offReduced, seq, "reduce-scatter"); err != nil {
		return err
	}
	for r := range c.size {
		lo, hi := slice(req.Count, c.size, r)
		if hi == lo {
			continue
		}
		from := c.resultAt(seq, r, in, lo*es)
		to := unsafe.Add(hostPtr(req.Dst), lo*es)
		if from != to {
			copy(unsafe.Slice((*byte)(to), (hi-lo)*es), unsafe.Slice((*byte)(from), (hi-lo)*es))
		}
	}
	return c.finish(seq, nil)
}

func (c *Comm) resultAt(seq uint64, r int, in []unsafe.Pointer, off int64) unsafe.Pointer {
	if c.ctl[r].desc(seq).ResultIn == resultInput {
		return unsafe.Add(in[r], off)
	}
	return unsafe.Pointer(&c.staging[r][off])
}

// slice returns rank r's share [lo, hi) of n elements.
func slice(n int64, world, r int) (int64, int64) {
	base, rem := n/int64(world), n%int64(world)
	lo := int64(r)*base + min(int64(r), rem)
	hi := lo + base
	if int64(r) < rem {
		hi++
	}
	return lo, hi
}

// finish is the end barrier: no rank may reuse its buffers while a peer
// still reads them. It returns callErr unless the barrier itself failed.
func (c *Comm) finish(seq uint64, callErr error) error {
	c.ctl[c.rank].store(offDone, seq)
	if err := c.waitPeers(offDone, seq, "end"); err != nil {
		return err
	}
	return callErr
}

// waitPeers waits until every peer's flag at off reaches seq. It spins
// briefly, then yields the CPU, then sleeps, so that more ranks than cores
// still make progress; it fails fast if a peer process died and after the
// timeout otherwise. A failed wait breaks the communicator.
func (c *Comm) waitPeers(off int, seq uint64, phase string) error {
	if c.net != nil {
		return c.waitLocalPeers(off, seq, phase)
	}
	start := time.Now()
	for r := range c.size {
		if r == c.rank {
			continue
		}
		v := c.ctl[r]
		for i := 0; v.load(off) < seq; i++ {
			c.backoff(i)
			if i%64 != 63 {
				continue
			}
			if pid := int(v.load(offPid)); pid != 0 && !shm.Alive(pid) {
				return c.fail(status.Errorf(status.Timeout,
					"rank %d (pid %d) exited before the %s of call #%d", r, pid, phase, seq))
			}
			if waited := time.Since(start); waited > c.opts.Timeout {
				return c.fail(status.Errorf(status.Timeout,
					"rank %d never arrived at the %s of call #%d within %v (P2PCOMM_TIMEOUT_MS)", r, phase, seq, c.opts.Timeout))
			}
		}
	}
	return nil
}

func (c *Comm) fail(err error) error {
	c.broken = fmt.Errorf("communicator unusable: %w", err)
	return err
}

// hostPtr turns an address that came through the C ABI into a pointer. The
// memory is not Go's (a tensor or a mapping), so the collector ignores it.
func hostPtr(addr uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&addr)) }

// waitLocalPeers is waitPeers on a communicator that spans nodes: it
// progresses UCX meanwhile and hears of failures elsewhere.
func (c *Comm) waitLocalPeers(off int, seq uint64, phase string) error {
	for _, r := range c.topo.Local() {
		if r == c.rank {
			continue
		}
		v := c.ctl[r]
		if err := c.await(r, fmt.Sprintf("the %s of all-reduce call #%d", phase, seq), func() bool {
			return v.load(off) >= seq
		}); err != nil {
			return err
		}
	}
	return nil
}
