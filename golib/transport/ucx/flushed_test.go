package ucx

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
)

// SignalFlushed orders data before the signal without waiting on other
// peers: rank 0 streams rounds of random pieces to rank 1, each followed by
// a SignalFlushed, while a put of its toward rank 2 stays unacknowledged
// (rank 2 does not progress until the stream is over). Rank 1 checks every
// byte once each signal arrived.
func TestSignalFlushedOrdersAndWaitsForNoOtherPeer(t *testing.T) {
	needUCX(t)
	expectOK(t, runJob(t, "flushed", 3, 60*time.Second))
}

func childFlushed(tr *Transport, bs bootstrap.Bootstrap, timeout time.Duration) error {
	j := newJob(tr, bs, timeout)
	if err := j.connect(); err != nil {
		return err
	}
	const rounds = 20
	switch j.rank {
	case 0:
		if err := tr.Put(j.rdst[2], 0, j.lsrc, 0, slotSize); err != nil {
			return err
		}
		for round := range rounds {
			if round > 0 {
				if err := j.await(ackWord(1), uint64(round), fmt.Sprintf("ack of round %d", round-1)); err != nil {
					return err
				}
			}
			fillSource(j.src, 0, round)
			for _, pc := range pieces(0, 1, round) {
				if err := tr.Put(j.rdst[1], uint64(pc.dstOff), j.lsrc, uint64(pc.srcOff), uint64(pc.len)); err != nil {
					return err
				}
			}
			if err := tr.SignalFlushed(j.rword[1], signalWord(0), 1); err != nil {
				return err
			}
		}
		// A signal that waited for rank 2 would never have gone out: rank 2
		// does not progress before the barrier below, and these waits are
		// bounded.
		if err := j.await(ackWord(1), rounds, "last ack"); err != nil {
			return err
		}
	case 1:
		model, other := make([]byte, slotSize), make([]byte, slotSize)
		for round := range rounds {
			if err := j.await(signalWord(0), uint64(round+1), fmt.Sprintf("signal of round %d", round)); err != nil {
				return err
			}
			fillSource(other, 0, round)
			for _, pc := range pieces(0, 1, round) {
				copy(model[pc.dstOff:pc.dstOff+pc.len], other[pc.srcOff:pc.srcOff+pc.len])
			}
			if got := j.dst[:slotSize]; !bytes.Equal(got, model) {
				i := 0
				for got[i] == model[i] {
					i++
				}
				return fmt.Errorf("round %d: byte %d is %#x at the signal, want %#x", round, i, got[i], model[i])
			}
			if err := tr.SignalFlushed(j.rword[0], ackWord(1), 1); err != nil {
				return err
			}
		}
		if err := tr.Drain(0, timeout); err != nil {
			return err
		}
	}
	// Rank 2 waits here without progressing until the stream is over.
	if j.rank == 2 {
		if err := bs.Barrier(); err != nil {
			return err
		}
	} else if err := tr.progressWhile(bs.Barrier); err != nil {
		return err
	}
	for p := range j.size {
		if err := tr.Flush(p); err != nil {
			return err
		}
	}
	return tr.progressWhile(bs.Barrier)
}
