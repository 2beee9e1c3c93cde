package gpucoll

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/symm"
)

func TestChooseResolvesEveryRequest(t *testing.T) {
	four := &Backend{size: 4, opts: Options{MaxBlocks: kMaxBlocks}}
	three := &Backend{size: 3, opts: Options{MaxBlocks: kMaxBlocks}}
	two := &Backend{size: 2, opts: Options{MaxBlocks: kMaxBlocks}}
	one := &Backend{size: 1, opts: Options{MaxBlocks: kMaxBlocks}}
	tests := []struct {
		name  string
		b     *Backend
		req   collective.Algorithm
		count int64
		dt    reduce.DType
		op    reduce.Op
		want  collective.Algorithm
	}{
		{"auto small", four, collective.Auto, 1024, reduce.BFloat16, reduce.Sum, collective.OneShotLL},
		{"auto 64 KiB", four, collective.Auto, 32 << 10, reduce.BFloat16, reduce.Sum, collective.OneShotLL},
		{"auto 64 KiB + 2", four, collective.Auto, 32<<10 + 1, reduce.BFloat16, reduce.Sum, collective.OneShotLamport},
		{"auto 256 KiB", four, collective.Auto, 128 << 10, reduce.Float16, reduce.Avg, collective.OneShotLamport},
		{"auto 256 KiB int32", four, collective.Auto, 64 << 10, reduce.Int32, reduce.Sum, collective.OneShotLL128},
		{"auto 256 KiB + 2", four, collective.Auto, 128<<10 + 1, reduce.BFloat16, reduce.Sum, collective.TwoShot},
		{"auto 4 MiB", four, collective.Auto, 2 << 20, reduce.BFloat16, reduce.Sum, collective.TwoShot},
		{"two ranks auto 128 KiB", two, collective.Auto, 64 << 10, reduce.BFloat16, reduce.Sum, collective.OneShotLL},
		{"two ranks auto 128 KiB + 2", two, collective.Auto, 64<<10 + 1, reduce.BFloat16, reduce.Sum, collective.OneShotLamport},
		{"two ranks auto 1 MiB", two, collective.Auto, 1 << 18, reduce.Float32, reduce.Avg, collective.OneShotLamport},
		{"two ranks auto 1 MiB + 4", two, collective.Auto, 1<<18 + 1, reduce.Float32, reduce.Sum, collective.TwoShotLamport},
		{"two ranks auto 4 MiB", two, collective.Auto, 2 << 20, reduce.BFloat16, reduce.Avg, collective.TwoShotLamport},
		{"two ranks auto 4 MiB + 2", two, collective.Auto, 2<<20 + 1, reduce.BFloat16, reduce.Sum, collective.TwoShot},
		{"two ranks auto 1 MiB max", two, collective.Auto, 512 << 10, reduce.BFloat16, reduce.Max, collective.OneShotLL128},
		{"two ranks auto 2 MiB max", two, collective.Auto, 1 << 20, reduce.BFloat16, reduce.Max, collective.TwoShot},
		{"two ranks auto 2 MiB int32", two, collective.Auto, 512 << 10, reduce.Int32, reduce.Sum, collective.TwoShot},
		{"oneshot_ll fits", four, collective.OneShotLL, llMaxPayload / 4, reduce.Float32, reduce.Sum, collective.OneShotLL},
		{"oneshot_ll too big", four, collective.OneShotLL, llMaxPayload/4 + 1, reduce.Float32, reduce.Sum, collective.OneShot},
		{"twoshot_ll fits", four, collective.TwoShotLL, 4 * llMaxPayload / 8, reduce.Float64, reduce.Sum, collective.TwoShotLL},
		{"twoshot_ll too big", four, collective.TwoShotLL, 4*llMaxPayload/8 + 1, reduce.Float64, reduce.Sum, collective.TwoShot},
		{"oneshot_push fits", four, collective.OneShotPush, llSlotBytes / 2, reduce.BFloat16, reduce.Sum, collective.OneShotPush},
		{"oneshot_push too big", four, collective.OneShotPush, llSlotBytes/2 + 1, reduce.BFloat16, reduce.Sum, collective.OneShot},
		{"oneshot_ll128 fits", two, collective.OneShotLL128, ll128MaxPayload / 2, reduce.BFloat16, reduce.Sum, collective.OneShotLL128},
		{"oneshot_ll128 too big", two, collective.OneShotLL128, ll128MaxPayload/2 + 1, reduce.BFloat16, reduce.Sum, collective.OneShot},
		{"oneshot_lamport fits", two, collective.OneShotLamport, 2 << 20, reduce.BFloat16, reduce.Avg, collective.OneShotLamport},
		{"oneshot_lamport float32", four, collective.OneShotLamport, lamportMaxPayload(4) / 4, reduce.Float32, reduce.Sum, collective.OneShotLamport},
		{"oneshot_lamport too big", four, collective.OneShotLamport, lamportMaxPayload(4)/4 + 4, reduce.Float32, reduce.Sum, collective.TwoShot},
		{"oneshot_lamport integers 1 MiB", two, collective.OneShotLamport, 256 << 10, reduce.Int32, reduce.Sum, collective.OneShotLL128},
		{"oneshot_lamport integers 1 MiB + 4", two, collective.OneShotLamport, 256<<10 + 1, reduce.Int32, reduce.Sum, collective.TwoShot},
		{"oneshot_lamport integers", two, collective.OneShotLamport, 1024, reduce.Int32, reduce.Sum, collective.OneShotLL128},
		{"oneshot_lamport float64", two, collective.OneShotLamport, 1024, reduce.Float64, reduce.Sum, collective.OneShotLL128},
		{"oneshot_lamport max", two, collective.OneShotLamport, 1024, reduce.Float16, reduce.Max, collective.OneShotLL128},
		{"twoshot_lamport fits", four, collective.TwoShotLamport, 2 << 20, reduce.BFloat16, reduce.Sum, collective.TwoShotLamport},
		{"twoshot_lamport too big", four, collective.TwoShotLamport, 2<<20 + 1, reduce.BFloat16, reduce.Sum, collective.TwoShot},
		{"twoshot_lamport three ranks", three, collective.TwoShotLamport, 1048572, reduce.Float32, reduce.Avg, collective.TwoShotLamport},
		{"twoshot_lamport three ranks too big", three, collective.TwoShotLamport, 1048573, reduce.Float32, reduce.Sum, collective.TwoShot},
		{"twoshot_lamport five ranks", &Backend{size: 5, opts: Options{MaxBlocks: kMaxBlocks}}, collective.TwoShotLamport,
			4194240 / 2, reduce.BFloat16, reduce.Sum, collective.TwoShotLamport},
		{"twoshot_lamport five ranks too big", &Backend{size: 5, opts: Options{MaxBlocks: kMaxBlocks}},
			collective.TwoShotLamport, 4194240/2 + 1, reduce.BFloat16, reduce.Sum, collective.TwoShot},
		{"twoshot_lamport integers", four, collective.TwoShotLamport, 1024, reduce.Int32, reduce.Sum, collective.TwoShot},
		{"twoshot_lamport max", four, collective.TwoShotLamport, 1024, reduce.BFloat16, reduce.Max, collective.TwoShot},
		{"twoshot_push fits", four, collective.TwoShotPush, 4 * llSlotBytes / 4, reduce.Float32, reduce.Sum, collective.TwoShotPush},
		{"twoshot_push too big", four, collective.TwoShotPush, 4*llSlotBytes/4 + 1, reduce.Float32, reduce.Sum, collective.TwoShot},
		{"rd non power of two", three, collective.RecursiveDoubling, 100, reduce.Float32, reduce.Sum, collective.TwoShot},
		{"rd power of two", four, collective.RecursiveDoubling, 100, reduce.Float32, reduce.Sum, collective.RecursiveDoubling},
		{"world one", one, collective.TwoShotLL, 100, reduce.Float32, reduce.Sum, collective.OneShot},
	}
	for _, tt := range tests {
		if got := tt.b.choose(tt.req, tt.count, tt.dt, tt.op); got != tt.want {
			t.Errorf("%s: choose(%s, %d x %s) = %s, want %s", tt.name, tt.req, tt.count, tt.dt, got, tt.want)
		}
	}
}

