package moe

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"runtime"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap/bootstraptest"
	"github.com/p2pcomm/p2pcomm/golib/hostcoll"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/shm"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/topo"
)

// runner runs f on world goroutines, each one rank of a CPU communicator
// with an EP of cfg, and returns each rank's error.
type runner func(t *testing.T, world int, cfg func(rank int) Config, f func(rank int, ep *EP) error) []error

// ranks is a runner of one node.
func ranks(t *testing.T, world int, cfg func(rank int) Config, f func(rank int, ep *EP) error) []error {
	t.Helper()
	return ranksOn(t, world, 0, 0, cfg, f)
}

// ranksOn is ranks on simulated nodes of localSize consecutive ranks (0:
// one node), whose waits end after timeout (0: the default).
func ranksOn(t *testing.T, world, localSize int, timeout time.Duration, cfg func(rank int) Config, f func(rank int, ep *EP) error) []error {
	t.Helper()
	return ranksWith(t, world, localSize, timeout, func(_ int, g Group, c *hostcoll.Comm, cfg Config) (*EP, error) {
		return NewCPU(g, c, cfg)
	}, cfg, f)
}

// testRails is the rail count ranksWith's ranks ask for (0: the default).
var testRails int

// ranksWith is ranksOn with the EPs that build makes over each rank's host
// backend.
func ranksWith(t *testing.T, world, localSize int, timeout time.Duration, build func(rank int, g Group, c *hostcoll.Comm, cfg Config) (*EP, error),
	cfg func(rank int) Config, f func(rank int, ep *EP) error) []error {
	t.Helper()
	shm.Dir = t.TempDir()
	bs := bootstraptest.NewMem(world)
	keys := make([][]byte, world)
	for r := range keys {
		keys[r] = []byte("host")
	}
	errs := make([]error, world)
	var wg sync.WaitGroup
	for r := range world {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o := hostcoll.Options{Cooperative: true, Timeout: timeout, NetRails: testRails} // Cooperative: the ranks are goroutines here
			if localSize > 0 {
				var err error
				if o.Topology, err = topo.Build(r, keys, localSize); err != nil {
					errs[r] = err
					return
				}
			}
			c, err := hostcoll.New(bs[r], o)
			if err != nil {
				errs[r] = err
				return
			}
			defer c.Close()
			ep, err := build(r, bs[r], c, cfg(r))
			if err != nil {
				errs[r] = err
				return
			}
			defer ep.Close()
			errs[r] = f(r, ep)
		}()
	}
	wg.Wait()
	held.Lock()
	held.s = nil
	held.Unlock()
	return errs
}

// tokens is one rank's dispatch input.
type tokens struct {
	x   []byte    // [T, H] of dtype
	idx []int64   // [T, K]
	w   []float32 // [T, K]
}

func makeTokens(rng *rand.Rand, T, H, E, K int, dt reduce.DType, minusOne float64) tokens {
	tk := tokens{x: make([]byte, T*H*dt.Size()), idx: make([]int64, T*K), w: make([]float32, T*K)}
	for i := range T * H {
		v := float32(rng.NormFloat64())
		p := unsafe.Pointer(&tk.x[i*dt.Size()])
		switch dt {
		case reduce.Float32:
			*(*float32)(p) = v
		case reduce.Float64:
			*(*float64)(p) = rng.NormFloat64()
		case reduce.BFloat16:
			*(*uint16)(p) = reduce.FloatToBF16(v)
		case reduce.Float16:
			*(*uint16)(p) = reduce.FloatToHalf(v)
		}
	}
	for i := range tk.idx {
		tk.idx[i] = int64(rng.Intn(E)) // repeats allowed: a token may reach one expert twice
		if rng.Float64() < minusOne {
			tk.idx[i] = -1
		}
		tk.w[i] = rng.Float32() + 0.1
	}
	return tk
}

// held keeps every slice handed out by address alive until the ranks using
// it are done: an address does not keep memory from the collector, and a
// stream-ordered copy runs after the call that queued it returns.
var held struct {
	sync.Mutex
	s []any
}

func addr[T any](s []T) uintptr {
	if len(s) == 0 {
		return 0
	}
	held.Lock()
	held.s = append(held.s, s)
	held.Unlock()
	return uintptr(unsafe.Pointer(&s[0]))
}

