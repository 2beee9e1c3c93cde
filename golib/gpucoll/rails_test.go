package gpucoll

import (
	"runtime"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/topo"
)

// TestNetRails: a count that splits the blocks evenly is taken as given,
// any other is an InvalidArgument naming the variable, and the default is
// a power of two up to DefaultNetRails that leaves two cores per proxy
// thread of the host's ranks where there are that many.
func TestNetRails(t *testing.T) {
	for _, c := range []struct{ set, want int }{{1, 1}, {2, 2}, {4, 4}, {8, 8}} {
		b := &Backend{opts: Options{NetRails: c.set}, topo: &topo.Topology{HostRanks: 64}}
		if got, err := b.netRails(); err != nil || got != c.want {
			t.Errorf("NetRails %d: got %d, %v; want %d", c.set, got, err, c.want)
		}
	}
	for _, bad := range []int{-1, 3, 5, 16} {
		b := &Backend{opts: Options{NetRails: bad}, topo: &topo.Topology{HostRanks: 1}}
		if _, err := b.netRails(); status.CodeOf(err) != status.InvalidArgument {
			t.Errorf("NetRails %d: %v, want InvalidArgument", bad, err)
		}
	}
	for _, ranks := range []int{1, 2, 8, 1024} {
		b := &Backend{topo: &topo.Topology{HostRanks: ranks}}
		got, err := b.netRails()
		if err != nil || got < 1 || got > DefaultNetRails || got&(got-1) != 0 {
			t.Fatalf("default on %d host ranks: %d, %v", ranks, got, err)
		}
		if got > 1 && 2*got*ranks > runtime.NumCPU() {
			t.Errorf("default on %d host ranks and %d cores: %d rails", ranks, runtime.NumCPU(), got)
		}
	}
}