func TestForcedAlgorithmAndTuneTable(t *testing.T) {
	b := &Backend{size: 2, opts: Options{MaxBlocks: kMaxBlocks, ForceAlgo: collective.Ring}}
	if got := b.choose(collective.Auto, 10, reduce.Float32, reduce.Sum); got != collective.Ring {
		t.Errorf("P2PCOMM_ALGO=ring: got %s", got)
	}
	if got := b.choose(collective.OneShot, 10, reduce.Float32, reduce.Sum); got != collective.OneShot {
		t.Errorf("a per-call algorithm beats P2PCOMM_ALGO: got %s", got)
	}
	b.opts.ForceAlgo = collective.Auto
	b.opts.Tune = Table{{4096, "oneshot"}, {1 << 62, "ring"}}
	if got := b.choose(collective.Auto, 1024, reduce.Float32, reduce.Sum); got != collective.OneShot {
		t.Errorf("4 KiB with the tune table: got %s", got)
	}
	if got := b.choose(collective.Auto, 1025, reduce.Float32, reduce.Sum); got != collective.Ring {
		t.Errorf("above 4 KiB with the tune table: got %s", got)
	}
}

// sliceBytes must bound what the kernel's slice_range gives slice 0.
func TestSliceBytesRoundsToPacks(t *testing.T) {
	if got := sliceBytes(10, reduce.Float32, 4); got != 16 {
		t.Errorf("10 floats over 4 ranks: slice %d bytes, want 16 (3 floats rounded up to a pack)", got)
	}
	if got := sliceBytes(1<<20, reduce.BFloat16, 4); got != 512<<10 {
		t.Errorf("1M bf16 over 4 ranks: slice %d bytes, want %d", got, 512<<10)
	}
}

