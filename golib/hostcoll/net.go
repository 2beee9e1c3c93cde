package hostcoll

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"slices"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport"
	"github.com/p2pcomm/p2pcomm/golib/transport/ucx"
)

// The inter-node side of the CPU backend. Each rank talks over UCX only to
// its group: the ranks with its local index on the other nodes. It
// registers two ranges: its staging area (owners put reduced results there)
// and a private region laid out alike on every rank:
//
//	words    [world][5]uint64  signals from each rank: headers, data chunks,
//	                           result chunks, calls done, failure records
//	                           (running totals)
//	headers  [2][world]header  one per call and sender, by call parity
//	outbox   [2][world]header  this rank's to each receiver, by call parity
//	records  [2][world]record  failure records, by version parity
//	recv     [nodes]slot       partials from each node for this rank's part
//	send     [nodes]slot       this rank's partials, by the node that owns each
const (
	wordHeader = iota
	wordData
	wordResult
	wordDone
	wordRecord
	wordsPerRank

	headerBytes = 256
	recordBytes = 256
	pageBytes   = 4096
)

// DefaultNetChunkBytes is how much of a partial travels per put and signal
// across nodes: small enough that the local reduction of the next chunk,
// the network and the owner's reduction overlap, large enough to hide the
// round trip each signal's flush costs (one chunk is in flight per peer).
const DefaultNetChunkBytes = 1 << 20

// header is what a rank tells each rank of its group at the start of every
// all-reduce across nodes: its node's verdict on the call (ranks of a node
// agree through shared memory first) and where its data signals start.
type header struct {
	Call     uint64 // the group's call count, for a consistency check
	Count    int64
	DataBase uint64 // data signals this sender had sent to the receiver before this call
	DType    int32
	Op       int32
	Code     int32 // status code of the sender's node-level error, 0 if none
	KeyLen   int32 // bytes of Detail that hold its output's key (DstAlloc userAlloc)
	// DstAlloc is the symmetric allocation (id) holding the sender's
	// output, where it wants its results put, at DstOffset; userAlloc: its
	// output, registered for the call (the key in Detail); -1: its staging
	// area.
	DstAlloc  int64
	DstOffset int64
	Detail    [headerBytes - 56]byte // the node's error, or the output's key
}

var _ [headerBytes - unsafe.Sizeof(header{})]byte
var _ [unsafe.Sizeof(header{}) - headerBytes]byte

// netLayout is the region's offsets; the same on every rank.
type netLayout struct {
	headers, records, recv, send uint64
	slot                         uint64 // bytes of one node's slot in recv and send
	size                         uint64
}

func roundUp(n, to uint64) uint64 { return (n + to - 1) / to * to }

// newNetLayout sizes the slots for the largest call the staging area
// admits: 16-bit elements filling it, split over the node's ranks and then
// the nodes, held as float32 (no other dtype needs more).
func newNetLayout(world, nodes, local int, stagingBytes int64) netLayout {
	elems := uint64(stagingBytes) / 2
	shard := (elems + uint64(local) - 1) / uint64(local)
	part := (shard + uint64(nodes) - 1) / uint64(nodes)
	var l netLayout
	l.slot = roundUp(part*4, 64)
	l.headers = roundUp(uint64(world*wordsPerRank*8), lineBytes)
	l.records = l.headers + uint64(4*world*headerBytes)
	l.recv = roundUp(l.records+uint64(2*world*recordBytes), pageBytes)
	l.send = l.recv + uint64(nodes)*l.slot
	l.size = roundUp(l.send+uint64(nodes)*l.slot, pageBytes)
	return l
}

func (l netLayout) word(sender, kind int) uint64 { return uint64(sender*wordsPerRank+kind) * 8 }

func (l netLayout) header(call uint64, world, sender int) uint64 {
	return l.headers + (call&1*uint64(world)+uint64(sender))*headerBytes
}

