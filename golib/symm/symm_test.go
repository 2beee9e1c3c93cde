package symm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"testing"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap/bootstraptest"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

func joinErrs(errs []error) error {
	var out []error
	for r, err := range errs {
		if err != nil {
			out = append(out, fmt.Errorf("rank %d: %w", r, err))
		}
	}
	return errors.Join(out...)
}

func TestNewMapsPeers(t *testing.T) {
	errs := runRanks(4, nil, func(rank int, s *Space, d *fakeDriver) error {
		peers := s.Peers()
		for r, p := range peers {
			if p.Rank != r || p.LocalOrdinal != r || p.BusID != fmt.Sprintf("0000:%02X:00.0", 0x10+r) {
				return fmt.Errorf("Peers()[%d] = %+v, want rank %d on GPU %d", r, p, r, r)
			}
		}
		return s.Close()
	})
	if err := joinErrs(errs); err != nil {
		t.Fatal(err)
	}
}

func TestNewPeerUnavailable(t *testing.T) {
	errs := runRanks(4, func(d *fakeDriver) { d.noPeer = map[[2]int]bool{{1, 2}: true} },
		func(int, *Space, *fakeDriver) error { return nil })
	for r, err := range errs {
		if status.CodeOf(err) != status.PeerUnavailable || !strings.Contains(err.Error(), "rank 1") ||
			!strings.Contains(err.Error(), "rank 2") {
			t.Errorf("rank %d: New() = %v, want PeerUnavailable naming ranks 1 and 2", r, err)
		}
	}
}

// TestNewRanksSharingAGPU puts ranks r and r+2 on GPU r of 2: every rank
// fails with PeerUnavailable naming the first pair.
func TestNewRanksSharingAGPU(t *testing.T) {
	errs := runRanksOn(4, func(r int) int { return r % 2 }, Options{}, nil, func(int, *Space, *fakeDriver) error { return nil })
	for r, err := range errs {
		if status.CodeOf(err) != status.PeerUnavailable || !strings.Contains(err.Error(), "ranks 0 and 2 are both on GPU") {
			t.Errorf("rank %d: New() = %v, want PeerUnavailable naming ranks 0 and 2", r, err)
		}
	}
}

// TestNewRanksSharingAGPUWhenAllowed: with ShareGPUs the same layout maps
// every peer, ranks r and r+2 on the same ordinal.
func TestNewRanksSharingAGPUWhenAllowed(t *testing.T) {
	errs := runRanksOn(4, func(r int) int { return r % 2 }, Options{ShareGPUs: true}, nil,
		func(rank int, s *Space, d *fakeDriver) error {
			for r, p := range s.Peers() {
				if p.Rank != r || p.LocalOrdinal != r%2 {
					return fmt.Errorf("Peers()[%d] = %+v, want rank %d on GPU %d", r, p, r, r%2)
				}
			}
			return s.Close()
		})
	if err := joinErrs(errs); err != nil {
		t.Fatal(err)
	}
}

func TestNewTooManyRanks(t *testing.T) {
	_, err := New(newFakeDriver(0), bootstraptest.NewMem(MaxRanks + 1)[0], 0, Options{})
	if status.CodeOf(err) != status.Unsupported {
		t.Errorf("New with %d ranks = %v, want Unsupported", MaxRanks+1, err)
	}
}

// TestRegisterSharesSegmentMappings registers two tensors of one torch
// segment per rank, at rank-dependent offsets, and checks the peer table and
// that each peer segment was opened once.
func TestRegisterSharesSegmentMappings(t *testing.T) {
	const size = 4
	errs := runRanks(size, nil, func(rank int, s *Space, d *fakeDriver) error {
		seg, _ := d.MemAlloc(8 << 20) // a torch caching-allocator segment
		tensorOffsets := []uint64{uint64(rank) * 512, 4<<20 + uint64(rank)*256}
		for i, off := range tensorOffsets {
			ptr := seg + uintptr(off)
			b, err := s.Register(ptr, 1<<20)
			if err != nil {
				return fmt.Errorf("Register(tensor %d) = %v", i, err)
			}
			if b.Local != ptr || b.Size != 1<<20 || b.Peers[rank] != ptr {
				return fmt.Errorf("Register(tensor %d) = local %#x size %d self %#x, want %#x, %d, %#x",
					i, b.Local, b.Size, b.Peers[rank], ptr, 1<<20, ptr)
			}
			for r := 0; r < size; r++ {
				if r == rank {
					continue
				}
				// Rank r's segment base, mapped here, plus r's own offset.
				peerSeg := uintptr(0x7f0000000000+r<<36) + 0x100000000000
				peerOff := []uint64{uint64(r) * 512, 4<<20 + uint64(r)*256}[i]
				if want := peerSeg + uintptr(peerOff); b.Peers[r] != want {
					return fmt.Errorf("tensor %d: Peers[%d] = %#x, want %#x", i, r, b.Peers[r], want)
				}
			}
			if got, ok := s.Lookup(ptr+100, 1000); !ok || got != b {
				return fmt.Errorf("Lookup(inside tensor %d) = %v, %v; want the buffer", i, got, ok)
			}
		}
		if d.opens != size-1 {
			return fmt.Errorf("IPC opens = %d, want %d (one per peer segment)", d.opens, size-1)
		}
		if _, ok := s.Lookup(seg+uintptr(tensorOffsets[0])+1<<20-10, 20); ok {
			return fmt.Errorf("Lookup(range crossing the end of tensor 0) found a buffer, want none")
		}
		if err := s.Close(); err != nil {
			return err
		}
		if d.closes != d.opens || len(d.opened) != 0 {
			return fmt.Errorf("after Close: %d closes for %d opens, %d still open", d.closes, d.opens, len(d.opened))
		}
		if _, ok := d.allocs[seg]; !ok {
			return fmt.Errorf("Close freed the registered (torch-owned) segment")
		}
		return nil
	})
	if err := joinErrs(errs); err != nil {
		t.Fatal(err)
	}
}