func TestLLGridsBySize(t *testing.T) {
	b := &Backend{size: 2, opts: Options{MaxBlocks: kMaxBlocks}}
	for _, tt := range []struct {
		world int
		count int64
		grid  uint32
	}{{2, 1, llSmallGrid}, {2, llSmallBytes / 4, llSmallGrid}, {2, llSmallBytes/4 + 1, llMidGrid},
		{2, llMidBytes / 4, llMidGrid}, {2, llMidBytes/4 + 1, llGrid}, {2, 500000, llGrid},
		{4, llSmallBytes / 4, llSmallGrid}, {4, llMidBytes/4 + 1, llMidGrid}, {4, 500000, llMidGrid}} {
		b.size = tt.world
		if g := b.geometry(collective.OneShotLL, reduce.Float32, tt.count); g.grid != tt.grid || g.deferred {
			t.Errorf("oneshot_ll of %d floats on %d ranks: geometry %+v, want grid %d", tt.count, tt.world, g, tt.grid)
		}
	}
	b.size = 2
	b.opts.MaxBlocks = 8
	if g := b.geometry(collective.TwoShotLL, reduce.Float32, 1<<20); g.grid != 8 {
		t.Errorf("P2PCOMM_MAX_BLOCKS=8 bounds LL grids: got %d", g.grid)
	}
	if g := b.geometry(collective.OneShot, reduce.Float32, 1024); g.grid != 8 || !g.deferred {
		t.Errorf("P2PCOMM_MAX_BLOCKS=8 bounds the deferred one-shot's fixed grid: got %+v", g)
	}
	// Shared GPUs leave each rank a share of the SMs, no power of two.
	b.opts.MaxBlocks = 65
	for _, algo := range []collective.Algorithm{collective.TwoShot, collective.OneShot, collective.OneShotLL} {
		if g := b.geometry(algo, reduce.Float32, 64<<20); g.grid != 65 {
			t.Errorf("%s of 256 MiB with at most 65 blocks: grid %d", algo, g.grid)
		}
	}
	if llHalfBytes(8) >= 1<<32 {
		t.Errorf("LL half of %d bytes does not fit AllReduceParams.half_bytes (u32)", llHalfBytes(8))
	}
}

