package hostcoll

import (
	"bytes"
	"fmt"
	"math/rand"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap/bootstraptest"
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/shm"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/topo"
	"github.com/p2pcomm/p2pcomm/golib/transport/ucx/ucxtest"
)

// runNodes is run over simulated nodes of localSize consecutive ranks.
func runNodes(t *testing.T, world, localSize int, opts Options, f func(c *Comm) error) []error {
	t.Helper()
	shm.Dir = t.TempDir()
	bs := bootstraptest.NewMem(world)
	opts.Cooperative = true // the ranks are goroutines here
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
			o := opts
			var err error
			if o.Topology, err = topo.Build(r, keys, localSize); err != nil {
				errs[r] = err
				return
			}
			c, err := New(bs[r], o)
			if err != nil {
				errs[r] = err
				return
			}
			defer c.Close()
			errs[r] = f(c)
		}()
	}
	wg.Wait()
	return errs
}

// expectedAcrossNodes is the documented result: op over the nodes, in
// order, of op over each node's ranks, in order, rounded once.
func expectedAcrossNodes(inputs [][]byte, localSize, count int, d reduce.DType, op reduce.Op) []byte {
	acc := reduce.AccType(d)
	var partials []unsafe.Pointer
	for lo := 0; lo < len(inputs); lo += localSize {
		p := make([]byte, max(count*acc.Size(), 1))
		srcs := make([]unsafe.Pointer, 0, localSize)
		for _, in := range inputs[lo : lo+localSize] {
			srcs = append(srcs, unsafe.Pointer(&in[0]))
		}
		reduce.HostPartial(unsafe.Pointer(&p[0]), srcs, count, d, op)
		partials = append(partials, unsafe.Pointer(&p[0]))
		runtime.KeepAlive(p)
	}
	out := make([]byte, max(count*d.Size(), 1))
	reduce.HostFinish(unsafe.Pointer(&out[0]), partials, count, d, op, len(inputs))
	return out[:count*d.Size()]
}

type nodesCase struct {
	world, localSize int
}

func (nc nodesCase) String() string {
	return fmt.Sprintf("%dx%d", nc.world/nc.localSize, nc.localSize)
}

// Every dtype, op and buffer mode, sizes that leave parts and chunks empty
// or ragged, on 2 and 3 nodes of 1 and 2 ranks: every byte is the documented
// expression's, on every rank. Small chunks make the larger size travel in
// many of them. Under the race detector (ten times slower), 2 x 1 and the
// smaller sizes on 3 x 2 only; the dist tests run 2 x 2 and 3 x 1 too.
func TestAllReduceAcrossNodesIsTheDocumentedExpression(t *testing.T) {
	ucxtest.Need(t)
	for _, nc := range []nodesCase{{2, 1}, {4, 2}, {3, 1}, {6, 2}} {
		t.Run(nc.String(), func(t *testing.T) {
			sizes := []int{1, 7, 4097, 30011}
			switch {
			case !raceEnabled:
			case nc.world == 6:
				sizes = sizes[:3]
			case nc.localSize > 1 || nc.world > 2:
				t.Skip("covered without the race detector and by tests/python/dist/test_nodes.py")
			}
			checkAcrossNodes(t, nc, sizes)
		})
	}
}

// The same matrix with every call's plain buffers registered for the call
// (one rank per node): partials from the input, results into the output.
func TestPlainBuffersRegisteredPerCall(t *testing.T) {
	ucxtest.Need(t)
	defer func(v int64) { userMinBytes = v }(userMinBytes)
	userMinBytes = 1
	for _, nc := range []nodesCase{{2, 1}, {3, 1}} {
		t.Run(nc.String(), func(t *testing.T) {
			if raceEnabled && nc.world > 2 {
				t.Skip("covered without the race detector")
			}
			checkAcrossNodes(t, nc, []int{1, 7, 4097, 30011})
		})
	}
}

