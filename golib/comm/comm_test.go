package comm

import (
	"bytes"
	"fmt"
	"math/rand"
	"strings"
	"sync"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap/bootstraptest"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// newRanks builds a CPU communicator per goroutine rank over one in-memory
// bootstrap.
func newRanks(t *testing.T, size int) []*Comm {
	t.Helper()
	comms, errs := tryRanks(size, func(int) map[string]string { return nil })
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

// tryRanks builds a CPU communicator per goroutine rank, each with the extra
// environment env(rank), and returns what every rank got.
func tryRanks(size int, env func(rank int) map[string]string) ([]*Comm, []error) {
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
			for k, v := range env(r) {
				cfg.Env[k] = v
			}
			comms[r], errs[r] = New(cfg, bs[r])
		}(r)
	}
	wg.Wait()
	return comms, errs
}

// A rank whose shared memory cannot be made fails construction on every rank
// with the cause, instead of a communicator that crashes at its first call.
func TestSetupFailureOfOneRankFailsEveryRankWithTheCause(t *testing.T) {
	const size = 3
	comms, errs := tryRanks(size, func(r int) map[string]string {
		if r == 1 {
			return map[string]string{"P2PCOMM_STAGING_BYTES": fmt.Sprint(int64(1) << 60)} // more than any tmpfs holds
		}
		return nil
	})
	for r := range comms {
		if errs[r] == nil {
			comms[r].Close()
			t.Fatalf("rank %d: New succeeded, want the failure of rank 1's shared memory", r)
		}
		if comms[r] != nil {
			t.Fatalf("rank %d: New returned a communicator with the error %v", r, errs[r])
		}
		want := "rank 1 could not create shared memory"
		if r == 1 {
			want = "reserve"
		}
		if status.CodeOf(errs[r]) != status.Capacity || !strings.Contains(errs[r].Error(), want) {
			t.Errorf("rank %d: got %v (%v), want a specific error containing %q", r, errs[r], status.CodeOf(errs[r]), want)
		}
	}
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

// P2PCOMM_BOOTSTRAP=mpi without a loadable Open MPI fails with Unsupported
// saying how to get one, instead of falling back to another bootstrap.
func TestMPIBootstrapWithoutOpenMPIIsUnsupported(t *testing.T) {
	path := t.TempDir() + "/libmpi.so.40"
	cfg := Config{Device: -1, Env: map[string]string{"P2PCOMM_BOOTSTRAP": "mpi", "P2PCOMM_MPI_LIB": path}}
	bs, err := pickBootstrap(cfg, nil)
	if err == nil {
		bs.Close()
		t.Fatalf("pickBootstrap with P2PCOMM_MPI_LIB=%s succeeded", path)
	}
	if status.CodeOf(err) != status.Unsupported {
		t.Fatalf("pickBootstrap: %v (code %v), want Unsupported", err, status.CodeOf(err))
	}
	for _, want := range []string{path, "apt-get install openmpi-bin", "P2PCOMM_MPI_LIB"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	t.Log(err)
}

// TestPortInlineBytesSetting: P2PCOMM_PORT_INLINE_BYTES takes 0..64 (0
// turns inline puts off), defaults to 64, and refuses anything else.
func TestPortInlineBytesSetting(t *testing.T) {
	for _, tt := range []struct {
		v    string
		want uint32
		bad  bool
	}{{"", 64, false}, {"0", 0, false}, {"8", 8, false}, {"64", 64, false}, {"65", 0, true}, {"-1", 0, true}, {"x", 0, true}} {
		p, err := portSettings(Config{Env: map[string]string{"P2PCOMM_PORT_INLINE_BYTES": tt.v}})
		if (err != nil) != tt.bad || (!tt.bad && p.inlineBytes != tt.want) {
			t.Errorf("P2PCOMM_PORT_INLINE_BYTES=%q: %d, %v; want %d, error %v", tt.v, p.inlineBytes, err, tt.want, tt.bad)
		}
	}
}
