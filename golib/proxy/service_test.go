package proxy

import (
	"errors"
	"math/rand"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

func newService(t *testing.T, tr transport.Transport, opts Options) *Service {
	t.Helper()
	s, err := New(tr, &HostAllocator{}, opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return s
}

func mustID(t *testing.T) func(uint32, error) uint32 {
	return func(id uint32, err error) uint32 {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
}

// TestTornEntryWaits: an entry whose second word shows the expected lap
// while its first still holds the last lap's is not taken until both agree.
func TestTornEntryWaits(t *testing.T) {
	s := newService(t, &fakeTransport{}, Options{Slots: 2})
	f, err := newFIFO(s, 0, 2) // no proxy goroutine: the test pops
	if err != nil {
		t.Fatal(err)
	}
	defer f.free()
	want, _ := Op{Type: TriggerPut, Size: 5, SrcOffset: 7}.Encode()
	slot := &f.ring[0]
	slot.Snd = want.Snd | lap(0, 2)<<lapBit
	if _, _, ok := f.pop(); ok {
		t.Fatal("pop took an entry whose first word is from the last lap")
	}
	slot.Fst = want.Fst | lap(0, 2)<<fstLapBit
	got, pos, ok := f.pop()
	if !ok || pos != 0 || Decode(got) != Decode(want) {
		t.Fatalf("pop = %+v, %d, %v; want %+v at 0", Decode(got), pos, ok, Decode(want))
	}
}

func TestEncodeDecodeRandom(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	for i := 0; i < 100000; i++ {
		op := Op{Type: uint32(1 + rng.Intn(7)), Channel: uint32(rng.Intn(MaxChannels)),
			DstMemory: uint32(rng.Intn(MaxMemories)), SrcMemory: uint32(rng.Intn(MaxMemories)),
			DstOffset: uint64(rng.Uint32()), SrcOffset: uint64(rng.Uint32()), Size: uint64(rng.Uint32() >> 1)}
		tr, err := op.Encode()
		if err != nil {
			t.Fatalf("Encode(%+v): %v", op, err)
		}
		if tr.Snd>>61 != 0 || tr.Fst>>fstLapBit&1 != 0 {
			t.Fatalf("Encode(%+v) sets a lap bit or bits 61..62: %#x %#x", op, tr.Fst, tr.Snd)
		}
		tr.Snd |= 1 << lapBit
		tr.Fst |= 1 << fstLapBit
		if got := Decode(tr); got != op {
			t.Fatalf("Decode(Encode(%+v)) = %+v", op, got)
		}
	}
	for _, bad := range []Op{{}, {Type: 8}, {Type: 1, Channel: MaxChannels}, {Type: 1, DstMemory: MaxMemories},
		{Type: 1, SrcOffset: MaxOffset + 1}, {Type: 1, Size: MaxSize + 1}} {
		if _, err := bad.Encode(); err == nil {
			t.Errorf("Encode(%+v) = nil error, want one", bad)
		}
	}
}

// TestRandomTriggersSeveralPushers: four pushers, each on its own channel
// and peer, push random puts and signals through an 8-slot ring; every
// trigger runs exactly once, with its own fields, in each pusher's order.
func TestRandomTriggersSeveralPushers(t *testing.T) {
	tr := &fakeTransport{}
	s := newService(t, tr, Options{Slots: 8, Timeout: 20 * time.Second})
	defer s.Close()
	id := mustID(t)
	const pushers, perPusher = 4, 3000
	srcs := make([]*fakeMem, pushers)
	var chans, dsts, srcIDs [pushers]uint32
	for p := 0; p < pushers; p++ {
		srcs[p] = &fakeMem{size: 1 << 32}
		srcIDs[p] = id(s.AddLocal(srcs[p]))
		dsts[p] = id(s.AddRemote(&fakeMem{peer: p, size: 1 << 32}))
		chans[p] = id(s.AddChannel(p, &fakeMem{peer: p, size: 64}, 8*uint64(p)))
	}
	f, err := s.NewFIFO()
	if err != nil {
		t.Fatal(err)
	}
	want := make([][]Op, pushers)
	var wg sync.WaitGroup
	errs := make(chan error, pushers)
	for p := 0; p < pushers; p++ {
		rng := rand.New(rand.NewSource(int64(p)))
		for i := 0; i < perPusher; i++ {
			want[p] = append(want[p], Op{Type: uint32(1 + rng.Intn(3)), Channel: chans[p], DstMemory: dsts[p],
				SrcMemory: srcIDs[p], DstOffset: uint64(rng.Uint32() >> 1), SrcOffset: uint64(rng.Uint32() >> 1),
				Size: uint64(rng.Intn(1 << 20))})
		}
		wg.Add(1)
		go func(ops []Op) {
			defer wg.Done()
			for _, op := range ops {
				if _, err := f.Push(op); err != nil {
					errs <- err
					return
				}
			}
		}(want[p])
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for p := 0; p < pushers; p++ {
		if err := f.Flush(chans[p]); err != nil {
			t.Fatal(err)
		}
	}
	calls := tr.snapshot()
	next := make([]int, pushers)
	sub := make([]int, pushers) // 0: next call is the put of want[p][next], 1: its signal
	for i, c := range calls {
		if c.kind == "flush" {
			continue
		}
		p := c.peer
		if next[p] >= perPusher {
			t.Fatalf("call %d: %+v after all of peer %d's triggers", i, c, p)
		}
		op := want[p][next[p]]
		if op.Type&TriggerPut != 0 && sub[p] == 0 {
			if c.kind != "put" || c.dstOff != op.DstOffset || c.srcOff != op.SrcOffset || c.size != op.Size || c.src != srcs[p] {
				t.Fatalf("call %d = %+v, want the put of %+v", i, c, op)
			}
			if op.Type&TriggerSignal != 0 {
				sub[p] = 1
				continue
			}
		} else if c.kind != "signal" || c.dstOff != 8*uint64(p) || c.size != 1 {
			t.Fatalf("call %d = %+v, want the signal of %+v", i, c, op)
		}
		next[p]++
		sub[p] = 0
		if !c.complete {
			t.Errorf("call %d (%+v) not complete after its channel's flush", i, c)
		}
	}
	for p := range next {
		if next[p] != perPusher {
			t.Errorf("pusher %d: %d triggers ran, want %d", p, next[p], perPusher)
		}
	}
}

// TestWrapAround runs over a million triggers through a 16-slot ring from
// two pushers: every one runs once, each pusher's in order.
func TestWrapAround(t *testing.T) {
	total := 1 << 20
	if raceEnabled {
		total = 1 << 16 // the race detector slows every atomic tenfold
	}
	ct := &countingTransport{perChannel: map[uint64]uint64{}}
	s := newService(t, ct, Options{Slots: 16, Timeout: 60 * time.Second})
	defer s.Close()
	id := mustID(t)
	src := id(s.AddLocal(&fakeMem{size: 1 << 32}))
	dst := id(s.AddRemote(&fakeMem{size: 1 << 32}))
	ch := id(s.AddChannel(0, nil, 0))
	f, err := s.NewFIFO()
	if err != nil {
		t.Fatal(err)
	}
	const pushers = 2
	var wantBytes atomic.Uint64
	var wg sync.WaitGroup
	start := time.Now()
	for p := 0; p < pushers; p++ {
		wg.Add(1)
		go func(p int) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(p)))
			for i := 0; i < total/pushers; i++ {
				size := 1 + uint64(rng.Intn(4096)) // the proxy skips empty puts
				wantBytes.Add(size)
				if _, err := f.Push(Op{Type: TriggerPut, Channel: ch, DstMemory: dst, SrcMemory: src,
					SrcOffset: uint64(p), DstOffset: uint64(i), Size: size}); err != nil {
					t.Error(err)
					return
				}
			}
		}(p)
	}
	wg.Wait()
	if err := f.Flush(ch); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d triggers through %d slots in %v", total, 16, time.Since(start))
	ct.mu.Lock()
	defer ct.mu.Unlock()
	if ct.puts != uint64(total) || ct.bytes != wantBytes.Load() || ct.outOfOrder != 0 {
		t.Errorf("proxy ran %d puts of %d bytes (%d out of order), want %d puts of %d bytes in order",
			ct.puts, ct.bytes, ct.outOfOrder, total, wantBytes.Load())
	}
}

// TestFlushWaitsForEarlierTriggers: a flush returns only after the
// transport flushed the channel's peer, after every earlier put.
func TestFlushWaitsForEarlierTriggers(t *testing.T) {
	tr := &fakeTransport{}
	s := newService(t, tr, Options{Slots: 4, Timeout: 10 * time.Second})
	defer s.Close()
	id := mustID(t)
	src := id(s.AddLocal(&fakeMem{size: 1 << 20}))
	var dst, ch [2]uint32
	for p := range dst {
		dst[p] = id(s.AddRemote(&fakeMem{peer: p, size: 1 << 20}))
		ch[p] = id(s.AddChannel(p, nil, 0))
	}
	f, err := s.NewFIFO()
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewSource(3))
	for round := 0; round < 200; round++ {
		n := 1 + rng.Intn(10)
		var last uint64
		for i := 0; i < n; i++ {
			p := rng.Intn(2)
			if last, err = f.Push(Op{Type: TriggerPut, Channel: ch[p], DstMemory: dst[p], SrcMemory: src, Size: 8}); err != nil {
				t.Fatal(err)
			}
		}
		p := rng.Intn(2)
		if err := f.Flush(ch[p]); err != nil {
			t.Fatal(err)
		}
		for i, c := range tr.snapshot() {
			if c.kind == "put" && c.peer == p && !c.complete {
				t.Fatalf("round %d: put %d to peer %d not complete when its flush returned", round, i, p)
			}
		}
		if done := atomic.LoadUint64(&f.hw.Done); done <= last {
			t.Fatalf("round %d: done = %d after a flush behind position %d", round, done, last)
		}
	}
}

