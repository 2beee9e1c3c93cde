package comm

import (
	"bytes"
	"fmt"
	"math/rand"
	"sync"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap/bootstraptest"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// newRanks builds a CPU communicator per goroutine rank over one in-memory
// bootstrap.
func newRanks(t *testing.T, size int) []*Comm {
	t.Helper()
	bs := bootstraptest.NewMem(size)
	comms := make([]*Comm, size)
	errs := make([]error, size)
	token := fmt.Sprint(rand.Uint64() >> 1) // this test's shared-memory names
	var wg sync.WaitGroup
	for r := range comms {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			cfg := Config{Bootstrap: "torch", Device: -1, Env: map[string]string{"P2PCOMM_JOB_TOKEN": token}}
			comms[r], errs[r] = New(cfg, bs[r])
		}(r)
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	t.Cleanup(func() {
		for _, c := range comms {
			c.Close()
		}
	})
	return comms
}

func TestAllGatherGivesEveryRankEveryRanksBytes(t *testing.T) {
	const size = 3
	comms := newRanks(t, size)
	sent := make([][]byte, size)
	for r := range sent {
		sent[r] = make([]byte, 24)
		rand.New(rand.NewSource(int64(r))).Read(sent[r])
	}
	got := make([][][]byte, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range comms {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			got[r], errs[r] = comms[r].AllGather(sent[r])
		}(r)
	}
	wg.Wait()
	for r := range comms {
		if errs[r] != nil {
			t.Fatalf("rank %d: %v", r, errs[r])
		}
		for q := range sent {
			if !bytes.Equal(got[r][q], sent[q]) {
				t.Fatalf("rank %d got %x from rank %d, which sent %x", r, got[r][q], q, sent[q])
			}
		}
	}
}

func TestAllGatherRejectsLengthsThatDiffer(t *testing.T) {
	comms := newRanks(t, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r := range comms {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			_, errs[r] = comms[r].AllGather(make([]byte, 8+r))
		}(r)
	}
	wg.Wait()
	for r, err := range errs {
		if status.CodeOf(err) != status.Mismatch {
			t.Fatalf("rank %d: got %v, want a mismatch error", r, err)
		}
	}
}

func TestAllGatherAfterCloseIsAStateError(t *testing.T) {
	comms := newRanks(t, 2)
	comms[0].Close()
	if _, err := comms[0].AllGather([]byte{1}); status.CodeOf(err) != status.State {
		t.Fatalf("got %v, want a state error", err)
	}
}
