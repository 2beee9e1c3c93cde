package hostcoll

import (
	"fmt"
	"runtime"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/p2pcomm/p2pcomm/golib/shm"
)

// Waits of an all-reduce across nodes: every one progresses UCX, hears of
// failures elsewhere, and is bounded by P2PCOMM_TIMEOUT_MS.

// Polls of a wait that spin, then yield, before the wait naps. On a host
// with more ranks than cores a wait naps almost at once: a poll that keeps
// its core keeps the awaited rank off it for a scheduler slice
// (docs/BENCHMARKS.md).
const (
	spinPolls, yieldPolls               = 512, 4096
	crowdedSpinPolls, crowdedYieldPolls = 8, 8
)

// backoff paces the i-th poll of a wait: spin, then yield, then sleep, so
// that more ranks than cores still make progress. Raw system calls: the
// thread belongs to the caller (Python), and Go's scheduler must not hand
// it off mid-wait, which costs milliseconds.
func (c *Comm) backoff(i int) {
	spin, yield := spinPolls, yieldPolls
	if c.crowded {
		spin, yield = crowdedSpinPolls, crowdedYieldPolls
	}
	switch {
	case i < spin:
	case i < yield:
		if c.opts.Cooperative {
			runtime.Gosched()
		} else {
			unix.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
		}
	default:
		if c.opts.Cooperative {
			time.Sleep(20 * time.Microsecond)
		} else {
			nap := unix.Timespec{Nsec: 20_000}
			unix.RawSyscall(unix.SYS_NANOSLEEP, uintptr(unsafe.Pointer(&nap)), 0, 0)
		}
	}
}

// Pace is backoff for waits of other packages on this communicator's
// peers (MoE across nodes): the i-th poll spins, yields or naps as this
// backend's own waits do.
func (c *Comm) Pace(i int) { c.backoff(i) }

// await polls ready until it holds, on behalf of a wait for rank peer (a
// local peer or a rank of this rank's group) described by what ("its
// header of call #3"). It fails when any rank reports a failure, when peer
// is gone, or after the timeout.
func (c *Comm) await(peer int, what string, ready func() bool) error {
	start := time.Now()
	for i := 0; !ready(); i++ {
		c.progress()
		c.backoff(i)
		if i%64 != 63 {
			continue
		}
		if rec, ok := c.finalRecord(); ok {
			return c.adopt(rec)
		}
		if err := c.peerGone(peer); err != "" {
			return c.netFailure(peer, fmt.Sprintf("%s before %s", err, what), true)
		}
		if time.Since(start) > c.opts.Timeout {
			return c.netFailure(peer, fmt.Sprintf("never arrived at %s within %v (P2PCOMM_TIMEOUT_MS)", what, c.opts.Timeout), false)
		}
	}
	return nil
}

// peerGone says how rank peer is known to have failed, or "".
func (c *Comm) peerGone(peer int) string {
	if c.topo.SameNode(peer) {
		if pid := int(c.ctl[peer].load(offPid)); pid != 0 && !shm.Alive(pid) {
			return fmt.Sprintf("exited (pid %d)", pid)
		}
		return ""
	}
	if err := c.net.t.PeerError(peer); err != nil {
		return fmt.Sprintf("failed (%v)", err)
	}
	return ""
}
