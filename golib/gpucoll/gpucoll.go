// Package gpucoll is the GPU backend: all-reduce through CUDA IPC peer
// memory with kernels compiled by NVRTC at run time.
package gpucoll

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/symm"
	"github.com/p2pcomm/p2pcomm/golib/topo"
)

// Options configure the GPU backend; zero values take the defaults.
type Options struct {
	Timeout      time.Duration // bound on every device-side wait (default 60 s)
	StagingBytes int64         // per-rank staging and scratch capacity (default 256 MiB)
	Tune         Table         // algorithm choice by size; nil: built-in defaults
	ForceAlgo    collective.Algorithm
	MaxBlocks    int      // grid limit, 1..128 (default 128)
	NVRTCOptions []string // extra options for the kernels, e.g. -DP2P_UNROLL=4
	ShareGPUs    bool     // several ranks on one GPU (tests only; see symm.Options)
	// Topology says which ranks share this rank's node; only their memory
	// is mapped (nil: every rank shares one node).
	Topology *topo.Topology
}

// DefaultStagingBytes is the staging capacity without P2PCOMM_STAGING_BYTES.
const DefaultStagingBytes = 256 << 20

// Backend implements collective.Backend on one GPU.
type Backend struct {
	drv     *cuda.Driver
	space   *symm.Space
	rank    int
	size    int
	device  int
	arch    int
	sms     int
	opts    Options
	signal  *symm.Buffer
	staging *symm.Buffer
	scratch *symm.Buffer
	halves  *symm.Buffer // deferred one-shot staging: two halves per rank
	ll      *symm.Buffer // LL receive buffers: two halves of llHalfBytes
	bs      bootstrap.Bootstrap
	graph   graphSlots
	errHost unsafe.Pointer // *errorWord in pinned host memory
	errDev  uintptr
	kernels *kernelCache
	broken  error
	params  allReduceParams // reused per launch: no allocation on the hot path
	topo    *topo.Topology
	user    userKernels // kernels compiled from callers' sources
}

var _ collective.Backend = (*Backend)(nil)

// New creates the GPU backend collectively on CUDA device ordinal device.
func New(bs bootstrap.Bootstrap, device int, opts Options) (*Backend, error) {
	if opts.Timeout <= 0 {
		opts.Timeout = 60 * time.Second
	}
	if opts.StagingBytes <= 0 {
		opts.StagingBytes = DefaultStagingBytes
	}
	opts.StagingBytes = (opts.StagingBytes + 4095) &^ 4095
	if opts.MaxBlocks <= 0 || opts.MaxBlocks > kMaxBlocks {
		opts.MaxBlocks = kMaxBlocks
	}
	if bs.Size() > kMaxRanks {
		return nil, status.Errorf(status.Unsupported, "world size %d exceeds the GPU backend's limit of %d ranks", bs.Size(), kMaxRanks)
	}
	// Every rank learns if one cannot even start, instead of waiting for it
	// in the first exchange of symm.New.
	drv, cc, sms, err := probe(device)
	if err = bootstrap.Agree(bs, err); err != nil {
		return nil, err
	}
	top := opts.Topology
	if top == nil {
		top = topo.Single(bs.Rank(), bs.Size())
	}
	space, err := symm.New(drv, bs, device, symm.Options{ShareGPUs: opts.ShareGPUs, Node: top.Local()})
	if err != nil {
		return nil, err
	}
	if opts.ShareGPUs {
		sms = smsPerRank(sms, space.Peers())
		opts.MaxBlocks = min(opts.MaxBlocks, sms)
	}
	b := &Backend{drv: drv, space: space, bs: bs, rank: bs.Rank(), size: bs.Size(), device: device, arch: cc, sms: sms, opts: opts, topo: top}
	if err := b.allocWorkspace(); err != nil {
		b.Close()
		return nil, err
	}
	b.kernels = newKernelCache(drv, cc, opts.NVRTCOptions)
	// Every rank's signals are zero before any kernel can write a peer's.
	if err := bs.Barrier(); err != nil {
		b.Close()
		return nil, err
	}
	return b, nil
}

