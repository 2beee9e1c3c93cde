package symm

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// exported is what a rank tells the others about one buffer.
type exported struct {
	Handle cuda.IPCHandle // of the allocation's base
	Base   uint64         // the base in the owner's address space (diagnostics)
	Offset uint64         // of the buffer from the base
	Size   uint64         // the buffer's bytes
}

const exportedSize = 64 + 3*8

func (e exported) encode() []byte {
	b := append([]byte(nil), e.Handle[:]...)
	b = binary.LittleEndian.AppendUint64(b, e.Base)
	b = binary.LittleEndian.AppendUint64(b, e.Offset)
	return binary.LittleEndian.AppendUint64(b, e.Size)
}

func decodeExported(r int, b []byte) (exported, error) {
	var e exported
	if len(b) != exportedSize {
		return e, status.Errorf(status.Bootstrap, "rank %d sent a %d-byte buffer record, want %d", r, len(b), exportedSize)
	}
	copy(e.Handle[:], b)
	e.Base = binary.LittleEndian.Uint64(b[64:])
	e.Offset = binary.LittleEndian.Uint64(b[72:])
	e.Size = binary.LittleEndian.Uint64(b[80:])
	return e, nil
}

func (s *Space) usable() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return status.Errorf(status.State, "symmetric memory used after Close")
	}
	return nil
}

// Alloc allocates nbytes (rounded up to Granularity) of zeroed device memory
// on every rank and maps every rank's allocation here. Collective: every
// rank must pass the same nbytes (status.Mismatch names the rank that did
// not). Close frees it.
func (s *Space) Alloc(nbytes uint64) (*Buffer, error) {
	if err := s.usable(); err != nil {
		return nil, err
	}
	size := (nbytes + Granularity - 1) / Granularity * Granularity
	var p uintptr
	local := func() (exported, error) {
		if nbytes == 0 {
			return exported{}, status.Errorf(status.InvalidArgument, "symmetric alloc of 0 bytes")
		}
		var err error
		if p, err = s.drv.MemAlloc(size); err != nil {
			return exported{}, fmt.Errorf("symmetric alloc of %d bytes on GPU %d: %w", size, s.device, err)
		}
		// Kernels rely on zeroed flags in fresh buffers.
		if err := s.drv.MemsetD8Async(p, 0, size, 0); err != nil {
			return exported{}, err
		}
		if err := s.drv.StreamSynchronize(0); err != nil {
			return exported{}, err
		}
		h, err := s.drv.IPCGetMemHandle(p)
		return exported{Handle: h, Base: uint64(p), Size: nbytes}, err
	}
	b, err := s.exchange(local, p)
	if err != nil {
		if p != 0 {
			_ = s.drv.MemFree(p)
		}
		return nil, err
	}
	b.Size, b.owned = size, true
	s.mu.Lock()
	s.buffers = append(s.buffers, b)
	s.mu.Unlock()
	return b, nil
}

// Register maps nbytes at ptr on every rank (see Map) and lets Lookup find
// the buffer: calls on memory inside it read the peers' counterparts in
// place, so the caller promises to use it symmetrically until Deregister.
func (s *Space) Register(ptr uintptr, nbytes uint64) (*Buffer, error) {
	b, err := s.Map(ptr, nbytes)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	// A registration of the same range replaces the old one and becomes the
	// newest, as on every rank, so Lookup finds the same buffer everywhere.
	for i, old := range s.buffers {
		if !old.owned && old.Local == b.Local && old.Size == b.Size {
			s.buffers = append(s.buffers[:i], s.buffers[i+1:]...)
			break
		}
	}
	s.buffers = append(s.buffers, b)
	return b, nil
}

