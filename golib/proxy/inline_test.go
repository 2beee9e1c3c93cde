package proxy

import (
	"bytes"
	"math/rand"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// inlineTransport is a fakeTransport that takes inline puts, keeping a
// copy of each one's bytes.
type inlineTransport struct {
	fakeTransport
	data [][]byte
}

func (f *inlineTransport) PutInline(dst transport.Remote, dstOff uint64, data []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := dst.(*fakeMem)
	f.calls = append(f.calls, &call{kind: "inline", peer: d.peer, dst: d, dstOff: dstOff, size: uint64(len(data))})
	f.data = append(f.data, bytes.Clone(data))
	return nil
}

// pushInline pushes an inline put as a kernel does: claim a position, wait
// for its slot, write the payload, then the entry with a release store.
func pushInline(t *testing.T, f *FIFO, op Op, data []byte) {
	t.Helper()
	op.SrcMemory, op.Size = InlineMemory, uint64(len(data))
	tr, err := op.Encode()
	if err != nil {
		t.Fatal(err)
	}
	pos := atomic.AddUint64(&f.dw.Head, 1) - 1
	for deadline := time.Now().Add(10 * time.Second); pos >= atomic.LoadUint64(&f.hw.Tail)+f.slots; {
		if time.Now().After(deadline) {
			t.Fatalf("slot of position %d never freed", pos)
		}
	}
	copy(unsafe.Slice((*byte)(f.payloadAt(pos)), InlineBytes), data)
	slot := &f.ring[pos&(f.slots-1)]
	l := lap(pos, f.slots)
	atomic.StoreUint64(&slot.Fst, tr.Fst|l<<fstLapBit)
	atomic.StoreUint64(&slot.Snd, tr.Snd|l<<lapBit)
}

// TestInlinePutsCarryTheirBytes: inline puts of random sizes, more than the
// ring holds, reach the transport with their own bytes, destination and
// order, and each one's signal follows its put.
func TestInlinePutsCarryTheirBytes(t *testing.T) {
	ft := &inlineTransport{}
	s := newService(t, ft, Options{Slots: 8})
	defer s.Close()
	id := mustID(t)
	dst := id(s.AddRemote(&fakeMem{peer: 1, size: 1 << 20}))
	ch := id(s.AddChannel(1, &fakeMem{peer: 1, size: 64}, 8))
	f, err := s.NewFIFO()
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewSource(3))
	var want [][]byte
	for i := range 100 {
		data := make([]byte, 1+rng.Intn(InlineBytes))
		rng.Read(data)
		want = append(want, data)
		typ := uint32(TriggerPut)
		if i%3 == 0 {
			typ |= TriggerSignal
		}
		pushInline(t, f, Op{Type: typ, Channel: ch, DstMemory: dst, DstOffset: uint64(1000 * i)}, data)
	}
	if err := f.Flush(ch); err != nil {
		t.Fatal(err)
	}
	calls := ft.snapshot()
	k := 0
	for i, c := range calls {
		if c.kind != "inline" {
			continue
		}
		if k >= len(want) || c.dstOff != uint64(1000*k) || !bytes.Equal(ft.data[k], want[k]) {
			t.Fatalf("inline put %d: offset %d, bytes %x; want offset %d, bytes %x", k, c.dstOff, ft.data[k], 1000*k, want[k])
		}
		if k%3 == 0 && (i+1 >= len(calls) || calls[i+1].kind != "signal") {
			t.Errorf("inline put %d: its signal does not follow it", k)
		}
		k++
	}
	if k != len(want) {
		t.Errorf("%d inline puts reached the transport, want %d", k, len(want))
	}
}

// TestInlinePutWithoutSupportFails: an inline put on a transport that does
// not take them fails the service naming it, and hosts cannot push one.
func TestInlinePutWithoutSupportFails(t *testing.T) {
	s := newService(t, &fakeTransport{}, Options{Slots: 8})
	defer s.Close()
	id := mustID(t)
	dst := id(s.AddRemote(&fakeMem{peer: 1, size: 1 << 20}))
	ch := id(s.AddChannel(1, nil, 0))
	f, err := s.NewFIFO()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Push(Op{Type: TriggerPut, Channel: ch, DstMemory: dst, SrcMemory: InlineMemory, Size: 8}); status.CodeOf(err) != status.InvalidArgument {
		t.Errorf("host push of an inline put: %v, want InvalidArgument", err)
	}
	pushInline(t, f, Op{Type: TriggerPut, Channel: ch, DstMemory: dst}, []byte{1, 2, 3})
	err = f.Flush(ch)
	if err == nil || !strings.Contains(err.Error(), "inline") {
		t.Errorf("flush after an inline put the transport cannot take: %v, want an error naming the inline put", err)
	}
}
