package cudaipc

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// op is one queued stream operation the fake driver saw.
type op struct {
	kind          string // copy, write
	dst, src      uintptr
	n             uint64
	stream        uintptr
	pendingAtSync bool
}

type fakeDriver struct {
	ops     []op
	busy    bool // StreamDone answers false
	queries int  // StreamDone calls
	opened  map[cuda.IPCHandle]int
	streams int
}

func (d *fakeDriver) MemAddressRange(p uintptr) (uintptr, uint64, error) {
	return p &^ 0xfffff, 1 << 20, nil // 1 MiB allocations at 1 MiB boundaries
}
func (d *fakeDriver) IPCGetMemHandle(p uintptr) (cuda.IPCHandle, error) {
	var h cuda.IPCHandle
	h[0], h[1] = byte(p>>20), 0xcd
	return h, nil
}
func (d *fakeDriver) MemcpyAsync(dst, src uintptr, n uint64, s uintptr) error {
	d.ops = append(d.ops, op{kind: "copy", dst: dst, src: src, n: n, stream: s})
	return nil
}
func (d *fakeDriver) StreamCreate(uint32) (uintptr, error) { d.streams++; return 0x5000, nil }
func (d *fakeDriver) StreamDestroy(uintptr) error          { d.streams--; return nil }
func (d *fakeDriver) StreamDone(uintptr) (bool, error)     { d.queries++; return !d.busy, nil }
func (d *fakeDriver) StreamWriteValue64(s uintptr, addr uintptr, v uint64) error {
	d.ops = append(d.ops, op{kind: "write", dst: addr, n: v, stream: s})
	return nil
}

// fakeOpener maps rank r's handle h at 0x7000_0000 + r * 16 MiB.
type fakeOpener struct{ calls int }

func (o *fakeOpener) OpenPeer(r int, h cuda.IPCHandle) (uintptr, error) {
	o.calls++
	if h[1] != 0xcd {
		return 0, errors.New("not a handle")
	}
	return 0x7000_0000 + uintptr(r)<<24, nil
}

func TestKeysPutsSignals(t *testing.T) {
	drv, opener := &fakeDriver{}, &fakeOpener{}
	tr, err := New(drv, opener, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	src, err := tr.Register(0x1230_0100, 4096, transport.DeviceMemory)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Register(0x1230_0100, 1<<20, transport.DeviceMemory); status.CodeOf(err) != status.InvalidArgument {
		t.Errorf("Register past the allocation's end = %v, want InvalidArgument", err)
	}
	if _, err := tr.Register(0x1230_0100, 64, transport.HostMemory); status.CodeOf(err) != status.Unsupported {
		t.Errorf("Register(host memory) = %v, want Unsupported", err)
	}
	// Same process: the key's address is used in place, no IPC open.
	self, err := tr.Remote(0, src.Key())
	if err != nil || self.Size() != 4096 || self.(*remote).addr != 0x1230_0100 || opener.calls != 0 {
		t.Fatalf("Remote(own key) = %+v, %v (opens %d), want the address in place", self, err, opener.calls)
	}
	// Another process's key goes through the opener, offset kept.
	key := append([]byte(nil), src.Key()...)
	key[88]++ // another pid
	peer, err := tr.Remote(3, key)
	if err != nil || peer.(*remote).addr != 0x7000_0000+3<<24+0x100 || peer.Peer() != 3 || opener.calls != 1 {
		t.Fatalf("Remote(3, a peer's key) = %+v, %v, want the opened base + 0x100", peer, err)
	}
	if _, err := tr.Remote(3, key[:10]); status.CodeOf(err) != status.InvalidArgument {
		t.Errorf("Remote(short key) = %v, want InvalidArgument", err)
	}
	if err := tr.Put(peer, 64, src, 128, 256); err != nil {
		t.Fatal(err)
	}
	if err := tr.Put(peer, 4000, src, 0, 256); status.CodeOf(err) != status.InvalidArgument {
		t.Errorf("Put past the end = %v, want InvalidArgument", err)
	}
	for i := 0; i < 3; i++ {
		if err := tr.Signal(peer, 8, 1); err != nil {
			t.Fatal(err)
		}
	}
	want := []op{
		{kind: "copy", dst: 0x7000_0000 + 3<<24 + 0x100 + 64, src: 0x1230_0100 + 128, n: 256, stream: 0x5000},
		{kind: "write", dst: 0x7000_0000 + 3<<24 + 0x100 + 8, n: 1, stream: 0x5000},
		{kind: "write", dst: 0x7000_0000 + 3<<24 + 0x100 + 8, n: 2, stream: 0x5000},
		{kind: "write", dst: 0x7000_0000 + 3<<24 + 0x100 + 8, n: 3, stream: 0x5000},
	}
	if len(drv.ops) != len(want) {
		t.Fatalf("driver saw %+v, want %+v", drv.ops, want)
	}
	for i := range want {
		if drv.ops[i] != want[i] {
			t.Errorf("driver op %d = %+v, want %+v", i, drv.ops[i], want[i])
		}
	}
	if err := tr.Flush(3); err != nil {
		t.Errorf("Flush = %v", err)
	}
	// Nothing queued since: the next flush answers without asking the stream.
	queries := drv.queries
	if err := tr.Flush(3); err != nil || drv.queries != queries {
		t.Errorf("Flush with nothing queued = %v after %d stream queries, want nil after none", err, drv.queries-queries)
	}
	drv.busy = true
	if err := tr.Signal(peer, 8, 1); err != nil {
		t.Fatal(err)
	}
	if err := tr.Flush(3); status.CodeOf(err) != status.Timeout || !strings.Contains(err.Error(), "flush of rank 3") {
		t.Errorf("Flush of a stuck stream = %v, want a timeout naming rank 3", err)
	}
	drv.busy = false
	if err := tr.Close(); err != nil || drv.streams != 0 {
		t.Errorf("Close = %v, %d streams left", err, drv.streams)
	}
}
