// Package proxy owns the FIFOs GPU kernels push triggers into and runs the
// service that executes each trigger on a transport.
package proxy

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/trace"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// DefaultTimeout bounds every wait when Options.Timeout is zero.
const DefaultTimeout = 60 * time.Second

// DefaultSlots is a FIFO's ring size when Options.Slots is zero.
const DefaultSlots = 512

// Options configures a Service; the zero value is usable.
type Options struct {
	// Timeout bounds every wait: a push for a free slot, a wait for
	// completion, Close waiting for the proxies (P2PCOMM_TIMEOUT_MS).
	Timeout time.Duration
	// Slots is each FIFO's ring size, a power of two (0: DefaultSlots).
	Slots int
	// Bind runs on each proxy goroutine's locked OS thread before it
	// polls: on a GPU it makes the device's context current there.
	Bind func() error
	// IdleSpin is how long a proxy keeps polling without sleeping after its
	// last trigger (0: one millisecond). Longer keeps latency low after
	// pauses at the cost of a busy core.
	IdleSpin time.Duration
	// IdleNap is how long an idle proxy then naps about 20 µs between
	// polls before it sleeps a millisecond at a time (0: one second): a
	// communicator left idle costs a core's 1% instead of its fifth, and
	// the first trigger after such a pause waits up to a millisecond.
	IdleNap time.Duration
}

// ConcurrentTransport is a transport whose calls are safe from several
// goroutines at once; the proxies of a Service over any other transport
// take turns calling it.
type ConcurrentTransport interface {
	transport.Transport
	Concurrent() bool
}

// channel is what a trigger's channel id stands for.
type channel struct {
	peer   int
	sem    transport.Remote // may be nil: the channel cannot signal
	semOff uint64
	// unflushed: a put or signal of the channel went out since its last
	// flush. A flush with nothing behind it is the FIFO's round trip
	// alone, without asking the transport.
	unflushed *atomic.Bool
}

// tables are the ids triggers name; replaced whole on registration so the
// proxies read them without a lock.
type tables struct {
	locals   []transport.Local
	remotes  []transport.Remote
	channels []channel
}

// Service executes the triggers of its FIFOs on one transport: one
// goroutine per FIFO, each on its own locked OS thread, so FIFOs of
// different kernels (or blocks) never wait behind each other's polling.
// The first failure is sticky: every later call returns it, and the device
// sees FifoHostWords.error and stops waiting.
type Service struct {
	tr      transport.Transport
	alloc   Allocator
	opts    Options
	timeout time.Duration
	trMu    sync.Mutex // held around transport calls unless it is concurrent
	trLock  bool

	regMu  sync.Mutex // registrations and FIFO creation
	tables atomic.Pointer[tables]
	fifos  []*FIFO

	failed atomic.Pointer[error]
	stop   atomic.Bool
	closed bool
}

// New returns a Service over tr whose FIFOs come from alloc.
func New(tr transport.Transport, alloc Allocator, opts Options) (*Service, error) {
	if tr == nil || alloc == nil {
		return nil, status.Errorf(status.InvalidArgument, "proxy: nil transport or allocator")
	}
	if opts.Slots == 0 {
		opts.Slots = DefaultSlots
	}
	if opts.Slots < 2 || opts.Slots&(opts.Slots-1) != 0 || opts.Slots > 1<<30 {
		return nil, status.Errorf(status.InvalidArgument, "proxy: %d FIFO slots, want a power of two", opts.Slots)
	}
	if opts.IdleSpin == 0 {
		opts.IdleSpin = time.Millisecond
	}
	if opts.IdleNap == 0 {
		opts.IdleNap = time.Second
	}
	s := &Service{tr: tr, alloc: alloc, opts: opts, timeout: opts.Timeout}
	if s.timeout <= 0 {
		s.timeout = DefaultTimeout
	}
	c, ok := tr.(ConcurrentTransport)
	s.trLock = !ok || !c.Concurrent()
	s.tables.Store(&tables{})
	return s, nil
}

// Err returns the Service's sticky error, nil while it is healthy.
func (s *Service) Err() error {
	if p := s.failed.Load(); p != nil {
		return *p
	}
	return nil
}

// fail records err as the sticky error (the first one wins) and tells
// every FIFO's device side.
func (s *Service) fail(err error) {
	if !s.failed.CompareAndSwap(nil, &err) {
		return
	}
	s.regMu.Lock()
	defer s.regMu.Unlock()
	for _, f := range s.fifos {
		atomic.StoreUint32(&f.hw.Error, ErrCodeProxy)
	}
}