func checkAcrossNodes(t *testing.T, nc nodesCase, sizes []int) {
	modes := []string{"staged", "symmetric-inplace", "symmetric-outofplace", "plain-inplace"}
	rng := rand.New(rand.NewSource(int64(nc.world*10 + nc.localSize)))
	type key struct{ size, d, op int }
	inputs := map[key][][]byte{}
	wants := map[key][]byte{}
	for _, n := range sizes {
		for d := reduce.Float32; d <= reduce.Int64; d++ {
			for op := reduce.Sum; op <= reduce.Avg; op++ {
				var in [][]byte
				for range nc.world {
					b := make([]byte, n*d.Size())
					fill(rng, b, d)
					in = append(in, b)
				}
				k := key{n, int(d), int(op)}
				inputs[k], wants[k] = in, expectedAcrossNodes(in, nc.localSize, n, d, op)
			}
		}
	}
	opts := Options{Timeout: 20 * time.Second, StagingBytes: 1 << 20, NetChunkBytes: 8 << 10}
	errs := runNodes(t, nc.world, nc.localSize, opts, func(c *Comm) error {
		sym, err := c.Alloc(int64(sizes[len(sizes)-1]) * 8)
		if err != nil {
			return err
		}
		i := 0
		for _, n := range sizes {
			for d := reduce.Float32; d <= reduce.Int64; d++ {
				for op := reduce.Sum; op <= reduce.Avg; op++ {
					k := key{n, int(d), int(op)}
					in := inputs[k]
					mode := modes[i%len(modes)]
					i++
					got, err := allReduceIn(c, mode, sym, in[c.rank], n, d, op)
					if err != nil {
						return fmt.Errorf("%d x %v %v (%s): %w", n, d, op, mode, err)
					}
					if want := wants[k]; !bytes.Equal(got, want) {
						at := 0
						for at < len(got) && got[at] == want[at] {
							at++
						}
						return fmt.Errorf("%d x %v %v (%s): byte %d = %#x, want %#x", n, d, op, mode, at, got[at], want[at])
					}
				}
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// Ranks whose buffers differ in one call (results into one rank's
// symmetric output, another's staging area), and symmetric allocations
// made after the network opened, freed, and made again: every byte is the
// documented expression's, on every rank.
func TestResultsLandWhereEachRankWantsThem(t *testing.T) {
	ucxtest.Need(t)
	defer func(v int64) { userMinBytes = v }(userMinBytes)
	for _, tc := range []struct {
		nc      nodesCase
		userMin int64 // plain buffers registered per call from this size
	}{{nodesCase{2, 1}, 1}, {nodesCase{2, 1}, 1 << 62}, {nodesCase{4, 2}, 1 << 62}, {nodesCase{3, 1}, 1}} {
		nc := tc.nc
		t.Run(fmt.Sprintf("%v/user-from-%d", nc, tc.userMin), func(t *testing.T) {
			if raceEnabled && nc.world > 2 {
				t.Skip("covered without the race detector")
			}
			userMinBytes = tc.userMin
			modes := []string{"staged", "symmetric-inplace", "symmetric-outofplace", "plain-inplace"}
			// 70001 elements leave shards of more than 64 KiB of partials on
			// 2 x 2 too: results travel. bfloat16 avg: partials folded
			// into the send slots (float32) even with one rank per node.
			sizes := []int{7, 4097, 70001}
			types := []struct {
				d  reduce.DType
				op reduce.Op
			}{{reduce.Float32, reduce.Sum}, {reduce.BFloat16, reduce.Avg}}
			rng := rand.New(rand.NewSource(int64(nc.world)))
			const rounds = 8
			inputs := make([][][]byte, rounds*len(sizes))
			wants := make([][]byte, len(inputs))
			for i := range inputs {
				n, ty := sizes[i%len(sizes)], types[i/len(sizes)%len(types)]
				for range nc.world {
					b := make([]byte, n*ty.d.Size())
					fill(rng, b, ty.d)
					inputs[i] = append(inputs[i], b)
				}
				wants[i] = expectedAcrossNodes(inputs[i], nc.localSize, n, ty.d, ty.op)
			}
			opts := Options{Timeout: 20 * time.Second, StagingBytes: 1 << 20, NetChunkBytes: 8 << 10}
			errs := runNodes(t, nc.world, nc.localSize, opts, func(c *Comm) error {
				var sym uintptr
				for i := range inputs {
					if i%len(sizes) == 0 { // a fresh allocation every round, the network open from the first
						if sym != 0 {
							if err := c.Free(sym); err != nil {
								return err
							}
						}
						var err error
						if sym, err = c.Alloc(int64(sizes[len(sizes)-1]) * 4); err != nil {
							return err
						}
					}
					mode := modes[(i/len(sizes)+c.rank)%len(modes)] // each rank its own placement
					n, ty := sizes[i%len(sizes)], types[i/len(sizes)%len(types)]
					got, err := allReduceIn(c, mode, sym, inputs[i][c.rank], n, ty.d, ty.op)
					if err != nil {
						return fmt.Errorf("call %d, %d x %v %v (%s): %w", i, n, ty.d, ty.op, mode, err)
					}
					if !bytes.Equal(got, wants[i]) {
						at := 0
						for at < len(got) && got[at] == wants[i][at] {
							at++
						}
						return fmt.Errorf("call %d, %d x %v %v (%s): byte %d = %#x, want %#x", i, n, ty.d, ty.op, mode, at, got[at], wants[i][at])
					}
				}
				return c.Free(sym)
			})
			for r, err := range errs {
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
		})
	}
}

// allReduceIn runs one all-reduce of in with its buffers placed as mode
// says, the output poisoned first, and returns the output.
func allReduceIn(c *Comm, mode string, sym uintptr, in []byte, n int, d reduce.DType, op reduce.Op) ([]byte, error) {
	nb := len(in)
	out := bytes.Repeat([]byte{0xA5}, nb+1)[:nb] // never empty, so &out[0] is valid
	own := append([]byte(nil), in...)
	own = append(own, 0)[:nb]
	src, dst := uintptr(unsafe.Pointer(&own[:1][0])), uintptr(unsafe.Pointer(&out[:1][0]))
	symBytes := unsafe.Slice((*byte)(hostPtr(sym)), nb)
	switch mode {
	case "symmetric-inplace":
		copy(symBytes, in)
		src, dst = sym, sym
	case "symmetric-outofplace":
		copy(symBytes, in)
		src = sym
	case "plain-inplace":
		copy(own, in)
		dst = src
	}
	err := c.AllReduce(collective.AllReduce{Src: src, Dst: dst, Count: int64(n), DType: d, Op: op})
	runtime.KeepAlive(own)
	runtime.KeepAlive(out)
	switch mode {
	case "symmetric-inplace":
		return append([]byte(nil), symBytes...), err
	case "plain-inplace":
		return own, err
	case "symmetric-outofplace":
		if !bytes.Equal(symBytes, in) {
			return nil, fmt.Errorf("the symmetric input changed")
		}
	case "staged":
		if !bytes.Equal(own, in) {
			return nil, fmt.Errorf("the input changed")
		}
	}
	return out, err
}

// A rank that rejects its call, ranks of different nodes that disagree, or
// a call over the staging capacity fail every rank of every node, and every
// rank is usable after.
func TestBadCallsAcrossNodesFailEveryRank(t *testing.T) {
	ucxtest.Need(t)
	t.Run("2x2", func(t *testing.T) { checkBadCalls(t, nodesCase{4, 2}) })
	// Ranks alone on their nodes, with plain buffers registered for every
	// call: a failed call leaves them registered nowhere.
	defer func(v int64) { userMinBytes = v }(userMinBytes)
	userMinBytes = 1
	t.Run("2x1/user", func(t *testing.T) { checkBadCalls(t, nodesCase{2, 1}) })
}

func checkBadCalls(t *testing.T, nc nodesCase) {
	opts := Options{Timeout: 10 * time.Second, StagingBytes: 1 << 16}
	last := nc.world - 1 // the rank that rejects its call
	errs := runNodes(t, nc.world, nc.localSize, opts, func(c *Comm) error {
		buf := make([]float32, 1<<15)
		defer runtime.KeepAlive(buf)
		p := uintptr(unsafe.Pointer(&buf[0]))
		call := func(req collective.AllReduce) error {
			req.Src, req.Dst = p, p
			if req.DType == 0 && req.Op == 0 {
				req.DType = reduce.Float32
			}
			return c.AllReduce(req)
		}
		expect := func(what string, err error, code status.Code, text string) error {
			if status.CodeOf(err) != code || !strings.Contains(err.Error(), text) {
				return fmt.Errorf("%s: got %v (%v), want %v containing %q", what, err, status.CodeOf(err), code, text)
			}
			return nil
		}
		var reject error
		if c.rank == last {
			reject = status.Errorf(status.InvalidArgument, "tensor is not contiguous")
		}
		err := call(collective.AllReduce{Count: 4, Reject: reject})
		if c.rank == last {
			err = expect("rejecting rank", err, status.InvalidArgument, "contiguous")
		} else {
			err = expect("the last rank rejected", err, status.Mismatch, fmt.Sprintf("rank %d", last))
		}
		if err != nil {
			return err
		}
		// Each node agrees inside; the nodes differ.
		if err := expect("counts differ by node", call(collective.AllReduce{Count: int64(10 + c.topo.Node())}), status.Mismatch, "disagree"); err != nil {
			return err
		}
		op := reduce.Sum
		if c.topo.Node() == 1 {
			op = reduce.Max
		}
		if err := expect("ops differ by node", call(collective.AllReduce{Count: 10, Op: op}), status.Mismatch, "disagree"); err != nil {
			return err
		}
		count, code := int64(16), status.Mismatch
		if c.rank == 0 {
			count, code = int64(len(buf)), status.Capacity
		}
		if err := expect("over capacity on rank 0", call(collective.AllReduce{Count: count}), code, map[bool]string{true: "staging", false: "rank 0"}[c.rank == 0]); err != nil {
			return err
		}
		for i := range 16 {
			buf[i] = float32(c.rank + i)
		}
		if err := call(collective.AllReduce{Count: 16}); err != nil {
			return fmt.Errorf("call after errors: %w", err)
		}
		for i := range 16 {
			if want := float32(nc.world*(nc.world-1)/2 + nc.world*i); buf[i] != want {
				return fmt.Errorf("after errors: [%d] = %g, want %g", i, buf[i], want)
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// Nodes of different sizes: every rank says what is supported, at once.
func TestUnevenNodesAreUnsupportedOnEveryRank(t *testing.T) {
	errs := runNodes(t, 3, 2, Options{Timeout: 5 * time.Second}, func(c *Comm) error {
		var x [4]float32
		p := uintptr(unsafe.Pointer(&x[0]))
		err := c.AllReduce(collective.AllReduce{Src: p, Dst: p, Count: 4, DType: reduce.Float32})
		runtime.KeepAlive(&x)
		if status.CodeOf(err) != status.Unsupported || !strings.Contains(err.Error(), "same number of ranks on every node") ||
			!strings.Contains(err.Error(), "node 1: rank 2") {
			return fmt.Errorf("got %v, want Unsupported saying what is supported and naming the nodes", err)
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// A rank that never comes to the call, alive (stopped) or gone (closed):
// every other rank, on its node or not, and whether it waits for it
// directly or for a rank that waits for it, fails within about the timeout
// naming it.
func TestAbsentRankAcrossNodesIsNamedByEveryRank(t *testing.T) {
	ucxtest.Need(t)
	const timeout = 1500 * time.Millisecond
	for _, nc := range []nodesCase{{4, 2}, {3, 1}, {6, 2}} {
		for _, how := range []string{"stopped", "gone"} {
			t.Run(nc.String()+"/"+how, func(t *testing.T) { checkAbsentRank(t, nc, how, timeout) })
		}
	}
	// With the survivors' plain buffers registered for the call, which a
	// failed call gives back before it returns.
	defer func(v int64) { userMinBytes = v }(userMinBytes)
	userMinBytes = 1
	for _, how := range []string{"stopped", "gone"} {
		t.Run("3x1/user/"+how, func(t *testing.T) { checkAbsentRank(t, nodesCase{3, 1}, how, timeout) })
	}
}

func checkAbsentRank(t *testing.T, nc nodesCase, how string, timeout time.Duration) {
	absent := nc.world - 2 // on the second node
	start := time.Now()
	took := make([]time.Duration, nc.world)
	var survivors sync.WaitGroup
	survivors.Add(nc.world - 1)
	errs := runNodes(t, nc.world, nc.localSize, Options{Timeout: timeout}, func(c *Comm) error {
		var x [5000]float32
		p := uintptr(unsafe.Pointer(&x[0]))
		call := func() error {
			return c.AllReduce(collective.AllReduce{Src: p, Dst: p, Count: int64(len(x)), DType: reduce.Float32})
		}
		if err := call(); err != nil { // opens the network on every rank
			return err
		}
		if c.rank == absent {
			if how == "stopped" {
				survivors.Wait() // keeps its transport open, as a stopped process does
			}
			return nil
		}
		defer survivors.Done()
		begin := time.Now()
		err := call()
		took[c.rank] = time.Since(begin)
		runtime.KeepAlive(&x)
		want := fmt.Sprintf("rank %d ", absent)
		if status.CodeOf(err) != status.Timeout || !strings.Contains(err.Error(), want) {
			return fmt.Errorf("got %v, want a timeout naming rank %d", err, absent)
		}
		if call() == nil {
			return fmt.Errorf("a broken communicator accepted another call")
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
		// The timeout, the wait for whom the awaited rank blames, and a second.
		if limit := timeout + collective.BlameWait(timeout) + time.Second; took[r] > limit {
			t.Errorf("rank %d raised after %v, want within %v", r, took[r], limit)
		}
	}
	t.Logf("raised after %v; %v in all", took, time.Since(start))
}