// smsPerRank is the SMs each rank may count on when ranks share GPUs: a
// kernel waiting for a peer's spins on its SM, so the ranks on one GPU must
// all fit at once, with one SM each to spare for a one-block helper (the
// MoE stage gate). The most ranks on any GPU decides, so that every rank
// derives the same grids.
func smsPerRank(sms int, peers []symm.Peer) int {
	on := map[[16]byte]int{}
	most := 1
	for _, p := range peers {
		on[p.UUID]++
		most = max(most, on[p.UUID])
	}
	if most == 1 {
		return sms
	}
	return max(1, sms/most-1)
}

// probe loads the driver and reads what the backend needs of the device.
func probe(device int) (drv *cuda.Driver, cc, sms int, err error) {
	if drv, err = cuda.Load(); err != nil {
		return nil, 0, 0, fmt.Errorf("GPU backend needs the CUDA driver: %w", err)
	}
	if err = drv.EnsureContext(device); err != nil {
		return nil, 0, 0, fmt.Errorf("make device %d current: %w", device, err)
	}
	dev, err := drv.Device(device)
	if err != nil {
		return nil, 0, 0, err
	}
	if cc, err = drv.ComputeCapability(dev); err != nil {
		return nil, 0, 0, err
	}
	if sms, err = drv.DeviceAttribute(cuda.AttrMultiprocessorCount, dev); err != nil {
		return nil, 0, 0, err
	}
	return drv, cc, sms, nil
}

func (b *Backend) allocWorkspace() error {
	var err error
	if b.signal, err = b.space.Alloc(signalBytes); err != nil {
		return fmt.Errorf("allocate signals: %w", err)
	}
	if b.staging, err = b.space.Alloc(uint64(b.opts.StagingBytes)); err != nil {
		return fmt.Errorf("allocate %d bytes of staging: %w", b.opts.StagingBytes, err)
	}
	if b.scratch, err = b.space.Alloc(uint64(b.opts.StagingBytes)); err != nil {
		return fmt.Errorf("allocate %d bytes of scratch: %w", b.opts.StagingBytes, err)
	}
	if b.halves, err = b.space.Alloc(2 * deferredHalfBytes); err != nil {
		return fmt.Errorf("allocate one-shot staging: %w", err)
	}
	if b.ll, err = b.space.Alloc(uint64(2 * llHalfBytes(b.size))); err != nil {
		return fmt.Errorf("allocate LL buffers: %w", err)
	}
	if b.graph.table, err = b.space.Alloc(maxGraphSlots * graphSlotBytes); err != nil {
		return fmt.Errorf("allocate graph slots: %w", err)
	}
	hm, err := b.space.HostMapped(uint64(unsafe.Sizeof(errorWord{})))
	if err != nil {
		return fmt.Errorf("allocate the error word: %w", err)
	}
	b.errHost, b.errDev = hm.Host, hm.Device
	*(*errorWord)(hm.Host) = errorWord{}
	return nil
}

// Alloc allocates symmetric device memory.
func (b *Backend) Alloc(nbytes int64) (uintptr, error) {
	if err := b.usable(); err != nil {
		return 0, err
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return 0, err
	}
	buf, err := b.space.Alloc(uint64(nbytes))
	if err != nil {
		return 0, err
	}
	return buf.Local, nil
}

// Free is not supported one allocation at a time: symmetric memory lives
// until the communicator closes.
func (b *Backend) Free(ptr uintptr) error {
	return status.Errorf(status.Unsupported, "GPU symmetric memory is released when the communicator closes")
}

