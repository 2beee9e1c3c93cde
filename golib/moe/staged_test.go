package moe

import (
	"errors"
	"fmt"
	"math/rand"
	"sync"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/hostcoll"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport/ucx/ucxtest"
)

// hostDevice is a StagedDevice whose "device" memory is host memory. Its
// copies wait in a queue until the stream is synchronized or an event is
// recorded after them, so that a path that read a download before waiting
// for it would read stale bytes. It keeps count of what it moved and of
// the pinned memory it holds, so that tests see the staged path's traffic.
type hostDevice struct {
	mu        sync.Mutex
	pinned    map[unsafe.Pointer][]byte
	queued    []func()
	copied    uint64 // bytes of every copy
	capturing bool
}

func newHostDevice() *hostDevice { return &hostDevice{pinned: map[unsafe.Pointer][]byte{}} }

func (d *hostDevice) EnsureContext() error { return nil }
func (d *hostDevice) MemcpyAsync(dst, src uintptr, n uint64, _ uintptr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.copied += n
	d.queued = append(d.queued, func() {
		copy(unsafe.Slice((*byte)(hostPtr(dst)), n), unsafe.Slice((*byte)(hostPtr(src)), n))
	})
	return nil
}

// run carries out the queued copies, in order.
func (d *hostDevice) run() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, f := range d.queued {
		f()
	}
	d.queued = nil
}

func (d *hostDevice) MemsetD8Async(uintptr, byte, uint64, uintptr) error { return nil }
func (d *hostDevice) StreamSynchronize(uintptr) error                    { d.run(); return nil }
func (d *hostDevice) StreamCreate(uint32) (uintptr, error)               { return 1, nil }
func (d *hostDevice) StreamDestroy(uintptr) error                        { return nil }
func (d *hostDevice) EventCreate(uint32) (cuda.Event, error)             { return 1, nil }
func (d *hostDevice) EventRecord(cuda.Event, uintptr) error              { d.run(); return nil }
func (d *hostDevice) StreamWaitEvent(uintptr, cuda.Event) error          { return nil }
func (d *hostDevice) EventSynchronize(cuda.Event) error                  { return nil }
func (d *hostDevice) EventDestroy(cuda.Event) error                      { return nil }
func (d *hostDevice) StreamCaptureStatus(uintptr) (cuda.CaptureStatus, error) {
	if d.capturing {
		return cuda.CaptureActive, nil
	}
	return cuda.CaptureNone, nil
}

func (d *hostDevice) MemHostAlloc(n uint64, _ uint32) (unsafe.Pointer, error) {
	b, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, err
	}
	p := unsafe.Pointer(&b[0])
	d.mu.Lock()
	d.pinned[p] = b
	d.mu.Unlock()
	return p, nil
}

func (d *hostDevice) MemFreeHost(p unsafe.Pointer) error {
	d.mu.Lock()
	b, ok := d.pinned[p]
	delete(d.pinned, p)
	d.mu.Unlock()
	if !ok {
		return fmt.Errorf("free of %p, which is not pinned", p)
	}
	return unix.Munmap(b)
}

// onStagedNodes is a runner of staged EPs over simulated nodes of
// localSize ranks, each rank's EP on its own hostDevice (devs[rank]).
func onStagedNodes(localSize int, devs *[]*hostDevice) runner {
	return func(t *testing.T, world int, cfg func(rank int) Config, f func(rank int, ep *EP) error) []error {
		t.Helper()
		*devs = make([]*hostDevice, world)
		for r := range world {
			(*devs)[r] = newHostDevice()
		}
		return ranksWith(t, world, localSize, 0, func(r int, g Group, c *hostcoll.Comm, cfg Config) (*EP, error) {
			return NewStaged(g, c, (*devs)[r], cfg)
		}, cfg, f)
	}
}

// GPU tensors across nodes go through pinned host memory and give the
// host path's bits: 2 nodes of 1 and of 2, eager and capturable, both
// transits; every pinned byte is given back when the EPs close.
func TestStagedAcrossNodesMatchesTheDocumentedOrderAndRounding(t *testing.T) {
	ucxtest.Need(t)
	for _, l := range []struct{ world, local int }{{2, 1}, {4, 2}} {
		t.Run(fmt.Sprintf("%dx%d", l.world/l.local, l.local), func(t *testing.T) {
			W := l.world
			var devs []*hostDevice
			checkRounds(t, onStagedNodes(l.local, &devs), []roundsCase{
				{W, 2 * W, 3, 24, 9, reduce.BFloat16, reduce.BFloat16, 0.2},
				{W, 2 * W, 8, 16, 6, reduce.Float32, reduce.Float32, 0.1},
			})
			for r, d := range devs {
				if d.copied == 0 {
					t.Errorf("rank %d: nothing went between device and host", r)
				}
				if len(d.pinned) != 0 {
					t.Errorf("rank %d: %d pinned buffers left after close", r, len(d.pinned))
				}
			}
		})
	}
}

// Rejected calls fail on every rank and move nothing; every rank is usable
// after.
func TestStagedRejectedCallsMoveNothing(t *testing.T) {
	ucxtest.Need(t)
	var devs []*hostDevice
	checkRejected(t, onStagedNodes(1, &devs))
}

// A call recorded into a CUDA graph is refused on the rank that records
// it, before any exchange, and the EP goes on.
func TestStagedRefusesCapture(t *testing.T) {
	ucxtest.Need(t)
	const W, E, K, H, Tm = 2, 4, 2, 8, 4
	cfg := func(int) Config {
		return Config{NumExperts: E, Hidden: H, MaxTokens: Tm, TopK: K, DType: reduce.Float32, CombineDType: reduce.Float32}
	}
	var devs []*hostDevice
	errs := onStagedNodes(1, &devs)(t, W, cfg, func(r int, ep *EP) error {
		tk := makeTokens(rand.New(rand.NewSource(int64(r))), Tm, H, E, K, reduce.Float32, 0)
		devs[r].capturing = true
		_, err := dispatch(ep, tk, Tm, true, 0)
		devs[r].capturing = false
		if status.CodeOf(err) != status.Unsupported || !contains(err, "CUDA graph") {
			return fmt.Errorf("dispatch while capturing = %v, want Unsupported naming CUDA graphs", err)
		}
		if _, err := dispatch(ep, tk, Tm, false, 0); err != nil {
			return fmt.Errorf("dispatch after the refusal: %w", err)
		}
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}
