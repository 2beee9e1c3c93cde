// Package hostcoll is the CPU backend: all-reduce among the processes of
// one host through POSIX shared memory.
package hostcoll

import (
	"encoding/binary"
	"fmt"
	"os"
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/shm"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/topo"
)

// Options configure a Comm; zero values take the defaults.
type Options struct {
	Job          uint64        // names segments; the same on every rank of a job
	StagingBytes int64         // per-rank staging capacity (default 64 MiB)
	Timeout      time.Duration // bound on every wait for a peer (default 60 s)
	// OneShotMaxBytes: at or below this size Auto picks one-shot.
	OneShotMaxBytes int64
	// Cooperative waits through Go's scheduler instead of raw system calls:
	// for ranks that are goroutines of one process (tests), which would
	// otherwise starve each other of Go's threads.
	Cooperative bool
	// Topology says which ranks share this rank's node; only their memory
	// is mapped (nil: every rank shares one node).
	Topology *topo.Topology
	// NetChunkBytes is how much of a partial each put across nodes carries
	// (default DefaultNetChunkBytes).
	NetChunkBytes int64
	// NetRails is how many rails (topo.NetRails) an ExpertParallel over
	// this Comm uses across nodes: 1, 2, 4 or 8, 0 for the default.
	NetRails int
}

// DefaultStagingBytes is the staging capacity without P2PCOMM_STAGING_BYTES.
const DefaultStagingBytes = 64 << 20

var commCounter atomic.Uint64

var _ collective.Backend = (*Comm)(nil)

// Comm is the CPU backend of one communicator. It implements
// collective.Backend.
type Comm struct {
	bs      bootstrap.Bootstrap
	rank    int
	size    int
	opts    Options
	prefix  string
	own     *shm.Segment   // this rank's control block + staging
	peers   []*shm.Segment // every rank's, own included at [rank]
	ctl     []ctlView
	staging [][]byte
	allocs  map[uintptr]*alloc
	nextID  int64
	seq     uint64
	broken  error
	scratch []byte
	topo    *topo.Topology
	crowded bool     // more ranks on this host than cores: waits nap almost at once (wait.go)
	net     *network // the inter-node phase's UCX side, from the first all-reduce across nodes
	// registered: ranges passed to Register, by address (their sizes), so
	// that channels can tell a registered range from any other.
	registered map[uintptr]int64
}

type alloc struct {
	id    int64
	size  int
	segs  []*shm.Segment // [rank]; nil for ranks of other nodes
	local uintptr
}

// New creates the CPU backend collectively: every rank maps the control
// block and staging area of every other rank of its node.
func New(bs bootstrap.Bootstrap, opts Options) (*Comm, error) {
	if opts.StagingBytes <= 0 {
		opts.StagingBytes = DefaultStagingBytes
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 60 * time.Second
	}
	if opts.NetChunkBytes <= 0 {
		opts.NetChunkBytes = DefaultNetChunkBytes
	}
	if opts.OneShotMaxBytes <= 0 {
		opts.OneShotMaxBytes = 8 << 10 // measured: two-shot wins from 16 KiB on 2 ranks
	}
	opts.StagingBytes = (opts.StagingBytes + stagingAlign - 1) / stagingAlign * stagingAlign
	shm.CleanStale()
	c := &Comm{bs: bs, rank: bs.Rank(), size: bs.Size(), opts: opts, allocs: map[uintptr]*alloc{},
		topo: opts.Topology, registered: map[uintptr]int64{}}
	if c.topo == nil {
		c.topo = topo.Single(c.rank, c.size)
	}
	c.crowded = c.topo.HostRanks > runtime.NumCPU()
	// Rank 0 picks a per-communicator id so two communicators of one job
	// never share names.
	var id [8]byte
	binary.LittleEndian.PutUint64(id[:], uint64(os.Getpid())<<20|commCounter.Add(1))
	ids, err := bs.AllGather(id[:])
	if err != nil {
		return nil, fmt.Errorf("agree on communicator id: %w", err)
	}
	c.prefix = fmt.Sprintf("c%x", binary.LittleEndian.Uint64(ids[0]))
	segBytes := ctlBytes + int(opts.StagingBytes)
	segs, err := c.openSymmetric("ctl", segBytes)
	if err != nil {
		return nil, err
	}
	c.peers = segs
	c.own = segs[c.rank]
	c.ctl = make([]ctlView, c.size)
	c.staging = make([][]byte, c.size)
	for r, s := range segs {
		if s != nil { // ranks of other nodes stay unmapped
			c.ctl[r] = ctlView{unsafe.Pointer(&s.Data[0])}
			c.staging[r] = s.Data[ctlBytes:]
		}
	}
	c.ctl[c.rank].store(offPid, uint64(os.Getpid()))
	if err := bs.Barrier(); err != nil { // every pid is published
		c.Close()
		return nil, err
	}
	return c, nil
}