// TestTransportErrorReachesNextCall: a failed put is the Service's error
// from then on, at the next Push, Flush and Close, and the device sees it.
func TestTransportErrorReachesNextCall(t *testing.T) {
	tr := &fakeTransport{failPut: 3}
	s := newService(t, tr, Options{Slots: 4, Timeout: 10 * time.Second})
	id := mustID(t)
	src, dst, ch := id(s.AddLocal(&fakeMem{size: 64})), id(s.AddRemote(&fakeMem{size: 64})), id(s.AddChannel(0, nil, 0))
	f, err := s.NewFIFO()
	if err != nil {
		t.Fatal(err)
	}
	put := Op{Type: TriggerPut, Channel: ch, DstMemory: dst, SrcMemory: src, Size: 64}
	for i := 0; i < 3; i++ {
		if _, err := f.Push(put); err != nil {
			t.Fatalf("push %d: %v", i, err)
		}
	}
	if err := f.Flush(ch); !errors.Is(err, errFakePut) || !strings.Contains(err.Error(), "put") {
		t.Fatalf("Flush after a failed put = %v, want the put's error", err)
	}
	if _, err := f.Push(put); !errors.Is(err, errFakePut) {
		t.Errorf("Push after a failed put = %v, want the put's error", err)
	}
	if code := atomic.LoadUint32(&f.hw.Error); code != ErrCodeProxy {
		t.Errorf("FifoHostWords.error = %d, want %d", code, ErrCodeProxy)
	}
	if err := s.Close(); !errors.Is(err, errFakePut) {
		t.Errorf("Close = %v, want the put's error", err)
	}
}

