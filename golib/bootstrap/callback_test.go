package bootstrap

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// fakeGroup is an in-memory fixed-size all-gather among size goroutines,
// standing in for torch.distributed.all_gather_into_tensor.
type fakeGroup struct {
	size  int
	mu    sync.Mutex
	cond  *sync.Cond
	round int
	bufs  [2][][]byte // by round parity: a fast rank may start round k+1 while a slow one still reads round k
	calls int
	fail  error // returned by every call once set
}

// abort fails every waiting and later call, so one rank's failure cannot
// leave the others waiting for it forever.
func (g *fakeGroup) abort(err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.fail = fmt.Errorf("another rank failed: %w", err)
	g.cond.Broadcast()
}

func newFakeGroup(size int) *fakeGroup {
	g := &fakeGroup{size: size, bufs: [2][][]byte{make([][]byte, size), make([][]byte, size)}}
	g.cond = sync.NewCond(&g.mu)
	return g
}

func (g *fakeGroup) allGather(rank int) func(send, recv []byte) error {
	return func(send, recv []byte) error {
		g.mu.Lock()
		defer g.mu.Unlock()
		if g.fail != nil {
			return g.fail
		}
		if len(recv) != len(send)*g.size {
			return fmt.Errorf("recv has %d bytes, want %d", len(recv), len(send)*g.size)
		}
		round := g.round
		bufs := g.bufs[round%2]
		bufs[rank] = append([]byte{}, send...)
		g.calls++
		if g.calls%g.size == 0 {
			g.round++
			g.cond.Broadcast()
		}
		for g.round == round && g.fail == nil {
			g.cond.Wait()
		}
		if g.fail != nil {
			return g.fail
		}
		for r, b := range bufs {
			if len(b) != len(send) {
				return fmt.Errorf("rank %d sent %d bytes, rank %d sent %d: sizes must match", r, len(b), rank, len(send))
			}
			copy(recv[r*len(send):], b)
		}
		return nil
	}
}

func TestCallbackAllGather(t *testing.T) {
	for size := 1; size <= 5; size++ {
		t.Run(fmt.Sprintf("size%d", size), func(t *testing.T) {
			g := newFakeGroup(size)
			errs := make([]error, size)
			var wg sync.WaitGroup
			for rank := range size {
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer func() {
						if errs[rank] != nil {
							g.abort(errs[rank])
						}
					}()
					b, err := NewCallback(rank, size, g.allGather(rank), nil)
					if err != nil {
						errs[rank] = err
						return
					}
					for round := range 30 {
						if errs[rank] = checkGather(b, round); errs[rank] != nil {
							return
						}
						if errs[rank] = b.Barrier(); errs[rank] != nil {
							return
						}
					}
				}()
			}
			wg.Wait()
			for r, err := range errs {
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
		})
	}
}

func TestCallbackErrors(t *testing.T) {
	boom := errors.New("NCCL error: unhandled system error")
	b, err := NewCallback(0, 1, func(send, recv []byte) error { return boom }, func() error { return boom })
	if err != nil {
		t.Fatalf("NewCallback: %v", err)
	}
	_, err = b.AllGather([]byte("x"))
	if status.CodeOf(err) != status.Bootstrap || !strings.Contains(errString(err), boom.Error()) {
		t.Errorf("AllGather = %v (code %v), want a %v error containing %q", err, status.CodeOf(err), status.Bootstrap, boom)
	}
	if again := b.Barrier(); again != err {
		t.Errorf("Barrier after failure = %v, want the same error %v", again, err)
	}
	b.Close()
	if _, err := b.AllGather(nil); status.CodeOf(err) != status.State {
		t.Errorf("AllGather after Close = %v, want a %v error", err, status.State)
	}

	b, _ = NewCallback(0, 1, func(send, recv []byte) error { return nil }, func() error { return boom })
	if err := b.Barrier(); status.CodeOf(err) != status.Bootstrap || !strings.Contains(errString(err), "barrier callback") {
		t.Errorf("Barrier = %v, want a %v error from the barrier callback", err, status.Bootstrap)
	}
}

func TestCallbackRejectsBadLengths(t *testing.T) {
	// A callback that is not rank-major puts someone else's length in our
	// slot; the result must not be trusted.
	swap := func(send, recv []byte) error {
		for i := range recv {
			recv[i] = 0xff
		}
		return nil
	}
	b, _ := NewCallback(0, 2, swap, nil)
	_, err := b.AllGather([]byte("abc"))
	if status.CodeOf(err) != status.Capacity {
		t.Errorf("AllGather with a garbage length = %v (code %v), want a %v error", err, status.CodeOf(err), status.Capacity)
	}
}

func TestNewCallbackValidates(t *testing.T) {
	ok := func(send, recv []byte) error { return nil }
	tests := []struct {
		name       string
		rank, size int
		ag         func(send, recv []byte) error
	}{
		{"size zero", 0, 0, ok},
		{"rank too big", 2, 2, ok},
		{"rank negative", -1, 2, ok},
		{"no callback", 0, 2, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := NewCallback(tt.rank, tt.size, tt.ag, nil); status.CodeOf(err) != status.InvalidArgument {
				t.Errorf("NewCallback(%d, %d) = %v, want an %v error", tt.rank, tt.size, err, status.InvalidArgument)
			}
		})
	}
}