func (s *Service) register(add func(t *tables) (uint32, error)) (uint32, error) {
	s.regMu.Lock()
	defer s.regMu.Unlock()
	if s.closed {
		return 0, status.Errorf(status.State, "proxy used after Close")
	}
	old := s.tables.Load()
	t := &tables{locals: old.locals, remotes: old.remotes, channels: old.channels}
	id, err := add(t)
	if err == nil {
		s.tables.Store(t)
	}
	return id, err
}

// AddLocal makes l a source of puts and returns its id (a trigger's
// src_memory).
func (s *Service) AddLocal(l transport.Local) (uint32, error) {
	return s.register(func(t *tables) (uint32, error) {
		if len(t.locals) >= InlineMemory {
			return 0, status.Errorf(status.Capacity, "proxy: more than %d local memories", InlineMemory)
		}
		t.locals = append(t.locals[:len(t.locals):len(t.locals)], l)
		return uint32(len(t.locals) - 1), nil
	})
}

// AddRemote makes r a destination of puts and returns its id (a
// trigger's dst_memory).
func (s *Service) AddRemote(r transport.Remote) (uint32, error) {
	return s.register(func(t *tables) (uint32, error) {
		if len(t.remotes) >= MaxMemories {
			return 0, status.Errorf(status.Capacity, "proxy: more than %d remote memories", MaxMemories)
		}
		t.remotes = append(t.remotes[:len(t.remotes):len(t.remotes)], r)
		return uint32(len(t.remotes) - 1), nil
	})
}

// AddChannel registers a channel to peer whose signals add to the 64-bit
// word at semOffset of sem (nil: the channel never signals), and returns
// its id.
func (s *Service) AddChannel(peer int, sem transport.Remote, semOffset uint64) (uint32, error) {
	return s.register(func(t *tables) (uint32, error) {
		if len(t.channels) >= MaxChannels {
			return 0, status.Errorf(status.Capacity, "proxy: more than %d channels", MaxChannels)
		}
		if sem != nil && (semOffset%8 != 0 || semOffset+8 > sem.Size()) {
			return 0, status.Errorf(status.InvalidArgument,
				"proxy: semaphore at offset %d of a %d-byte memory of peer %d", semOffset, sem.Size(), peer)
		}
		t.channels = append(t.channels[:len(t.channels):len(t.channels)], channel{peer, sem, semOffset, new(atomic.Bool)})
		return uint32(len(t.channels) - 1), nil
	})
}

// NewFIFO allocates a FIFO and starts its proxy goroutine.
func (s *Service) NewFIFO() (*FIFO, error) {
	s.regMu.Lock()
	defer s.regMu.Unlock()
	if s.closed {
		return nil, status.Errorf(status.State, "proxy used after Close")
	}
	f, err := newFIFO(s, uint32(len(s.fifos)), uint64(s.opts.Slots))
	if err != nil {
		return nil, err
	}
	if s.Err() != nil {
		atomic.StoreUint32(&f.hw.Error, ErrCodeProxy)
	}
	bound := make(chan error, 1)
	go s.serve(f, bound)
	if err := <-bound; err != nil {
		<-f.done
		_ = f.free()
		return nil, fmt.Errorf("proxy for FIFO %d: %w", f.id, err)
	}
	s.fifos = append(s.fifos, f)
	return f, nil
}

// serve is one FIFO's proxy: it pops triggers in order and runs them,
// publishing done after each. After a failure it keeps popping without
// running anything, so pushers never block on a full ring; done stays put
// and every waiter sees the error instead.
func (s *Service) serve(f *FIFO, bound chan<- error) {
	defer close(f.done)
	runtime.LockOSThread() // the CUDA context belongs to the OS thread
	defer runtime.UnlockOSThread()
	if s.opts.Bind != nil {
		if err := s.opts.Bind(); err != nil {
			bound <- err
			return
		}
	}
	bound <- nil
	defer s.drain(f)
	last := time.Now()
	// busy: a trigger ran or progress moved since the clock was last read;
	// napping: the proxy was idle past IdleSpin at that read.
	busy, napping := false, false
	for idle := 0; !s.stop.Load(); {
		t, pos, ok := f.pop()
		if !ok {
			// No runtime.Gosched here: on a locked thread it hands the
			// thread off and back through futexes, tens of microseconds
			// that a trigger arriving meanwhile waits out. Progress often:
			// a UCX target's data moves only while it progresses.
			idle++
			if idle&7 != 0 {
				continue
			}
			if s.progress() {
				busy, napping = true, false
			}
			// While spinning, the clock only every 1024th look: the nap
			// decision needs no finer grain, and every read of it is a
			// look at the ring that comes later.
			if !napping && idle&1023 != 0 {
				continue
			}
			now := time.Now()
			if busy {
				last, busy = now, false
				continue
			}
			switch idleFor := now.Sub(last); {
			case idleFor > s.opts.IdleNap:
				napping = true
				sleep(time.Millisecond)
			case idleFor > s.opts.IdleSpin:
				napping = true
				Nap()
			}
			continue
		}
		idle, busy, napping = 0, true, false
		if s.Err() == nil {
			op := Decode(t)
			traceOp('p', f, pos, op)
			if err := s.run(f, op, pos); err != nil {
				s.fail(err)
				continue
			}
			atomic.StoreUint64(&f.hw.Done, pos+1)
			traceOp('d', f, pos, op)
		}
	}
}

