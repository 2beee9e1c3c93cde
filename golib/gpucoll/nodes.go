package gpucoll

import (
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/channel"
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/proxy"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/symm"
	"github.com/p2pcomm/p2pcomm/golib/topo"
	"github.com/p2pcomm/p2pcomm/golib/trace"
)

// All-reduce across nodes on GPUs: allreduce_hier.cu, one launch per call;
// inside a node peer memory, between nodes port channels (the proxy and
// UCX) over pinned host memory the kernel reads and writes itself, so that
// the proxy makes no CUDA call while the kernel waits for it. Every
// algorithm name runs it on a communicator that spans nodes.

// Geometry shared with allreduce_hier.cu.
const (
	hierBlocks    = 8         // kHierBlocks: the grid, and one port channel set per block
	hierRing      = 2         // kHierRing: chunks in flight per block and peer
	hierSlotBytes = 256 << 10 // a ring slot: one chunk of partials in the accumulator type
	hierFile      = "allreduce_hier.cu"
	// kHierExchangeSlotBytes: a slot of the exchange area, where the
	// partials of calls that skip the results' trip go, by call parity.
	hierExchangeSlotBytes = 132 << 10
	// hierAlgo enters the call's signature (it is no collective.Algorithm
	// of the C ABI).
	hierAlgo = collective.Algorithm(-2)
)

// Rails split the blocks evenly: topo's rail counts divide hierBlocks.
var _ = [1]int{}[hierBlocks%topo.MaxNetRails]

// hierParams mirrors HierParams in allreduce_hier.cu byte for byte
// (LAYOUT.md; layout_test.go pins the offsets).
type hierParams struct {
	PeerIn        [kMaxRanks]uint64
	PeerHier      [kMaxRanks]uint64
	PeerSignal    [kMaxRanks]uint64
	LocalSrc      uint64
	Out           uint64
	Err           uint64
	Chans         uint64
	Net           uint64
	Count         int64
	TimeoutNs     uint64
	ChunkElems    int64
	RingOffset    uint64
	SlotBytes     uint64
	LocalRank     int32
	LocalSize     int32
	Node          int32
	Nodes         int32
	Rank          int32
	World         int32
	Op            int32
	Signature     int32
	Flags         uint32
	CallSignature int32
	GlobalOf      [kMaxRanks]int32
	GroupOf       [kMaxRanks]int32
}

func (p *hierParams) bytes() []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(p)), unsafe.Sizeof(*p))
}

// nodes is the backend's state for calls across nodes, made at the first.
type nodes struct {
	rails   []*channel.Channels // each its own UCX worker, connections and proxy thread
	buf     *symm.Buffer        // results region, each local rank's mapped
	net     *symm.HostBuffer    // what crosses nodes: results on their way, rings, exchange area
	table   *symm.Buffer        // PortChannel[hierBlocks][nodes], device memory
	results uint64              // bytes of the results region
	params  hierParams          // reused per launch
	fns     [6]cuda.Function    // allreduce_hier<T> by dtype, compiled at setup
}

