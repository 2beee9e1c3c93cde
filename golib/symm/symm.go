// Package symm maps GPU memory of every rank into every other rank's address
// space through CUDA IPC, so kernels can load and store peers' buffers.
package symm

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// MaxRanks is the most ranks a Space spans; it matches the kernels' kMaxRanks.
const MaxRanks = 8

// Granularity is what Alloc rounds sizes up to.
const Granularity = 2 << 20

// Driver is the part of *cuda.Driver a Space uses; tests substitute a fake.
type Driver interface {
	EnsureContext(ordinal int) error
	DeviceCount() (int, error)
	Device(ordinal int) (cuda.Device, error)
	DeviceUUID(dev cuda.Device) ([16]byte, error)
	DevicePCIBusID(dev cuda.Device) (string, error)
	CanAccessPeer(dev, peer cuda.Device) (bool, error)
	MemAlloc(n uint64) (uintptr, error)
	MemFree(p uintptr) error
	MemsetD8Async(p uintptr, v byte, n uint64, stream uintptr) error
	StreamSynchronize(stream uintptr) error
	MemAddressRange(p uintptr) (base uintptr, size uint64, err error)
	PointerDeviceOrdinal(p uintptr) (int, error)
	PointerIPCCapable(p uintptr) (bool, error)
	IPCGetMemHandle(p uintptr) (cuda.IPCHandle, error)
	IPCOpenMemHandle(h cuda.IPCHandle) (uintptr, error)
	IPCCloseMemHandle(p uintptr) error
	MemHostAlloc(n uint64, flags uint32) (unsafe.Pointer, error)
	MemHostDevicePointer(host unsafe.Pointer) (uintptr, error)
	MemFreeHost(host unsafe.Pointer) error
}

var _ Driver = (*cuda.Driver)(nil)

// Peer describes one rank's GPU as this process sees it.
type Peer struct {
	Rank         int
	UUID         [16]byte
	BusID        string // PCI id, "0000:1B:00.0"
	LocalOrdinal int    // the GPU's ordinal in this process, -1 if not visible here
}

// Buffer is memory mapped on every rank. The Space that returned it owns the
// mappings: it must outlive every use of these addresses, kernels included.
type Buffer struct {
	Local uintptr           // this rank's address
	Peers [MaxRanks]uintptr // Peers[r]: rank r's buffer in this address space (0 for another node); Peers[rank] == Local
	Size  uint64            // bytes, the same on every rank
	Seq   uint64            // which collective Alloc, Map or Register made it: the same on every rank
	owned bool              // allocated by Alloc, freed by Close
}

// Contains reports whether [p, p+n) lies inside b.
func (b *Buffer) Contains(p uintptr, n uint64) bool {
	return p >= b.Local && uint64(p-b.Local)+n <= b.Size
}

// HostBuffer is pinned host memory mapped into the device address space:
// kernels write Device, the host reads Host.
type HostBuffer struct {
	Host   unsafe.Pointer
	Device uintptr
	Size   uint64
}

// openKey names one peer allocation: the same handle from the same rank is
// the same allocation, and a process may open it only once.
type openKey struct {
	rank   int
	handle cuda.IPCHandle
}

// Space is the symmetric memory of one communicator on one GPU. Collective
// methods (New, Alloc, Register, Deregister) must be called by every rank in
// the same order, and not concurrently on one Space; Lookup may be called
// from any goroutine.
type Space struct {
	drv    Driver
	bs     bootstrap.Bootstrap
	device int
	rank   int
	size   int
	peers  []Peer

	mu      sync.Mutex
	opened  map[openKey]uintptr // peer allocation -> its base mapped here
	buffers []*Buffer           // Alloc'd and registered, newest last
	made    uint64              // buffers made so far (Buffer.Seq)
	hosts   []*HostBuffer
	closed  bool
	mapped  []bool // mapped[r]: rank r's memory is mapped here (its node)
}

// Options changes what New accepts.
type Options struct {
	// ShareGPUs lets several ranks use one GPU. It exists to test world
	// sizes larger than the GPUs at hand, and needs MPS: without it the
	// ranks' kernels take turns on the GPU, and a kernel that waits for a
	// peer's can spin through its whole time slice.
	ShareGPUs bool
	// Node lists the ranks whose memory this rank maps (its own node's,
	// ascending); nil means every rank. Collective calls still involve
	// every rank; the others' Buffer.Peers entries stay 0.
	Node []int
}

