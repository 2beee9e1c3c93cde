package gpucoll

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// Table picks an algorithm by payload size: the first entry whose MaxBytes
// is at least the payload wins; the last entry covers everything larger.
type Table []TableEntry

// TableEntry is one row of a Table.
type TableEntry struct {
	MaxBytes  int64  `json:"max_bytes"`
	Algorithm string `json:"algorithm"`
}

// tuneFile is what `python -m p2pcomm.tune` writes: one table per world size.
type tuneFile struct {
	Device string           `json:"device"`
	Tables map[string]Table `json:"tables"` // world size -> table
}

// LoadTable reads the table for world from a tune file. A missing file is
// not an error: the defaults apply.
func LoadTable(path string, world int) (Table, error) {
	data, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var f tuneFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, status.Errorf(status.InvalidArgument, "tune file %s: %v", path, err)
	}
	t := f.Tables[fmt.Sprint(world)]
	for _, e := range t {
		a, ok := collective.ParseAlgorithm(e.Algorithm)
		if !ok || a == collective.Auto {
			return nil, status.Errorf(status.InvalidArgument, "tune file %s: unknown algorithm %q", path, e.Algorithm)
		}
		if a == collective.Ring || a == collective.RecursiveDoubling {
			// auto promises float16/bfloat16 rounded once.
			return nil, status.Errorf(status.InvalidArgument,
				"tune file %s: %s rounds 16-bit floats at every step; auto runs only algorithms that round once", path, a)
		}
	}
	return t, nil
}

// defaultTable: LL while latency dominates, then Lamport's plain words,
// which put no flag on the wire, then two-shot once bandwidth does
// (crossovers measured with bf16 in CUDA graphs on 4 and 2 x H200;
// `python -m p2pcomm.tune` writes a table for the machine at hand;
// docs/BENCHMARKS.md). Two ranks keep the Lamport one-shot to 1 MiB (each
// byte crosses the link once, in one trip) and its two-shot to 4 MiB (half
// the polling and reducing per rank, and each rank sends its half as soon
// as it is reduced). More ranks leave the Lamport one-shot after 256 KiB,
// where it ties the two-shot on 4 ranks: beyond, world - 1 copies of the
// input cost more than the two-shot's barriers. Lamport's two-shot is no
// faster than the barrier two-shot there.
// Calls that Lamport cannot carry take LL128 to 1 MiB, then two-shot
// (choose).
func defaultTable(world int) Table {
	if world == 2 {
		return Table{{128 << 10, "oneshot_ll"}, {1 << 20, "oneshot_lamport"}, {4 << 20, "twoshot_lamport"},
			{1 << 62, "twoshot"}}
	}
	return Table{{64 << 10, "oneshot_ll"}, {256 << 10, "oneshot_lamport"}, {1 << 62, "twoshot"}}
}

// choose resolves the algorithm of a call of count elements of dt reduced
// by op: the request, else P2PCOMM_ALGO, else the table; then what the
// world, the dtype and op, and the LL buffers allow. Every rank resolves the
// same call the same way.
func (b *Backend) choose(requested collective.Algorithm, count int64, dt reduce.DType, op reduce.Op) collective.Algorithm {
	nbytes := count * int64(dt.Size())
	algo := requested
	if algo == collective.Auto {
		algo = b.opts.ForceAlgo
	}
	if algo == collective.Auto {
		table := b.opts.Tune
		if len(table) == 0 {
			table = defaultTable(b.size)
		}
		algo = collective.TwoShot
		for _, e := range table {
			a, _ := collective.ParseAlgorithm(e.Algorithm)
			algo = a
			if nbytes <= e.MaxBytes {
				break
			}
		}
	}
	// Recursive doubling pairs ranks by XOR: it needs a power-of-two world.
	if algo == collective.RecursiveDoubling && b.size&(b.size-1) != 0 {
		algo = collective.TwoShot
	}
	// The LL protocols send what fits in their slots; larger calls take the
	// barrier-based algorithm of the same shape.
	if algo == collective.OneShotLL && nbytes > llMaxPayload {
		algo = collective.OneShot
	}
	if algo == collective.TwoShotLL && sliceBytes(count, dt, b.size) > llMaxPayload {
		algo = collective.TwoShot
	}
	// Lamport words carry float sums up to the size of an area; other calls
	// take its nearest kin: LL128 up to 1 MiB, two-shot above, where LL128
	// is slower (docs/BENCHMARKS.md).
	if algo == collective.OneShotLamport && (!lamportFits(dt, op) || nbytes > lamportMaxPayload(b.size)) {
		algo = collective.TwoShot
		if nbytes <= lamportFallbackLL128 {
			algo = collective.OneShotLL128
		}
	}
	if algo == collective.TwoShotLamport && (!lamportFits(dt, op) || !lamportTwoShotFits(nbytes, b.size)) {
		algo = collective.TwoShot
	}
	if algo == collective.OneShotLL128 && nbytes > ll128MaxPayload {
		algo = collective.OneShot
	}
	if algo == collective.OneShotPush && nbytes > llSlotBytes {
		algo = collective.OneShot
	}
	if algo == collective.TwoShotPush && sliceBytes(count, dt, b.size) > llSlotBytes {
		algo = collective.TwoShot
	}
	if b.size == 1 {
		algo = collective.OneShot
	}
	return algo
}

