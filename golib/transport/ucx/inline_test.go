package ucx

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// TestInlinePuts: inline puts of 1..64 bytes, each answered in turn after
// its signal, land byte for byte, into host memory (one UCP put of a copy)
// and into device memory (staged: the bytes go into a send slot, the
// signal rides in the entry's header, the entry one active message;
// whole words land through the Copier's Write, the rest through its Copy).
func TestInlinePuts(t *testing.T) {
	needUCX(t)
	for _, role := range []string{"inline", "stagedinline"} {
		t.Run(role, func(t *testing.T) { expectOK(t, runJob(t, role, 2, 60*time.Second)) })
	}
}

// childInline ping-pongs inline puts with signals; mem is the kind of the
// destination buffers.
func childInline(tr *Transport, bs bootstrap.Bootstrap, timeout time.Duration, mem transport.Memory) error {
	j := newJob(tr, bs, timeout)
	j.mem = mem
	if err := j.connect(); err != nil {
		return err
	}
	me, peer := j.rank, 1-j.rank
	if mem == transport.DeviceMemory && !tr.stage.peers[peer].am {
		return fmt.Errorf("rank %d does not land entries sent as active messages", peer)
	}
	rng := rand.New(rand.NewPCG(5, 9)) // both ranks draw the same sizes and bytes
	for i := 1; i <= 200; i++ {
		n, off := 1+rng.IntN(64), uint64(rng.IntN(slotSize-64))
		if i%2 == 0 { // whole words: a Copier's Write lands them
			n, off = 8*(1+rng.IntN(8)), off&^7
		}
		data := make([]byte, n)
		for k := range data {
			data[k] = byte(rng.Uint32())
		}
		if (i%2 == 1) == (me == 0) {
			if err := tr.PutInline(j.rdst[peer], uint64(me*slotSize)+off, data); err != nil {
				return err
			}
			clear(data) // the transport's copy is what travels
			if err := tr.Signal(j.rword[peer], signalWord(me), 1); err != nil {
				return err
			}
			continue
		}
		if err := j.await(signalWord(peer), uint64((i+me)/2), fmt.Sprintf("signal %d of rank %d", i, peer)); err != nil {
			return err
		}
		if got := j.dst[peer*slotSize+int(off):][:len(data)]; !bytes.Equal(got, data) {
			return fmt.Errorf("inline put %d of %d bytes from rank %d: got %x, want %x", i, len(data), peer, got, data)
		}
	}
	if mem == transport.DeviceMemory {
		if err := fencedBehindDirectPut(tr, j, me, peer); err != nil {
			return err
		}
	}
	if err := tr.Flush(peer); err != nil {
		return err
	}
	return tr.progressWhile(bs.Barrier)
}

// fencedBehindDirectPut: rank 0 puts a host word straight to rank 1, then
// an inline put with a signal: that entry goes as fenced puts, not as an
// active message (which nothing orders behind the put), and rank 1 finds
// the word once the signal came; the next entry is a message again.
func fencedBehindDirectPut(tr *Transport, j *job, me, peer int) error {
	word := mmapBytes(8)
	lw, err := tr.Register(addrOf(word), 8, transport.HostMemory)
	if err != nil {
		return err
	}
	defer lw.Close()
	const value = 0x5eed_f00d
	extra := uint64(16*me + 8) // beside this rank's signal word
	st := &tr.stage.peers[peer]
	if me == 0 {
		*(*uint64)(unsafe.Pointer(&word[0])) = value
		if err := tr.Put(j.rword[peer], extra, lw, 0, 8); err != nil {
			return err
		}
		for k, want := range []uint64{0, 1} { // the fenced entry, then a message
			before := st.amSent
			if err := tr.PutInline(j.rdst[peer], 0, []byte{1, 2, 3}); err != nil {
				return err
			}
			if err := tr.Signal(j.rword[peer], signalWord(me), 1); err != nil {
				return err
			}
			for len(st.queue) > 0 { // Progress pumps the queue
				if _, err := tr.Progress(); err != nil {
					return err
				}
			}
			if got := st.amSent - before; got != want {
				return fmt.Errorf("entry %d after a direct put: %d sent as active messages, want %d", k, got, want)
			}
		}
		// A signal with nothing staged owed is a direct put too: an entry
		// behind it with a larger total for the same word must not land
		// first, or the put would take the word back.
		if err := tr.Flush(peer); err != nil {
			return err
		}
		if tr.stageSignal(peer) {
			return fmt.Errorf("a signal after a flush would travel through the ring")
		}
		if err := tr.Signal(j.rword[peer], signalWord(me), 1); err != nil {
			return err
		}
		before := st.amSent
		if err := tr.PutInline(j.rdst[peer], 0, []byte{4, 5, 6}); err != nil {
			return err
		}
		if err := tr.Signal(j.rword[peer], signalWord(me), 1); err != nil {
			return err
		}
		for len(st.queue) > 0 {
			if _, err := tr.Progress(); err != nil {
				return err
			}
		}
		if got := st.amSent - before; got != 0 {
			return fmt.Errorf("the entry after a direct signal: %d sent as active messages, want 0", got)
		}
		return nil
	}
	if err := j.await(signalWord(peer), 101, "the signal behind the direct put"); err != nil {
		return err
	}
	if got := j.load(uint64(16*peer + 8)); got != value {
		return fmt.Errorf("the direct put's word is %#x once the signal behind it came, want %#x", got, value)
	}
	if err := j.await(signalWord(peer), 102, "the next signal"); err != nil {
		return err
	}
	if err := j.await(signalWord(peer), 104, "the signal of the entry behind a direct signal"); err != nil {
		return err
	}
	if got := j.dst[peer*slotSize : peer*slotSize+3]; !bytes.Equal(got, []byte{4, 5, 6}) {
		return fmt.Errorf("the entry behind a direct signal: got %x, want 040506", got)
	}
	return nil
}