// outbox is where this rank's header of call for receiver is built.
func (l netLayout) outbox(call uint64, world, receiver int) uint64 {
	return l.header(call, world, receiver) + uint64(2*world*headerBytes)
}

func (l netLayout) record(version uint64, world, sender int) uint64 {
	return l.records + (version&1*uint64(world)+uint64(sender))*recordBytes
}

// network is this rank's UCX side: the transport, the region, and what its
// group has sent so far.
type network struct {
	t           *ucx.Transport
	lay         netLayout
	region      []byte
	regionL     transport.Local
	stagingL    transport.Local
	regionR     []transport.Remote // by node; nil for this rank's
	stagingR    []transport.Remote
	group       []int // group[m]: the rank of node m with this rank's local index
	node        int
	chunk       int64 // bytes of partials per put
	linger      time.Duration
	blameWait   time.Duration   // collective.BlameWait of the timeout
	calls       uint64          // all-reduces across nodes so far
	dataSent    []uint64        // by node: data chunks signalled to that node's group rank
	dataBase    []uint64        // by node: data chunks its group rank had signalled before this call
	results     []uint64        // by node: result chunks expected from it so far
	version     uint64          // of this rank's failure record
	bg          *ucx.Background // progresses UCX between calls
	allocs      map[int64]*netAlloc
	resultR     []transport.Remote // by node: where this call's results for its group rank go
	resultOff   []uint64
	callRemotes []transport.Remote // group ranks' outputs registered for this call
}

// releaseCallRemotes drops the keys of outputs registered for the call
// that ended (each Close flushes its peer first if anything is pending).
func (n *network) releaseCallRemotes() {
	for _, r := range n.callRemotes {
		r.Close()
	}
	n.callRemotes = n.callRemotes[:0]
}

// netAlloc is a symmetric allocation registered with the transport, on
// this rank and its group: an all-reduce in place on it gets its results
// there directly, with no copy out of the staging area.
type netAlloc struct {
	local  transport.Local
	remote []transport.Remote // by node; nil for this rank's
}

func (a *netAlloc) close() {
	for _, r := range a.remote {
		if r != nil {
			r.Close()
		}
	}
	if a.local != nil {
		a.local.Close()
	}
}

func (n *network) base() unsafe.Pointer { return unsafe.Pointer(&n.region[0]) }

func (n *network) at(off uint64) unsafe.Pointer { return unsafe.Add(n.base(), off) }

// load reads a signal word that sender's puts advance.
func (n *network) load(sender, kind int) uint64 {
	return atomic.LoadUint64((*uint64)(n.at(n.lay.word(sender, kind))))
}

// openNetwork opens the UCX transport and the region and exchanges keys.
// Collective over every rank; any rank's failure is every rank's, and
// leaves nothing open, so a later call may try again.
func (c *Comm) openNetwork() error {
	if err := bootstrap.Agree(c.bs, ucx.Available(nil)); err != nil {
		return fmt.Errorf("all-reduce across nodes needs UCX: %w", err)
	}
	t, err := ucx.Open(c.bs, ucx.Options{Timeout: c.opts.Timeout, Stage: ucx.StageNever,
		SeparateHosts: c.topo.SharedHosts, OneHost: c.topo.OneHost()})
	if err != nil {
		return fmt.Errorf("all-reduce across nodes: %w", err)
	}
	nodes := len(c.topo.Nodes)
	n := &network{t: t, node: c.topo.Node(), chunk: c.opts.NetChunkBytes, dataSent: make([]uint64, nodes),
		dataBase: make([]uint64, nodes), results: make([]uint64, nodes), allocs: map[int64]*netAlloc{},
		resultR: make([]transport.Remote, nodes), resultOff: make([]uint64, nodes)}
	n.linger = min(c.opts.Timeout/8, 500*time.Millisecond)
	n.blameWait = collective.BlameWait(c.opts.Timeout)
	n.lay = newNetLayout(c.size, nodes, len(c.topo.Local()), c.opts.StagingBytes)
	li := c.topo.LocalRank()
	for _, ranks := range c.topo.Nodes {
		n.group = append(n.group, ranks[li])
	}
	keys, err := c.registerNetwork(n)
	if err = bootstrap.Agree(c.bs, err); err != nil {
		n.close()
		return fmt.Errorf("all-reduce across nodes: %w", err)
	}
	all, err := c.bs.AllGather(keys)
	if err == nil {
		err = c.connectGroup(n, all)
	}
	if err = bootstrap.Agree(c.bs, err); err != nil {
		n.close()
		return fmt.Errorf("all-reduce across nodes: %w", err)
	}
	allocs := make([]*alloc, 0, len(c.allocs))
	for _, a := range c.allocs {
		allocs = append(allocs, a)
	}
	slices.SortFunc(allocs, func(a, b *alloc) int { return cmp.Compare(a.id, b.id) })
	if err := c.registerAllocs(n, allocs); err != nil {
		n.close()
		return fmt.Errorf("all-reduce across nodes: %w", err)
	}
	n.bg = ucx.StartBackground(n.t)
	c.net = n
	return nil
}