// TestUnregisteredChannelFails: a trigger naming an unknown channel fails
// the Service with an error naming it.
func TestUnregisteredChannelFails(t *testing.T) {
	s := newService(t, &fakeTransport{}, Options{Slots: 4, Timeout: 10 * time.Second})
	defer s.Close()
	f, err := s.NewFIFO()
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Flush(7); err == nil || !strings.Contains(err.Error(), "channel 7 is not registered") {
		t.Errorf("Flush(7) = %v, want an error naming channel 7", err)
	}
}

// TestStalledProxyTimesOut: with the proxy stuck in a put, a flush and
// then a push into the full ring each time out naming what waited.
func TestStalledProxyTimesOut(t *testing.T) {
	tr := &fakeTransport{block: make(chan struct{}), entered: make(chan struct{}, 1)}
	const timeout = 200 * time.Millisecond
	s := newService(t, tr, Options{Slots: 4, Timeout: timeout})
	id := mustID(t)
	src, dst := id(s.AddLocal(&fakeMem{size: 64})), id(s.AddRemote(&fakeMem{peer: 5, size: 64}))
	ch := id(s.AddChannel(5, nil, 0))
	f, err := s.NewFIFO()
	if err != nil {
		t.Fatal(err)
	}
	put := Op{Type: TriggerPut, Channel: ch, DstMemory: dst, SrcMemory: src, Size: 64}
	if _, err := f.Push(put); err != nil {
		t.Fatal(err)
	}
	<-tr.entered // the proxy holds the first put
	start := time.Now()
	err = f.Flush(ch)
	if status.CodeOf(err) != status.Timeout || !strings.Contains(err.Error(), "flush of channel 0 (peer 5)") {
		t.Errorf("Flush with a stalled proxy = %v, want a timeout naming the flush and peer 5", err)
	}
	if d := time.Since(start); d < timeout || d > 20*timeout {
		t.Errorf("Flush gave up after %v, want about %v", d, timeout)
	}
	for i := 0; ; i++ {
		if _, err = f.Push(put); err != nil {
			break
		}
		if i > 4 {
			t.Fatal("pushed past a full 4-slot ring")
		}
	}
	if status.CodeOf(err) != status.Timeout || !strings.Contains(err.Error(), "push of [put] of 64 bytes on channel 0, peer 5") {
		t.Errorf("Push into a full ring = %v, want a timeout naming the push and peer 5", err)
	}
	if _, err2 := f.Push(put); !errors.Is(err2, err) {
		t.Errorf("Push after a push timeout = %v, want the sticky %v", err2, err)
	}
	close(tr.block)
	if err := s.Close(); status.CodeOf(err) != status.Timeout {
		t.Errorf("Close = %v, want the sticky timeout", err)
	}
}

