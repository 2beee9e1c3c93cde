// Package topo groups the ranks of a communicator into nodes: the ranks that
// may reach each other's memory directly (CUDA IPC, shared memory). Peers in
// another node are reached only through the network (a PortChannel over UCX).
package topo

import (
	"bytes"
	"fmt"
	"os"
	"strings"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// LocalSizeEnv splits each host into nodes of that many consecutive ranks.
const LocalSizeEnv = "P2PCOMM_LOCAL_SIZE"

// Topology says which node each rank belongs to. Nodes are numbered in the
// order of their lowest rank; every rank computes the same Topology.
type Topology struct {
	Rank   int     // this rank
	NodeOf []int   // NodeOf[r]: the node of rank r
	Nodes  [][]int // Nodes[n]: the ranks of node n, ascending
	// SharedHosts: some nodes share a host (LocalSizeEnv split it), so
	// anything between nodes must avoid what works only within a host.
	SharedHosts bool
	// HostRanks is how many ranks run on this rank's host, in any node.
	HostRanks int
}

// Single returns the topology of size ranks that all share one node.
func Single(rank, size int) *Topology {
	t := &Topology{Rank: rank, NodeOf: make([]int, size), Nodes: [][]int{make([]int, size)}, HostRanks: size}
	for r := range size {
		t.Nodes[0][r] = r
	}
	return t
}

// OneHost reports whether every rank runs on this rank's host.
func (t *Topology) OneHost() bool { return t.HostRanks == len(t.NodeOf) }

// Node is this rank's node.
func (t *Topology) Node() int { return t.NodeOf[t.Rank] }

// Local returns the ranks of this rank's node, ascending (this rank included).
func (t *Topology) Local() []int { return t.Nodes[t.Node()] }

// LocalRank is this rank's index among the ranks of its node.
func (t *Topology) LocalRank() int {
	for i, r := range t.Local() {
		if r == t.Rank {
			return i
		}
	}
	return -1
}

// SameNode reports whether rank r shares this rank's node.
func (t *Topology) SameNode(r int) bool {
	return r >= 0 && r < len(t.NodeOf) && t.NodeOf[r] == t.Node()
}

// Uniform returns nil when every node has as many ranks as the others: what
// a collective across nodes that pairs the ranks of each local index needs
// (they form groups of one rank per node); else an Unsupported error saying
// what needs it. Every rank knows the topology, so every rank fails alike.
func (t *Topology) Uniform(what string) error {
	for _, ranks := range t.Nodes {
		if len(ranks) != len(t.Nodes[0]) {
			return status.Errorf(status.Unsupported,
				"%s across nodes needs the same number of ranks on every node (it pairs the ranks of each local index across nodes); this communicator spans %s",
				what, t)
		}
	}
	return nil
}

// MultiNode reports whether the ranks span more than one node.
func (t *Topology) MultiNode() bool { return len(t.Nodes) > 1 }

// String lists the nodes: "2 nodes (node 0: ranks 0-1, node 1: ranks 2-3)".
func (t *Topology) String() string {
	parts := make([]string, len(t.Nodes))
	for n, ranks := range t.Nodes {
		parts[n] = fmt.Sprintf("node %d: %s", n, rankList(ranks))
	}
	noun := "nodes"
	if len(t.Nodes) == 1 {
		noun = "node"
	}
	return fmt.Sprintf("%d %s (%s)", len(t.Nodes), noun, strings.Join(parts, ", "))
}

// rankList writes ascending ranks compactly: "ranks 0-3", "ranks 0, 2", "rank 5".
func rankList(ranks []int) string {
	var parts []string
	for i := 0; i < len(ranks); {
		j := i
		for j+1 < len(ranks) && ranks[j+1] == ranks[j]+1 {
			j++
		}
		switch {
		case j == i:
			parts = append(parts, fmt.Sprint(ranks[i]))
		default:
			parts = append(parts, fmt.Sprintf("%d-%d", ranks[i], ranks[j]))
		}
		i = j + 1
	}
	if len(ranks) == 1 {
		return "rank " + parts[0]
	}
	return "ranks " + strings.Join(parts, ", ")
}

// HostKey identifies this host: its name and the kernel's boot id, so two
// machines that happen to share a hostname (containers, clones) still differ.
// A missing boot id leaves the hostname alone.
func HostKey() []byte {
	name, err := os.Hostname()
	if err != nil {
		name = "?"
	}
	boot, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	return []byte(name + "\x00" + strings.TrimSpace(string(boot)))
}

// hostName is the readable part of a host key.
func hostName(key []byte) string {
	if i := bytes.IndexByte(key, 0); i >= 0 {
		return string(key[:i])
	}
	return string(key)
}

// Build groups ranks by their host keys (keys[r] is rank r's). With
// localSize 0 a node is a host. With localSize n > 0 the ranks form nodes of
// n consecutive ranks (the last may be smaller), each of which must lie on
// one host: otherwise status.InvalidArgument names the ranks.
func Build(rank int, keys [][]byte, localSize int) (*Topology, error) {
	size := len(keys)
	if rank < 0 || rank >= size {
		return nil, status.Errorf(status.InvalidArgument, "rank %d out of range [0, %d)", rank, size)
	}
	t := &Topology{Rank: rank, NodeOf: make([]int, size)}
	for _, k := range keys {
		if bytes.Equal(k, keys[rank]) {
			t.HostRanks++
		}
	}
	if localSize < 0 {
		return nil, status.Errorf(status.InvalidArgument, "%s=%d: want a positive integer", LocalSizeEnv, localSize)
	}
	if localSize > 0 {
		for r := range size {
			n := r / localSize
			if n == len(t.Nodes) {
				t.Nodes = append(t.Nodes, nil)
			}
			first := t.Nodes[n]
			if len(first) > 0 && !bytes.Equal(keys[first[0]], keys[r]) {
				return nil, status.Errorf(status.InvalidArgument,
					"%s=%d puts ranks %d and %d in node %d, but they run on different hosts (%s, %s): a node must lie on one host",
					LocalSizeEnv, localSize, first[0], r, n, hostName(keys[first[0]]), hostName(keys[r]))
			}
			t.NodeOf[r] = n
			t.Nodes[n] = append(t.Nodes[n], r)
		}
		hosts := map[string]bool{}
		for _, node := range t.Nodes {
			key := string(keys[node[0]])
			t.SharedHosts = t.SharedHosts || hosts[key]
			hosts[key] = true
		}
		return t, nil
	}
	index := map[string]int{}
	for r, k := range keys {
		n, ok := index[string(k)]
		if !ok {
			n = len(t.Nodes)
			index[string(k)] = n
			t.Nodes = append(t.Nodes, nil)
		}
		t.NodeOf[r] = n
		t.Nodes[n] = append(t.Nodes[n], r)
	}
	return t, nil
}

// Discover all-gathers every rank's host key through bs and builds the
// Topology (see Build). Collective; every rank gets the same answer or the
// same error.
func Discover(bs bootstrap.Bootstrap, key []byte, localSize int) (*Topology, error) {
	keys, err := bs.AllGather(key)
	if err != nil {
		return nil, fmt.Errorf("exchange host names: %w", err)
	}
	return Build(bs.Rank(), keys, localSize)
}
