package proxy

import (
	"errors"
	"fmt"
	"sync"

	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// fakeMem is a fake registered range (local or remote).
type fakeMem struct {
	peer int
	size uint64
}

func (m *fakeMem) Key() []byte  { return nil }
func (m *fakeMem) Size() uint64 { return m.size }
func (m *fakeMem) Peer() int    { return m.peer }
func (m *fakeMem) Close() error { return nil }

// call is one transport call the fake saw.
type call struct {
	kind     string // put, signal, flush
	peer     int
	dst, src *fakeMem
	dstOff   uint64
	srcOff   uint64
	size     uint64
	complete bool // a put or signal is complete once a later flush of its peer ran
}

// fakeTransport records calls. Puts and signals stay pending until a
// Flush of their peer; failPut makes the put with that index fail; block,
// when set, holds every Put until it is closed.
type fakeTransport struct {
	mu      sync.Mutex
	calls   []*call
	puts    int
	failPut int // 1-based index of the put that fails; 0: none
	block   chan struct{}
	entered chan struct{} // receives once per blocked Put
}

var errFakePut = errors.New("fake put failed")

func (f *fakeTransport) Name() string { return "fake" }
func (f *fakeTransport) Register(addr uintptr, size uint64, mem transport.Memory) (transport.Local, error) {
	return &fakeMem{size: size}, nil
}
func (f *fakeTransport) Remote(peer int, key []byte) (transport.Remote, error) {
	return &fakeMem{peer: peer, size: 1 << 20}, nil
}

func (f *fakeTransport) Put(dst transport.Remote, dstOff uint64, src transport.Local, srcOff, size uint64) error {
	if f.block != nil {
		if f.entered != nil {
			f.entered <- struct{}{}
		}
		<-f.block
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.puts++
	if f.puts == f.failPut {
		return fmt.Errorf("put #%d: %w", f.puts, errFakePut)
	}
	d, s := dst.(*fakeMem), src.(*fakeMem)
	f.calls = append(f.calls, &call{kind: "put", peer: d.peer, dst: d, src: s, dstOff: dstOff, srcOff: srcOff, size: size})
	return nil
}

func (f *fakeTransport) Signal(dst transport.Remote, dstOff uint64, value uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := dst.(*fakeMem)
	f.calls = append(f.calls, &call{kind: "signal", peer: d.peer, dst: d, dstOff: dstOff, size: value})
	return nil
}

func (f *fakeTransport) Flush(peer int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range f.calls {
		if c.peer == peer {
			c.complete = true
		}
	}
	f.calls = append(f.calls, &call{kind: "flush", peer: peer, complete: true})
	return nil
}

func (f *fakeTransport) Progress() (bool, error) { return false, nil }
func (f *fakeTransport) Close() error            { return nil }

func (f *fakeTransport) snapshot() []call {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]call, len(f.calls))
	for i, c := range f.calls {
		out[i] = *c
	}
	return out
}

// countingTransport only counts and sums, for long runs.
type countingTransport struct {
	mu          sync.Mutex
	puts, bytes uint64
	perChannel  map[uint64]uint64 // dstOff (the pusher's sequence) checks order
	outOfOrder  int
}

func (c *countingTransport) Name() string { return "counting" }
func (c *countingTransport) Register(uintptr, uint64, transport.Memory) (transport.Local, error) {
	return &fakeMem{size: 1 << 32}, nil
}
func (c *countingTransport) Remote(peer int, _ []byte) (transport.Remote, error) {
	return &fakeMem{peer: peer, size: 1 << 32}, nil
}
func (c *countingTransport) Put(dst transport.Remote, dstOff uint64, src transport.Local, srcOff, size uint64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.puts++
	c.bytes += size
	// srcOff carries the pusher, dstOff its sequence number.
	if c.perChannel[srcOff] != dstOff {
		c.outOfOrder++
	}
	c.perChannel[srcOff] = dstOff + 1
	return nil
}
func (c *countingTransport) Signal(transport.Remote, uint64, uint64) error { return nil }
func (c *countingTransport) Flush(int) error                               { return nil }
func (c *countingTransport) Progress() (bool, error)                       { return false, nil }
func (c *countingTransport) Close() error                                  { return nil }

// putSignalTransport is a fakeTransport that also takes a put and its
// signal as one call, recorded as "putsignal".
type putSignalTransport struct{ fakeTransport }

func (f *putSignalTransport) PutWithSignal(dst transport.Remote, dstOff uint64, src transport.Local, srcOff, size uint64,
	sem transport.Remote, semOff, value uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	d, s := dst.(*fakeMem), src.(*fakeMem)
	f.calls = append(f.calls, &call{kind: "putsignal", peer: d.peer, dst: d, src: s, dstOff: dstOff, srcOff: srcOff, size: size})
	return nil
}