func TestNewRejectsBadSlots(t *testing.T) {
	for _, slots := range []int{1, 3, 100} {
		if _, err := New(&fakeTransport{}, &HostAllocator{}, Options{Slots: slots}); status.CodeOf(err) != status.InvalidArgument {
			t.Errorf("New(Slots: %d) = %v, want InvalidArgument", slots, err)
		}
	}
}

// BenchmarkHostPush measures host pushes through a 512-slot ring to a
// proxy running a transport that only counts.
func BenchmarkHostPush(b *testing.B) {
	ct := &countingTransport{perChannel: map[uint64]uint64{}}
	s, err := New(ct, &HostAllocator{}, Options{IdleSpin: time.Minute})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	s.AddLocal(&fakeMem{size: 1 << 32})
	s.AddRemote(&fakeMem{size: 1 << 32})
	ch, _ := s.AddChannel(0, nil, 0)
	f, err := s.NewFIFO()
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := f.Push(Op{Type: TriggerPut, Channel: ch, DstOffset: uint64(i), Size: 1}); err != nil {
			b.Fatal(err)
		}
	}
	if err := f.Flush(ch); err != nil {
		b.Fatal(err)
	}
}

// TestCloseRunsPushedTriggers: Close runs what a finished kernel already
// pushed before it stops the proxy, or the peers would wait for it.
func TestCloseRunsPushedTriggers(t *testing.T) {
	tr := &fakeTransport{block: make(chan struct{}), entered: make(chan struct{}, 16)}
	s := newService(t, tr, Options{Slots: 8, Timeout: 10 * time.Second})
	id := mustID(t)
	src := id(s.AddLocal(&fakeMem{size: 1 << 20}))
	dst := id(s.AddRemote(&fakeMem{peer: 1, size: 1 << 20}))
	ch := id(s.AddChannel(1, nil, 0))
	f, err := s.NewFIFO()
	if err != nil {
		t.Fatal(err)
	}
	const n = 6
	for i := 0; i < n; i++ {
		if _, err := f.Push(Op{Type: TriggerPut, Channel: ch, DstMemory: dst, SrcMemory: src, Size: 8}); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			<-tr.entered // the proxy is inside the first put: the rest wait in the ring
		}
	}
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	for !s.stop.Load() {
		time.Sleep(time.Millisecond)
	}
	close(tr.block)
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if puts := len(tr.snapshot()); puts != n {
		t.Errorf("Close returned after %d of the %d pushed puts ran", puts, n)
	}
}

// progressCounter counts the proxy's polls of an idle transport.
type progressCounter struct {
	fakeTransport
	n atomic.Int64
}

func (p *progressCounter) Progress() (bool, error) { p.n.Add(1); return false, nil }

// TestIdleProxyDozes: past IdleNap an idle proxy polls about once a
// millisecond instead of every few tens of microseconds, and still takes
// the next trigger.
func TestIdleProxyDozes(t *testing.T) {
	tr := &progressCounter{}
	s := newService(t, tr, Options{Timeout: 10 * time.Second, IdleSpin: time.Millisecond, IdleNap: 100 * time.Millisecond})
	defer s.Close()
	ch := mustID(t)(s.AddChannel(0, nil, 0))
	f, err := s.NewFIFO()
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	before := tr.n.Load()
	time.Sleep(200 * time.Millisecond)
	// Napping, 200 ms would take thousands of polls; dozing, at most 200.
	if polls := tr.n.Load() - before; polls > 400 {
		t.Errorf("an idle proxy polled %d times in 200 ms after IdleNap, want at most 400", polls)
	}
	start := time.Now()
	if err := f.Flush(ch); err != nil {
		t.Fatal(err)
	}
	if waited := time.Since(start); waited > time.Second {
		t.Errorf("a flush after the pause took %v", waited)
	}
}

