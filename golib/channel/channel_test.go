package channel_test

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap/bootstraptest"
	"github.com/p2pcomm/p2pcomm/golib/channel"
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/comm"
	"github.com/p2pcomm/p2pcomm/golib/proxy"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport/ucx/ucxtest"
)

// The test binary re-executes itself as every rank of a job; roleEnv says
// what a rank does.
const (
	roleEnv   = "P2PCOMM_TEST_CHANNEL_ROLE"
	timeoutMS = 5000
	slot      = 256 << 10 // bytes each sender owns in a receiver's range
)

func TestMain(m *testing.M) {
	if role := os.Getenv(roleEnv); role != "" {
		os.Exit(child(role))
	}
	os.Exit(m.Run())
}

// runJob starts size ranks in role and waits for all, killing them after
// limit.
func runJob(t *testing.T, role string, size int, limit time.Duration, env ...string) []bootstraptest.Rank {
	t.Helper()
	env = append([]string{"P2PCOMM_TIMEOUT_MS=" + strconv.Itoa(timeoutMS)}, env...)
	return bootstraptest.RunJob(t, roleEnv, role, size, limit, env...)
}

func expectOK(t *testing.T, results []bootstraptest.Rank, skip ...int) {
	t.Helper()
	bootstraptest.ExpectDone(t, results, skip...)
}

// Every rank its own node, so every peer is reached over UCX: random pieces
// of random data put into every peer, each byte checked after signal/wait.
func TestPortChannelsAcrossNodes(t *testing.T) {
	ucxtest.Need(t)
	for _, size := range []int{2, 3} {
		t.Run(fmt.Sprintf("nodes%d", size), func(t *testing.T) {
			expectOK(t, runJob(t, "exchange", size, 60*time.Second, "P2PCOMM_LOCAL_SIZE=1"))
		})
	}
}

// Without the knob the ranks of one host form one node; with it, nodes of
// P2PCOMM_LOCAL_SIZE consecutive ranks.
func TestTopologyAcrossProcesses(t *testing.T) {
	for _, c := range []struct {
		knob, want string
	}{{"", "[0 0 0]"}, {"2", "[0 0 1]"}, {"1", "[0 1 2]"}} {
		t.Run("local size "+c.knob, func(t *testing.T) {
			env := []string{"P2PCOMM_TEST_WANT_NODES=" + c.want}
			if c.knob != "" {
				env = append(env, "P2PCOMM_LOCAL_SIZE="+c.knob)
			}
			expectOK(t, runJob(t, "topology", 3, 30*time.Second, env...))
		})
	}
}

// Bad input fails on every rank with a specific error, and the ranks stay
// in step: a good call afterwards works.
func TestPortChannelsBadInput(t *testing.T) {
	ucxtest.Need(t)
	expectOK(t, runJob(t, "invalid", 3, 60*time.Second, "P2PCOMM_LOCAL_SIZE=1"))
}

// A rank killed in the middle of its puts: the others get status.Timeout
// naming it within the timeout.
func TestPortChannelsPeerKilled(t *testing.T) {
	ucxtest.Need(t)
	expectOK(t, runJob(t, "kill", 3, 60*time.Second, "P2PCOMM_LOCAL_SIZE=1"), 2)
}

// ---- the ranks ----

func child(role string) int {
	env := map[string]string{}
	for _, kv := range os.Environ() {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	c, err := comm.New(comm.Config{Bootstrap: "tcp", Device: -1, Env: env}, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, "comm:", err)
		return 1
	}
	defer c.Close()
	r := &rank{c: c, me: c.Rank(), size: c.Size()}
	switch role {
	case "exchange":
		err = r.exchange(4)
	case "topology":
		err = r.topology(env["P2PCOMM_TEST_WANT_NODES"])
	case "invalid":
		err = r.invalid()
	case "kill":
		err = r.kill(2)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "rank %d: %v\n", r.me, err)
		return 1
	}
	if err := c.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "close:", err)
		return 1
	}
	fmt.Println("DONE")
	return 0
}

type rank struct {
	c        *comm.Comm
	me, size int
}

// hostBytes views n bytes at a host address that came from the backend.
func hostBytes(p uintptr, n int) []byte {
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&p))), n)
}

func (r *rank) alloc(n int64) (uintptr, error) {
	var p uintptr
	err := r.c.Do(func(b collective.Backend) (err error) { p, err = b.Alloc(n); return err })
	return p, err
}

