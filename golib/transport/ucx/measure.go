package ucx

import (
	"encoding/binary"
	"fmt"
	"slices"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// Measurement is one size's put bandwidth from rank 0 to rank 1.
type Measurement struct {
	Bytes      uint64
	Iterations int
	Elapsed    time.Duration
}

// GBps is the bandwidth in 1e9 bytes per second.
func (m Measurement) GBps() float64 {
	return float64(m.Bytes) * float64(m.Iterations) / m.Elapsed.Seconds() / 1e9
}

// MeasurePut measures rank 0's puts to rank 1 on host memory; see
// MeasurePutMemory.
func MeasurePut(tr *Transport, bs bootstrap.Bootstrap, sizes []uint64, budget time.Duration) ([]Measurement, time.Duration, error) {
	mmap := func(size uint64) (uintptr, error) {
		mem, err := syscall.Mmap(-1, 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
		if err != nil {
			return 0, err
		}
		return uintptr(unsafe.Pointer(&mem[0])), nil // left mapped: a measurement runs once
	}
	return MeasurePutMemory(tr, bs, sizes, budget, transport.HostMemory, mmap)
}

// MeasurePutMemory measures rank 0's put bandwidth to rank 1 for each size
// (puts of one size back to back from one buffer to one buffer, then one
// flush) and the median round trip of an 8-byte put plus flush, with both
// buffers of kind mem from alloc: device memory, with a Copier given to
// Open, measures the staged path, flush included (data copied into the
// peer's device memory). It is collective over bs; ranks past 1 only take
// part in the exchanges. The result is rank 0's.
//
// The same quantities from UCX alone, between two processes (server
// first, then client; add -m cuda for device memory):
//
//	ucx_perftest -p PORT
//	ucx_perftest HOST -p PORT -t ucp_put_bw -s SIZE -n ITERS
//	ucx_perftest HOST -p PORT -t ucp_put_lat -s 8 -n ITERS
//
// put_bw is comparable with the bandwidth here; put_lat reports half of a
// ping-pong, so twice its 50th percentile compares with the round trip
// here. Run both with the same UCX_TLS (e.g. UCX_TLS=tcp,self, or tcp,
// cuda_copy,self for device memory over tcp).
func MeasurePutMemory(tr *Transport, bs bootstrap.Bootstrap, sizes []uint64, budget time.Duration,
	mem transport.Memory, alloc func(size uint64) (uintptr, error)) ([]Measurement, time.Duration, error) {
	if bs.Size() < 2 {
		return nil, 0, status.Errorf(status.InvalidArgument, "UCX measure: needs 2 ranks, have %d", bs.Size())
	}
	largest := uint64(8)
	for _, s := range sizes {
		largest = max(largest, s)
	}
	buf, err := alloc(largest)
	if err != nil {
		return nil, 0, status.Errorf(status.Internal, "UCX measure: allocate %d bytes of %s memory: %v", largest, mem, err)
	}
	l, err := tr.Register(buf, largest, mem)
	if err != nil {
		return nil, 0, err
	}
	defer l.Close()
	// The done word lives in host memory of its own: the target polls it.
	word, err := syscall.Mmap(-1, 0, 8, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return nil, 0, status.Errorf(status.Internal, "UCX measure: map the done word: %v", err)
	}
	defer syscall.Munmap(word)
	lw, err := tr.Register(uintptr(unsafe.Pointer(&word[0])), 8, transport.HostMemory)
	if err != nil {
		return nil, 0, err
	}
	defer lw.Close()
	keys, err := bs.AllGather(append(binary.LittleEndian.AppendUint32(nil, uint32(len(l.Key()))), append(l.Key(), lw.Key()...)...))
	if err != nil {
		return nil, 0, err
	}
	if bs.Rank() != 0 {
		// The target progresses, as a proxy does, until rank 0 says done.
		done := (*uint64)(unsafe.Pointer(&word[0]))
		deadline := time.Now().Add(tr.timeout + budget*time.Duration(len(sizes)+1))
		for bs.Rank() == 1 && atomic.LoadUint64(done) == 0 {
			if _, err := tr.Progress(); err != nil {
				return nil, 0, err
			}
			if time.Now().After(deadline) {
				return nil, 0, status.Errorf(status.Timeout, "UCX measure: rank 0 never finished")
			}
		}
		return nil, 0, tr.progressWhile(bs.Barrier)
	}
	k := keys[1]
	if len(k) < 4 || uint64(len(k)-4) < uint64(binary.LittleEndian.Uint32(k)) {
		return nil, 0, status.Errorf(status.Mismatch, "UCX measure: rank 1 sent a %d-byte key", len(k))
	}
	n := binary.LittleEndian.Uint32(k)
	dst, err := tr.Remote(1, k[4:4+n])
	if err != nil {
		return nil, 0, err
	}
	defer dst.Close()
	dw, err := tr.Remote(1, k[4+n:])
	if err != nil {
		return nil, 0, err
	}
	defer dw.Close()
	var out []Measurement
	for _, size := range sizes {
		m := Measurement{Bytes: size}
		start := time.Now()
		for batch := 1; time.Since(start) < budget; batch *= 2 {
			for range batch {
				if err := tr.Put(dst, 0, l, 0, size); err != nil {
					return nil, 0, err
				}
			}
			if err := tr.Flush(1); err != nil {
				return nil, 0, err
			}
			m.Iterations += batch
		}
		m.Elapsed = time.Since(start)
		out = append(out, m)
	}
	var trips []time.Duration
	for start := time.Now(); time.Since(start) < budget || len(trips) == 0; {
		t0 := time.Now()
		if err := tr.Put(dst, 0, l, 0, 8); err != nil {
			return nil, 0, err
		}
		if err := tr.Flush(1); err != nil {
			return nil, 0, err
		}
		trips = append(trips, time.Since(t0))
	}
	slices.Sort(trips)
	if err := tr.Signal(dw, 0, 1); err != nil {
		return nil, 0, err
	}
	if err := tr.Flush(1); err != nil {
		return nil, 0, err
	}
	if err := tr.progressWhile(bs.Barrier); err != nil {
		return nil, 0, fmt.Errorf("UCX measure: %w", err)
	}
	return out, trips[len(trips)/2], nil
}

// MeasurePingPong measures the one-way latency of an 8-byte put with a
// signal behind it (what a PortChannel's putWithSignal asks of the
// transport) between ranks 0 and 1: each rank in turn puts 8 bytes of
// kind mem from alloc and signals, the other progresses until the signal
// word changes and answers. The result is the median of half round trips,
// on rank 0. It is collective over bs; ranks past 1 only take part in the
// exchanges. ucx_perftest's ucp_put_lat with -s 8 is the same quantity for
// a bare put.
func MeasurePingPong(tr *Transport, bs bootstrap.Bootstrap, budget time.Duration,
	mem transport.Memory, alloc func(size uint64) (uintptr, error)) (time.Duration, error) {
	if bs.Size() < 2 {
		return 0, status.Errorf(status.InvalidArgument, "UCX ping-pong: needs 2 ranks, have %d", bs.Size())
	}
	buf, err := alloc(8)
	if err != nil {
		return 0, status.Errorf(status.Internal, "UCX ping-pong: allocate 8 bytes of %s memory: %v", mem, err)
	}
	l, err := tr.Register(buf, 8, mem)
	if err != nil {
		return 0, err
	}
	defer l.Close()
	// Word 0 counts the peer's signals; word 1 is rank 0's "stop".
	word, err := syscall.Mmap(-1, 0, 16, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return 0, status.Errorf(status.Internal, "UCX ping-pong: map the signal words: %v", err)
	}
	defer syscall.Munmap(word)
	lw, err := tr.Register(uintptr(unsafe.Pointer(&word[0])), 16, transport.HostMemory)
	if err != nil {
		return 0, err
	}
	defer lw.Close()
	keys, err := bs.AllGather(append(binary.LittleEndian.AppendUint32(nil, uint32(len(l.Key()))), append(l.Key(), lw.Key()...)...))
	if err != nil {
		return 0, err
	}
	me := bs.Rank()
	if me > 1 {
		return 0, tr.progressWhile(bs.Barrier)
	}
	peer := 1 - me
	k := keys[peer]
	if len(k) < 4 || uint64(len(k)-4) < uint64(binary.LittleEndian.Uint32(k)) {
		return 0, status.Errorf(status.Mismatch, "UCX ping-pong: rank %d sent a %d-byte key", peer, len(k))
	}
	n := binary.LittleEndian.Uint32(k)
	dst, err := tr.Remote(peer, k[4:4+n])
	if err != nil {
		return 0, err
	}
	defer dst.Close()
	dw, err := tr.Remote(peer, k[4+n:])
	if err != nil {
		return 0, err
	}
	defer dw.Close()
	signals := (*uint64)(unsafe.Pointer(&word[0]))
	stop := (*uint64)(unsafe.Pointer(&word[8]))
	deadline := time.Now().Add(tr.timeout + 2*budget)
	// await progresses until the peer's i-th signal arrived, or rank 0 says
	// stop (rank 1 only).
	await := func(i uint64) (bool, error) {
		for p := 0; atomic.LoadUint64(signals) < i; p++ {
			if me == 1 && atomic.LoadUint64(stop) != 0 {
				return false, nil
			}
			if _, err := tr.Progress(); err != nil {
				return false, err
			}
			if p%256 == 255 && time.Now().After(deadline) {
				return false, status.Errorf(status.Timeout, "UCX ping-pong: signal %d of rank %d did not arrive within %v", i, peer, tr.timeout)
			}
		}
		return true, nil
	}
	send := func() error {
		if err := tr.Put(dst, 0, l, 0, 8); err != nil {
			return err
		}
		return tr.Signal(dw, 0, 1)
	}
	var trips []time.Duration
	start := time.Now()
	for i := uint64(1); ; i++ {
		if me == 1 {
			if ok, err := await(i); err != nil || !ok {
				if err != nil {
					return 0, err
				}
				break
			}
			if err := send(); err != nil {
				return 0, err
			}
			continue
		}
		if len(trips) >= 100 && time.Since(start) > budget {
			break
		}
		t0 := time.Now()
		if err := send(); err != nil {
			return 0, err
		}
		if _, err := await(i); err != nil {
			return 0, err
		}
		trips = append(trips, time.Since(t0))
	}
	if me == 0 {
		if err := tr.Signal(dw, 8, 1); err != nil {
			return 0, err
		}
	}
	if err := tr.Flush(peer); err != nil {
		return 0, err
	}
	if err := tr.progressWhile(bs.Barrier); err != nil {
		return 0, fmt.Errorf("UCX ping-pong: %w", err)
	}
	if me != 0 {
		return 0, nil
	}
	slices.Sort(trips)
	return trips[len(trips)/2] / 2, nil
}