// allReduceNodes enqueues one all-reduce across nodes on req.Stream. Like
// every GPU call it does not wait: a mismatch or a peer that never comes is
// raised at the next call or Check.
func (b *Backend) allReduceNodes(req collective.AllReduce) error {
	if err := b.topo.Uniform("all-reduce"); err != nil {
		return err
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	if b.nodes == nil {
		if err := b.openNodes(req.Stream); err != nil {
			return err
		}
	}
	why := req.Reject
	if why == nil {
		why = reduce.Check(req.DType, req.Op)
	}
	if why == nil && req.Count < 0 {
		why = status.Errorf(status.InvalidArgument, "negative element count %d", req.Count)
	}
	if why == nil && req.Bytes() > b.opts.StagingBytes {
		why = status.Errorf(status.Capacity,
			"tensor of %d bytes exceeds the staging capacity of %d bytes, which an all-reduce across nodes needs for any input: raise P2PCOMM_STAGING_BYTES",
			req.Bytes(), b.opts.StagingBytes)
	}
	if why != nil {
		// Take part with nothing to move and a signature nobody matches:
		// every rank of every node fails the call, then goes on.
		if err := b.launchHier(reduce.Float32, 0, reduce.Sum, 0, 0, rejectSignature, rejectSignature, 0, req.Stream); err != nil {
			return err
		}
		return why
	}
	call := signature(req.Count, req.DType, req.Op, hierAlgo)
	return b.launchHier(req.DType, req.Count, req.Op, req.Src, req.Dst, call, call, req.Bytes(), req.Stream)
}

// launchHier fills the parameters and launches allreduce_hier<dt>.
func (b *Backend) launchHier(dt reduce.DType, count int64, op reduce.Op, src, dst uintptr, sig, call int32, nbytes int64, stream uintptr) error {
	n := b.nodes
	p := &n.params
	local := b.topo.Local()
	*p = hierParams{Err: uint64(b.errDev), Chans: uint64(n.table.Local), Net: uint64(n.net.Device), Count: count,
		TimeoutNs: uint64(b.opts.Timeout.Nanoseconds()), RingOffset: n.results, SlotBytes: hierSlotBytes,
		LocalRank: int32(b.topo.LocalRank()), LocalSize: int32(len(local)), Node: int32(b.topo.Node()),
		Nodes: int32(len(b.topo.Nodes)), Rank: int32(b.rank), World: int32(b.size), Op: int32(op),
		Signature: sig, CallSignature: call, LocalSrc: uint64(src), Out: uint64(dst)}
	p.ChunkElems = int64(hierSlotBytes / reduce.AccType(dt).Size())
	for i := range p.GlobalOf {
		p.GlobalOf[i], p.GroupOf[i] = -1, -1
	}
	for q, r := range local {
		p.GlobalOf[q] = int32(r)
		p.PeerIn[q] = uint64(b.staging.Peers[r])
		p.PeerHier[q] = uint64(n.buf.Peers[r])
		p.PeerSignal[q] = uint64(b.signal.Peers[r])
	}
	for m, ranks := range b.topo.Nodes {
		p.GroupOf[m] = int32(ranks[b.topo.LocalRank()])
	}
	if count == 0 {
		// Nothing is read or written; a harmless output the kernel accepts.
		p.LocalSrc, p.Out = 0, uint64(b.scratch.Local)
	} else if buf, ok := b.space.Lookup(src, uint64(nbytes)); ok {
		// Registered on every rank of the node: read in place, and the
		// node's ranks check they all are (where the input lies joins the
		// signature they compare; other nodes compare only the call).
		off := src - buf.Local
		for q, r := range local {
			p.PeerIn[q] = uint64(buf.Peers[r] + off)
		}
		p.LocalSrc = 0
		p.Signature = withSource(sig, buf.Seq, uint64(off))
	}
	trace.Mark("launch")
	if err := b.drv.Launch(n.fns[dt], hierBlocks, kThreads, 0, stream, p.bytes()); err != nil {
		return fmt.Errorf("launch the all-reduce across nodes: %w", err)
	}
	trace.Mark("launched")
	return nil
}

// openNodes sets up calls across nodes: the hier buffers, one port channel
// set per block over them (the proxy and UCX start here), and the table of
// channels the kernel reads. Collective; a failure on any rank fails every
// rank and closes the rails it opened, so a later call tries again (the
// buffers it allocated stay with the communicator's memory until it
// closes). It allocates and synchronizes, so it cannot run inside a CUDA
// graph capture.
func (b *Backend) openNodes(stream uintptr) error {
	if st, err := b.drv.StreamCaptureStatus(stream); err == nil && st != cuda.CaptureNone {
		return status.Errorf(status.State,
			"the first all-reduce across nodes sets up port channels and cannot be captured in a CUDA graph: run one before capturing")
	}
	local, nodeCount := len(b.topo.Local()), len(b.topo.Nodes)
	if nodeCount > kMaxRanks {
		return status.Errorf(status.Unsupported, "all-reduce across nodes supports up to %d nodes; this communicator spans %s", kMaxRanks, b.topo)
	}
	// The results region holds one shard: a local rank's share of the
	// largest call the staging area admits, in packs of 16 bytes.
	shard := (uint64(b.opts.StagingBytes)+uint64(local)-1)/uint64(local) + 256
	results := (shard + 4095) &^ 4095
	rings := uint64(2 * hierBlocks * nodeCount * hierRing * hierSlotBytes)
	exchange := uint64(2 * hierBlocks * nodeCount * 2 * hierExchangeSlotBytes)
	total := results + rings + exchange // the net buffer
	if total-1 > proxy.MaxOffset {
		return status.Errorf(status.Capacity, "all-reduce across nodes needs %d bytes of port channel memory, more than a trigger addresses: lower P2PCOMM_STAGING_BYTES", total)
	}
	n := &nodes{results: results}
	err := b.buildNodes(n, results, total)
	if err != nil {
		n.close()
		return fmt.Errorf("all-reduce across nodes: %w", err)
	}
	b.nodes = n
	return nil
}

// buildNodes makes n's buffers, channels and table (collective steps,
// each failing on every rank alike).
func (b *Backend) buildNodes(n *nodes, results, total uint64) error {
	var err error
	if n.buf, err = b.space.Alloc(results); err != nil {
		return err
	}
	n.net, err = b.space.HostMapped(total)
	if err = bootstrap.Agree(b.bs, err); err != nil {
		return err
	}
	nodeCount := len(b.topo.Nodes)
	if n.table, err = b.space.Alloc(uint64(hierBlocks * nodeCount * int(unsafe.Sizeof(proxy.PortChannel{})))); err != nil {
		return err
	}
	// One lane of channels per block. Blocks share a rail (a FIFO, its
	// proxy thread and a UCX worker with connections of its own): proxies
	// sharing one worker would take turns at it, and one thread moving
	// every byte both ways over tcp is what limits a rank's bandwidth.
	rails, err := b.topo.AgreeRails(b.bs, b.opts.NetRails)
	if err != nil {
		return err
	}
	table := make([]proxy.PortChannel, hierBlocks*nodeCount)
	per := hierBlocks / rails
	for rail := range rails {
		// A rail is a stripe of its own already.
		ch := channel.New(channel.Config{Bootstrap: b.bs, Topology: b.topo, Timeout: b.opts.Timeout, UCXStripes: 1,
			GPU: &channel.GPU{Driver: b.drv, Space: b.space, Device: b.device, ErrWord: b.errDev}})
		n.rails = append(n.rails, ch)
		_, lanes, err := ch.HostPortChannels(n.net, per)
		if err != nil {
			return err
		}
		for k, chans := range lanes {
			for m, ranks := range b.topo.Nodes {
				if m != b.topo.Node() {
					table[(rail*per+k)*nodeCount+m] = chans[ranks[b.topo.LocalRank()]]
				}
			}
		}
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	raw := unsafe.Slice((*byte)(unsafe.Pointer(&table[0])), len(table)*int(unsafe.Sizeof(table[0])))
	err = b.drv.MemcpyAsync(n.table.Local, uintptr(unsafe.Pointer(&raw[0])), uint64(len(raw)), 0)
	if err == nil {
		err = b.drv.StreamSynchronize(0)
	}
	runtime.KeepAlive(table)
	if err = bootstrap.Agree(b.bs, err); err != nil {
		return err
	}
	// Compile ahead: a rank compiling inside its first call would leave
	// peers already in the kernel waiting.
	for dt := range n.fns {
		if n.fns[dt], err = b.kernels.named(hierFile, fmt.Sprintf("allreduce_hier<%s>", cType[reduce.DType(dt)])); err != nil {
			break
		}
	}
	return bootstrap.Agree(b.bs, err)
}

// close stops the channels' proxies and transports; the buffers go with the
// symmetric memory. Not collective.
func (n *nodes) close() error {
	if n == nil {
		return nil
	}
	var errs []error
	for _, ch := range n.rails {
		errs = append(errs, ch.Close())
	}
	return errors.Join(errs...)
}

// proxyErr is the sticky error of the proxy the kernel's port channels use.
func (n *nodes) proxyErr() error {
	if n == nil {
		return nil
	}
	for _, ch := range n.rails {
		if err := ch.Err(); err != nil {
			return err
		}
	}
	return nil
}

// closeNodes releases what openNodes made, before the backend's memory.
func (b *Backend) closeNodes() error {
	if b.nodes == nil {
		return nil
	}
	err := b.nodes.close()
	b.nodes = nil
	if err != nil {
		return fmt.Errorf("close the all-reduce across nodes: %w", err)
	}
	return nil
}