// result is one rank's dispatch output.
type result struct {
	x      []byte
	info   []int32
	counts []int32
	rows   int64
}

func dispatch(ep *EP, tk tokens, T int, capturable bool, check int32) (result, error) {
	a := &DispatchArgs{X: addr(tk.x), TopkIdx: addr(tk.idx), TopkWeights: addr(tk.w), NumTokens: T, IdxBytes: 8,
		Check: check, Capturable: capturable}
	var r result
	rb := int64(ep.hidden * ep.dtype.Size())
	alloc := func(rows int64) Rows {
		r.x, r.info, r.counts, r.rows = make([]byte, rows*rb), make([]int32, 4*rows), make([]int32, ep.numLocal+1), rows
		return Rows{X: addr(r.x), Info: addr(r.info), Counts: addr(r.counts), Rows: rows}
	}
	if capturable {
		a.Out = alloc(ep.maxRecvRows)
	}
	rows, err := ep.Dispatch(a)
	runtime.KeepAlive(tk)
	if err == nil && capturable {
		err = settled(ep)
	}
	if err != nil || capturable {
		return r, err
	}
	for q, c := range ep.Checks() {
		if c != 0 {
			return r, status.Errorf(status.Mismatch, "rank %d rejected", q)
		}
	}
	return r, ep.Expand(alloc(rows), 0)
}

// settled waits for a call in stream order (a staged EP's capturable
// calls) to finish, as a caller reading its results would, and returns
// what its host functions recorded failing.
func settled(ep *EP) error {
	if ep.staged == nil {
		return nil
	}
	if err := ep.staged.dev.StreamSynchronize(0); err != nil {
		return err
	}
	return ep.staged.failure()
}

// pair is a received row's key in the documented order.
type pair struct{ local, src, token, k int }

func wantPairs(all []tokens, rank, W, E, K int) []pair {
	L := E / W
	var keys []pair
	for s, tk := range all {
		for t := range len(tk.idx) / K {
			for k := range K {
				if e := int(tk.idx[t*K+k]); e >= 0 && e/L == rank {
					keys = append(keys, pair{e % L, s, t, k})
				}
			}
		}
	}
	sort.Slice(keys, func(i, j int) bool {
		a, b := keys[i], keys[j]
		if a.local != b.local {
			return a.local < b.local
		}
		if a.src != b.src {
			return a.src < b.src
		}
		if a.token != b.token {
			return a.token < b.token
		}
		return a.k < b.k
	})
	return keys
}

func checkDispatch(r result, all []tokens, rank, W, E, K, H int, dt reduce.DType) error {
	keys := wantPairs(all, rank, W, E, K)
	R := int64(len(keys))
	L := E / W
	if int64(r.counts[L]) != R {
		return fmt.Errorf("rank %d: %d rows, want %d", rank, r.counts[L], R)
	}
	per := make([]int32, L)
	for _, p := range keys {
		per[p.local]++
	}
	for e := range L {
		if r.counts[e] != per[e] {
			return fmt.Errorf("rank %d: expert %d has %d rows, want %d", rank, e, r.counts[e], per[e])
		}
	}
	rb := H * dt.Size()
	for i, p := range keys {
		got := pair{int(r.info[i]), int(r.info[r.rows+int64(i)]), int(r.info[2*r.rows+int64(i)]), -1}
		if got.local != p.local || got.src != p.src || got.token != p.token {
			return fmt.Errorf("rank %d row %d: (expert, source, token) %v, want %v", rank, i, got, p)
		}
		if w := math.Float32frombits(uint32(r.info[3*r.rows+int64(i)])); w != all[p.src].w[p.token*K+p.k] {
			return fmt.Errorf("rank %d row %d: weight %v, want %v", rank, i, w, all[p.src].w[p.token*K+p.k])
		}
		if string(r.x[i*rb:(i+1)*rb]) != string(all[p.src].x[p.token*rb:(p.token+1)*rb]) {
			return fmt.Errorf("rank %d row %d: token row differs", rank, i)
		}
	}
	return nil
}

