package proxy

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// FIFO is one ring of triggers and the words around it (channel.cuh's
// FifoHandle). Kernels push through Handle; the host pushes with Push, by
// the same protocol; one proxy goroutine pops.
type FIFO struct {
	svc   *Service
	id    uint32
	slots uint64
	mem   [3]Memory    // ring then payloads, device words, host words
	ring  []Trigger    // host view of the ring
	dw    *deviceWords // nil when the device words are out of the host's reach
	hw    *hostWords
	tail  uint64 // the proxy's next position (its goroutine only)
	done  chan struct{}
	// payload holds the bytes of the inline put pop returned last: its
	// slot is free for pushers once pop returns.
	payload [InlineBytes]byte
}

// Handle returns the device addresses kernels push through. The FIFO must
// outlive every kernel given it.
func (f *FIFO) Handle() FifoHandle {
	return FifoHandle{Ring: f.mem[0].Device, Dev: f.mem[1].Device, Host: f.mem[2].Device,
		Slots: uint32(f.slots), ID: f.id}
}

// ID is the FIFO's index in its Service.
func (f *FIFO) ID() uint32 { return f.id }

// backoff waits a little between polls: spin first, then yield, then sleep.
func backoff(spin int) {
	switch {
	case spin < 64:
	case spin < 4096:
		runtime.Gosched()
	default:
		time.Sleep(20 * time.Microsecond)
	}
}

// Push queues op as the device does (atomic head, a slot reused only once
// the proxy's tail has passed it, the lap bit stored last with a release
// store) and returns its position. It blocks while the ring is full, up to
// the Service's timeout; a timeout leaves a hole the proxy cannot pass, so
// it also fails the Service. The error is the Service's sticky error if
// there is one. Safe for concurrent use; only for host-reachable FIFOs.
func (f *FIFO) Push(op Op) (uint64, error) {
	if err := f.svc.Err(); err != nil {
		return 0, err
	}
	if f.dw == nil {
		return 0, status.Errorf(status.Unsupported, "FIFO %d: its head is device memory: push from a kernel", f.id)
	}
	if op.Type&TriggerPut != 0 && op.SrcMemory == InlineMemory {
		return 0, status.Errorf(status.InvalidArgument, "FIFO %d: memory id %d is for kernels' inline puts", f.id, InlineMemory)
	}
	t, err := op.Encode()
	if err != nil {
		return 0, status.Errorf(status.InvalidArgument, "FIFO %d: %v", f.id, err)
	}
	pos := atomic.AddUint64(&f.dw.Head, 1) - 1
	if pos >= atomic.LoadUint64(&f.dw.TailCache)+f.slots {
		deadline := time.Now().Add(f.svc.timeout)
		var tail uint64
		for spin := 0; ; spin++ {
			if tail = atomic.LoadUint64(&f.hw.Tail); pos < tail+f.slots {
				break
			}
			if err := f.svc.Err(); err != nil {
				return 0, err
			}
			if spin&63 == 63 && time.Now().After(deadline) {
				err := status.Errorf(status.Timeout,
					"FIFO %d: push of %s at position %d waited %v for a free slot (proxy at %d): the proxy is stalled (P2PCOMM_TIMEOUT_MS)",
					f.id, f.svc.describe(op), pos, f.svc.timeout, tail)
				f.svc.fail(err)
				return 0, err
			}
			backoff(spin)
		}
		for c := atomic.LoadUint64(&f.dw.TailCache); c < tail && !atomic.CompareAndSwapUint64(&f.dw.TailCache, c, tail); {
			c = atomic.LoadUint64(&f.dw.TailCache)
		}
	}
	slot := &f.ring[pos&(f.slots-1)]
	l := lap(pos, f.slots)
	atomic.StoreUint64(&slot.Fst, t.Fst|l<<fstLapBit)
	atomic.StoreUint64(&slot.Snd, t.Snd|l<<lapBit)
	return pos, nil
}

// Wait blocks until the proxy has handled position pos (for a flush
// trigger: completed it), up to the Service's timeout. It returns the
// Service's sticky error if the proxy failed.
func (f *FIFO) Wait(pos uint64) error {
	return f.wait(pos, "wait")
}

