package gpucoll

import (
	"fmt"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// StreamBarrier enqueues a device-side barrier among all ranks on stream:
// a deferred one-shot kernel with no elements is exactly one start barrier,
// one round of flags over NVLink. That is a whole barrier: a peer's flag
// arrives only after every kernel it enqueued earlier has finished (stream
// order), and flags only grow with the epoch, so no end barrier is needed
// before the slots are reused, and a second round trip would only add a
// flag's flight to every barrier.
// Capturable in CUDA graphs; bounded like every wait. Its kernel is the
// one-shot's of barrierDType (Prepare builds it ahead).
func (b *Backend) StreamBarrier(stream uintptr, call collective.Call) error {
	if err := b.Check(); err != nil {
		return err
	}
	if !call.Valid() {
		return status.Errorf(status.InvalidArgument, "stream barrier for unknown call %d", call)
	}
	if b.topo.MultiNode() {
		return b.acrossNodes("a stream barrier")
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	// out must not alias peer_in[rank] for one-shot; scratch is free here.
	// The fence publishes what earlier kernels wrote into peers' memory.
	p := b.fill(0, reduce.Sum, 0)
	p.Out = uint64(b.scratch.Local)
	p.Flags = flagFence | uint32(call)<<callShift
	b.useHalves(p) // deferred: no end barrier; with no elements nothing is staged or read
	return b.launchGrid(collective.OneShot, barrierDType, 1, stream)
}

// barrierDType is the element type of StreamBarrier's one-shot kernel (it
// reduces no element).
const barrierDType = reduce.Float32

// Launch runs a kernel of native/kernels by file and name expression with
// a caller-packed parameter struct (the kernel's one by-value argument), for
// collectives built outside this package (MoE dispatch and combine). The
// kernel must not wait on peers: order it with StreamBarrier.
func (b *Backend) Launch(file, expr string, grid, block, sharedBytes uint32, stream uintptr, params []byte) error {
	if err := b.Check(); err != nil {
		return err
	}
	if grid == 0 || block == 0 || block > 1024 {
		return status.Errorf(status.InvalidArgument, "launch %s: bad geometry grid %d block %d", expr, grid, block)
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	fn, err := b.kernels.named(file, expr)
	if err != nil {
		return err
	}
	if err := b.kernels.allowShared(fn, sharedBytes); err != nil {
		return fmt.Errorf("launch %s with %d bytes of dynamic shared memory: %w", expr, sharedBytes, err)
	}
	if err := b.drv.Launch(fn, grid, block, sharedBytes, stream, params); err != nil {
		return fmt.Errorf("launch %s: %w", expr, err)
	}
	return nil
}

// Prepare compiles and loads the file holding kernel expr (every kernel
// it declares) and the stream barrier's kernel, so that the first launches
// do not compile: a rank compiling there made peers already waiting in a
// kernel time out. Callers run it before a host-side exchange that lines
// the ranks up. Not collective.
func (b *Backend) Prepare(file, expr string) error {
	if err := b.Check(); err != nil {
		return err
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	if _, err := b.kernels.named(file, expr); err != nil {
		return err
	}
	_, err := b.kernels.function(collective.OneShot, barrierDType) // StreamBarrier's kernel
	return err
}

// SMCount is the number of multiprocessors of this rank's GPU (its share of
// them when ranks share GPUs).
func (b *Backend) SMCount() int { return b.sms }

// WaitInfo is what kernels launched through Launch need to bound their own
// waits the way this backend's do (p2p_common.cuh's Waiter): this rank's
// Signal (its abort claim), the device address of the error word that
// Check reads, and the timeout in nanoseconds.
func (b *Backend) WaitInfo() (signal, errWord uintptr, timeoutNs uint64) {
	return b.signal.Peers[b.rank], b.errDev, uint64(b.opts.Timeout.Nanoseconds())
}
