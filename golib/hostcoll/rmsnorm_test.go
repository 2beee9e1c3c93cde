package hostcoll

import (
	"bytes"
	"errors"
	"math/rand"
	"runtime"
	"testing"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// TestAllReduceRMSNorm: residual_out is the backend's all-reduce plus the
// residual, rounded once; normed is reduce.ResidualRMSNorm of it (tested
// against float64 in golib/reduce); in place gives the same bits; a rank
// with a bad request fails every rank and leaves them usable.
func TestAllReduceRMSNorm(t *testing.T) {
	const world, rows, hidden = 3, 5, 64
	const n = rows * hidden
	d := reduce.BFloat16
	ptr := func(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }
	errs := run(t, world, Options{}, func(c *Comm) error {
		rng := rand.New(rand.NewSource(int64(c.rank)))
		x, res, w := heapBytes(2*n), heapBytes(2*n), heapBytes(2*hidden)
		sum, normed, resOut := heapBytes(2*n), heapBytes(2*n), heapBytes(2*n)
		// The requests hold addresses only, which keep nothing alive.
		defer runtime.KeepAlive([][]byte{x, res, w, sum, normed, resOut})
		fill(rng, x, d)
		fill(rng, res, d)
		fill(rng, w, d)
		if err := c.AllReduce(collective.AllReduce{Src: ptr(x), Dst: ptr(sum), Count: n, DType: d, Op: reduce.Sum}); err != nil {
			return err
		}
		wantRes, wantNormed := heapBytes(2*n), heapBytes(2*n)
		copy(wantNormed, sum)
		reduce.ResidualRMSNorm(unsafe.Pointer(&wantNormed[0]), unsafe.Pointer(&wantRes[0]), unsafe.Pointer(&wantNormed[0]),
			unsafe.Pointer(&res[0]), unsafe.Pointer(&w[0]), rows, hidden, true, 1e-6)
		req := collective.RMSNorm{X: ptr(x), Residual: ptr(res), Weight: ptr(w), Normed: ptr(normed),
			ResidualOut: ptr(resOut), Rows: rows, Hidden: hidden, DType: d, Eps: 1e-6}
		if err := c.AllReduceRMSNorm(req); err != nil {
			return err
		}
		if !bytes.Equal(resOut, wantRes) || !bytes.Equal(normed, wantNormed) {
			return errors.New("out of place: results differ from all-reduce + ResidualRMSNorm")
		}
		req.ResidualOut = req.Residual // in place
		if err := c.AllReduceRMSNorm(req); err != nil {
			return err
		}
		if !bytes.Equal(res, wantRes) || !bytes.Equal(normed, wantNormed) {
			return errors.New("in place: results differ")
		}
		bad := req
		if c.rank == 1 {
			bad.Hidden = 20000
		}
		err := c.AllReduceRMSNorm(bad)
		want := status.Mismatch
		if c.rank == 1 {
			want = status.Unsupported
		}
		if status.CodeOf(err) != want {
			return errors.New("bad request on rank 1: got " + err.Error() + ", want " + want.String())
		}
		req.ResidualOut = ptr(resOut)
		return c.AllReduceRMSNorm(req) // usable after
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// heapBytes allocates on the heap: the test passes buffers by address as
// the C ABI does, and a buffer on a goroutine's stack could move meanwhile.
//
//go:noinline
func heapBytes(n int) []byte { return make([]byte, n) }