// TestMapIsNotRegistered: a mapped buffer has its peer table but Lookup
// does not find it (graph inputs: only their graphs read them in place).
func TestMapIsNotRegistered(t *testing.T) {
	errs := runRanks(2, nil, func(rank int, s *Space, d *fakeDriver) error {
		seg, _ := d.MemAlloc(4 << 20)
		b, err := s.Map(seg+4096, 1<<20)
		if err != nil {
			return fmt.Errorf("Map = %v", err)
		}
		peer := 1 - rank
		if want := uintptr(0x7f0000000000+peer<<36) + 0x100000000000 + 4096; b.Peers[peer] != want || b.Peers[rank] != seg+4096 {
			return fmt.Errorf("Map peers = %#x, want %#x at %d and %#x at %d", b.Peers, want, peer, seg+4096, rank)
		}
		if got, ok := s.Lookup(seg+4096, 1); ok {
			return fmt.Errorf("Lookup found mapped buffer %#x, want nothing", got.Local)
		}
		reg, err := s.Register(seg+4096, 1<<20)
		if err != nil {
			return err
		}
		if _, ok := s.Lookup(seg+4096, 1); !ok {
			return fmt.Errorf("Lookup after Register found nothing")
		}
		if b.Seq != 1 || reg.Seq != 2 {
			return fmt.Errorf("Seq of the first and second buffers = %d, %d; want 1, 2 on every rank", b.Seq, reg.Seq)
		}
		if d.opens != 1 {
			return fmt.Errorf("IPC opens after Map and Register of one segment = %d, want 1", d.opens)
		}
		return s.Close()
	})
	if err := joinErrs(errs); err != nil {
		t.Fatal(err)
	}
}

// TestMapRefusesMemoryIPCCannotExport: one rank's tensor comes from
// cuMemCreate (torch's expandable segments): every rank gets
// InvalidArgument, that rank's saying why, and Shareable says no there.
func TestMapRefusesMemoryIPCCannotExport(t *testing.T) {
	errs := runRanks(3, nil, func(rank int, s *Space, d *fakeDriver) error {
		seg, _ := d.MemAlloc(4 << 20)
		if !s.Shareable(seg, 1<<20) || s.Shareable(seg+4096, 4<<20) || s.Shareable(0xdead0000, 1) {
			return fmt.Errorf("Shareable: want true inside a fresh allocation only")
		}
		if rank == 1 {
			d.noIPC = map[uintptr]bool{seg: true}
			if s.Shareable(seg, 1<<20) {
				return fmt.Errorf("Shareable(cuMemCreate memory) = true")
			}
		}
		_, err := s.Map(seg, 1<<20)
		return err
	})
	for r, err := range errs {
		if status.CodeOf(err) != status.InvalidArgument {
			t.Errorf("rank %d: Map = %v, want InvalidArgument", r, err)
		}
		if r == 1 && !strings.Contains(fmt.Sprint(err), "expandable_segments") {
			t.Errorf("rank 1: Map = %v, want it to say why (expandable_segments)", err)
		}
		if r != 1 && !strings.Contains(fmt.Sprint(err), "rank 1 failed") {
			t.Errorf("rank %d: Map = %v, want it to name rank 1", r, err)
		}
	}
}

