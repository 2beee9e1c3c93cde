package gpucoll

import (
	"regexp"
	"strconv"
	"testing"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/native/kernels"
)

// TestRMSNormLayoutMatchesTheKernel reads RMSNormParams' table and
// kRMSNormMaxHidden from allreduce_rmsnorm.cu (whose static_asserts pin
// the same table) and compares them with the Go mirror.
func TestRMSNormLayoutMatchesTheKernel(t *testing.T) {
	src, err := kernels.Source(rmsNormFile)
	if err != nil {
		t.Fatal(err)
	}
	var q rmsNormParams
	got := map[string][2]uintptr{
		"ar":           {unsafe.Offsetof(q.AR), unsafe.Sizeof(q.AR)},
		"residual":     {unsafe.Offsetof(q.Residual), unsafe.Sizeof(q.Residual)},
		"weight":       {unsafe.Offsetof(q.Weight), unsafe.Sizeof(q.Weight)},
		"residual_out": {unsafe.Offsetof(q.ResidualOut), unsafe.Sizeof(q.ResidualOut)},
		"rows":         {unsafe.Offsetof(q.Rows), unsafe.Sizeof(q.Rows)},
		"hidden":       {unsafe.Offsetof(q.Hidden), unsafe.Sizeof(q.Hidden)},
		"eps":          {unsafe.Offsetof(q.Eps), unsafe.Sizeof(q.Eps)},
	}
	rows := regexp.MustCompile(`(?m)^//\s+(\d+)\s+(\d+)\s+(\w+)\s`).FindAllStringSubmatch(src, -1)
	seen := 0
	for _, m := range rows {
		off, _ := strconv.Atoi(m[1])
		size, _ := strconv.Atoi(m[2])
		g, ok := got[m[3]]
		if !ok {
			continue
		}
		seen++
		if g != [2]uintptr{uintptr(off), uintptr(size)} {
			t.Errorf("RMSNormParams.%s: Go offset %d size %d, %s's table %d, %d", m[3], g[0], g[1], rmsNormFile, off, size)
		}
	}
	if seen != len(got) {
		t.Errorf("found %d of RMSNormParams' %d fields in %s's table", seen, len(got), rmsNormFile)
	}
	total := regexp.MustCompile(`static_assert\(sizeof\(RMSNormParams\) == (\d+)`).FindStringSubmatch(src)
	if total == nil || total[1] != strconv.Itoa(int(unsafe.Sizeof(q))) {
		t.Errorf("sizeof(RMSNormParams): Go %d, %s %v", unsafe.Sizeof(q), rmsNormFile, total)
	}
	limit := regexp.MustCompile(`constexpr int kRMSNormMaxHidden = (\d+);`).FindStringSubmatch(src)
	if limit == nil || limit[1] != strconv.Itoa(collective.RMSNormMaxHidden) {
		t.Errorf("collective.RMSNormMaxHidden = %d, %s's kRMSNormMaxHidden %v", collective.RMSNormMaxHidden, rmsNormFile, limit)
	}
	for algo, names := range rmsNormKernels {
		for _, expr := range names {
			found := false
			for _, e := range kernels.Instantiations(src) {
				found = found || e == expr
			}
			if !found {
				t.Errorf("%s's kernel %q is not instantiated in %s", algo, expr, rmsNormFile)
			}
		}
	}
}