// New creates the Space of this rank on the GPU with the given ordinal
// (which must be the current context's device or have none current). It is
// collective: ranks exchange GPU UUIDs and PCI ids, and every rank fails
// with status.PeerUnavailable if two ranks share a GPU (unless
// opts.ShareGPUs) or any pair of GPUs
// visible to one process cannot access each other. A peer whose GPU this
// process cannot see is noted (LocalOrdinal -1); mapping its memory then
// relies on IPC.
func New(drv Driver, bs bootstrap.Bootstrap, device int, opts Options) (*Space, error) {
	s := &Space{drv: drv, bs: bs, device: device, rank: bs.Rank(), size: bs.Size(), opened: map[openKey]uintptr{}}
	if s.size > MaxRanks {
		return nil, status.Errorf(status.Unsupported, "symmetric memory spans at most %d ranks, got %d", MaxRanks, s.size)
	}
	s.mapped = make([]bool, s.size)
	for r := range s.mapped {
		s.mapped[r] = opts.Node == nil
	}
	for _, r := range opts.Node {
		if r >= 0 && r < s.size {
			s.mapped[r] = true
		}
	}
	s.mapped[s.rank] = true
	self, err := s.describeSelf()
	if err = s.agree(err); err != nil {
		return nil, err
	}
	recs, err := bs.AllGather(self)
	if err != nil {
		return nil, fmt.Errorf("exchange GPU ids: %w", err)
	}
	err = s.mapPeers(recs, opts.ShareGPUs)
	if err = s.agree(err); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *Space) describeSelf() ([]byte, error) {
	if err := s.drv.EnsureContext(s.device); err != nil {
		return nil, fmt.Errorf("context of GPU %d: %w", s.device, err)
	}
	dev, err := s.drv.Device(s.device)
	if err != nil {
		return nil, err
	}
	uuid, err := s.drv.DeviceUUID(dev)
	if err != nil {
		return nil, err
	}
	bus, err := s.drv.DevicePCIBusID(dev)
	if err != nil {
		return nil, err
	}
	return append(uuid[:], bus...), nil
}

// mapPeers finds each peer's GPU among the visible ones and checks access.
func (s *Space) mapPeers(recs [][]byte, shareGPUs bool) error {
	visible := map[[16]byte]int{}
	n, err := s.drv.DeviceCount()
	if err != nil {
		return err
	}
	for ord := 0; ord < n; ord++ {
		dev, err := s.drv.Device(ord)
		if err != nil {
			return err
		}
		u, err := s.drv.DeviceUUID(dev)
		if err != nil {
			return err
		}
		visible[u] = ord
	}
	s.peers = make([]Peer, s.size)
	for r, rec := range recs {
		if len(rec) < 16 {
			return status.Errorf(status.Bootstrap, "rank %d sent a %d-byte GPU id", r, len(rec))
		}
		p := Peer{Rank: r, BusID: string(rec[16:]), LocalOrdinal: -1}
		copy(p.UUID[:], rec[:16])
		if ord, ok := visible[p.UUID]; ok {
			p.LocalOrdinal = ord
		}
		s.peers[r] = p
	}
	// Two ranks on one GPU are refused up front, as NCCL does: without MPS
	// their kernels do not run side by side, so a kernel waiting for the
	// other rank's would end in a timeout or a mismatch after
	// P2PCOMM_TIMEOUT_MS instead of an error that says why.
	for a := 0; a < len(s.peers) && !shareGPUs; a++ {
		for b := a + 1; b < len(s.peers); b++ {
			if s.mapped[a] && s.mapped[b] && s.peers[a].UUID == s.peers[b].UUID {
				return status.Errorf(status.PeerUnavailable,
					"ranks %d and %d are both on GPU %s: p2pcomm needs one GPU per rank "+
						"(P2PCOMM_SHARE_GPUS=1 lets tests share one, under MPS)", a, b, s.peers[a].BusID)
			}
		}
	}
	me, err := s.drv.Device(s.device)
	if err != nil {
		return err
	}
	for _, p := range s.peers {
		if p.Rank == s.rank || !s.mapped[p.Rank] || p.LocalOrdinal < 0 || p.LocalOrdinal == s.device {
			continue
		}
		dev, err := s.drv.Device(p.LocalOrdinal)
		if err != nil {
			return err
		}
		ok, err := s.drv.CanAccessPeer(me, dev)
		if err != nil {
			return fmt.Errorf("peer access from GPU %d to GPU %d: %w", s.device, p.LocalOrdinal, err)
		}
		if !ok {
			return status.Errorf(status.PeerUnavailable,
				"rank %d (GPU %d, %s) cannot access rank %d (GPU %d, %s): no P2P between these GPUs",
				s.rank, s.device, s.peers[s.rank].BusID, p.Rank, p.LocalOrdinal, p.BusID)
		}
	}
	return nil
}

// Rank and Size are this rank and the number of ranks.
func (s *Space) Rank() int { return s.rank }

// Size returns the number of ranks.
func (s *Space) Size() int { return s.size }

// Mapped reports whether rank r's memory is mapped here (r is of this
// rank's node).
func (s *Space) Mapped(r int) bool { return r >= 0 && r < s.size && s.mapped[r] }

// Peers returns every rank's GPU, indexed by rank.
func (s *Space) Peers() []Peer { return append([]Peer(nil), s.peers...) }

// agree makes a local failure everyone's: ranks exchange their error (or
// none) so that no rank walks into the next collective while another has
// given up. It returns this rank's own error first, else the lowest failing
// rank's, with its status code.
func (s *Space) agree(local error) error { return bootstrap.Agree(s.bs, local) }
