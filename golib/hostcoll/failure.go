package hostcoll

import (
	"fmt"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// Failures of an all-reduce across nodes: a rank whose wait fails says why,
// and whom it blames, where every rank that may wait for it looks.

// record says why a rank gave up on a call and whom it blames. A rank
// publishes one where its local peers (shared memory) and its group (UCX)
// look while they wait, so that a failure reaches every rank and each names
// the rank that caused it, not merely the peer it was waiting for.
type record struct {
	Culprit  int32
	Final    int32 // 0: the reporter timed out and is still asking whom it waited for
	Reporter int32
	_        int32
	Text     [recordBytes - 16]byte
}

var _ [recordBytes - unsafe.Sizeof(record{})]byte
var _ [unsafe.Sizeof(record{}) - recordBytes]byte

func (r *record) text() string {
	b := r.Text[:]
	for i, c := range b {
		if c == 0 {
			b = b[:i]
			break
		}
	}
	return string(b)
}

// sources are the ranks whose failure records this rank reads: its local
// peers (shared memory) and its group (UCX).
func (c *Comm) sources() []int {
	var out []int
	for _, r := range c.topo.Local() {
		if r != c.rank {
			out = append(out, r)
		}
	}
	for m, r := range c.net.group {
		if m != c.net.node {
			out = append(out, r)
		}
	}
	return out
}

// readRecord returns rank r's latest failure record, if it published one.
func (c *Comm) readRecord(r int) (record, bool) {
	var ver uint64
	var slot unsafe.Pointer
	if c.topo.SameNode(r) {
		v := c.ctl[r]
		if ver = v.load(offAbortVer); ver != 0 {
			slot = unsafe.Add(v.base, offAbortRec+int(ver&1)*recordBytes)
		}
	} else if ver = c.net.load(r, wordRecord); ver != 0 {
		slot = c.net.at(c.net.lay.record(ver, c.size, r))
	}
	if ver == 0 {
		return record{}, false
	}
	return *(*record)(slot), true
}

// finalRecord returns a settled failure record of any source that blames
// another rank than this one.
func (c *Comm) finalRecord() (record, bool) {
	for _, r := range c.sources() {
		if rec, ok := c.readRecord(r); ok && rec.Final != 0 && int(rec.Culprit) != c.rank {
			return rec, true
		}
	}
	return record{}, false
}

// publish makes rec this rank's failure record: in its control block for
// its local peers, and put into its group's regions.
func (c *Comm) publish(rec record) {
	n := c.net
	n.version++
	ver := n.version
	v := c.ctl[c.rank]
	*(*record)(unsafe.Add(v.base, offAbortRec+int(ver&1)*recordBytes)) = rec
	v.store(offAbortVer, ver)
	off := n.lay.record(ver, c.size, c.rank) // this rank's own slot is its outbox
	*(*record)(n.at(off)) = rec
	for m := range n.group {
		if m == n.node || n.t.PeerError(n.group[m]) != nil {
			continue
		}
		if n.t.Put(n.regionR[m], off, n.regionL, off, recordBytes) == nil {
			n.t.SignalFlushed(n.regionR[m], n.lay.word(c.rank, wordRecord), 1)
		}
	}
	for m := range n.group {
		if m != n.node {
			n.t.Drain(n.group[m], 100*time.Millisecond) // a peer that takes nothing is failing anyway
		}
	}
}

// netFailure ends this rank's part in the call after its wait for rank
// peer failed (why completes "rank 3 (node 1) ..."). When sure, peer is the
// culprit. Otherwise (a timeout) peer may itself be waiting for another
// rank: this rank publishes a tentative record, then listens a little
// while for peer's record and blames whom peer blames. It publishes its
// final record and breaks the communicator.
func (c *Comm) netFailure(peer int, why string, sure bool) error {
	rec := record{Culprit: int32(peer), Reporter: int32(c.rank)}
	copy(rec.Text[:len(rec.Text)-1], fmt.Sprintf("rank %d (node %d) %s; seen by rank %d", peer, c.topo.NodeOf[peer], why, c.rank))
	if !sure {
		rec = c.resolve(peer, rec)
	}
	rec.Final = 1
	c.publish(rec)
	return c.fail(status.Errorf(status.Timeout, "all-reduce across nodes: %s", rec.text()))
}

// protocolFailure ends the communicator over something peer sent that this
// rank cannot follow (a bug, or a peer of another build): a final record
// tells every rank at once, instead of their waits running out.
func (c *Comm) protocolFailure(peer int, why string) error {
	rec := record{Culprit: int32(peer), Reporter: int32(c.rank), Final: 1}
	copy(rec.Text[:len(rec.Text)-1], fmt.Sprintf("rank %d (node %d) %s; seen by rank %d", peer, c.topo.NodeOf[peer], why, c.rank))
	c.publish(rec)
	return c.fail(status.Errorf(status.Internal, "all-reduce across nodes: %s", rec.text()))
}

// resolve publishes rec as tentative and follows the chain of blame from
// peer for up to collective.BlameWait.
func (c *Comm) resolve(peer int, rec record) record {
	c.publish(rec)
	deadline := time.Now().Add(c.net.blameWait)
	for i := 0; time.Now().Before(deadline); i++ {
		c.progress()
		c.backoff(4096 + i)
		if got, ok := c.finalRecord(); ok {
			return got
		}
		if got, ok := c.readRecord(peer); ok && int(got.Culprit) != c.rank {
			rec.Culprit, rec.Reporter, rec.Text = got.Culprit, got.Reporter, got.Text
			if got.Final != 0 {
				break
			}
		}
	}
	return rec
}

// adopt takes another rank's settled failure as this rank's own and passes
// it on.
func (c *Comm) adopt(rec record) error {
	rec.Final = 1
	c.publish(rec)
	return c.fail(status.Errorf(status.Timeout, "all-reduce across nodes: %s", rec.text()))
}
