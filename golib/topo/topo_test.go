package topo

import (
	"fmt"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap/bootstraptest"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

func keys(hosts ...string) [][]byte {
	out := make([][]byte, len(hosts))
	for r, h := range hosts {
		out[r] = []byte(h + "\x00boot-" + h)
	}
	return out
}

func TestBuild(t *testing.T) {
	cases := []struct {
		name      string
		hosts     []string
		localSize int
		nodes     [][]int
		str       string
		shared    bool // some nodes share a host
	}{
		{"one host", []string{"a", "a", "a"}, 0, [][]int{{0, 1, 2}}, "1 node (node 0: ranks 0-2)", false},
		{"two hosts", []string{"a", "a", "b", "b"}, 0, [][]int{{0, 1}, {2, 3}}, "2 nodes (node 0: ranks 0-1, node 1: ranks 2-3)", false},
		{"interleaved hosts", []string{"a", "b", "a", "b"}, 0, [][]int{{0, 2}, {1, 3}}, "2 nodes (node 0: ranks 0, 2, node 1: ranks 1, 3)", false},
		{"knob 1", []string{"a", "a", "a"}, 1, [][]int{{0}, {1}, {2}}, "3 nodes (node 0: rank 0, node 1: rank 1, node 2: rank 2)", true},
		{"knob 2, last smaller", []string{"a", "a", "a", "a", "a"}, 2, [][]int{{0, 1}, {2, 3}, {4}}, "", true},
		{"knob larger than world", []string{"a", "a"}, 8, [][]int{{0, 1}}, "", false},
		{"knob within hosts", []string{"a", "a", "b", "b"}, 2, [][]int{{0, 1}, {2, 3}}, "", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for rank := range c.hosts {
				top, err := Build(rank, keys(c.hosts...), c.localSize)
				if err != nil {
					t.Fatalf("Build(%d, %v, %d): %v", rank, c.hosts, c.localSize, err)
				}
				if !reflect.DeepEqual(top.Nodes, c.nodes) {
					t.Fatalf("Build(%d, %v, %d).Nodes = %v, want %v", rank, c.hosts, c.localSize, top.Nodes, c.nodes)
				}
				local := top.Local()
				if local[top.LocalRank()] != rank || !top.SameNode(rank) {
					t.Errorf("rank %d: local ranks %v, local index %d", rank, local, top.LocalRank())
				}
				for r := range c.hosts {
					if top.SameNode(r) != (top.NodeOf[r] == top.Node()) {
						t.Errorf("rank %d: SameNode(%d) disagrees with NodeOf", rank, r)
					}
				}
				if top.MultiNode() != (len(c.nodes) > 1) {
					t.Errorf("rank %d: MultiNode() = %v with %d nodes", rank, top.MultiNode(), len(c.nodes))
				}
				if top.SharedHosts != c.shared {
					t.Errorf("rank %d: SharedHosts = %v, want %v", rank, top.SharedHosts, c.shared)
				}
				onHost := 0
				for _, h := range c.hosts {
					if h == c.hosts[rank] {
						onHost++
					}
				}
				if top.HostRanks != onHost {
					t.Errorf("rank %d: HostRanks = %d, want %d", rank, top.HostRanks, onHost)
				}
				if c.str != "" && top.String() != c.str {
					t.Errorf("String() = %q, want %q", top.String(), c.str)
				}
			}
		})
	}
}

func TestBuildRefusesANodeAcrossHosts(t *testing.T) {
	_, err := Build(0, keys("a", "a", "b", "b"), 3)
	if status.CodeOf(err) != status.InvalidArgument {
		t.Fatalf("Build with a node across hosts: %v, want InvalidArgument", err)
	}
	for _, want := range []string{"ranks 0 and 2", "a, b", LocalSizeEnv + "=3"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not contain %q", err, want)
		}
	}
}

// Discover gives every rank the same nodes, from host keys faked per rank.
func TestDiscover(t *testing.T) {
	const size = 4
	hosts := []string{"x", "x", "y", "y"}
	for _, localSize := range []int{0, 1, 3} {
		t.Run(fmt.Sprintf("local size %d", localSize), func(t *testing.T) {
			bs := bootstraptest.NewMem(size)
			tops := make([]*Topology, size)
			errs := make([]error, size)
			var wg sync.WaitGroup
			for r := range size {
				wg.Add(1)
				go func() {
					defer wg.Done()
					tops[r], errs[r] = Discover(bs[r], keys(hosts[r])[0], localSize)
				}()
			}
			wg.Wait()
			for r := range size {
				if localSize == 3 {
					if status.CodeOf(errs[r]) != status.InvalidArgument {
						t.Errorf("rank %d: %v, want InvalidArgument (node 0 spans hosts x and y)", r, errs[r])
					}
					continue
				}
				if errs[r] != nil {
					t.Fatalf("rank %d: %v", r, errs[r])
				}
				if !reflect.DeepEqual(tops[r].NodeOf, tops[0].NodeOf) {
					t.Errorf("rank %d sees nodes %v, rank 0 %v", r, tops[r].NodeOf, tops[0].NodeOf)
				}
			}
		})
	}
}

func TestHostKeyIsStable(t *testing.T) {
	if a, b := HostKey(), HostKey(); string(a) != string(b) || len(a) == 0 {
		t.Fatalf("HostKey() = %q then %q", a, b)
	}
}

// Uniform accepts nodes of equal size and names the shape it refuses.
func TestUniform(t *testing.T) {
	even := &Topology{Rank: 0, NodeOf: []int{0, 0, 1, 1}, Nodes: [][]int{{0, 1}, {2, 3}}}
	if err := even.Uniform("all-reduce"); err != nil {
		t.Errorf("2 x 2: %v", err)
	}
	uneven := &Topology{Rank: 2, NodeOf: []int{0, 0, 1}, Nodes: [][]int{{0, 1}, {2}}}
	err := uneven.Uniform("all-reduce")
	if status.CodeOf(err) != status.Unsupported || !strings.Contains(err.Error(), "all-reduce across nodes") {
		t.Errorf("2 + 1: got %v, want Unsupported naming the all-reduce", err)
	}
}