// openSymmetric creates this rank's segment named tag, maps the segments of
// the peers of its node, and unlinks its own once all have mapped it, so a
// crash leaves no file. It is collective over every rank, so that nodes stay
// in step.
func (c *Comm) openSymmetric(tag string, size int) ([]*shm.Segment, error) {
	name := shm.Name(c.opts.Job, os.Getpid(), fmt.Sprintf("%s.%s.r%d", c.prefix, tag, c.rank))
	own, err := shm.Create(name, size)
	// Everyone reports success or failure, so one rank's failure fails all.
	msg := []byte(name)
	if err != nil {
		msg = []byte("!" + err.Error())
	}
	names, gerr := c.bs.AllGather(msg)
	if gerr != nil {
		own.Close()
		shm.Unlink(name)
		return nil, gerr
	}
	segs := make([]*shm.Segment, c.size)
	segs[c.rank] = own
	// On failure, still reach the barrier below: peers wait there for us.
	openErr := err
	for r, n := range names {
		if r == c.rank || openErr != nil || !c.topo.SameNode(r) {
			continue
		}
		if len(n) > 0 && n[0] == '!' {
			openErr = status.Errorf(status.Capacity, "rank %d could not create shared memory: %s", r, n[1:])
			break
		}
		if segs[r], err = shm.Open(string(n), size); err != nil {
			openErr = fmt.Errorf("map rank %d's %s segment: %w", r, tag, err)
			break
		}
	}
	// Unlink only after every rank has tried to map.
	if err := c.bs.Barrier(); err != nil && openErr == nil {
		openErr = err
	}
	shm.Unlink(name)
	if openErr != nil {
		for _, s := range segs {
			s.Close()
		}
		return nil, openErr
	}
	return segs, nil
}

// Alloc collectively allocates symmetric memory: nbytes in every rank's own
// segment, each mapped by all ranks.
func (c *Comm) Alloc(nbytes int64) (uintptr, error) {
	if err := c.usable(); err != nil {
		return 0, err
	}
	if nbytes <= 0 {
		return 0, status.Errorf(status.InvalidArgument, "symmetric allocation of %d bytes", nbytes)
	}
	size := int((nbytes + stagingAlign - 1) / stagingAlign * stagingAlign)
	id := c.nextID
	c.nextID++
	segs, err := c.openSymmetric(fmt.Sprintf("a%d", id), size)
	if err != nil {
		return 0, err
	}
	a := &alloc{id: id, size: size, segs: segs, local: uintptr(unsafe.Pointer(&segs[c.rank].Data[0]))}
	if c.net != nil {
		if err := c.registerAllocs(c.net, []*alloc{a}); err != nil {
			for _, s := range segs {
				s.Close()
			}
			return 0, err
		}
	}
	c.allocs[a.local] = a
	return a.local, nil
}

// Free collectively releases a symmetric allocation.
func (c *Comm) Free(ptr uintptr) error {
	a, ok := c.allocs[ptr]
	if !ok {
		return status.Errorf(status.InvalidArgument, "%#x is not a symmetric allocation of this communicator", ptr)
	}
	// Peers may still read this rank's memory until everyone stops using it.
	err := c.bs.Barrier()
	if c.net != nil {
		c.net.forgetAlloc(a.id)
	}
	delete(c.allocs, ptr)
	for _, s := range a.segs {
		s.Close()
	}
	return err
}