// TestRegisterAgainBecomesNewest: registering a range again replaces its
// old entry and makes it the newest, so Lookup in an overlap finds it (on
// every rank alike, whatever the order of earlier registrations).
func TestRegisterAgainBecomesNewest(t *testing.T) {
	errs := runRanks(2, nil, func(rank int, s *Space, d *fakeDriver) error {
		seg, _ := d.MemAlloc(4 << 20)
		a, err := s.Register(seg, 2<<20)
		if err != nil {
			return err
		}
		if _, err := s.Register(seg+4096, 1<<20); err != nil {
			return err
		}
		again, err := s.Register(seg, 2<<20)
		if err != nil {
			return err
		}
		if got, ok := s.Lookup(seg+8192, 64); !ok || got != again || again == a {
			return fmt.Errorf("Lookup in the overlap = %v, %v; want the newest registration (Seq %d)", got, ok, again.Seq)
		}
		if err := s.Deregister(seg); err != nil {
			return err
		}
		if got, ok := s.Lookup(seg+8192, 64); !ok || got.Local != seg+4096 {
			return fmt.Errorf("after Deregister of the first range, Lookup = %v, %v; want the second", got, ok)
		}
		return s.Close()
	})
	if err := joinErrs(errs); err != nil {
		t.Fatal(err)
	}
}

func TestRegisterMismatch(t *testing.T) {
	errs := runRanks(4, nil, func(rank int, s *Space, d *fakeDriver) error {
		seg, _ := d.MemAlloc(4 << 20)
		n := uint64(1 << 20)
		if rank == 2 {
			n = 2 << 20
		}
		_, err := s.Register(seg, n)
		return err
	})
	for r, err := range errs {
		if status.CodeOf(err) != status.Mismatch || !strings.Contains(err.Error(), "rank 2 passed 2097152 bytes") {
			t.Errorf("rank %d: Register = %v, want Mismatch naming rank 2", r, err)
		}
	}
}

func TestRegisterLocalErrorReachesEveryRank(t *testing.T) {
	errs := runRanks(3, nil, func(rank int, s *Space, d *fakeDriver) error {
		seg, _ := d.MemAlloc(4 << 20)
		if rank == 1 {
			seg = 0xdead0000 // not device memory
		}
		_, err := s.Register(seg, 1<<20)
		return err
	})
	for r, err := range errs {
		if status.CodeOf(err) != status.InvalidArgument {
			t.Errorf("rank %d: Register = %v, want InvalidArgument", r, err)
		}
		if r != 1 && !strings.Contains(fmt.Sprint(err), "rank 1 failed") {
			t.Errorf("rank %d: Register = %v, want it to name rank 1", r, err)
		}
	}
}

func TestDeregisterKeepsMappings(t *testing.T) {
	errs := runRanks(2, nil, func(rank int, s *Space, d *fakeDriver) error {
		seg, _ := d.MemAlloc(4 << 20)
		if _, err := s.Register(seg, 1<<20); err != nil {
			return err
		}
		if err := s.Deregister(seg); err != nil {
			return fmt.Errorf("Deregister = %v", err)
		}
		if _, ok := s.Lookup(seg, 1); ok {
			return fmt.Errorf("Lookup after Deregister found the buffer")
		}
		if _, err := s.Register(seg+4096, 1<<20); err != nil {
			return err
		}
		if d.opens != 1 {
			return fmt.Errorf("IPC opens after re-registering the same segment = %d, want 1", d.opens)
		}
		if err := s.Deregister(seg + 1); status.CodeOf(err) != status.InvalidArgument {
			return fmt.Errorf("Deregister(unknown) = %v, want InvalidArgument", err)
		}
		return s.Close()
	})
	if err := joinErrs(errs); err != nil {
		t.Fatal(err)
	}
}

func TestAllocAndClose(t *testing.T) {
	errs := runRanks(3, nil, func(rank int, s *Space, d *fakeDriver) error {
		b, err := s.Alloc(1000)
		if err != nil {
			return fmt.Errorf("Alloc(1000) = %v", err)
		}
		if b.Size != Granularity || !d.zeroed[b.Local] || b.Peers[rank] != b.Local {
			return fmt.Errorf("Alloc(1000) = size %d zeroed %v self %#x; want %d, true, %#x",
				b.Size, d.zeroed[b.Local], b.Peers[rank], Granularity, b.Local)
		}
		for r := 0; r < 3; r++ {
			if r != rank && b.Peers[r] == 0 {
				return fmt.Errorf("Alloc: Peers[%d] not mapped", r)
			}
		}
		h, err := s.HostMapped(64)
		if err != nil {
			return fmt.Errorf("HostMapped(64) = %v", err)
		}
		if got := unsafe.Slice((*byte)(h.Host), 64); got[0] != 0 || got[63] != 0 || h.Device == 0 {
			return fmt.Errorf("HostMapped: first/last byte %d/%d device %#x; want zeroed and mapped", got[0], got[63], h.Device)
		}
		if err := s.Close(); err != nil {
			return fmt.Errorf("Close = %v", err)
		}
		if len(d.allocs) != 0 || len(d.hostMem) != 0 || len(d.opened) != 0 {
			return fmt.Errorf("after Close: %d allocs, %d host buffers, %d mappings left; want none",
				len(d.allocs), len(d.hostMem), len(d.opened))
		}
		if err := s.Close(); err != nil {
			return fmt.Errorf("second Close = %v, want nil", err)
		}
		if _, err := s.Alloc(1); status.CodeOf(err) != status.State {
			return fmt.Errorf("Alloc after Close = %v, want State", err)
		}
		return nil
	})
	if err := joinErrs(errs); err != nil {
		t.Fatal(err)
	}
}

