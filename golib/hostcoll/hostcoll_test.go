package hostcoll

import (
	"errors"
	"fmt"
	"math/rand"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap/bootstraptest"
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/shm"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// run creates one Comm per rank and runs f on each concurrently.
func run(t *testing.T, world int, opts Options, f func(c *Comm) error) []error {
	t.Helper()
	shm.Dir = t.TempDir()
	bs := bootstraptest.NewMem(world)
	opts.Cooperative = true // the ranks are goroutines here
	errs := make([]error, world)
	var wg sync.WaitGroup
	for r := range world {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := New(bs[r], opts)
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

func fill(rng *rand.Rand, b []byte, d reduce.DType) {
	n := len(b) / d.Size()
	for i := range n {
		v := rng.NormFloat64()
		p := unsafe.Pointer(&b[i*d.Size()])
		switch d {
		case reduce.Float32:
			*(*float32)(p) = float32(v)
		case reduce.Float64:
			*(*float64)(p) = v
		case reduce.Float16:
			*(*uint16)(p) = reduce.FloatToHalf(float32(v))
		case reduce.BFloat16:
			*(*uint16)(p) = reduce.FloatToBF16(float32(v))
		case reduce.Int32:
			*(*int32)(p) = int32(rng.Intn(9) - 4)
		case reduce.Int64:
			*(*int64)(p) = int64(rng.Intn(9) - 4)
		}
	}
}

func TestAllReduceMatchesHostReduction(t *testing.T) {
	for _, world := range []int{1, 2, 3, 4} {
		for _, algo := range []collective.Algorithm{collective.OneShot, collective.TwoShot} {
			for _, mode := range []string{"staged", "symmetric-inplace", "symmetric-outofplace"} {
				name := fmt.Sprintf("world%d/%s/%s", world, algo, mode)
				t.Run(name, func(t *testing.T) { checkAllReduce(t, world, algo, mode) })
			}
		}
	}
}

func checkAllReduce(t *testing.T, world int, algo collective.Algorithm, mode string) {
	const count = 4097
	inputs := map[[3]int][]byte{} // (rank, dtype, op) -> input
	rng := rand.New(rand.NewSource(int64(world)))
	for r := range world {
		for d := reduce.Float32; d <= reduce.Int64; d++ {
			for op := reduce.Sum; op <= reduce.Avg; op++ {
				b := make([]byte, count*d.Size())
				fill(rng, b, d)
				inputs[[3]int{r, int(d), int(op)}] = b
			}
		}
	}
	results := make([]map[[2]int][]byte, world)
	errs := run(t, world, Options{Timeout: 10 * time.Second}, func(c *Comm) error {
		results[c.rank] = map[[2]int][]byte{}
		var sym uintptr
		if mode != "staged" {
			var err error
			if sym, err = c.Alloc(count * 8); err != nil {
				return err
			}
		}
		for d := reduce.Float32; d <= reduce.Int64; d++ {
			for op := reduce.Sum; op <= reduce.Avg; op++ {
				in := inputs[[3]int{c.rank, int(d), int(op)}]
				nb := len(in)
				out := make([]byte, nb)
				for i := range out {
					out[i] = 0xA5 // poison
				}
				src := uintptr(unsafe.Pointer(&in[0]))
				dst := uintptr(unsafe.Pointer(&out[0]))
				var staged []byte // a uintptr does not keep its slice alive: KeepAlive below does
				switch mode {
				case "staged":
					staged = append([]byte(nil), in...)
					src = uintptr(unsafe.Pointer(&staged[0]))
				case "symmetric-inplace":
					copy(unsafe.Slice((*byte)(hostPtr(sym)), nb), in)
					src, dst = sym, sym
				case "symmetric-outofplace":
					copy(unsafe.Slice((*byte)(hostPtr(sym)), nb), in)
					src = sym
				}
				req := collective.AllReduce{Src: src, Dst: dst, Count: count, DType: d, Op: op, Algo: algo}
				err := c.AllReduce(req)
				runtime.KeepAlive(staged)
				if err != nil {
					return fmt.Errorf("%v %v: %w", d, op, err)
				}
				if mode == "symmetric-inplace" {
					copy(out, unsafe.Slice((*byte)(hostPtr(sym)), nb))
				}
				results[c.rank][[2]int{int(d), int(op)}] = out
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	for d := reduce.Float32; d <= reduce.Int64; d++ {
		for op := reduce.Sum; op <= reduce.Avg; op++ {
			srcs := make([]unsafe.Pointer, world)
			for r := range world {
				srcs[r] = unsafe.Pointer(&inputs[[3]int{r, int(d), int(op)}][0])
			}
			want := make([]byte, count*d.Size())
			reduce.Host(unsafe.Pointer(&want[0]), srcs, count, d, op)
			for r := range world {
				got := results[r][[2]int{int(d), int(op)}]
				for i := range want {
					if got[i] != want[i] {
						t.Fatalf("rank %d %v %v: byte %d = %#x, want %#x", r, d, op, i, got[i], want[i])
					}
				}
			}
		}
	}
}

func TestMismatchedCallsFailEverywhereAndLeaveCommUsable(t *testing.T) {
	errs := run(t, 3, Options{Timeout: 5 * time.Second, StagingBytes: 1 << 16}, func(c *Comm) error {
		buf := make([]float32, 1<<15) // 128 KiB: over the staging capacity
		defer runtime.KeepAlive(buf)  // p alone does not keep it alive
		p := uintptr(unsafe.Pointer(&buf[0]))
		n := int64(100 + c.rank) // sizes differ
		err := c.AllReduce(collective.AllReduce{Src: p, Dst: p, Count: n, DType: reduce.Float32})
		if status.CodeOf(err) != status.Mismatch {
			return fmt.Errorf("different sizes: got %v, want a mismatch error", err)
		}
		count := int64(16)
		if c.rank == 1 {
			count = int64(len(buf))
		}
		err = c.AllReduce(collective.AllReduce{Src: p, Dst: p, Count: count, DType: reduce.Float32})
		want := status.Mismatch
		if c.rank == 1 {
			want = status.Capacity
		}
		if status.CodeOf(err) != want {
			return fmt.Errorf("rank %d oversize: got %v, want %v", c.rank, err, want)
		}
		for i := range 16 {
			buf[i] = float32(c.rank + i)
		}
		if err := c.AllReduce(collective.AllReduce{Src: p, Dst: p, Count: 16, DType: reduce.Float32}); err != nil {
			return fmt.Errorf("call after errors: %w", err)
		}
		for i := range 16 {
			if want := float32(3*i + 3); buf[i] != want {
				return fmt.Errorf("after errors: [%d] = %g, want %g", i, buf[i], want)
			}
		}
		return c.Barrier()
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

func TestAbsentRankTimesOutNamingIt(t *testing.T) {
	start := time.Now()
	errs := run(t, 2, Options{Timeout: 300 * time.Millisecond}, func(c *Comm) error {
		if c.rank == 1 {
			return nil // never calls
		}
		var x [4]float32
		defer runtime.KeepAlive(&x) // p alone does not keep it alive
		p := uintptr(unsafe.Pointer(&x[0]))
		err := c.AllReduce(collective.AllReduce{Src: p, Dst: p, Count: 4, DType: reduce.Float32})
		var se *status.Error
		if !errors.As(err, &se) || se.Code != status.Timeout {
			return fmt.Errorf("got %v, want a timeout", err)
		}
		if want := "rank 1 never arrived"; !contains(err.Error(), want) {
			return fmt.Errorf("error %q does not say %q", err, want)
		}
		if c.AllReduce(collective.AllReduce{Src: p, Dst: p, Count: 4, DType: reduce.Float32}) == nil {
			return errors.New("a broken communicator accepted another call")
		}
		return nil
	})
	if errs[0] != nil {
		t.Fatal(errs[0])
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("timeout took %v", took)
	}
}

func contains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}

func TestSegmentsAreUnlinkedOnceMapped(t *testing.T) {
	run(t, 2, Options{}, func(c *Comm) error {
		_, err := c.Alloc(1 << 12)
		return err
	})
	entries, _ := os.ReadDir(shm.Dir)
	if len(entries) != 0 {
		t.Errorf("%d segment files left behind: %v", len(entries), entries[0].Name())
	}
}

// One rank failing to create its segment must fail Alloc on every rank at
// once (not after the timeout) and leave the communicator usable.
func TestAllocFailureOnOneRankFailsAllAndKeepsCommUsable(t *testing.T) {
	start := time.Now()
	var mu sync.Mutex
	blocked := false
	errs := run(t, 3, Options{Timeout: 5 * time.Second}, func(c *Comm) error {
		mu.Lock()
		if !blocked { // occupy rank 1's next segment name, so its O_EXCL create fails
			name := shm.Name(c.opts.Job, os.Getpid(), fmt.Sprintf("%s.a0.r1", c.prefix))
			if err := os.WriteFile(shm.Dir+"/"+name, nil, 0o600); err != nil {
				mu.Unlock()
				return err
			}
			blocked = true
		}
		mu.Unlock()
		if err := c.Barrier(); err != nil { // the file exists before anyone allocates
			return err
		}
		_, err := c.Alloc(1 << 12)
		if err == nil {
			return fmt.Errorf("rank %d: Alloc succeeded although rank 1 could not create its segment", c.rank)
		}
		if c.rank != 1 && !contains(err.Error(), "rank 1") {
			return fmt.Errorf("rank %d: error %q does not name rank 1", c.rank, err)
		}
		var x [3]float32
		x[0] = float32(c.rank)
		p := uintptr(unsafe.Pointer(&x[0]))
		if err := c.AllReduce(collective.AllReduce{Src: p, Dst: p, Count: 3, DType: reduce.Float32}); err != nil {
			return fmt.Errorf("rank %d: all-reduce after the failed Alloc: %w", c.rank, err)
		}
		if x[0] != 3 {
			return fmt.Errorf("rank %d: sum = %g, want 3", c.rank, x[0])
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("took %v: someone waited for a timeout", took)
	}
}
