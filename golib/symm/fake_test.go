package symm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap/bootstraptest"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
)

// fakeDriver is one rank's CUDA driver. Rank r owns GPU r; all GPUs are
// visible to every rank. Device memory is fake address ranges; IPC handles
// encode the owner rank and base; opening the same handle twice without
// closing it fails, as real drivers may.
type fakeDriver struct {
	rank    int
	noPeer  map[[2]int]bool // GPU pairs without P2P
	mu      sync.Mutex
	next    uintptr
	allocs  map[uintptr]uint64 // base -> size
	noIPC   map[uintptr]bool   // bases CUDA IPC cannot export (cuMemCreate memory)
	opened  map[cuda.IPCHandle]uintptr
	opens   int
	closes  int
	zeroed  map[uintptr]bool
	hostMem map[unsafe.Pointer][]byte
}

func newFakeDriver(rank int) *fakeDriver {
	return &fakeDriver{rank: rank, next: uintptr(0x7f0000000000 + rank<<36), allocs: map[uintptr]uint64{},
		opened: map[cuda.IPCHandle]uintptr{}, zeroed: map[uintptr]bool{}, hostMem: map[unsafe.Pointer][]byte{}}
}

var errFake = errors.New("fake CUDA failure")

func (d *fakeDriver) EnsureContext(int) error             { return nil }
func (d *fakeDriver) DeviceCount() (int, error)           { return 8, nil }
func (d *fakeDriver) Device(ord int) (cuda.Device, error) { return cuda.Device(ord), nil }
func (d *fakeDriver) DevicePCIBusID(dev cuda.Device) (string, error) {
	return fmt.Sprintf("0000:%02X:00.0", 0x10+int(dev)), nil
}
func (d *fakeDriver) DeviceUUID(dev cuda.Device) ([16]byte, error) {
	return [16]byte{0xAA, byte(dev)}, nil
}
func (d *fakeDriver) CanAccessPeer(a, b cuda.Device) (bool, error) {
	return !d.noPeer[[2]int{int(a), int(b)}] && !d.noPeer[[2]int{int(b), int(a)}], nil
}

func (d *fakeDriver) MemAlloc(n uint64) (uintptr, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	p := d.next
	d.next += uintptr(n+0xfffff) &^ 0xfffff
	d.allocs[p] = n
	return p, nil
}

func (d *fakeDriver) MemFree(p uintptr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.allocs[p]; !ok {
		return errFake
	}
	delete(d.allocs, p)
	return nil
}

func (d *fakeDriver) MemsetD8Async(p uintptr, v byte, n uint64, _ uintptr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if size, ok := d.allocs[p]; ok && v == 0 && n == size {
		d.zeroed[p] = true
	}
	return nil
}
func (d *fakeDriver) StreamSynchronize(uintptr) error { return nil }

func (d *fakeDriver) MemAddressRange(p uintptr) (uintptr, uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for base, size := range d.allocs {
		if p >= base && uint64(p-base) < size {
			return base, size, nil
		}
	}
	return 0, 0, errFake
}

func (d *fakeDriver) PointerDeviceOrdinal(p uintptr) (int, error) {
	if _, _, err := d.MemAddressRange(p); err != nil {
		return 0, err
	}
	return d.rank, nil
}

func (d *fakeDriver) PointerIPCCapable(p uintptr) (bool, error) {
	base, _, err := d.MemAddressRange(p)
	if err != nil {
		return false, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return !d.noIPC[base], nil
}

func (d *fakeDriver) IPCGetMemHandle(p uintptr) (cuda.IPCHandle, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.allocs[p]; !ok {
		return cuda.IPCHandle{}, fmt.Errorf("IPC handle of %#x: not an allocation base: %w", p, errFake)
	}
	var h cuda.IPCHandle
	h[0] = byte(d.rank)
	binary.LittleEndian.PutUint64(h[8:], uint64(p))
	return h, nil
}

func (d *fakeDriver) IPCOpenMemHandle(h cuda.IPCHandle) (uintptr, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if int(h[0]) == d.rank {
		return 0, fmt.Errorf("open own handle: %w", errFake)
	}
	if _, ok := d.opened[h]; ok {
		return 0, fmt.Errorf("handle opened twice: %w", errFake)
	}
	d.opens++
	base := mappedBase(h)
	d.opened[h] = base
	return base, nil
}

// mappedBase is where a peer allocation appears in any rank: deterministic
// so tests can predict it.
func mappedBase(h cuda.IPCHandle) uintptr {
	return uintptr(binary.LittleEndian.Uint64(h[8:])) + 0x100000000000
}

func (d *fakeDriver) IPCCloseMemHandle(p uintptr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for h, base := range d.opened {
		if base == p {
			delete(d.opened, h)
			d.closes++
			return nil
		}
	}
	return errFake
}

func (d *fakeDriver) MemHostAlloc(n uint64, flags uint32) (unsafe.Pointer, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if flags != cuda.HostAllocDeviceMap|cuda.HostAllocPortable {
		return nil, errFake
	}
	b := make([]byte, n)
	for i := range b {
		b[i] = 0xEE // HostMapped must zero it
	}
	p := unsafe.Pointer(&b[0])
	d.hostMem[p] = b
	return p, nil
}

func (d *fakeDriver) MemHostDevicePointer(host unsafe.Pointer) (uintptr, error) {
	return uintptr(host) ^ 0x1, nil
}

func (d *fakeDriver) MemFreeHost(host unsafe.Pointer) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.hostMem[host]; !ok {
		return errFake
	}
	delete(d.hostMem, host)
	return nil
}

// runRanks runs f on size goroutine ranks, each with its own fake driver,
// and returns each rank's error.
func runRanks(size int, setup func(*fakeDriver), f func(rank int, s *Space, d *fakeDriver) error) []error {
	return runRanksOn(size, func(r int) int { return r }, Options{}, setup, f)
}

// runRanksOn is runRanks with rank r on GPU device(r), and New's options.
func runRanksOn(size int, device func(int) int, opts Options, setup func(*fakeDriver), f func(rank int, s *Space, d *fakeDriver) error) []error {
	bs := bootstraptest.NewMem(size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := 0; r < size; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d := newFakeDriver(r)
			if setup != nil {
				setup(d)
			}
			s, err := New(d, bs[r], device(r), opts)
			if err != nil {
				errs[r] = err
				return
			}
			errs[r] = f(r, s, d)
		}()
	}
	wg.Wait()
	return errs
}