func (r *rank) ports(p uintptr, n uint64) (uint64, []proxy.PortChannel, error) {
	var id uint64
	var chans []proxy.PortChannel
	err := r.c.WithChannels(func(ch *channel.Channels) (err error) { id, chans, err = ch.PortChannels(p, n); return err })
	return id, chans, err
}

func (r *rank) ch(f func(*channel.Channels) error) error { return r.c.WithChannels(f) }

// portOps are the host-side calls on one set, each taking the
// communicator's lock on its own (a barrier in between needs it too).
type portOps struct {
	r  *rank
	id uint64
}

func (o portOps) put(q int, dst, src, n uint64) error {
	return o.r.ch(func(ch *channel.Channels) error { return ch.Put(o.id, q, dst, src, n) })
}
func (o portOps) signal(q int) error {
	return o.r.ch(func(ch *channel.Channels) error { return ch.Signal(o.id, q) })
}
func (o portOps) flush(q int) error {
	return o.r.ch(func(ch *channel.Channels) error { return ch.Flush(o.id, q) })
}
func (o portOps) wait(q int, count uint64) error {
	return o.r.ch(func(ch *channel.Channels) error { return ch.Wait(o.id, q, count) })
}

// piece is one put: n bytes from srcOff of the sender's source area to
// dstOff of its slot at the receiver.
type piece struct{ srcOff, dstOff, n int }

func pieces(sender, receiver, round int) []piece {
	rng := rand.New(rand.NewPCG(uint64(sender)<<32|uint64(receiver), uint64(round)))
	var out []piece
	for off := rng.IntN(512); off < slot; {
		n := min(1+rng.IntN(1<<uint(1+rng.IntN(15))), slot-off)
		if rng.IntN(3) > 0 {
			out = append(out, piece{srcOff: rng.IntN(slot - n + 1), dstOff: off, n: n})
		}
		off += n + rng.IntN(64)
	}
	return out
}

func fill(b []byte, sender, round int) {
	rng := rand.New(rand.NewPCG(uint64(sender), uint64(round)+1000))
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
}

// exchange: the range holds one slot per sender, then this rank's source
// area. Each round every rank puts random pieces into its slot at every
// peer, signals, flushes, waits for every peer's signal and checks its
// slots against a model.
func (r *rank) exchange(rounds int) error {
	n := uint64((r.size + 1) * slot)
	p, err := r.alloc(int64(n))
	if err != nil {
		return err
	}
	id, chans, err := r.ports(p, n)
	if err != nil {
		return err
	}
	if chans[r.me] != (proxy.PortChannel{}) {
		return fmt.Errorf("the entry for this rank is %+v, want zero", chans[r.me])
	}
	for q, h := range chans {
		if q != r.me && (h.Peer != int32(q) || h.Rank != int32(r.me) || h.Sem == 0 || h.FIFO.Ring == 0) {
			return fmt.Errorf("entry %d is %+v", q, h)
		}
	}
	mem := hostBytes(p, int(n))
	src := mem[r.size*slot:]
	models := make([][]byte, r.size)
	for s := range models {
		models[s] = make([]byte, slot)
	}
	other := make([]byte, slot)
	ch := portOps{r, id}
	{
		for round := range rounds {
			fill(src, r.me, round)
			for q := range r.size {
				if q == r.me {
					continue
				}
				for _, pc := range pieces(r.me, q, round) {
					if err := ch.put(q, uint64(r.me*slot+pc.dstOff), uint64(r.size*slot+pc.srcOff), uint64(pc.n)); err != nil {
						return err
					}
				}
				if err := ch.signal(q); err != nil {
					return err
				}
			}
			for q := range r.size {
				if q != r.me {
					if err := ch.flush(q); err != nil {
						return err
					}
				}
			}
			for s := range r.size {
				if s == r.me {
					continue
				}
				if err := ch.wait(s, uint64(round+1)); err != nil {
					return err
				}
				fill(other, s, round)
				for _, pc := range pieces(s, r.me, round) {
					copy(models[s][pc.dstOff:pc.dstOff+pc.n], other[pc.srcOff:pc.srcOff+pc.n])
				}
				if got := mem[s*slot : (s+1)*slot]; !bytes.Equal(got, models[s]) {
					i := 0
					for got[i] == models[s][i] {
						i++
					}
					return fmt.Errorf("round %d: slot of rank %d differs first at byte %d: got %#x, want %#x", round, s, i, got[i], models[s][i])
				}
			}
			// Nobody puts the next round into a slot still being checked.
			if err := r.c.Barrier(); err != nil {
				return err
			}
		}
		fmt.Printf("%d rounds with %d peers checked\n", rounds, r.size-1)
		return nil
	}
}