func TestSignatureSeparatesCallsWithoutAllocating(t *testing.T) {
	base := signature(4096, reduce.BFloat16, reduce.Sum, collective.OneShotLL)
	for _, other := range []int32{
		signature(4097, reduce.BFloat16, reduce.Sum, collective.OneShotLL),
		signature(4096, reduce.Float16, reduce.Sum, collective.OneShotLL),
		signature(4096, reduce.BFloat16, reduce.Max, collective.OneShotLL),
		signature(4096, reduce.BFloat16, reduce.Sum, collective.TwoShotLL),
	} {
		if other == base {
			t.Errorf("two different calls share signature %d", base)
		}
	}
	if base < 0 || base == rejectSignature {
		t.Errorf("signature %d collides with the reject signature", base)
	}
	if n := testing.AllocsPerRun(100, func() { signature(1, reduce.Float32, reduce.Sum, collective.Auto) }); n != 0 {
		t.Errorf("signature allocates %.0f times per call", n)
	}
}

// TestWithSourceSeparatesInPlaceReads: staged calls and in-place calls on
// other buffers or offsets never share a signature, and none is the reject
// signature.
func TestWithSourceSeparatesInPlaceReads(t *testing.T) {
	base := signature(1<<20, reduce.Float32, reduce.Sum, collective.TwoShot)
	seen := map[int32]string{base: "staged"}
	for _, c := range []struct{ seq, off uint64 }{{1, 0}, {2, 0}, {1, 4096}, {2, 4096}, {7, 1 << 30}} {
		got := withSource(base, c.seq, c.off)
		name := fmt.Sprintf("buffer %d offset %d", c.seq, c.off)
		if prev, dup := seen[got]; dup {
			t.Errorf("%s and %s share signature %d", name, prev, got)
		}
		seen[got] = name
		if got < 0 || got == rejectSignature {
			t.Errorf("%s: signature %d collides with the reject signature", name, got)
		}
		if again := withSource(base, c.seq, c.off); again != got {
			t.Errorf("%s: signature not deterministic (%d, %d)", name, got, again)
		}
	}
	if n := testing.AllocsPerRun(100, func() { withSource(base, 3, 64) }); n != 0 {
		t.Errorf("withSource allocates %.0f times per call", n)
	}
}

// TestSMsPerRank: ranks sharing GPUs split the SMs by the most ranks on
// any one GPU, keeping one SM each to spare; one rank a GPU keeps them all.
func TestSMsPerRank(t *testing.T) {
	on := func(gpus ...byte) []symm.Peer {
		peers := make([]symm.Peer, len(gpus))
		for r, g := range gpus {
			peers[r] = symm.Peer{Rank: r, UUID: [16]byte{g}}
		}
		return peers
	}
	for _, c := range []struct {
		sms   int
		peers []symm.Peer
		want  int
	}{
		{132, on(0, 1, 2, 3), 132},
		{132, on(0, 0, 0, 0, 0, 0, 0, 0), 15},
		{132, on(0, 1, 0, 1, 0), 43},
		{4, on(0, 0, 0, 0, 0, 0, 0, 0), 1},
	} {
		if got := smsPerRank(c.sms, c.peers); got != c.want {
			t.Errorf("smsPerRank(%d, %d ranks) = %d, want %d", c.sms, len(c.peers), got, c.want)
		}
	}
}

// TestLoadTableRefusesPerStepRounding: a tune file may not send auto to an
// algorithm that rounds 16-bit floats at every step, and says why.
func TestLoadTableRefusesPerStepRounding(t *testing.T) {
	dir := t.TempDir()
	for name, ok := range map[string]bool{"twoshot": true, "ring": false, "recursive_doubling": false, "bogus": false} {
		path := filepath.Join(dir, name+".json")
		body := `{"device": "x", "tables": {"2": [{"max_bytes": 4096, "algorithm": "` + name + `"}]}}`
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		table, err := LoadTable(path, 2)
		if ok != (err == nil) {
			t.Errorf("%s: LoadTable = %v, %v", name, table, err)
		}
		if !ok && name != "bogus" && (err == nil || !strings.Contains(err.Error(), "every step")) {
			t.Errorf("%s: error %v does not say why", name, err)
		}
	}
}
