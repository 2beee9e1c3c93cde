package comm

import (
	"reflect"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport/ucx"
)

// fakeHosts makes each rank's host key its config's TEST_HOST for the test.
func fakeHosts(t *testing.T) {
	old := hostKey
	hostKey = func(cfg Config) []byte { return []byte(cfg.Env["TEST_HOST"]) }
	t.Cleanup(func() { hostKey = old })
}

// each runs f on every rank at once and returns what each returned.
func each(comms []*Comm, f func(r int, c *Comm) error) []error {
	errs := make([]error, len(comms))
	var wg sync.WaitGroup
	for r, c := range comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = f(r, c)
		}()
	}
	wg.Wait()
	return errs
}

func TestTopologyOfOneHostIsOneNode(t *testing.T) {
	comms := newRanks(t, 3)
	for r, c := range comms {
		top := c.Topology()
		if top.MultiNode() || top.LocalRank() != r || !reflect.DeepEqual(top.Nodes, [][]int{{0, 1, 2}}) {
			t.Errorf("rank %d: topology %v, local rank %d; want one node of ranks 0-2", r, top, top.LocalRank())
		}
	}
}

// P2PCOMM_LOCAL_SIZE=1 makes every rank its own node: construction, symmetric
// allocation, barriers and all-reduce (through UCX; without it Unsupported,
// saying how to get it) work; peer addresses of another node are
// Unsupported on every rank.
func TestSimulatedNodes(t *testing.T) {
	const size = 3
	comms, errs := tryRanks(size, func(int) map[string]string { return map[string]string{"P2PCOMM_LOCAL_SIZE": "1"} })
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: New: %v", r, err)
		}
	}
	t.Cleanup(func() {
		for _, c := range comms {
			c.Close()
		}
	})
	for r, c := range comms {
		if top := c.Topology(); !reflect.DeepEqual(top.NodeOf, []int{0, 1, 2}) || top.LocalRank() != 0 {
			t.Errorf("rank %d: topology %v", r, top)
		}
	}
	errs = each(comms, func(r int, c *Comm) error {
		var p uintptr
		if err := c.Do(func(b collective.Backend) (err error) { p, err = b.Alloc(4096); return err }); err != nil {
			return err
		}
		if err := c.Barrier(); err != nil {
			return err
		}
		x := unsafe.Slice((*float32)(*(*unsafe.Pointer)(unsafe.Pointer(&p))), 4) // p is shared memory, not Go's
		for i := range x {
			x[i] = float32(r + i)
		}
		err := c.Do(func(b collective.Backend) error {
			return b.AllReduce(collective.AllReduce{Src: p, Dst: p, Count: 4, DType: reduce.Float32, Op: reduce.Sum})
		})
		switch {
		case ucx.Available(nil) != nil:
			if status.CodeOf(err) != status.Unsupported || !strings.Contains(err.Error(), "libucx") {
				t.Errorf("rank %d: all-reduce across nodes without UCX: %v, want Unsupported saying how to get it", r, err)
			}
		case err != nil:
			t.Errorf("rank %d: all-reduce across nodes: %v", r, err)
		case x[0] != 3 || x[3] != 12:
			t.Errorf("rank %d: all-reduce across nodes gave %v, want [3 6 9 12]", r, x)
		}
		err = c.Do(func(b collective.Backend) error {
			_, err := b.(collective.PeerMemory).PeerAddress(p, 4096, (r+1)%size)
			return err
		})
		if status.CodeOf(err) != status.Unsupported {
			t.Errorf("rank %d: peer address of another node: %v, want Unsupported", r, err)
		}
		return c.Barrier()
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// A node must lie on one host: P2PCOMM_LOCAL_SIZE=2 over ranks on hosts
// a, a, b, b is fine; =3 puts ranks 0 and 2 together and fails everywhere.
func TestLocalSizeAcrossHosts(t *testing.T) {
	fakeHosts(t)
	hosts := []string{"a", "a", "b", "b"}
	for _, c := range []struct {
		localSize string
		nodeOf    []int
	}{{"", []int{0, 0, 1, 1}}, {"2", []int{0, 0, 1, 1}}, {"1", []int{0, 1, 2, 3}}, {"3", nil}} {
		comms, errs := tryRanks(len(hosts), func(r int) map[string]string {
			env := map[string]string{"TEST_HOST": hosts[r]}
			if c.localSize != "" {
				env["P2PCOMM_LOCAL_SIZE"] = c.localSize
			}
			return env
		})
		for r, err := range errs {
			switch {
			case c.nodeOf == nil && (status.CodeOf(err) != status.InvalidArgument || !strings.Contains(err.Error(), "ranks 0 and 2")):
				t.Errorf("P2PCOMM_LOCAL_SIZE=%s, rank %d: %v, want InvalidArgument naming ranks 0 and 2", c.localSize, r, err)
			case c.nodeOf != nil && err != nil:
				t.Errorf("P2PCOMM_LOCAL_SIZE=%s, rank %d: %v", c.localSize, r, err)
			case c.nodeOf != nil && !reflect.DeepEqual(comms[r].Topology().NodeOf, c.nodeOf):
				t.Errorf("P2PCOMM_LOCAL_SIZE=%s, rank %d: nodes %v, want %v", c.localSize, r, comms[r].Topology().NodeOf, c.nodeOf)
			}
			if comms[r] != nil {
				comms[r].Close()
			}
		}
	}
}