func TestAllocMismatch(t *testing.T) {
	errs := runRanks(2, nil, func(rank int, s *Space, d *fakeDriver) error {
		_, err := s.Alloc(uint64(1000 + rank))
		if err == nil {
			return nil
		}
		if len(d.allocs) != 0 {
			return fmt.Errorf("failed Alloc left %d allocations", len(d.allocs))
		}
		return err
	})
	for r, err := range errs {
		if status.CodeOf(err) != status.Mismatch {
			t.Errorf("rank %d: Alloc(different sizes) = %v, want Mismatch", r, err)
		}
	}
}

// TestOpenPeerSharesMappings: a handle the Space already opened (Alloc) is
// not opened again through OpenPeer, and a new one is opened once.
func TestOpenPeerSharesMappings(t *testing.T) {
	errs := runRanks(2, nil, func(rank int, s *Space, d *fakeDriver) error {
		b, err := s.Alloc(64)
		if err != nil {
			return err
		}
		peer := 1 - rank
		var h cuda.IPCHandle
		h[0] = byte(peer)
		binary.LittleEndian.PutUint64(h[8:], uint64(b.Peers[peer]-0x100000000000))
		opens := d.opens
		base, err := s.OpenPeer(peer, h)
		if err != nil || base != b.Peers[peer] || d.opens != opens {
			return fmt.Errorf("OpenPeer(Alloc's handle) = %#x, %v (%d new opens), want %#x and no open", base, err, d.opens-opens, b.Peers[peer])
		}
		binary.LittleEndian.PutUint64(h[8:], 0x7777000)
		for i := 0; i < 2; i++ {
			if base, err = s.OpenPeer(peer, h); err != nil || base != mappedBase(h) {
				return fmt.Errorf("OpenPeer(new handle) #%d = %#x, %v, want %#x", i, base, err, mappedBase(h))
			}
		}
		if d.opens != opens+1 {
			return fmt.Errorf("a new handle opened %d times, want once", d.opens-opens)
		}
		if _, err := s.OpenPeer(rank, h); status.CodeOf(err) != status.InvalidArgument {
			return fmt.Errorf("OpenPeer(own rank) = %v, want InvalidArgument", err)
		}
		return s.Close()
	})
	if err := joinErrs(errs); err != nil {
		t.Fatal(err)
	}
}

// With Options.Node a rank maps only its node's memory: nodes {0, 1} and
// {2, 3} stand for two hosts with GPUs 0 and 1 each, so ranks of different
// nodes on "one GPU" are no conflict, and Alloc leaves the other node's
// entries 0 while staying collective over all four ranks.
func TestNodeLimitsMapping(t *testing.T) {
	const size = 4
	bs := bootstraptest.NewMem(size)
	errs := make([]error, size)
	done := make(chan struct{})
	for r := range size {
		go func() {
			defer func() { done <- struct{}{} }()
			d := newFakeDriver(r)
			node := []int{r &^ 1, r | 1}
			s, err := New(d, bs[r], r%2, Options{Node: node})
			if err != nil {
				errs[r] = err
				return
			}
			defer s.Close()
			b, err := s.Alloc(1 << 20)
			if err != nil {
				errs[r] = err
				return
			}
			for p := range size {
				mapped := p == node[0] || p == node[1]
				if (b.Peers[p] != 0) != mapped || s.Mapped(p) != mapped {
					errs[r] = fmt.Errorf("Peers[%d] = %#x, Mapped(%d) = %v; want mapped = %v", p, b.Peers[p], p, s.Mapped(p), mapped)
					return
				}
			}
			if d.opens != 1 {
				errs[r] = fmt.Errorf("opened %d IPC handles, want 1 (the node peer's)", d.opens)
				return
			}
			if _, err := s.OpenPeer(r^2, cuda.IPCHandle{}); status.CodeOf(err) != status.InvalidArgument {
				errs[r] = fmt.Errorf("OpenPeer of rank %d of another node: %v, want InvalidArgument", r^2, err)
			}
		}()
	}
	for range size {
		<-done
	}
	if err := joinErrs(errs); err != nil {
		t.Fatal(err)
	}
}
