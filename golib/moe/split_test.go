package moe

import (
	"runtime"
	"testing"
)

// split covers every item exactly once, for any count and worker number,
// and workers never exceeds the items, the cores or maxSplit.
func TestSplitCoversEveryItemOnce(t *testing.T) {
	for _, n := range []int{0, 1, 2, 7, 100, 1001} {
		for _, w := range []int{1, 2, 3, 16} {
			hits := make([]int32, n)
			split(n, w, func(worker, lo, hi int) {
				if worker < 0 || worker >= max(w, 1) {
					t.Errorf("n=%d w=%d: worker %d", n, w, worker)
				}
				for i := lo; i < hi; i++ {
					hits[i]++ // ranges are disjoint: no two goroutines touch one item
				}
			})
			for i, h := range hits {
				if h != 1 {
					t.Fatalf("n=%d w=%d: item %d done %d times", n, w, i, h)
				}
			}
		}
	}
	if got := workers(1, 1<<30); got != 1 {
		t.Errorf("workers(1 item) = %d", got)
	}
	if got := workers(1000, 1); got != 1 {
		t.Errorf("workers(1000 bytes) = %d, want 1", got)
	}
	if got, most := workers(1<<20, 1<<20), min(runtime.GOMAXPROCS(0), maxSplit); got != most {
		t.Errorf("workers(1 TiB) = %d, want %d", got, most)
	}
}

// A worker's panic reaches split's caller (where the C boundary recovers
// it), not the process.
func TestSplitPanicReachesTheCaller(t *testing.T) {
	defer func() {
		if p := recover(); p != "item 7" {
			t.Errorf("recovered %v, want item 7's panic", p)
		}
	}()
	split(10, 3, func(_, lo, hi int) {
		if lo <= 7 && 7 < hi {
			panic("item 7")
		}
	})
	t.Error("split returned past a worker's panic")
}