// registerAllocs registers symmetric allocations (the same on every rank,
// in id order) with the transport and exchanges their keys. Collective
// over every rank; any rank's failure is every rank's, and leaves none of
// them registered.
//
// The background progress (when running) pauses only around the transport
// calls, not while this rank waits for its peers in the bootstrap: they may
// need its progress to finish what they sent it.
func (c *Comm) registerAllocs(n *network, allocs []*alloc) error {
	added := make([]*netAlloc, len(allocs))
	enter, leave := func() {
		if n.bg != nil {
			n.bg.Enter()
		}
	}, func() {
		if n.bg != nil {
			n.bg.Leave()
		}
	}
	undo := func() {
		enter()
		defer leave()
		for _, na := range added {
			if na != nil {
				na.close()
			}
		}
	}
	var keys [][]byte
	var err error
	enter()
	for i, a := range allocs {
		added[i] = &netAlloc{remote: make([]transport.Remote, len(n.group))}
		if added[i].local, err = n.t.Register(a.local, uint64(a.size), transport.HostMemory); err != nil {
			break
		}
		keys = append(keys, added[i].local.Key())
	}
	leave()
	if err = bootstrap.Agree(c.bs, err); err != nil {
		undo()
		return fmt.Errorf("register symmetric memory: %w", err)
	}
	all, err := c.bs.AllGather(transport.AppendKeys(nil, keys...))
	if err == nil {
		enter()
		err = c.connectAllocs(n, added, all)
		leave()
	}
	if err = bootstrap.Agree(c.bs, err); err != nil {
		undo()
		return fmt.Errorf("register symmetric memory: %w", err)
	}
	for i, a := range allocs {
		n.allocs[a.id] = added[i]
	}
	return nil
}

// connectAllocs turns the group's keys of added into remote ranges.
func (c *Comm) connectAllocs(n *network, added []*netAlloc, all [][]byte) error {
	for m, r := range n.group {
		if m == n.node {
			continue
		}
		keys, ok := transport.SplitKeys(all[r], len(added))
		if !ok {
			return status.Errorf(status.Bootstrap, "rank %d sent %d bytes of keys for %d symmetric allocations", r, len(all[r]), len(added))
		}
		for i, na := range added {
			var err error
			if na.remote[m], err = n.t.Remote(r, keys[i]); err != nil {
				return err
			}
		}
	}
	return nil
}

// forgetAlloc releases a symmetric allocation's registration (Free).
func (n *network) forgetAlloc(id int64) {
	if na := n.allocs[id]; na != nil {
		n.bg.Enter()
		na.close()
		n.bg.Leave()
		delete(n.allocs, id)
	}
}