// Map maps nbytes at ptr, device memory of this rank's GPU from any
// allocator (torch's caching allocator included), on every rank, without
// registering it: Lookup does not find it, so only whoever keeps the
// returned peer addresses reads them. Collective: every rank passes its own
// ptr and the same nbytes (status.Mismatch names the rank that did not).
// Each peer allocation is opened once and cached until Close: the tensors of
// one torch segment share it.
func (s *Space) Map(ptr uintptr, nbytes uint64) (*Buffer, error) {
	if err := s.usable(); err != nil {
		return nil, err
	}
	local := func() (exported, error) {
		if ptr == 0 || nbytes == 0 {
			return exported{}, status.Errorf(status.InvalidArgument, "register %#x (%d bytes): null or empty", ptr, nbytes)
		}
		ord, err := s.drv.PointerDeviceOrdinal(ptr)
		if err != nil {
			return exported{}, status.Errorf(status.InvalidArgument, "register %#x: not device memory: %v", ptr, err)
		}
		if ord != s.device {
			return exported{}, status.Errorf(status.InvalidArgument, "register %#x: memory is on GPU %d, this communicator uses GPU %d", ptr, ord, s.device)
		}
		base, size, err := s.drv.MemAddressRange(ptr)
		if err != nil {
			return exported{}, err
		}
		off := uint64(ptr - base)
		if off+nbytes > size {
			return exported{}, status.Errorf(status.InvalidArgument,
				"register %#x: %d bytes run past the end of its %d-byte allocation", ptr, nbytes, size)
		}
		if ok, err := s.drv.PointerIPCCapable(ptr); err != nil {
			return exported{}, err
		} else if !ok {
			return exported{}, status.Errorf(status.InvalidArgument,
				"register %#x: CUDA IPC cannot share this memory (it comes from cuMemCreate or a memory pool, "+
					"e.g. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): allocate it with comm.empty(), "+
					"or turn expandable_segments off", ptr)
		}
		h, err := s.drv.IPCGetMemHandle(base)
		return exported{Handle: h, Base: uint64(base), Offset: off, Size: nbytes}, err
	}
	return s.exchange(local, ptr)
}

// Shareable says whether Map would accept [ptr, ptr+nbytes) on this rank:
// memory still allocated, in one allocation, that CUDA IPC can export.
// Local, not collective.
func (s *Space) Shareable(ptr uintptr, nbytes uint64) bool {
	base, size, err := s.drv.MemAddressRange(ptr)
	if err != nil || uint64(ptr-base)+nbytes > size {
		return false
	}
	ok, err := s.drv.PointerIPCCapable(ptr)
	return err == nil && ok
}

// exchange runs the collective part of Alloc and Map: each rank's
// local step, the all-gather, the size check and the opening of peers.
func (s *Space) exchange(local func() (exported, error), self uintptr) (*Buffer, error) {
	mine, err := local()
	if err = s.agree(err); err != nil {
		return nil, err
	}
	if self == 0 {
		self = uintptr(mine.Base) // Alloc: known only after local()
	}
	all, err := s.bs.AllGather(mine.encode())
	if err != nil {
		return nil, fmt.Errorf("exchange IPC handles: %w", err)
	}
	recs := make([]exported, len(all))
	for r, raw := range all {
		if recs[r], err = decodeExported(r, raw); err != nil {
			return nil, err
		}
	}
	// Compare with rank 0 so that every rank reports the same culprit.
	for r, e := range recs {
		if e.Size != recs[0].Size {
			return nil, status.Errorf(status.Mismatch, "rank %d passed %d bytes, rank 0 passed %d",
				r, e.Size, recs[0].Size)
		}
	}
	b := &Buffer{Local: self, Size: mine.Size}
	err = nil
	for r, e := range recs {
		if r == s.rank {
			b.Peers[r] = self
			continue
		}
		if !s.mapped[r] {
			continue // another node: its memory is out of reach
		}
		base, oerr := s.open(r, e.Handle)
		if oerr != nil {
			err = fmt.Errorf("open IPC handle of rank %d (GPU %s): %w", r, s.peers[r].BusID, oerr)
			break
		}
		b.Peers[r] = base + uintptr(e.Offset)
	}
	if err = s.agree(err); err != nil {
		return nil, err
	}
	// Every rank gets here or none does (agree), so the count stays in step.
	s.mu.Lock()
	s.made++
	b.Seq = s.made
	s.mu.Unlock()
	return b, nil
}

// open maps rank r's allocation once and caches the mapping until Close.
func (s *Space) open(r int, h cuda.IPCHandle) (uintptr, error) {
	key := openKey{r, h}
	s.mu.Lock()
	base, ok := s.opened[key]
	s.mu.Unlock()
	if ok {
		return base, nil
	}
	base, err := s.drv.IPCOpenMemHandle(h)
	if err != nil {
		return 0, err
	}
	s.mu.Lock()
	s.opened[key] = base
	s.mu.Unlock()
	return base, nil
}