// Register accepts any host range: CPU tensors outside symmetric memory go
// through the staging area, so there is nothing to map. The range is noted
// for Contains.
func (c *Comm) Register(ptr uintptr, nbytes int64) error {
	if err := c.usable(); err != nil {
		return err
	}
	if ptr != 0 && nbytes > 0 {
		c.registered[ptr] = nbytes
	}
	return nil
}

// Deregister is the inverse of Register.
func (c *Comm) Deregister(ptr uintptr) error {
	if err := c.usable(); err != nil {
		return err
	}
	delete(c.registered, ptr)
	return nil
}

// Contains reports whether [ptr, ptr+nbytes) lies in one symmetric
// allocation or one registered range of this rank.
func (c *Comm) Contains(ptr uintptr, nbytes int64) bool {
	if a, _ := c.find(ptr, nbytes); a != nil {
		return true
	}
	for p, n := range c.registered {
		if ptr >= p && nbytes >= 0 && ptr+uintptr(nbytes) <= p+uintptr(n) {
			return true
		}
	}
	return false
}

// Topology is the node layout the backend was built with.
func (c *Comm) Topology() *topo.Topology { return c.topo }

// Timeout is the bound on every wait for a peer (P2PCOMM_TIMEOUT_MS).
func (c *Comm) Timeout() time.Duration { return c.opts.Timeout }

// NetRails is the rail count asked for across nodes (0: the default).
func (c *Comm) NetRails() int { return c.opts.NetRails }

// Check returns the error that broke the communicator, if any.
func (c *Comm) Check() error { return c.broken }

// Close unmaps everything. Not collective.
func (c *Comm) Close() error {
	if c.net != nil {
		// UCX holds registrations of the staging area: it goes first.
		c.net.close()
		c.net = nil
	}
	for _, a := range c.allocs {
		for _, s := range a.segs {
			s.Close()
		}
	}
	c.allocs = map[uintptr]*alloc{}
	for _, s := range c.peers {
		s.Close()
	}
	c.peers, c.ctl, c.staging = nil, nil, nil
	if c.broken == nil {
		c.broken = status.Errorf(status.State, "communicator is closed")
	}
	return nil
}

func (c *Comm) usable() error {
	if c.broken != nil {
		return c.broken
	}
	return nil
}

// find returns the symmetric allocation holding [p, p+n) and p's offset in it.
func (c *Comm) find(p uintptr, n int64) (*alloc, int64) {
	for base, a := range c.allocs {
		if p >= base && p+uintptr(n) <= base+uintptr(a.size) {
			return a, int64(p - base)
		}
	}
	return nil, 0
}

// PeerAddress returns where this process maps rank's copy of the symmetric
// range [ptr, ptr+nbytes).
func (c *Comm) PeerAddress(ptr uintptr, nbytes int64, rank int) (uintptr, error) {
	if err := c.usable(); err != nil {
		return 0, err
	}
	if rank < 0 || rank >= c.size {
		return 0, status.Errorf(status.InvalidArgument, "rank %d out of range [0, %d)", rank, c.size)
	}
	if !c.topo.SameNode(rank) {
		return 0, status.Errorf(status.Unsupported, "rank %d is on node %d, rank %d on node %d: memory of another node is not mapped (%s)",
			rank, c.topo.NodeOf[rank], c.rank, c.topo.Node(), c.topo)
	}
	a, off := c.find(ptr, nbytes)
	if a == nil {
		return 0, status.Errorf(status.InvalidArgument, "%#x (+%d bytes) is not in symmetric memory from comm.empty()", ptr, nbytes)
	}
	return uintptr(unsafe.Pointer(&a.segs[rank].Data[0])) + uintptr(off), nil
}

// StreamBarrier is Barrier: the CPU has no streams.
func (c *Comm) StreamBarrier(uintptr, collective.Call) error { return c.Barrier() }
