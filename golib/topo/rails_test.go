package topo

import (
	"runtime"
	"sync"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap/bootstraptest"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// TestNetRails: a count of 1, 2, 4 or 8 is taken as given, any other is an
// InvalidArgument naming the variable, and the default is a power of two up
// to MaxNetRails that leaves two cores per rail of the host's ranks where
// there are that many.
func TestNetRails(t *testing.T) {
	for _, n := range []int{1, 2, 4, 8} {
		if got, err := (&Topology{HostRanks: 64}).NetRails(n); err != nil || got != n {
			t.Errorf("%d rails asked: got %d, %v", n, got, err)
		}
	}
	for _, bad := range []int{-1, 3, 5, 16} {
		if _, err := (&Topology{HostRanks: 1}).NetRails(bad); status.CodeOf(err) != status.InvalidArgument {
			t.Errorf("%d rails asked: %v, want InvalidArgument", bad, err)
		}
	}
	for _, ranks := range []int{0, 1, 2, 8, 1024} {
		got, err := (&Topology{HostRanks: ranks}).NetRails(0)
		if err != nil || got < 1 || got > MaxNetRails || got&(got-1) != 0 {
			t.Fatalf("default on %d host ranks: %d, %v", ranks, got, err)
		}
		if got > 1 && 2*got > coresPerRank(runtime.NumCPU(), onlineCPUs(), ranks) {
			t.Errorf("default on %d host ranks and %d cores: %d rails", ranks, runtime.NumCPU(), got)
		}
	}
	// A rank bound to 16 of 128 cores has them to itself; an unbound one
	// shares the host's with the other ranks.
	for _, c := range []struct{ allowed, online, ranks, want int }{
		{16, 128, 8, 16}, {128, 128, 8, 16}, {2, 2, 4, 0}, {32, 0, 2, 16}, {4, 4, 1, 4},
	} {
		if got := coresPerRank(c.allowed, c.online, c.ranks); got != c.want {
			t.Errorf("coresPerRank(%d of %d, %d ranks) = %d, want %d", c.allowed, c.online, c.ranks, got, c.want)
		}
	}
	if n := onlineCPUs(); n != 0 && n < runtime.NumCPU() {
		t.Errorf("%d CPUs online, fewer than the %d this process may run on", n, runtime.NumCPU())
	}
}

// TestAgreeRails: ranks settle on the fewest rails asked; one rank's bad
// count is every rank's InvalidArgument.
func TestAgreeRails(t *testing.T) {
	for _, c := range []struct {
		asked []int
		want  int // 0: every rank fails
	}{{[]int{8, 2, 4}, 2}, {[]int{1, 8, 8}, 1}, {[]int{4, 3, 4}, 0}} {
		bss := bootstraptest.NewMem(len(c.asked))
		got, errs := make([]int, len(bss)), make([]error, len(bss))
		var wg sync.WaitGroup
		for r, bs := range bss {
			wg.Add(1)
			go func() {
				defer wg.Done()
				got[r], errs[r] = (&Topology{Rank: r, HostRanks: 1}).AgreeRails(bs, c.asked[r])
			}()
		}
		wg.Wait()
		for r := range bss {
			if c.want == 0 && status.CodeOf(errs[r]) != status.InvalidArgument {
				t.Errorf("asked %v: rank %d got %v, want InvalidArgument", c.asked, r, errs[r])
			}
			if c.want != 0 && (errs[r] != nil || got[r] != c.want) {
				t.Errorf("asked %v: rank %d got %d, %v; want %d", c.asked, r, got[r], errs[r], c.want)
			}
		}
	}
}