func (r *rank) topology(want string) error {
	top := r.c.Topology()
	if got := fmt.Sprint(top.NodeOf); got != want {
		return fmt.Errorf("nodes %s, want %s", got, want)
	}
	if top.Local()[top.LocalRank()] != r.me {
		return fmt.Errorf("local rank %d of %v", top.LocalRank(), top.Local())
	}
	return nil
}

func expect(err error, code status.Code, what, contains string) error {
	if status.CodeOf(err) != code || !strings.Contains(err.Error(), contains) {
		return fmt.Errorf("%s: got %v (%v), want %v containing %q", what, err, status.CodeOf(err), code, contains)
	}
	return nil
}

func (r *rank) invalid() error {
	const n = 64 << 10
	p, err := r.alloc(2 * n)
	if err != nil {
		return err
	}
	_, _, err = r.ports(p, n+uint64(r.me%2)*4096)
	if err := expect(err, status.Mismatch, "sizes that differ", "rank 1 passed 69632 bytes, rank 0 passed 65536"); err != nil {
		return err
	}
	stray := make([]byte, n) // not registered
	q := p
	if r.me == 1 {
		q = uintptr(unsafe.Pointer(&stray[0]))
	}
	_, _, err = r.ports(q, n)
	if err := expect(err, status.InvalidArgument, "an unregistered range", "neither from comm.empty() nor registered"); err != nil {
		return err
	}
	err = r.ch(func(ch *channel.Channels) error { _, _, err := ch.MemoryChannels(p, n); return err })
	if err := expect(err, status.Unsupported, "memory channels on the CPU backend", "GPU backend"); err != nil {
		return err
	}
	err = r.ch(func(ch *channel.Channels) error { _, _, err := ch.HostPortChannels(nil, 1); return err })
	if err := expect(err, status.Unsupported, "host port channels on the CPU backend", "GPU communicators"); err != nil {
		return err
	}
	id, _, err := r.ports(p, n)
	if err != nil {
		return fmt.Errorf("a good call after bad ones: %w", err)
	}
	return r.ch(func(ch *channel.Channels) error {
		if err := expect(ch.Put(id, r.me, 0, 0, 8), status.InvalidArgument, "a put to oneself", "not a peer"); err != nil {
			return err
		}
		if err := expect(ch.Put(id, (r.me+1)%r.size, n-4, 0, 8), status.InvalidArgument, "a put past the end", "past the end"); err != nil {
			return err
		}
		return expect(ch.Wait(id+1, 0, 1), status.InvalidArgument, "a set that does not exist", "does not exist")
	})
}

// namesRank matches the transport's or the wait's words for rank 2, not the
// call's own prefix ("port flush from rank 0 to rank 2").
var namesRank = regexp.MustCompile(`rank 2 (failed|did not complete)|\(peer 2\)|for rank 2: \d+ signals arrived`)

// kill: rank victim puts to every peer and exits without a flush; the
// others put to it, then flush and wait for its signal. Survivors put only
// to the victim, so that one finishing first and closing does not fail
// the other's puts.
func (r *rank) kill(victim int) error {
	const n = 4 << 20
	p, err := r.alloc(n)
	if err != nil {
		return err
	}
	id, _, err := r.ports(p, n)
	if err != nil {
		return err
	}
	if err := r.c.Barrier(); err != nil {
		return err
	}
	ch := portOps{r, id}
	{
		for q := range r.size {
			if q == r.me || (r.me != victim && q != victim) {
				continue
			}
			for i := range 8 {
				if err := ch.put(q, uint64(i)*(n/8), uint64(i)*(n/8), n/8); err != nil {
					return err
				}
			}
		}
		if r.me == victim {
			os.Exit(3)
		}
		start := time.Now()
		err := ch.flush(victim)
		if err == nil {
			err = ch.wait(victim, 1)
		}
		took := time.Since(start)
		if status.CodeOf(err) != status.Timeout || !namesRank.MatchString(err.Error()) {
			return fmt.Errorf("after rank %d died: %v (%v), want a timeout naming it", victim, err, status.CodeOf(err))
		}
		if limit := timeoutMS*time.Millisecond + 2*time.Second; took > limit {
			return fmt.Errorf("the error took %v, more than %v", took, limit)
		}
		fmt.Printf("after %v: %v\n", took, err)
		return nil
	}
}
