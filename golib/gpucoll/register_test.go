package gpucoll

import (
	"slices"
	"sync"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap/bootstraptest"
)

// TestLiveOnEveryRank: an input counts as live only where every rank still
// has it allocated, and every rank gets the same answer.
func TestLiveOnEveryRank(t *testing.T) {
	live := [][]bool{
		{true, true, false, true},
		{true, false, false, true},
		{true, true, true, true},
	}
	want := []bool{true, false, false, true}
	bs := bootstraptest.NewMem(len(live))
	got := make([][]bool, len(live))
	errs := make([]error, len(live))
	var wg sync.WaitGroup
	for r := range live {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[r], errs[r] = liveOnEveryRank(bs[r], live[r])
		}()
	}
	wg.Wait()
	for r := range live {
		if errs[r] != nil || !slices.Equal(got[r], want) {
			t.Errorf("rank %d: liveOnEveryRank(%v) = %v, %v; want %v", r, live[r], got[r], errs[r], want)
		}
	}
}