func (f *FIFO) wait(pos uint64, what string) error {
	deadline := time.Now().Add(f.svc.timeout)
	for spin := 0; ; spin++ {
		if err := f.svc.Err(); err != nil {
			return err
		}
		done := atomic.LoadUint64(&f.hw.Done)
		if done > pos {
			return nil
		}
		if spin&63 == 63 && time.Now().After(deadline) {
			return status.Errorf(status.Timeout,
				"FIFO %d: %s for position %d waited %v; the proxy has handled %d (P2PCOMM_TIMEOUT_MS)",
				f.id, what, pos, f.svc.timeout, done)
		}
		backoff(spin)
	}
}

// Flush pushes a flush trigger on channel and waits until the proxy has
// completed it: every earlier put and signal of the channel has landed.
func (f *FIFO) Flush(channel uint32) error {
	pos, err := f.Push(Op{Type: TriggerFlush, Channel: channel})
	if err != nil {
		return err
	}
	return f.wait(pos, "flush of "+f.svc.describeChannel(channel))
}

// pop returns the entry at the proxy's tail if it is fresh, and frees its
// slot: the proxy owns a copy, so pushers may reuse the slot at once.
func (f *FIFO) pop() (Trigger, uint64, bool) {
	pos := f.tail
	slot := &f.ring[pos&(f.slots-1)]
	l := lap(pos, f.slots)
	snd := atomic.LoadUint64(&slot.Snd)
	if snd>>lapBit != l {
		return Trigger{}, 0, false
	}
	// The device stores both words at once, but the host may see them land
	// apart: the first word carries the lap bit too.
	fst := atomic.LoadUint64(&slot.Fst)
	if fst>>fstLapBit&1 != l {
		return Trigger{}, 0, false
	}
	if field(snd, 48, typeBits)&TriggerPut != 0 && field(snd, 32, memoryBits) == InlineMemory {
		// The entry's release store published the payload's stores.
		n := min(field(fst, 0, sizeBits), InlineBytes)
		copy(f.payload[:n], unsafe.Slice((*byte)(f.payloadAt(pos)), n))
	}
	t := Trigger{Fst: fst, Snd: snd}
	f.tail = pos + 1
	atomic.StoreUint64(&f.hw.Tail, f.tail)
	return t, pos, true
}

// payloadAt is the host address of position pos's payload slot, after the
// ring.
func (f *FIFO) payloadAt(pos uint64) unsafe.Pointer {
	return unsafe.Add(f.mem[0].Host, f.slots*uint64(unsafe.Sizeof(Trigger{}))+(pos&(f.slots-1))*InlineBytes)
}

// newFIFO allocates a FIFO's memory; slots is a power of two.
func newFIFO(s *Service, id uint32, slots uint64) (*FIFO, error) {
	f := &FIFO{svc: s, id: id, slots: slots, done: make(chan struct{})}
	sizes := [3]uint64{slots * (uint64(unsafe.Sizeof(Trigger{})) + InlineBytes), deviceWordsSize, hostWordsSize}
	for i, n := range sizes {
		var err error
		if i == 1 {
			f.mem[i], err = s.alloc.Device(n)
		} else {
			f.mem[i], err = s.alloc.Mapped(n)
		}
		if err == nil && i != 1 && f.mem[i].Host == nil {
			err = fmt.Errorf("allocator returned mapped memory without a host address")
		}
		if err != nil {
			f.free()
			return nil, fmt.Errorf("FIFO %d: %w", id, err)
		}
	}
	f.ring = unsafe.Slice((*Trigger)(f.mem[0].Host), slots)
	if f.mem[1].Host != nil {
		f.dw = (*deviceWords)(f.mem[1].Host)
	}
	f.hw = (*hostWords)(f.mem[2].Host)
	return f, nil
}

func (f *FIFO) free() error {
	var first error
	for i := range f.mem {
		if f.mem[i].Size != 0 {
			if err := f.svc.alloc.Free(f.mem[i]); err != nil && first == nil {
				first = err
			}
			f.mem[i] = Memory{}
		}
	}
	return first
}