// registerNetwork maps the region and registers it and the staging area;
// it returns the keys to exchange: the staging capacity (which sizes every
// slot, so it must agree), then both keys, length-prefixed.
func (c *Comm) registerNetwork(n *network) ([]byte, error) {
	region, err := unix.Mmap(-1, 0, int(n.lay.size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, status.Errorf(status.Capacity, "map %d bytes for the inter-node phase: %v", n.lay.size, err)
	}
	n.region = region
	if n.regionL, err = n.t.Register(uintptr(n.base()), n.lay.size, transport.HostMemory); err != nil {
		return nil, err
	}
	staging := c.staging[c.rank]
	if n.stagingL, err = n.t.Register(uintptr(unsafe.Pointer(&staging[0])), uint64(len(staging)), transport.HostMemory); err != nil {
		return nil, err
	}
	out := binary.LittleEndian.AppendUint64(nil, uint64(c.opts.StagingBytes))
	return transport.AppendKeys(out, n.regionL.Key(), n.stagingL.Key()), nil
}

// connectGroup turns the keys of this rank's group into remote ranges.
func (c *Comm) connectGroup(n *network, all [][]byte) error {
	n.regionR = make([]transport.Remote, len(n.group))
	n.stagingR = make([]transport.Remote, len(n.group))
	for m, r := range n.group {
		b := all[r]
		if len(b) < 8 {
			return status.Errorf(status.Bootstrap, "rank %d sent no inter-node keys", r)
		}
		if s := int64(binary.LittleEndian.Uint64(b)); s != c.opts.StagingBytes {
			return status.Errorf(status.Mismatch, "ranks disagree on P2PCOMM_STAGING_BYTES: rank %d has %d, rank %d has %d",
				c.rank, c.opts.StagingBytes, r, s)
		}
		if m == n.node {
			continue
		}
		keys, ok := transport.SplitKeys(b[8:], 2)
		if !ok {
			return status.Errorf(status.Bootstrap, "rank %d sent truncated inter-node keys", r)
		}
		var err error
		if n.regionR[m], err = n.t.Remote(r, keys[0]); err != nil {
			return err
		}
		if n.stagingR[m], err = n.t.Remote(r, keys[1]); err != nil {
			return err
		}
	}
	return nil
}

// close releases the transport (and with it every registration), then the
// region. Not collective. It first flushes what this rank sent its group,
// each for up to linger: a group rank may still be in the last call and
// wait for it, and closing cuts UCX's send buffers off unsent.
func (n *network) close() error {
	n.bg.Stop()
	n.bg = nil
	var err error
	if n.t != nil {
		err = n.t.CloseAfterFlush(n.group, n.linger) // this rank's own entry is skipped there
	}
	if n.region != nil {
		unix.Munmap(n.region)
		n.region = nil
	}
	return err
}

// put sends bytes of this rank's range src at off to node m's rank, at the
// same offset of dst, then signals word kind there (a header's, partials' or
// results'): one message where UCX can (PutWithSignal), else a signal that
// follows its data on the endpoint behind a weak fence (tcp keeps an
// endpoint's puts in order), so several chunks can be in flight.
func (c *Comm) put(m int, dst transport.Remote, dstOff uint64, src transport.Local, srcOff, bytes uint64, kind int, what string) error {
	n := c.net
	if err := n.t.PutWithSignal(dst, dstOff, src, srcOff, bytes, n.regionR[m], n.lay.word(c.rank, kind), 1); err != nil {
		return c.netFailure(n.group[m], fmt.Sprintf("could not be sent its %s: %v", what, err), true)
	}
	return nil
}

// progress moves UCX: peers' puts into this rank land only while it does
// (tcp), and so do its own puts once the socket is full. Every wait of an
// all-reduce across nodes progresses, even one on shared memory: a local
// peer may wait for a remote rank that waits for this rank's data.
func (c *Comm) progress() {
	c.net.t.Progress() // its only error is a device copier's, and there is none here
}