// Deregister forgets the registered buffer at ptr. Collective: it ends at a
// barrier so that ranks stay in step. The peer mappings stay open until
// Close: other registered tensors of the same segment may share them, and
// closing an IPC mapping while a peer's kernel might still be queued against
// it is unsafe; reopening is also far more expensive than keeping them.
func (s *Space) Deregister(ptr uintptr) error {
	if err := s.usable(); err != nil {
		return err
	}
	s.mu.Lock()
	found := false
	for i, b := range s.buffers {
		if !b.owned && b.Local == ptr {
			s.buffers = append(s.buffers[:i], s.buffers[i+1:]...)
			found = true
			break
		}
	}
	s.mu.Unlock()
	if err := s.bs.Barrier(); err != nil {
		return fmt.Errorf("deregister %#x: %w", ptr, err)
	}
	if !found {
		return status.Errorf(status.InvalidArgument, "deregister %#x: not a registered buffer", ptr)
	}
	return nil
}

// Lookup returns the newest buffer (registered or allocated) that contains
// [ptr, ptr+nbytes) on this rank.
func (s *Space) Lookup(ptr uintptr, nbytes uint64) (*Buffer, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := len(s.buffers) - 1; i >= 0; i-- {
		if b := s.buffers[i]; b.Contains(ptr, nbytes) {
			return b, true
		}
	}
	return nil, false
}

// HostMapped allocates nbytes of zeroed, pinned host memory mapped into the
// device address space (portable to every context), for words kernels write
// and the host polls, such as a timeout flag. Not collective; Close frees it.
func (s *Space) HostMapped(nbytes uint64) (*HostBuffer, error) {
	if err := s.usable(); err != nil {
		return nil, err
	}
	if nbytes == 0 {
		return nil, status.Errorf(status.InvalidArgument, "host-mapped alloc of 0 bytes")
	}
	host, err := s.drv.MemHostAlloc(nbytes, cuda.HostAllocDeviceMap|cuda.HostAllocPortable)
	if err != nil {
		return nil, fmt.Errorf("host-mapped alloc of %d bytes: %w", nbytes, err)
	}
	clear(unsafeBytes(host, nbytes))
	dev, err := s.drv.MemHostDevicePointer(host)
	if err != nil {
		_ = s.drv.MemFreeHost(host)
		return nil, fmt.Errorf("device address of host-mapped memory: %w", err)
	}
	h := &HostBuffer{Host: host, Device: dev, Size: nbytes}
	s.mu.Lock()
	s.hosts = append(s.hosts, h)
	s.mu.Unlock()
	return h, nil
}

// Close unmaps every peer allocation and frees what Alloc and HostMapped
// allocated. It is local, not collective: synchronize the streams that use
// the buffers, and have ranks meet at a barrier first, so that no peer still
// reads memory this rank frees. Calling Close again does nothing.
func (s *Space) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	var errs []error
	for k, base := range s.opened {
		if err := s.drv.IPCCloseMemHandle(base); err != nil {
			errs = append(errs, fmt.Errorf("close IPC mapping of rank %d: %w", k.rank, err))
		}
	}
	s.opened = nil
	for _, b := range s.buffers {
		if b.owned {
			if err := s.drv.MemFree(b.Local); err != nil {
				errs = append(errs, fmt.Errorf("free symmetric buffer %#x: %w", b.Local, err))
			}
		}
	}
	s.buffers = nil
	for _, h := range s.hosts {
		if err := s.drv.MemFreeHost(h.Host); err != nil {
			errs = append(errs, fmt.Errorf("free host-mapped buffer: %w", err))
		}
	}
	s.hosts = nil
	return errors.Join(errs...)
}

// OpenPeer maps the allocation rank r exported as h (cuIpcGetMemHandle of
// its base) and returns that base here. Each allocation is opened once per
// Space, whoever asks (a process may open a handle only once), and stays
// mapped until Close: transports that exchange their own keys share the
// mappings of Alloc, Register and Map.
func (s *Space) OpenPeer(r int, h cuda.IPCHandle) (uintptr, error) {
	if err := s.usable(); err != nil {
		return 0, err
	}
	if r < 0 || r >= s.size || r == s.rank {
		return 0, status.Errorf(status.InvalidArgument, "open IPC handle of rank %d: not a peer of rank %d in a world of %d", r, s.rank, s.size)
	}
	if !s.mapped[r] {
		return 0, status.Errorf(status.InvalidArgument, "open IPC handle of rank %d: it is on another node than rank %d", r, s.rank)
	}
	return s.open(r, h)
}