// TestFlushAsksTransportOnlyAfterWork: a flush reaches the transport when a
// put or signal of its channel went out since the channel's last flush,
// and only then.
func TestFlushAsksTransportOnlyAfterWork(t *testing.T) {
	tr := &fakeTransport{}
	s, f, src, dst, ch := peerChannel(t, tr)
	defer s.Close()
	flushes := func() (n int) {
		for _, c := range tr.snapshot() {
			if c.kind == "flush" {
				n++
			}
		}
		return n
	}
	steps := []struct {
		op   *Op // pushed before the flush; nil: none
		want int
	}{
		{nil, 0},
		{&Op{Type: TriggerPut, Channel: ch, DstMemory: dst, SrcMemory: src, Size: 8}, 1},
		{nil, 1},
		{&Op{Type: TriggerPut, Channel: ch, DstMemory: dst, SrcMemory: src, Size: 0}, 1},
		{&Op{Type: TriggerSignal, Channel: ch}, 2},
		{&Op{Type: TriggerPut | TriggerSignal, Channel: ch, DstMemory: dst, SrcMemory: src, Size: 64}, 3},
		{nil, 3},
	}
	for i, st := range steps {
		if st.op != nil {
			if _, err := f.Push(*st.op); err != nil {
				t.Fatal(err)
			}
		}
		if err := f.Flush(ch); err != nil {
			t.Fatal(err)
		}
		if got := flushes(); got != st.want {
			t.Fatalf("step %d: the transport flushed %d times, want %d", i, got, st.want)
		}
	}
}

// TestPutWithSignalIsOneCall: on a transport that takes a put and its
// signal together, a putWithSignal trigger is one such call with the put's
// ranges; a put alone, a signal alone, an empty put with a signal and an
// inline put keep their own calls.
func TestPutWithSignalIsOneCall(t *testing.T) {
	tr := &putSignalTransport{}
	s, f, src, dst, ch := peerChannel(t, tr)
	defer s.Close()
	ops := []Op{
		{Type: TriggerPut | TriggerSignal, Channel: ch, DstMemory: dst, SrcMemory: src, DstOffset: 64, SrcOffset: 128, Size: 4112},
		{Type: TriggerPut, Channel: ch, DstMemory: dst, SrcMemory: src, Size: 8},
		{Type: TriggerSignal, Channel: ch},
		{Type: TriggerPut | TriggerSignal, Channel: ch, DstMemory: dst, SrcMemory: src, Size: 0},
	}
	for _, op := range ops {
		if _, err := f.Push(op); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Flush(ch); err != nil {
		t.Fatal(err)
	}
	var kinds []string
	for _, c := range tr.snapshot() {
		kinds = append(kinds, c.kind)
		if c.kind == "putsignal" && (c.dstOff != 64 || c.srcOff != 128 || c.size != 4112) {
			t.Errorf("put with signal of %d bytes from %d to %d, want 4112 from 128 to 64", c.size, c.srcOff, c.dstOff)
		}
	}
	if want := "putsignal put signal signal flush"; strings.Join(kinds, " ") != want {
		t.Fatalf("transport calls %q, want %q", strings.Join(kinds, " "), want)
	}
}

// peerChannel is a Service over tr with one FIFO and a channel to peer 1
// with a semaphore, and the ids of a 1 MiB source and destination.
func peerChannel(t *testing.T, tr transport.Transport) (s *Service, f *FIFO, src, dst, ch uint32) {
	t.Helper()
	s = newService(t, tr, Options{Timeout: 10 * time.Second})
	id := mustID(t)
	src = id(s.AddLocal(&fakeMem{size: 1 << 20}))
	dst = id(s.AddRemote(&fakeMem{peer: 1, size: 1 << 20}))
	ch = id(s.AddChannel(1, &fakeMem{peer: 1, size: 1 << 20}, 0))
	f, err := s.NewFIFO()
	if err != nil {
		s.Close()
		t.Fatal(err)
	}
	return s, f, src, dst, ch
}
