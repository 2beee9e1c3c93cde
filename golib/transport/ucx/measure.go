package ucx

import (
	"fmt"
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

// MeasurePut measures, on host memory, rank 0's put bandwidth to rank 1 for
// each size (puts of one size back to back, then one flush) and the
// round trip of an 8-byte put plus flush. It is collective over bs; ranks
// past 1 only take part in the exchanges. The result is rank 0's.
func MeasurePut(tr *Transport, bs bootstrap.Bootstrap, sizes []uint64, budget time.Duration) ([]Measurement, time.Duration, error) {
	if bs.Size() < 2 {
		return nil, 0, status.Errorf(status.InvalidArgument, "UCX measure: needs 2 ranks, have %d", bs.Size())
	}
	largest := uint64(8)
	for _, s := range sizes {
		largest = max(largest, s)
	}
	mem, err := syscall.Mmap(-1, 0, int(largest)+64, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return nil, 0, status.Errorf(status.Internal, "UCX measure: map %d bytes: %v", largest, err)
	}
	defer syscall.Munmap(mem)
	l, err := tr.Register(uintptr(unsafe.Pointer(&mem[0])), uint64(len(mem)), transport.HostMemory)
	if err != nil {
		return nil, 0, err
	}
	defer l.Close()
	keys, err := bs.AllGather(l.Key())
	if err != nil {
		return nil, 0, err
	}
	if bs.Rank() != 0 {
		// The target progresses, as a proxy does, until rank 0 says done
		// through the last word of its range.
		done := (*uint64)(unsafe.Pointer(&mem[len(mem)-8]))
		deadline := time.Now().Add(tr.timeout + budget*time.Duration(len(sizes)+1))
		for bs.Rank() == 1 && atomic.LoadUint64(done) == 0 {
			if err := tr.Progress(); err != nil {
				return nil, 0, err
			}
			if time.Now().After(deadline) {
				return nil, 0, status.Errorf(status.Timeout, "UCX measure: rank 0 never finished")
			}
		}
		return nil, 0, tr.progressWhile(bs.Barrier)
	}
	dst, err := tr.Remote(1, keys[1])
	if err != nil {
		return nil, 0, err
	}
	defer dst.Close()
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
	n := 0
	start := time.Now()
	for ; time.Since(start) < budget || n == 0; n++ {
		if err := tr.Put(dst, 0, l, 0, 8); err != nil {
			return nil, 0, err
		}
		if err := tr.Flush(1); err != nil {
			return nil, 0, err
		}
	}
	latency := time.Since(start) / time.Duration(n)
	if err := tr.Signal(dst, uint64(len(mem)-8), 1); err != nil {
		return nil, 0, err
	}
	if err := tr.Flush(1); err != nil {
		return nil, 0, err
	}
	if err := tr.progressWhile(bs.Barrier); err != nil {
		return nil, 0, fmt.Errorf("UCX measure: %w", err)
	}
	return out, latency, nil
}
