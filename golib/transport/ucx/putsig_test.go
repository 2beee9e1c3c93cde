package ucx

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
)

// TestPutWithSignal: puts with signals into host memory over a single tcp
// lane go as one active message each, and land whole before their signal:
// alone, behind a plain put (which the message must not pass), followed by
// a plain signal (which must not pass the message), and past the size one
// message takes (two messages then); random sizes and bytes, every byte
// checked, the ranks taking turns. A UCP that cannot name an endpoint's
// lanes (1.13) sends two messages, with the same results.
func TestPutWithSignal(t *testing.T) {
	needUCX(t)
	expectOK(t, runJob(t, "putsig", 2, 60*time.Second))
}

func childPutSignal(tr *Transport, bs bootstrap.Bootstrap, timeout time.Duration) error {
	j := newJob(tr, bs, timeout)
	if err := j.connect(); err != nil {
		return err
	}
	me, peer := j.rank, 1-j.rank
	// Where UCP names the endpoint's transports (1.22 does, 1.13 does not),
	// the single tcp lane must take the one-message way; else the two
	// messages must give the same results.
	oneMessage := tr.laneNames(peer) != nil
	if oneMessage && !tr.peers[peer].putsig {
		return fmt.Errorf("rank %d: puts with signals to rank %d do not go as one message (lanes %v)", me, peer, tr.laneNames(peer))
	}
	rng := rand.New(rand.NewPCG(7, 3)) // both ranks draw the same cases, sizes and bytes
	fill := func(b []byte) {
		for k := range b {
			b[k] = byte(rng.Uint32())
		}
	}
	const half = slotSize / 2
	total := uint64(0) // signals the sender of round i has sent so far, by rank
	totals := [2]uint64{}
	var sent uint64
	for i := 0; i < 240; i++ {
		sender := i % 2
		kind := (i / 2) % 4
		n := 1 + rng.IntN(putSigMax)
		if kind == 3 {
			n = putSigMax + 1 + rng.IntN(putSigMax)
		}
		off := uint64(rng.IntN(half - n))
		data := make([]byte, n)
		fill(data)
		var plain []byte
		plainOff := uint64(half + rng.IntN(half-4096))
		if kind == 1 {
			plain = make([]byte, 1+rng.IntN(4096))
			fill(plain)
		}
		signals := uint64(1)
		if kind == 2 {
			signals = 2
		}
		totals[sender] += signals
		total = totals[sender]
		dstBase := uint64(sender * slotSize)
		if sender == me {
			if plain != nil {
				copy(j.src[plainOff:], plain)
				if err := tr.Put(j.rdst[peer], dstBase+plainOff, j.lsrc, plainOff, uint64(len(plain))); err != nil {
					return err
				}
			}
			copy(j.src[off:], data)
			if err := tr.PutWithSignal(j.rdst[peer], dstBase+off, j.lsrc, off, uint64(n), j.rword[peer], signalWord(me), 1); err != nil {
				return err
			}
			if kind == 2 {
				if err := tr.Signal(j.rword[peer], signalWord(me), 1); err != nil {
					return err
				}
			}
			if kind != 3 {
				sent++
			}
			// The source stays put until the peer's answer: its next turn.
			continue
		}
		// The first signal's total is enough: the message is whole when its
		// signal is seen (a second, plain signal follows it in kind 2).
		if err := awaitAtLeast(j, signalWord(peer), total-signals+1, fmt.Sprintf("round %d (kind %d) from rank %d", i, kind, peer)); err != nil {
			return err
		}
		if got := j.dst[int(dstBase+off):][:n]; !bytes.Equal(got, data) {
			return fmt.Errorf("round %d (kind %d): %d bytes from rank %d differ at their signal", i, kind, n, peer)
		}
		if plain != nil {
			if got := j.dst[int(dstBase+plainOff):][:len(plain)]; !bytes.Equal(got, plain) {
				return fmt.Errorf("round %d: the plain put before the message had not landed at its signal", i)
			}
		}
		if err := j.await(signalWord(peer), total, fmt.Sprintf("round %d's last signal from rank %d", i, peer)); err != nil {
			return err
		}
	}
	if !oneMessage {
		sent = 0
	}
	if got := tr.peers[peer].putsigSent; got != sent {
		return fmt.Errorf("rank %d sent %d puts with signals as one message, want %d", me, got, sent)
	}
	if err := tr.Flush(peer); err != nil {
		return err
	}
	return tr.progressWhile(bs.Barrier)
}

// awaitAtLeast progresses until the word at off reaches want (a later
// signal may already have passed it).
func awaitAtLeast(j *job, off, want uint64, what string) error {
	deadline := time.Now().Add(j.timeout)
	for j.load(off) < want {
		if _, err := j.tr.Progress(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: word %d is %d, want at least %d", what, off, j.load(off), want)
		}
	}
	return nil
}