func TestChooseRMSNorm(t *testing.T) {
	b := &Backend{size: 4, opts: Options{MaxBlocks: kMaxBlocks}}
	tests := []struct {
		name   string
		req    collective.Algorithm
		nbytes int64
		want   collective.Algorithm
	}{
		{"auto small", collective.Auto, 16 << 10, collective.OneShotLamport},
		{"auto at the crossover", collective.Auto, 512 << 10, collective.OneShotLamport},
		{"auto above it", collective.Auto, 512<<10 + 16, collective.TwoShot},
		{"oneshot_ll fits", collective.OneShotLL, llMaxPayload, collective.OneShotLL},
		{"oneshot_ll too big", collective.OneShotLL, llMaxPayload + 16, collective.TwoShot},
		{"twoshot small", collective.TwoShot, 16, collective.TwoShot},
		{"oneshot_lamport fits", collective.OneShotLamport, lamportMaxPayload(4), collective.OneShotLamport},
		{"oneshot_lamport too big", collective.OneShotLamport, lamportMaxPayload(4) + 16, collective.TwoShot},
		{"unknown is auto", collective.Ring, 16, collective.OneShotLamport},
	}
	for _, tt := range tests {
		if got := b.chooseRMSNorm(tt.req, tt.nbytes); got != tt.want {
			t.Errorf("%s: chooseRMSNorm(%s, %d) = %s, want %s", tt.name, tt.req, tt.nbytes, got, tt.want)
		}
	}
	// Two ranks run Lamport's one-shot as far as its areas go (4 MiB), from
	// a call with no rows (a rank that rejected its own) on.
	two := &Backend{size: 2, opts: Options{MaxBlocks: kMaxBlocks}}
	for _, tt := range []struct {
		nbytes int64
		want   collective.Algorithm
	}{{0, collective.OneShotLamport}, {16, collective.OneShotLamport}, {4 << 20, collective.OneShotLamport},
		{4<<20 + 16, collective.TwoShot}} {
		if got := two.chooseRMSNorm(collective.Auto, tt.nbytes); got != tt.want {
			t.Errorf("2 ranks: chooseRMSNorm(auto, %d) = %s, want %s", tt.nbytes, got, tt.want)
		}
	}
	one := &Backend{size: 1, opts: Options{MaxBlocks: kMaxBlocks}}
	if got := one.chooseRMSNorm(collective.Auto, 16); got != collective.OneShotLL {
		t.Errorf("1 rank: chooseRMSNorm(auto, 16) = %s, want %s", got, collective.OneShotLL)
	}
}

func TestRMSNormGrid(t *testing.T) {
	b := &Backend{size: 4, opts: Options{MaxBlocks: kMaxBlocks}}
	tests := []struct {
		name         string
		algo         collective.Algorithm
		rows, nbytes int64
		want         uint32
	}{
		{"LL small", collective.OneShotLL, 1, 8 << 10, llSmallGrid},
		{"LL middle", collective.OneShotLL, 16, 128 << 10, llMidGrid},
		{"LL large, 4 ranks", collective.OneShotLL, 64, 1 << 20, llMidGrid},
		{"two-shot one row per slice", collective.TwoShot, 3, 3 << 14, 1},
		{"two-shot 5 rows per slice", collective.TwoShot, 17, 17 << 14, 8},
		{"two-shot capped", collective.TwoShot, 8192, 8192 << 14, kMaxBlocks},
		{"two-shot no rows", collective.TwoShot, 0, 0, 1},
	}
	for _, tt := range tests {
		if got := b.rmsNormGrid(tt.algo, tt.rows, tt.nbytes); got != tt.want {
			t.Errorf("%s: rmsNormGrid(%s, %d rows, %d bytes) = %d, want %d", tt.name, tt.algo, tt.rows, tt.nbytes, got, tt.want)
		}
	}
	two := &Backend{size: 2, opts: Options{MaxBlocks: kMaxBlocks}}
	if got := two.rmsNormGrid(collective.OneShotLL, 64, 1<<20); got != llGrid {
		t.Errorf("LL large, 2 ranks: grid %d, want %d", got, llGrid)
	}
	b.opts.MaxBlocks = 65 // a share of a GPU's SMs under MPS
	if got := b.rmsNormGrid(collective.TwoShot, 8192, 8192<<14); got != 65 {
		t.Errorf("two-shot with at most 65 blocks: grid %d", got)
	}
}

// TestRMSNormSignature: every field that changes the result or the kernel
// changes the signature, which never equals an all-reduce's of the same
// size or the rejecting rank's.
func TestRMSNormSignature(t *testing.T) {
	base := rmsNormSignature(7, 4096, reduce.BFloat16, 1e-6, collective.OneShotLL)
	others := map[string]int32{
		"rows":       rmsNormSignature(8, 4096, reduce.BFloat16, 1e-6, collective.OneShotLL),
		"hidden":     rmsNormSignature(14, 2048, reduce.BFloat16, 1e-6, collective.OneShotLL),
		"dtype":      rmsNormSignature(7, 4096, reduce.Float16, 1e-6, collective.OneShotLL),
		"eps":        rmsNormSignature(7, 4096, reduce.BFloat16, 1e-5, collective.OneShotLL),
		"algorithm":  rmsNormSignature(7, 4096, reduce.BFloat16, 1e-6, collective.TwoShot),
		"all-reduce": signature(7*4096, reduce.BFloat16, reduce.Sum, collective.OneShotLL),
	}
	for name, s := range others {
		if s == base {
			t.Errorf("a call with another %s has the same signature %d", name, s)
		}
	}
	if base < 0 || base == rejectSignature {
		t.Errorf("signature %d is negative or the reject signature", base)
	}
}