// drain runs, at Close, the triggers already in f's ring: a kernel that
// finished has pushed them, and its peers wait for what they carry.
func (s *Service) drain(f *FIFO) {
	for {
		t, pos, ok := f.pop()
		if !ok {
			return
		}
		if s.Err() != nil {
			continue
		}
		if err := s.run(f, Decode(t), pos); err != nil {
			s.fail(err)
			continue
		}
		atomic.StoreUint64(&f.hw.Done, pos+1)
	}
}

// progress advances the transport and reports whether it is active.
func (s *Service) progress() bool {
	if s.Err() != nil {
		return false
	}
	s.lockTransport()
	active, err := s.tr.Progress()
	s.unlockTransport()
	if err != nil {
		s.fail(fmt.Errorf("proxy: %s progress: %w", s.tr.Name(), err))
	}
	return active
}

// Nap sleeps about 20 microseconds in the kernel: time.Sleep of so little
// can take the runtime's timer granularity (up to a millisecond), and an
// idle proxy (or a host waiting on a channel) still polls.
func Nap() { sleep(20 * time.Microsecond) }

// sleep sleeps in the kernel, keeping the locked thread.
func sleep(d time.Duration) {
	ts := unix.NsecToTimespec(int64(d))
	_ = unix.Nanosleep(&ts, nil)
}

func (s *Service) lockTransport() {
	if s.trLock {
		s.trMu.Lock()
	}
}

func (s *Service) unlockTransport() {
	if s.trLock {
		s.trMu.Unlock()
	}
}

// run executes one trigger: put, then signal, then flush, as its type says.
func (s *Service) run(f *FIFO, op Op, pos uint64) error {
	t := s.tables.Load()
	where := func() string { return fmt.Sprintf("FIFO %d position %d (%s)", f.id, pos, describe(t, op)) }
	if int(op.Channel) >= len(t.channels) {
		return status.Errorf(status.InvalidArgument, "proxy: %s: channel %d is not registered", where(), op.Channel)
	}
	ch := t.channels[op.Channel]
	s.lockTransport()
	defer s.unlockTransport()
	signalled := false // the put took the signal along
	if op.Type&TriggerPut != 0 {
		var err error
		if signalled, err = s.put(f, op, t, ch, where); err != nil {
			return err
		}
		if op.Size > 0 {
			ch.unflushed.Store(true) // once the put is under way, so that a flush after this sees it
		}
		traceOp('u', f, pos, op)
	}
	if op.Type&TriggerSignal != 0 {
		if ch.sem == nil {
			return status.Errorf(status.InvalidArgument, "proxy: %s: the channel has no semaphore", where())
		}
		if !signalled {
			if err := s.tr.Signal(ch.sem, ch.semOff, 1); err != nil {
				return fmt.Errorf("proxy: %s: %s signal: %w", where(), s.tr.Name(), err)
			}
		}
		ch.unflushed.Store(true)
		traceOp('s', f, pos, op)
	}
	if op.Type&TriggerFlush != 0 && ch.unflushed.Swap(false) {
		if err := s.tr.Flush(ch.peer); err != nil {
			return fmt.Errorf("proxy: %s: %s flush: %w", where(), s.tr.Name(), err)
		}
	}
	return nil
}