// Register opens peers' IPC mappings of [ptr, ptr+nbytes) so all-reduce on
// it runs in place without staging.
func (b *Backend) Register(ptr uintptr, nbytes int64) error {
	if err := b.usable(); err != nil {
		return err
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	_, err := b.space.Register(ptr, uint64(nbytes))
	return err
}

// Deregister forgets a registration.
func (b *Backend) Deregister(ptr uintptr) error { return b.space.Deregister(ptr) }

// Check reports what a kernel recorded in the error word. A timeout breaks
// the communicator for good: the ranks' counters no longer agree.
func (b *Backend) Check() error {
	if b.broken != nil {
		return b.broken
	}
	if b.errHost == nil {
		return nil
	}
	w := (*errorWord)(b.errHost)
	code := atomic.LoadUint32(&w.Code)
	if code == 0 {
		return nil
	}
	e := *w
	err := describe(e)
	if code == errMismatch {
		// Nothing was reduced and every rank finished its barriers: usable.
		atomic.StoreUint32(&w.Code, 0)
		return err
	}
	b.broken = fmt.Errorf("communicator unusable: %w", err)
	return err
}

// Close frees everything. Not collective; idempotent. The caller's thread
// may have another device's context current, so this device's is made
// current first (frees and IPC closes act on the current context).
func (b *Backend) Close() error {
	var err error
	if b.space != nil {
		// Free even if the context could not be made current: a leak is
		// worse than a failed free, and both are reported.
		// Frees wait for the device, so no kernel of the modules unloaded
		// after them still runs.
		err = errors.Join(b.drv.EnsureContext(b.device), b.space.Close(), // also frees the host-mapped error word
			b.kernels.close())
		if err != nil {
			err = fmt.Errorf("close the GPU communicator: %w", err)
		}
		b.space = nil
	}
	b.errHost = nil
	if b.broken == nil {
		b.broken = status.Errorf(status.State, "communicator is closed")
	}
	return err
}

func (b *Backend) usable() error {
	if b.broken != nil {
		return b.broken
	}
	return nil
}

// AllReduce enqueues one all-reduce on req.Stream. It does not wait for the
// GPU: a peer that never arrives is reported by the kernel through the
// error word, and raised at the next call or Check.
func (b *Backend) AllReduce(req collective.AllReduce) error {
	if err := b.Check(); err != nil {
		return err
	}
	if b.topo.MultiNode() {
		// Every rank knows the topology, so every rank fails here alike.
		return b.acrossNodes("all-reduce")
	}
	if req.Reject != nil {
		return b.reject(req)
	}
	if err := reduce.Check(req.DType, req.Op); err != nil {
		return err
	}
	if req.Count < 0 {
		return status.Errorf(status.InvalidArgument, "negative element count %d", req.Count)
	}
	// The caller's thread may have another device's context current.
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	nbytes := req.Bytes()
	algo := b.choose(req.Algo, req.Count, req.DType)
	g := b.geometry(algo, req.DType, req.Count)
	sig := signature(req.Count, req.DType, req.Op, algo)
	if req.Count == 0 {
		// Still a collective: a peer that passed data learns of the mismatch.
		return b.launchEmpty(algo, req.DType, g, sig, req.Stream)
	}
	p := b.fill(req.Count, req.Op, sig)
	p.LocalSrc, p.Out = uint64(req.Src), uint64(req.Dst)
	switch {
	case isLL(algo):
		// Peers receive into their own LL buffers: the input is read where
		// it is, registered or not.
		b.useLL(p)
		return b.launchGrid(algo, req.DType, g.grid, req.Stream)
	case g.deferred:
		// Small one-shot: always staged (a local copy is cheaper than the end
		// barrier that reading a caller's buffer in place would need).
		b.useHalves(p)
		return b.launchGrid(algo, req.DType, g.grid, req.Stream)
	}
	// Registered input is read in place by peers; anything else the kernel
	// copies into its staging buffer itself, fused into the same launch.
	// Only two-shot may write its output over its input while peers still
	// read it (they stop before its middle barrier); the others must stage.
	buf, registered := b.space.Lookup(req.Src, uint64(nbytes))
	if registered && (req.Src != req.Dst || algo == collective.TwoShot) {
		off := req.Src - buf.Local
		for r := range b.size {
			p.PeerIn[r] = uint64(buf.Peers[r] + off)
		}
		p.LocalSrc = 0
		p.Signature = withSource(sig, buf.Seq, uint64(off))
	} else if nbytes > b.opts.StagingBytes {
		return b.refuse(algo, req.DType, g, req.Stream, status.Errorf(status.Capacity,
			"tensor of %d bytes exceeds the staging capacity of %d bytes: register it (comm.register_buffer) or raise P2PCOMM_STAGING_BYTES",
			nbytes, b.opts.StagingBytes))
	}
	if need := scratchBytes(algo, nbytes, b.size); need > b.opts.StagingBytes {
		return b.refuse(algo, req.DType, g, req.Stream, status.Errorf(status.Capacity,
			"%s all-reduce of %d bytes needs %d bytes of scratch, more than the %d available: use algorithm='twoshot' or raise P2PCOMM_STAGING_BYTES",
			algo, nbytes, need, b.opts.StagingBytes))
	}
	if algo == collective.TwoShot && nbytes >= pullMinBytes {
		p.Flags |= flagPull
	}
	if algo == collective.TwoShot && p.LocalSrc != 0 {
		p.GraphSlot = uint64(b.graph.slotFor(b.drv, req.Src, nbytes, req.Stream))
	}
	return b.launchGrid(algo, req.DType, g.grid, req.Stream)
}

// useLL points the kernel at every rank's LL buffers.
func (b *Backend) useLL(p *allReduceParams) {
	p.HalfBytes = uint32(llHalfBytes(b.size))
	for r := range b.size {
		p.PeerIn[r] = uint64(b.ll.Peers[r])
	}
}

// useHalves points deferred one-shot at every rank's two staging halves.
func (b *Backend) useHalves(p *allReduceParams) {
	p.HalfBytes = deferredHalfBytes
	for r := range b.size {
		p.PeerIn[r] = uint64(b.halves.Peers[r])
	}
}

// fill resets the reused parameter block with what every launch shares.
func (b *Backend) fill(count int64, op reduce.Op, sig int32) *allReduceParams {
	p := &b.params
	*p = allReduceParams{Err: uint64(b.errDev), Count: count, TimeoutNs: uint64(b.opts.Timeout.Nanoseconds()),
		Rank: int32(b.rank), World: int32(b.size), Op: int32(op), Signature: sig}
	for r := range b.size {
		p.PeerSignal[r] = uint64(b.signal.Peers[r])
		p.PeerScratch[r] = uint64(b.scratch.Peers[r])
		p.PeerIn[r] = uint64(b.staging.Peers[r])
	}
	return p
}

// reject takes part in the call with a signature no peer can match, so
// every peer's kernel skips the data and records a mismatch (raised at its
// next call or Check), while this rank returns its own validation error.
// req.Count and req.DType, when known, pick the grid the peers will use.
func (b *Backend) reject(req collective.AllReduce) error {
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	dt := req.DType
	if !dt.Valid() {
		dt = reduce.Float32
	}
	algo := b.choose(req.Algo, req.Count, dt)
	return b.refuse(algo, dt, b.geometry(algo, dt, req.Count), req.Stream, req.Reject)
}

// refuse takes part in a call this rank cannot make, as reject does, and
// returns why: a rank whose tensor is too big to stage while its peers read
// theirs in place (registered on some ranks only) must not leave them
// waiting. When every rank refuses, none reports a mismatch.
func (b *Backend) refuse(algo collective.Algorithm, dt reduce.DType, g geometry, stream uintptr, why error) error {
	if err := b.launchEmpty(algo, dt, g, rejectSignature, stream); err != nil {
		return err
	}
	return why
}

// launchEmpty runs algo's kernel with no elements on the grid a call of
// geometry g uses: its barriers (or LL headers) carry sig to the peers, who
// compare it with theirs, and nothing else is read or written. Ring and
// recursive doubling sync only with neighbours and carry no signature, so
// for them it launches nothing: peers that expect data report this rank by
// timeout.
func (b *Backend) launchEmpty(algo collective.Algorithm, dt reduce.DType, g geometry, sig int32, stream uintptr) error {
	if algo == collective.Ring || algo == collective.RecursiveDoubling {
		return nil
	}
	p := b.fill(0, reduce.Sum, sig)
	// A harmless output each kernel accepts: one-shot's must not be its
	// staging, two-shot's must not be its scratch.
	p.Out = uint64(b.scratch.Local)
	if algo == collective.TwoShot {
		p.Out = uint64(b.staging.Local)
	}
	switch {
	case isLL(algo):
		b.useLL(p)
	case g.deferred:
		b.useHalves(p)
	}
	return b.launchGrid(algo, dt, g.grid, stream)
}

func (b *Backend) launchGrid(algo collective.Algorithm, dt reduce.DType, grid uint32, stream uintptr) error {
	fn, err := b.kernels.function(algo, dt)
	if err != nil {
		return err
	}
	if err := b.drv.Launch(fn, grid, kThreads, 0, stream, b.params.bytes()); err != nil {
		return fmt.Errorf("launch %s all-reduce: %w", algo, err)
	}
	return nil
}

// scratchBytes is the scratch each algorithm needs per rank
// (native/kernels/LAYOUT.md), R being the payload rounded up to 128 bytes.
func scratchBytes(algo collective.Algorithm, nbytes int64, world int) int64 {
	r := (nbytes + 127) &^ 127
	switch algo {
	case collective.TwoShot:
		return r
	case collective.Ring:
		return 2 * r
	case collective.RecursiveDoubling:
		steps := int64(0)
		for w := world; w > 1; w >>= 1 {
			steps++
		}
		return max(steps-1, 0) * r
	}
	return 0
}

// PeerAddress returns where this process maps rank's copy of a symmetric or
// registered range.
func (b *Backend) PeerAddress(ptr uintptr, nbytes int64, rank int) (uintptr, error) {
	if err := b.usable(); err != nil {
		return 0, err
	}
	if rank < 0 || rank >= b.size {
		return 0, status.Errorf(status.InvalidArgument, "rank %d out of range [0, %d)", rank, b.size)
	}
	if !b.topo.SameNode(rank) {
		return 0, status.Errorf(status.Unsupported, "rank %d is on node %d, rank %d on node %d: memory of another node is not mapped (%s)",
			rank, b.topo.NodeOf[rank], b.rank, b.topo.Node(), b.topo)
	}
	buf, ok := b.space.Lookup(ptr, uint64(nbytes))
	if !ok {
		return 0, status.Errorf(status.InvalidArgument, "%#x (+%d bytes) is neither from comm.empty() nor registered", ptr, nbytes)
	}
	return buf.Peers[rank] + (ptr - buf.Local), nil
}

// StreamBarrier enqueues a device-side barrier among all ranks on stream:
// a deferred one-shot kernel with no elements is exactly one start barrier,
// one round of flags over NVLink. That is a whole barrier: a peer's flag
// arrives only after every kernel it enqueued earlier has finished (stream
// order), and flags only grow with the epoch, so no end barrier is needed
// before the slots are reused (the non-deferred one-shot's second round trip
// cost ~3 us per barrier, four per MoE dispatch and combine).
// Capturable in CUDA graphs; bounded like every wait. Its kernel is the
// one-shot's of barrierDType (Prepare builds it ahead).
func (b *Backend) StreamBarrier(stream uintptr, call collective.Call) error {
	if err := b.Check(); err != nil {
		return err
	}
	if !call.Valid() {
		return status.Errorf(status.InvalidArgument, "stream barrier for unknown call %d", call)
	}
	if b.topo.MultiNode() {
		return b.acrossNodes("a stream barrier")
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	// out must not alias peer_in[rank] for one-shot; scratch is free here.
	// The fence publishes what earlier kernels wrote into peers' memory.
	p := b.fill(0, reduce.Sum, 0)
	p.Out = uint64(b.scratch.Local)
	p.Flags = flagFence | uint32(call)<<callShift
	b.useHalves(p) // deferred: no end barrier; with no elements nothing is staged or read
	return b.launchGrid(collective.OneShot, barrierDType, 1, stream)
}

// barrierDType is the element type of StreamBarrier's one-shot kernel (it
// reduces no element).
const barrierDType = reduce.Float32

// Launch runs a kernel of native/kernels by file and name expression with
// a caller-packed parameter struct (the kernel's one by-value argument), for
// collectives built outside this package (MoE dispatch and combine). The
// kernel must not wait on peers: order it with StreamBarrier.
func (b *Backend) Launch(file, expr string, grid, block, sharedBytes uint32, stream uintptr, params []byte) error {
	if err := b.Check(); err != nil {
		return err
	}
	if grid == 0 || block == 0 || block > 1024 {
		return status.Errorf(status.InvalidArgument, "launch %s: bad geometry grid %d block %d", expr, grid, block)
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	fn, err := b.kernels.named(file, expr)
	if err != nil {
		return err
	}
	if err := b.kernels.allowShared(fn, sharedBytes); err != nil {
		return fmt.Errorf("launch %s with %d bytes of dynamic shared memory: %w", expr, sharedBytes, err)
	}
	if err := b.drv.Launch(fn, grid, block, sharedBytes, stream, params); err != nil {
		return fmt.Errorf("launch %s: %w", expr, err)
	}
	return nil
}

// Prepare compiles and loads the file holding kernel expr (every kernel
// it declares) and the stream barrier's kernel, so that the first launches
// do not compile: a rank compiling there made peers already waiting in a
// kernel time out. Callers run it before a host-side exchange that lines
// the ranks up. Not collective.
func (b *Backend) Prepare(file, expr string) error {
	if err := b.Check(); err != nil {
		return err
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	if _, err := b.kernels.named(file, expr); err != nil {
		return err
	}
	_, err := b.kernels.function(collective.OneShot, barrierDType) // StreamBarrier's kernel
	return err
}

// acrossNodes is the error of calls that need every rank's memory.
func (b *Backend) acrossNodes(what string) error {
	return status.Errorf(status.Unsupported, "%s across nodes is not available on the GPU backend: this communicator spans %s", what, b.topo)
}

// Topology is the node layout the backend was built with.
func (b *Backend) Topology() *topo.Topology { return b.topo }

// Space is the backend's symmetric memory (its node's peers mapped); it
// lives until Close.
func (b *Backend) Space() *symm.Space { return b.space }

// Driver is the CUDA driver the backend uses.
func (b *Backend) Driver() *cuda.Driver { return b.drv }

// Device is the CUDA ordinal of the backend's GPU.
func (b *Backend) Device() int { return b.device }

// Timeout bounds every wait of the backend's kernels (P2PCOMM_TIMEOUT_MS).
func (b *Backend) Timeout() time.Duration { return b.opts.Timeout }

// SMCount is the number of multiprocessors of this rank's GPU (its share of
// them when ranks share GPUs).
func (b *Backend) SMCount() int { return b.sms }

// WaitInfo is what kernels launched through Launch need to bound their own
// waits the way this backend's do (p2p_common.cuh's Waiter): this rank's
// Signal (its abort claim), the device address of the error word that
// Check reads, and the timeout in nanoseconds.
func (b *Backend) WaitInfo() (signal, errWord uintptr, timeoutNs uint64) {
	return b.signal.Peers[b.rank], b.errDev, uint64(b.opts.Timeout.Nanoseconds())
}

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