// sliceBytes is the largest two-shot slice (slice_range in p2p_common.cuh:
// slices are whole 16-byte packs).
func sliceBytes(count int64, dt reduce.DType, world int) int64 {
	per := (count + int64(world) - 1) / int64(world)
	pack := int64(16 / dt.Size())
	return (per + pack - 1) / pack * pack * int64(dt.Size())
}

// isLL: the algorithm runs on the LL buffers (LL, LL128, push and Lamport
// kernels: Lamport's headers are there).
func isLL(a collective.Algorithm) bool {
	switch a {
	case collective.OneShotLL, collective.TwoShotLL, collective.OneShotPush, collective.TwoShotPush, collective.OneShotLL128,
		collective.OneShotLamport, collective.TwoShotLamport:
		return true
	}
	return false
}

// geometry is how a call is launched; every rank derives the same one from
// the same call, and the kernels pair blocks by index.
type geometry struct {
	grid     uint32
	deferred bool // one-shot without an end barrier (allreduce_oneshot.cu)
}

// geometry: small one-shot calls run deferred on their fixed grid; others
// get about 16 KiB of each input per block, rounded up to a power of two so
// that calls of slightly different sizes still pair their blocks (and a
// mismatch is then reported as such, not as a timeout).
func (b *Backend) geometry(algo collective.Algorithm, dt reduce.DType, count int64) geometry {
	nbytes := count * int64(dt.Size())
	if isLL(algo) {
		return geometry{grid: llGridFor(nbytes, b.size, b.opts.MaxBlocks)}
	}
	if algo == collective.OneShot && nbytes <= deferredHalfBytes {
		return geometry{grid: uint32(min(deferredGrid, b.opts.MaxBlocks)), deferred: true}
	}
	g := int64(1)
	for g < int64(b.opts.MaxBlocks) && g*(16<<10) < nbytes {
		g *= 2
	}
	// A limit that is no power of two (GPUs shared under MPS) still holds.
	return geometry{grid: uint32(min(g, int64(b.opts.MaxBlocks)))}
}

// signature summarizes a call so kernels can check that every rank made
// the same one (start flags carry it). Never equal to rejectSignature.
// FNV-1a over the fields' bytes, by hand: this is on every call's path and
// must not allocate.
func signature(count int64, dt reduce.DType, op reduce.Op, algo collective.Algorithm) int32 {
	h := fnv1a(2166136261, uint64(count), 8)
	h = fnv1a(h, uint64(uint32(dt)), 4)
	h = fnv1a(h, uint64(uint32(op)), 4)
	h = fnv1a(h, uint64(uint32(algo)), 4)
	return int32(h & 0x7fffffff)
}

// withSource folds into a call's signature the registered buffer it reads
// in place (its collective Seq) and the input's offset there. Peers read
// this rank's input at that offset of their mapping of the same buffer, so
// ranks that disagree (one in place, another staged; other buffers or
// offsets) would read the wrong bytes: their signatures now differ and
// every rank raises a mismatch instead. Staged calls keep the plain one.
func withSource(sig int32, seq, off uint64) int32 {
	h := fnv1a(uint32(sig), seq, 8)
	h = fnv1a(h, off, 8)
	return int32(h & 0x7fffffff)
}

// withDirect marks a two-shot call whose peers store the result into this
// rank's registered buffer (flagDirect): a rank that reads the same buffer in
// place but wants its result elsewhere must not pair with it.
func withDirect(sig int32) int32 {
	return int32(fnv1a(uint32(sig), 1, 1) & 0x7fffffff)
}

// fnv1a mixes the low n bytes of v into h.
func fnv1a(h uint32, v uint64, n int) uint32 {
	for range n {
		h = (h ^ uint32(v&0xff)) * 16777619
		v >>= 8
	}
	return h
}

// rejectSignature marks a rank that rejected its own arguments: it matches
// no real call, so every peer skips the data.
const rejectSignature = -1
