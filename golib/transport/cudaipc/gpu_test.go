package cudaipc

import (
	"bytes"
	"math/rand"
	"runtime"
	"slices"
	"testing"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// TestPutSignalFlushGPU puts random ranges of random data between two
// buffers of GPU 0 through the copy engine, signals after each put,
// flushes, and checks every byte and the semaphore's count.
func TestPutSignalFlushGPU(t *testing.T) {
	drv, err := cuda.Load()
	if err != nil {
		t.Skipf("no CUDA driver: %v", err)
	}
	gpus, err := drv.DeviceCount()
	if err != nil || gpus == 0 {
		t.Skipf("no GPU (%d, %v)", gpus, err)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	// One process, one GPU: a second GPU's memory would need peer access
	// between the two contexts here (the communicator maps a peer's memory
	// over IPC instead; the GPU suite's port-channel tests cover that).
	for dstGPU := 0; dstGPU < 1; dstGPU++ {
		const n = 8 << 20
		alloc := func(ordinal int) uintptr {
			if err := drv.EnsureContext(ordinal); err != nil {
				t.Fatal(err)
			}
			p, err := drv.MemAlloc(n)
			if err != nil {
				t.Fatal(err)
			}
			if err := drv.MemsetD8Async(p, 0, n, 0); err != nil {
				t.Fatal(err)
			}
			if err := drv.StreamSynchronize(0); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = drv.MemFree(p) })
			return p
		}
		dst, sem := alloc(dstGPU), alloc(dstGPU)
		src := alloc(0) // the transport runs in GPU 0's context
		data := make([]byte, n)
		rand.New(rand.NewSource(int64(dstGPU))).Read(data)
		host, err := drv.MemHostAlloc(n, cuda.HostAllocPortable)
		if err != nil {
			t.Fatal(err)
		}
		copy(unsafe.Slice((*byte)(host), n), data)
		if err := drv.MemcpyAsync(src, uintptr(host), n, 0); err == nil {
			err = drv.StreamSynchronize(0)
		}
		_ = drv.MemFreeHost(host)
		if err != nil {
			t.Fatal(err)
		}
		tr, err := New(drv, nil, 20*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		l, err := tr.Register(src, n, transport.DeviceMemory)
		if err != nil {
			t.Fatal(err)
		}
		// The receiving side registers its memory in its own device's context,
		// as the rank that owns it would.
		remoteOf := func(p uintptr, size uint64) transport.Remote {
			if err := drv.EnsureContext(dstGPU); err != nil {
				t.Fatal(err)
			}
			loc, err := tr.Register(p, size, transport.DeviceMemory)
			if err == nil {
				err = drv.EnsureContext(0)
			}
			if err != nil {
				t.Fatal(err)
			}
			r, err := tr.Remote(1, loc.Key())
			if err != nil {
				t.Fatal(err)
			}
			return r
		}
		rd, rs := remoteOf(dst, n), remoteOf(sem, 64)
		// Random cuts of [0, n) put in a random order: every byte once.
		rng := rand.New(rand.NewSource(5))
		cuts := []uint64{0, n}
		for i := 0; i < 200; i++ {
			cuts = append(cuts, uint64(rng.Intn(n)))
		}
		slices.Sort(cuts)
		order := rng.Perm(len(cuts) - 1)
		for _, i := range order {
			if err := tr.Put(rd, cuts[i], l, cuts[i], cuts[i+1]-cuts[i]); err != nil {
				t.Fatal(err)
			}
			if err := tr.Signal(rs, 8, 1); err != nil {
				t.Fatal(err)
			}
		}
		if err := tr.Flush(1); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, n)
		if err := drv.MemcpyDtoH(got, dst); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, data) {
			for i := range data {
				if got[i] != data[i] {
					t.Fatalf("GPU 0 -> GPU %d: byte %d = %#x, want %#x", dstGPU, i, got[i], data[i])
				}
			}
		}
		var word [16]byte
		if err := drv.MemcpyDtoH(word[:], sem); err != nil {
			t.Fatal(err)
		}
		if c0, c1 := *(*uint64)(unsafe.Pointer(&word[0])), *(*uint64)(unsafe.Pointer(&word[8])); c0 != 0 || c1 != uint64(len(order)) {
			t.Errorf("GPU 0 -> GPU %d: semaphore words = %d, %d; want 0, %d", dstGPU, c0, c1, len(order))
		}
		if err := tr.Close(); err != nil {
			t.Error(err)
		}
	}
}