// put runs a trigger's put: from a registered local memory, or the bytes an
// inline put carried (popped into f.payload). A put from registered memory
// with a signal behind it goes as one transport call where the transport
// takes them so (transport.PutSignaler); signalled says it did.
func (s *Service) put(f *FIFO, op Op, t *tables, ch channel, where func() string) (signalled bool, err error) {
	inline := op.SrcMemory == InlineMemory
	if int(op.DstMemory) >= len(t.remotes) || (!inline && int(op.SrcMemory) >= len(t.locals)) {
		return false, status.Errorf(status.InvalidArgument, "proxy: %s: memory not registered", where())
	}
	dst := t.remotes[op.DstMemory]
	if op.DstOffset+op.Size > dst.Size() {
		return false, status.Errorf(status.InvalidArgument, "proxy: %s: out of bounds (destination %d bytes)", where(), dst.Size())
	}
	if !inline {
		src := t.locals[op.SrcMemory]
		if op.SrcOffset+op.Size > src.Size() {
			return false, status.Errorf(status.InvalidArgument, "proxy: %s: out of bounds (source %d bytes)", where(), src.Size())
		}
		if op.Size == 0 {
			return false, nil
		}
		if ps, ok := s.tr.(transport.PutSignaler); ok && op.Type&TriggerSignal != 0 && ch.sem != nil {
			if err := ps.PutWithSignal(dst, op.DstOffset, src, op.SrcOffset, op.Size, ch.sem, ch.semOff, 1); err != nil {
				return false, fmt.Errorf("proxy: %s: %s put with signal: %w", where(), s.tr.Name(), err)
			}
			return true, nil
		}
		if err := s.tr.Put(dst, op.DstOffset, src, op.SrcOffset, op.Size); err != nil {
			return false, fmt.Errorf("proxy: %s: %s put: %w", where(), s.tr.Name(), err)
		}
		return false, nil
	}
	ip, ok := s.tr.(transport.InlinePutter)
	switch {
	case !ok:
		return false, status.Errorf(status.InvalidArgument, "proxy: %s: an inline put, which %s does not take", where(), s.tr.Name())
	case op.Size > InlineBytes:
		return false, status.Errorf(status.InvalidArgument, "proxy: %s: an inline put of more than %d bytes", where(), InlineBytes)
	case op.Size == 0:
		return false, nil
	}
	if err := ip.PutInline(dst, op.DstOffset, f.payload[:op.Size]); err != nil {
		return false, fmt.Errorf("proxy: %s: %s put: %w", where(), s.tr.Name(), err)
	}
	return false, nil
}

// describe names a trigger for errors: its kind, channel and peer.
func describe(t *tables, op Op) string {
	var kind []string
	for _, k := range []struct {
		bit  uint32
		name string
	}{{TriggerPut, "put"}, {TriggerSignal, "signal"}, {TriggerFlush, "flush"}} {
		if op.Type&k.bit != 0 {
			kind = append(kind, k.name)
		}
	}
	peer := "unregistered"
	if int(op.Channel) < len(t.channels) {
		peer = fmt.Sprintf("peer %d", t.channels[op.Channel].peer)
	}
	name := "empty trigger"
	if len(kind) > 0 {
		name = fmt.Sprint(kind)
	}
	if op.Type&TriggerPut != 0 {
		name += fmt.Sprintf(" of %d bytes", op.Size)
		if op.SrcMemory == InlineMemory {
			name += " inline"
		}
	}
	return fmt.Sprintf("%s on channel %d, %s", name, op.Channel, peer)
}

func (s *Service) describe(op Op) string { return describe(s.tables.Load(), op) }

func (s *Service) describeChannel(c uint32) string {
	t := s.tables.Load()
	if int(c) < len(t.channels) {
		return fmt.Sprintf("channel %d (peer %d)", c, t.channels[c].peer)
	}
	return fmt.Sprintf("channel %d", c)
}

// Close stops every proxy once it has run the triggers already pushed
// (waiting up to the timeout for one inside a transport call) and frees
// the FIFOs. Kernels using them must have finished. It returns the sticky
// error, if any, joined with its own.
func (s *Service) Close() error {
	s.regMu.Lock()
	if s.closed {
		s.regMu.Unlock()
		return s.Err()
	}
	s.closed = true
	fifos := s.fifos
	s.regMu.Unlock()
	s.stop.Store(true)
	errs := []error{s.Err()}
	deadline := time.After(s.timeout)
	for _, f := range fifos {
		select {
		case <-f.done:
			errs = append(errs, f.free())
		case <-deadline:
			// Its memory stays allocated: the stuck goroutine still reads it.
			errs = append(errs, status.Errorf(status.Timeout,
				"proxy: close: FIFO %d's proxy did not stop within %v (stuck in a %s call)", f.id, s.timeout, s.tr.Name()))
		}
	}
	_ = trace.Write() // a diagnostic: a prefix that cannot be written does not fail Close
	return errors.Join(errs...)
}
