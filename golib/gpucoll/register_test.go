package gpucoll

import (
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
)

// inProcess is an all-gather among goroutine ranks, for callback bootstraps.
type inProcess struct {
	mu    sync.Mutex
	cond  *sync.Cond
	size  int
	round int
	in    [][]byte
	out   [][]byte
}

func newInProcess(size int) *inProcess {
	w := &inProcess{size: size, in: make([][]byte, size)}
	w.cond = sync.NewCond(&w.mu)
	return w
}

func (w *inProcess) bootstrap(t *testing.T, rank int) bootstrap.Bootstrap {
	bs, err := bootstrap.NewCallback(rank, w.size, func(send, recv []byte) error {
		w.mu.Lock()
		defer w.mu.Unlock()
		round := w.round
		w.in[rank] = append([]byte(nil), send...)
		arrived := 0
		for _, b := range w.in {
			if b != nil {
				arrived++
			}
		}
		if arrived == w.size {
			w.out, w.in = w.in, make([][]byte, w.size)
			w.round++
			w.cond.Broadcast()
		}
		for w.round == round {
			w.cond.Wait()
		}
		for r, b := range w.out {
			copy(recv[r*len(send):], b)
		}
		return nil
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return bs
}

// TestLiveOnEveryRank: an input counts as live only where every rank still
// has it allocated, and every rank gets the same answer.
func TestLiveOnEveryRank(t *testing.T) {
	live := [][]bool{
		{true, true, false, true},
		{true, false, false, true},
		{true, true, true, true},
	}
	want := []bool{true, false, false, true}
	w := newInProcess(len(live))
	got := make([][]bool, len(live))
	errs := make([]error, len(live))
	var wg sync.WaitGroup
	for r := range live {
		bs := w.bootstrap(t, r)
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[r], errs[r] = liveOnEveryRank(bs, live[r])
		}()
	}
	wg.Wait()
	for r := range live {
		if errs[r] != nil || !slices.Equal(got[r], want) {
			t.Errorf("rank %d: liveOnEveryRank(%v) = %v, %v; want %v", r, live[r], got[r], errs[r], want)
		}
	}
	if fmt.Sprint(live[0]) != "[true true false true]" {
		t.Errorf("liveOnEveryRank changed its argument: %v", live[0])
	}
}
