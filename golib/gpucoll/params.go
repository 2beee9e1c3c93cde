package gpucoll

import (
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/reduce"
)

// kMaxRanks mirrors native/kernels/p2p_common.cuh.
const kMaxRanks = 8

// allReduceParams mirrors AllReduceParams in p2p_common.cuh byte for byte
// (native/kernels/LAYOUT.md; layout_test.go pins the offsets). It holds no
// Go pointers, so its bytes may be handed to C.
type allReduceParams struct {
	PeerIn      [kMaxRanks]uint64
	PeerScratch [kMaxRanks]uint64
	PeerSignal  [kMaxRanks]uint64
	LocalSrc    uint64
	Out         uint64
	Err         uint64
	Count       int64
	TimeoutNs   uint64
	Rank        int32
	World       int32
	Op          int32
	Signature   int32
	HalfBytes   uint32 // deferred one-shot when nonzero
	Flags       uint32 // flagFence
	GraphSlot   uint64 // *GraphSlot, for calls captured with a staged input
}

// GraphSlot in p2p_common.cuh: {u64 ready; void* peer_in[8]}.
const graphSlotBytes = 8 + 8*kMaxRanks

// maxGraphSlots bounds the captured two-shot calls with unregistered inputs
// a communicator keeps slots for; later ones stage on every replay.
const maxGraphSlots = 4096

func (p *allReduceParams) bytes() []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(p)), unsafe.Sizeof(*p))
}

// errorWord mirrors ErrorWord: what a kernel records when a wait times out.
type errorWord struct {
	Code     uint32
	Rank     int32
	Peer     int32
	Phase    int32
	Block    int32
	Step     int32
	Expected uint64
	Seen     uint64
}

// flagFence asks kernels for a full system fence before each flag store:
// for barriers that publish writes of earlier kernels.
const flagFence = 1

// callShift places the collective.Call a barrier serves in the flags
// (p2p_common.cuh kCallShift); its waits report step = -1 - call.
const callShift = 8

// flagPull makes two-shot gather by reading peers, at the cost of an end
// barrier that pushing does not need: it pays only for large payloads, and
// pullMinBytes is where it starts to (docs/BENCHMARKS.md).
const (
	flagPull     = 2
	pullMinBytes = 8 << 20
)

// flagDirect makes a two-shot call in place on a registered buffer write
// each reduced slice straight into every rank's buffer and end with a
// barrier, instead of pushing it into peers' scratch and copying it out:
// one pass over the payload fewer. Only the owner of a slice reads or
// writes it, so the peers' inputs can take the result. It also beats
// pulling on two ranks at every size (each reads one half and writes the
// other, both directions of the link busy at once), and on more up to
// directMaxBytes; pull takes over beyond (4 x H200, docs/BENCHMARKS.md).
const (
	flagDirect     = 4
	directMaxBytes = 16 << 20
)

// Deferred one-shot geometry (p2p_common.cuh kDeferredGrid, kChunkPacks).
const (
	deferredGrid = 16
	// deferredHalfBytes bounds the calls that skip the end barrier: each
	// rank keeps two halves of this size.
	deferredHalfBytes = 1 << 20
)

// LL buffers (allreduce_ll.cu): per rank two halves, each a header block
// (2 x kMaxBlocks x kMaxRanks lines of 16 bytes) and 2 x world slots. A line
// carries 8 bytes of payload, so a slot of llSlotBytes holds llMaxPayload.
const (
	llHeaderBytes = 2 * kMaxBlocks * kMaxRanks * 16
	llSlotBytes   = 2 << 20
	llMaxPayload  = llSlotBytes / 2
	// LL grids by payload: small calls are faster on fewer blocks, since
	// every block exchanges a header with every peer; larger ones on more,
	// since a block moves its lines at a pace of its own (docs/BENCHMARKS.md).
	// Blocks also announce the call in the header rows of larger grids, so
	// ranks whose calls differ in size still see a mismatch.
	llSmallBytes = 64 << 10
	llSmallGrid  = 16
	llMidBytes   = 256 << 10
	llMidGrid    = 64
	llGrid       = kMaxBlocks
)

// llGridFor is the grid of an LL call moving nbytes among world ranks, at
// most maxBlocks. The 128-block grid was measured on two ranks; more ranks,
// whose blocks each exchange headers with more peers, keep 64 until
// measured.
func llGridFor(nbytes int64, world, maxBlocks int) uint32 {
	switch {
	case nbytes <= llSmallBytes:
		return uint32(min(llSmallGrid, maxBlocks))
	case nbytes <= llMidBytes || world > 2:
		return uint32(min(llMidGrid, maxBlocks))
	}
	return uint32(min(llGrid, maxBlocks))
}

// LL128 (allreduce_ll128.cu): the a and b regions end to end hold one area
// of two slots per source rank, in groups of 512 bytes on the wire carrying
// 480 of data.
const ll128MaxPayload = 2 * llSlotBytes / 512 * 480

// Lamport buffers (allreduce_lamport.cu): per rank two halves of
// lamportHalfBytes, each world areas of lamportMaxPayload, every free word
// holding lamportFree.
const (
	lamportHalfBytes = 8 << 20
	lamportFree      = 0x80000000
)

// lamportFallbackLL128: Lamport calls it cannot carry run LL128 up to here.
const lamportFallbackLL128 = 1 << 20

func lamportMaxPayload(world int) int64 { return lamportHalfBytes / int64(world) / 16 * 16 }

// lamportTwoShotFits: the two-shot's slices (whole vectors, world of them)
// and their results fit one area together (allreduce_twoshot_lamport).
func lamportTwoShotFits(nbytes int64, world int) bool {
	vectors := (nbytes + 15) / 16
	slice := (vectors + int64(world) - 1) / int64(world)
	return 2*slice*16 <= lamportMaxPayload(world)
}

// lamportFits: Lamport words carry sums of 16- and 32-bit floats only.
func lamportFits(dt reduce.DType, op reduce.Op) bool {
	return (dt == reduce.Float32 || dt == reduce.Float16 || dt == reduce.BFloat16) &&
		(op == reduce.Sum || op == reduce.Avg)
}

func llHalfBytes(world int) int64 { return llHeaderBytes + 2*int64(world)*llSlotBytes }

// signalBytes is sizeof(Signal) in p2p_common.cuh.
const signalBytes = 33920

// cType names each dtype as the kernels' templates spell it.
var cType = map[reduce.DType]string{
	reduce.Float32: "float", reduce.Float64: "double", reduce.Float16: "half16",
	reduce.BFloat16: "bf16", reduce.Int32: "int", reduce.Int64: "long long",
}