// expertOut is a per-row "expert" the reference can recompute: each element
// times (1 + local/8) plus source/8, in float32, rounded to dtype.
func expertOut(r result, H int, dt reduce.DType) []byte {
	out := make([]byte, len(r.x))
	f := make([]float32, H)
	rb := H * dt.Size()
	for i := range int(r.counts[len(r.counts)-1]) {
		widen(f, r.x[i*rb:(i+1)*rb], dt)
		scale, shift := 1+float32(r.info[i])/8, float32(r.info[r.rows+int64(i)])/8
		for j := range f {
			f[j] = float32(float32(f[j]*scale) + shift)
		}
		narrow(out[i*rb:(i+1)*rb], f, dt)
	}
	return out
}

// emulate is combine's documented rounding, written out on the inputs: per
// expert rank d, the float32 sum from +0 of fl32(w * out) for k ascending
// (those on d), rounded to the transit; then the float32 sum from +0 over
// the ranks the token went to, rounded to dtype.
func emulate(tk tokens, rank, W, E, K, H int, dt, tr reduce.DType) []byte {
	L := E / W
	T := len(tk.idx) / K
	rb := H * dt.Size()
	y := make([]byte, T*rb)
	x, v, part, acc := make([]float32, H), make([]float32, H), make([]float32, H), make([]float32, H)
	cast := make([]byte, H*tr.Size())
	for t := range T {
		widen(x, tk.x[t*rb:(t+1)*rb], dt)
		clear(acc)
		for d := range W {
			sent := false
			clear(part)
			for k := range K {
				e := int(tk.idx[t*K+k])
				if e < 0 || e/L != d {
					continue
				}
				sent = true
				scale, shift := 1+float32(e%L)/8, float32(rank)/8
				for j := range x {
					v[j] = float32(float32(x[j]*scale) + shift)
				}
				row := make([]byte, rb)
				narrow(row, v, dt)
				widen(v, row, dt)
				for j := range v {
					part[j] += float32(tk.w[t*K+k] * v[j])
				}
			}
			if sent {
				narrow(cast, part, tr)
				widen(part, cast, tr)
				for j := range part {
					acc[j] += part[j]
				}
			}
		}
		narrow(y[t*rb:(t+1)*rb], acc, dt)
	}
	return y
}

// roundsCase is one configuration of checkRounds.
type roundsCase struct {
	world, E, K, H, Tm int
	dt, tr             reduce.DType
	minusOne           float64
}

func TestCPUDispatchCombineMatchTheDocumentedOrderAndRounding(t *testing.T) {
	var cases []roundsCase
	for _, world := range []int{1, 2, 3} {
		for _, dt := range []reduce.DType{reduce.Float32, reduce.BFloat16, reduce.Float16, reduce.Float64} {
			for _, tr := range []reduce.DType{reduce.Float32, dt} {
				cases = append(cases, roundsCase{world, 4 * world, 3, 24, 9, dt, tr, 0.2})
			}
		}
	}
	cases = append(cases, roundsCase{2, 8, 12, 16, 5, reduce.BFloat16, reduce.BFloat16, 0.1},
		roundsCase{3, 3, 1, 8, 20, reduce.Float32, reduce.Float32, 0},
		roundsCase{2, 8, 4, 1024, 200, reduce.BFloat16, reduce.Float32, 0.1}) // large enough to be split among workers
	checkRounds(t, ranks, cases)
}

// checkRounds runs three rounds of dispatch and combine (eager,
// capturable, eager) of each case on run's ranks, rank 1 sending nothing
// and the others between 1 and T_max tokens, and checks every row against
// the documented order and every combine against the emulation of its
// rounding, bit for bit.
func checkRounds(t *testing.T, run runner, cases []roundsCase) {
	for _, c := range cases {
		name := fmt.Sprintf("W%d/E%d/K%d/%s/%s", c.world, c.E, c.K, c.dt, c.tr)
		t.Run(name, func(t *testing.T) {
			// Rank 1 sends nothing; the others between 1 and T_max tokens.
			sizes := make([]int, c.world)
			for q := range sizes {
				sizes[q] = []int{c.Tm, 0, 1 + (5*q)%c.Tm}[min(q, 2)]
			}
			rounds := make([][]tokens, 3)
			for i := range rounds {
				for q := range c.world {
					rounds[i] = append(rounds[i], makeTokens(rand.New(rand.NewSource(int64(100*i+q))), sizes[q], c.H, c.E, c.K, c.dt, c.minusOne))
				}
			}
			cfg := func(int) Config {
				return Config{NumExperts: c.E, Hidden: c.H, MaxTokens: c.Tm, TopK: c.K, DType: c.dt, CombineDType: c.tr}
			}
			errs := run(t, c.world, cfg, func(r int, ep *EP) error {
				for i, all := range rounds {
					capturable := i == 1
					res, err := dispatch(ep, all[r], sizes[r], capturable, 0)
					if err != nil {
						return err
					}
					if err := checkDispatch(res, all, r, c.world, c.E, c.K, c.H, c.dt); err != nil {
						return fmt.Errorf("round %d: %w", i, err)
					}
					out := expertOut(res, c.H, c.dt)
					y := make([]byte, sizes[r]*c.H*c.dt.Size())
					for range 2 { // combining one result twice gives the same bits
						err := ep.Combine(&CombineArgs{ExpertOut: addr(out), ExpertRows: res.rows, Y: addr(y),
							NumTokens: sizes[r], Capturable: capturable})
						if err == nil && capturable {
							err = settled(ep)
						}
						runtime.KeepAlive(out) // only its address went in
						if err != nil {
							return err
						}
						if want := emulate(all[r], r, c.world, c.E, c.K, c.H, c.dt, c.tr); string(y) != string(want) {
							return fmt.Errorf("round %d: combine differs from the emulation", i)
						}
					}
				}
				return nil
			})
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A rank that rejects its arguments, or an expert id out of range, makes
// every rank see the failure in the checks of the same eager call, no data
// moves, and the latest result still combines.
func TestCPURejectedCallsMoveNothing(t *testing.T) { checkRejected(t, ranks) }

// sameConfig is the configuration every rank passes: E experts, rows of H
// elements of dt, Tm tokens at most, K experts a token, float32 partials.
func sameConfig(E, H, Tm, K int, dt reduce.DType) func(int) Config {
	return func(int) Config {
		return Config{NumExperts: E, Hidden: H, MaxTokens: Tm, TopK: K, DType: dt, CombineDType: reduce.Float32}
	}
}

// checkRejected is TestCPURejectedCallsMoveNothing on run's ranks (3).
func checkRejected(t *testing.T, run runner) {
	const W, E, K, H, Tm = 3, 6, 2, 8, 4
	dt := reduce.BFloat16
	cfg := sameConfig(E, H, Tm, K, dt)
	first := make([]tokens, W)
	for q := range W {
		first[q] = makeTokens(rand.New(rand.NewSource(int64(q))), Tm, H, E, K, dt, 0.1)
	}
	errs := run(t, W, cfg, func(r int, ep *EP) error {
		res, err := dispatch(ep, first[r], Tm, false, 0)
		if err != nil {
			return err
		}
		out := expertOut(res, H, dt)
		want := emulate(first[r], r, W, E, K, H, dt, reduce.Float32)
		combine := func(check int32) ([]byte, error) {
			y := make([]byte, Tm*H*dt.Size())
			err := ep.Combine(&CombineArgs{ExpertOut: addr(out), ExpertRows: res.rows, Y: addr(y), NumTokens: Tm, Check: check})
			runtime.KeepAlive(out) // only its address went in
			return y, err
		}
		other := makeTokens(rand.New(rand.NewSource(int64(50+r))), Tm, H, E, K, dt, 0)
		for bad := range W {
			check := int32(0)
			if r == bad {
				check = int32(status.Unsupported)
			}
			if _, err := dispatch(ep, other, Tm, false, check); err == nil || status.CodeOf(err) != status.Mismatch {
				return fmt.Errorf("dispatch rejected by rank %d: got %v", bad, err)
			}
			if got := ep.Checks(); got[bad] != int32(status.Unsupported) {
				return fmt.Errorf("checks %v, want rank %d's code", got, bad)
			}
		}
		bad := other
		bad.idx = append([]int64(nil), other.idx...)
		if r == 2 {
			bad.idx[3] = E
		}
		if _, err := dispatch(ep, bad, Tm, false, 0); err == nil {
			return fmt.Errorf("an expert id out of range on rank 2 went through")
		}
		if got := ep.Checks(); got[2] != checkInvalidArg {
			return fmt.Errorf("checks %v, want rank 2's invalid argument", got)
		}
		if r == 0 {
			if _, err := combine(int32(status.InvalidArgument)); err != nil {
				return err
			}
		} else if _, err := combine(0); err != nil {
			return err
		}
		if ep.Checks()[0] == 0 {
			return fmt.Errorf("combine: rank 0's rejection not seen: %v", ep.Checks())
		}
		y, err := combine(0)
		if err != nil {
			return err
		}
		if string(y) != string(want) {
			return fmt.Errorf("the latest result no longer combines to the same bits")
		}
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

// Construction agrees on the configuration: a rank that rejects its
// arguments fails alone with ErrRejected and the others name it; ranks that
// differ name the field; num_experts must divide among the ranks.
func TestCPUConstructionAgrees(t *testing.T) {
	base := Config{NumExperts: 4, Hidden: 8, MaxTokens: 4, TopK: 2, DType: reduce.Float32, CombineDType: reduce.Float32}
	tests := []struct {
		name string
		cfg  func(rank int) Config
		want func(rank int, err error) bool
	}{
		{"rejected", func(r int) Config { c := base; c.Rejected = r == 1; return c }, func(r int, err error) bool {
			if r == 1 {
				return errors.Is(err, ErrRejected)
			}
			return status.CodeOf(err) == status.Mismatch && contains(err, "rank 1 rejected")
		}},
		{"hidden differs", func(r int) Config { c := base; c.Hidden = 8 + 8*r; return c }, func(_ int, err error) bool {
			return status.CodeOf(err) == status.InvalidArgument && contains(err, "hidden (from 8 to 16)")
		}},
		{"not divisible", func(int) Config { c := base; c.NumExperts = 3; return c }, func(_ int, err error) bool {
			return status.CodeOf(err) == status.InvalidArgument && contains(err, "divisible")
		}},
		{"transit", func(int) Config { c := base; c.DType = reduce.BFloat16; c.CombineDType = reduce.Float16; return c },
			func(_ int, err error) bool { return status.CodeOf(err) == status.Unsupported }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			shm.Dir = t.TempDir()
			bs := bootstraptest.NewMem(2)
			var wg sync.WaitGroup
			errs := make([]error, 2)
			for r := range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					c, err := hostcoll.New(bs[r], hostcoll.Options{Cooperative: true})
					if err != nil {
						errs[r] = err
						return
					}
					defer c.Close()
					_, errs[r] = NewCPU(bs[r], c, tt.cfg(r))
				}()
			}
			wg.Wait()
			for r, err := range errs {
				if !tt.want(r, err) {
					t.Errorf("rank %d: NewCPU = %v", r, err)
				}
			}
		})
	}
}

func contains(err error, s string) bool { return err != nil && strings.Contains(err.Error(), s) }

// addWidened and addWeighted give, element by element, the bits of
// widening first and adding after, for every dtype, lengths around the eight-wide steps, and values with NaN,
// infinities and signed zeros.
func TestAddsInPlaceMatchWidenThenAdd(t *testing.T) {
	rng := rand.New(rand.NewSource(3))
	special := []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1)), 0, float32(math.Copysign(0, -1)), 1e-40, 6e4}
	for _, d := range []reduce.DType{reduce.Float32, reduce.BFloat16, reduce.Float16, reduce.Float64} {
		for _, n := range []int{0, 1, 7, 8, 9, 16, 23, 1027} {
			vals := make([]float32, n)
			for i := range vals {
				vals[i] = float32(rng.NormFloat64()) * 3
				if rng.Intn(6) == 0 {
					vals[i] = special[rng.Intn(len(special))]
				}
			}
			src := make([]byte, n*d.Size())
			narrow(src, vals, d)
			start := make([]float32, n)
			for i := range start {
				start[i] = float32(rng.NormFloat64())
			}
			w := float32(rng.NormFloat64())
			tmp, want := make([]float32, n), make([]float32, n)
			widen(tmp, src, d)
			for i, v := range tmp {
				want[i] = start[i] + v
			}
			got := append([]float32(nil), start...)
			addWidened(got, make([]float32, n), src, d)
			for i := range got {
				if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
					t.Fatalf("addWidened %s n=%d: element %d is %v, want %v", d, n, i, got[i], want[i])
				}
			}
			for i, v := range tmp {
				want[i] = start[i] + float32(w*v)
			}
			got = append(got[:0], start...)
			addWeighted(got, make([]float32, n), w, src, d)
			for i := range got {
				if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
					t.Fatalf("addWeighted %s n=%d: element %d is %v, want %v", d, n, i, got[i], want[i])
				}
			}
		}
	}
}
