// Command capi is the C ABI of p2pcomm, built with -buildmode=c-shared into
// libp2pcomm.so. Every export takes plain integers and pointers, returns a
// status code (golib/status), recovers panics, and records a message that
// p2p_last_error returns on the same thread.
package main

/*
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

// One all-reduce's arguments in one block: from Python, packing them is
// cheaper than converting eight ctypes arguments (about a microsecond).
typedef struct {
	uint64_t handle, src, dst;
	int64_t count;
	int32_t dtype, op, algo, reserved;
	uint64_t stream;
} p2p_all_reduce_args;

typedef int (*p2p_allgather_fn)(void* ctx, const void* send, int64_t nbytes, void* recv);
typedef int (*p2p_barrier_fn)(void* ctx);

static int call_allgather(p2p_allgather_fn f, void* ctx, const void* send, int64_t n, void* recv) {
	return f(ctx, send, n, recv);
}
static int call_barrier(p2p_barrier_fn f, void* ctx) { return f(ctx); }
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"os"
	"runtime/debug"
	"sync"
	"syscall"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/channel"
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/comm"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/proxy"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// abiVersion changes whenever an export's signature or meaning changes;
// the Python loader refuses a library with another version.
const abiVersion = 11

var loadPid = os.Getpid()

func main() {}

//export p2p_abi_version
func p2p_abi_version() C.int { return abiVersion }

//export p2p_last_error
func p2p_last_error(buf *C.char, capacity C.int64_t) C.int64_t {
	msg := lastErrors.get()
	if buf != nil && capacity > 0 {
		n := min(int(capacity)-1, len(msg))
		dst := unsafe.Slice((*byte)(unsafe.Pointer(buf)), int(capacity))
		copy(dst, msg[:n])
		dst[n] = 0
	}
	return C.int64_t(len(msg))
}

//export p2p_init
func p2p_init(configJSON *C.char, allgather C.p2p_allgather_fn, barrier C.p2p_barrier_fn, ctx unsafe.Pointer, out *C.uint64_t) C.int {
	return guard(func() error {
		var cfg comm.Config
		if err := json.Unmarshal([]byte(C.GoString(configJSON)), &cfg); err != nil {
			return status.Errorf(status.InvalidArgument, "bad init config: %v", err)
		}
		var torchBS bootstrap.Bootstrap
		if allgather != nil {
			rank, size, err := rankSize(cfg)
			if err != nil {
				return err
			}
			torchBS, err = bootstrap.NewCallback(rank, size,
				func(send, recv []byte) error { return callAllGather(allgather, ctx, send, recv) },
				func() error { return callBarrier(barrier, ctx) })
			if err != nil {
				return err
			}
		}
		c, err := comm.New(cfg, torchBS)
		if err != nil {
			return err
		}
		*out = C.uint64_t(handles.add(c))
		return nil
	})
}

func rankSize(cfg comm.Config) (int, int, error) {
	var rank, size int
	_, err1 := fmt.Sscan(cfg.Env["P2PCOMM_GROUP_RANK"], &rank)
	_, err2 := fmt.Sscan(cfg.Env["P2PCOMM_GROUP_SIZE"], &size)
	if err1 != nil || err2 != nil {
		return 0, 0, status.Errorf(status.InvalidArgument, "torch bootstrap needs P2PCOMM_GROUP_RANK and P2PCOMM_GROUP_SIZE in the config")
	}
	return rank, size, nil
}

// The callbacks get C copies: C code must never keep or receive Go pointers
// to memory that holds Go pointers, and these buffers outlive no call.
func callAllGather(f C.p2p_allgather_fn, ctx unsafe.Pointer, send, recv []byte) error {
	cs := C.CBytes(send)
	defer C.free(cs)
	cr := C.malloc(C.size_t(max(len(recv), 1)))
	defer C.free(cr)
	if rc := C.call_allgather(f, ctx, cs, C.int64_t(len(send)), cr); rc != 0 {
		return status.Errorf(status.Bootstrap, "torch.distributed all_gather failed (see the Python exception above)")
	}
	copy(recv, unsafe.Slice((*byte)(cr), len(recv)))
	return nil
}

func callBarrier(f C.p2p_barrier_fn, ctx unsafe.Pointer) error {
	if rc := C.call_barrier(f, ctx); rc != 0 {
		return status.Errorf(status.Bootstrap, "torch.distributed barrier failed (see the Python exception above)")
	}
	return nil
}

// p2p_shutdown ends process-wide state (MPI) once no communicator is
// left; call it at process exit. Safe to call when MPI was never used.
//
//export p2p_shutdown
func p2p_shutdown() C.int {
	return guard(bootstrap.FinalizeMPI)
}

//export p2p_finalize
func p2p_finalize(h C.uint64_t) C.int {
	return guard(func() error {
		c, err := handles.take(uint64(h))
		if err != nil {
			return err
		}
		eps.closeOf(c)
		return c.Close()
	})
}

//export p2p_rank
func p2p_rank(h C.uint64_t, out *C.int32_t) C.int {
	return withComm(h, func(c *comm.Comm) error { *out = C.int32_t(c.Rank()); return nil })
}

//export p2p_world_size
func p2p_world_size(h C.uint64_t, out *C.int32_t) C.int {
	return withComm(h, func(c *comm.Comm) error { *out = C.int32_t(c.Size()); return nil })
}

//export p2p_alloc
func p2p_alloc(h C.uint64_t, nbytes C.int64_t, out *C.uint64_t) C.int {
	return withBackend(h, func(b collective.Backend) error {
		p, err := b.Alloc(int64(nbytes))
		*out = C.uint64_t(p)
		return err
	})
}

//export p2p_free
func p2p_free(h C.uint64_t, ptr C.uint64_t) C.int {
	return withBackend(h, func(b collective.Backend) error { return b.Free(uintptr(ptr)) })
}

//export p2p_register
func p2p_register(h C.uint64_t, ptr C.uint64_t, nbytes C.int64_t) C.int {
	return withBackend(h, func(b collective.Backend) error { return b.Register(uintptr(ptr), int64(nbytes)) })
}

//export p2p_deregister
func p2p_deregister(h C.uint64_t, ptr C.uint64_t) C.int {
	return withBackend(h, func(b collective.Backend) error { return b.Deregister(uintptr(ptr)) })
}

// The block's layout is what Python packs ("<QQQqiiiiQ", 56 bytes).
var _ = [1]struct{}{}[unsafe.Sizeof(C.p2p_all_reduce_args{})-56]

// p2p_all_reduce_packed is p2p_all_reduce with its arguments in a block
// (p2p_all_reduce_args), read before it returns.
//
//export p2p_all_reduce_packed
func p2p_all_reduce_packed(a *C.p2p_all_reduce_args) C.int {
	if a == nil {
		return guard(func() error { return status.Errorf(status.InvalidArgument, "p2p_all_reduce_packed: null arguments") })
	}
	return p2p_all_reduce(C.uint64_t(a.handle), C.uint64_t(a.src), C.uint64_t(a.dst), C.int64_t(a.count),
		C.int32_t(a.dtype), C.int32_t(a.op), C.int32_t(a.algo), C.uint64_t(a.stream))
}

//export p2p_all_reduce
func p2p_all_reduce(h C.uint64_t, src, dst C.uint64_t, count C.int64_t, dtype, op, algo C.int32_t, stream C.uint64_t) C.int {
	return withBackend(h, func(b collective.Backend) error {
		return b.AllReduce(collective.AllReduce{
			Src: uintptr(src), Dst: uintptr(dst), Count: int64(count),
			DType: reduce.DType(dtype), Op: reduce.Op(op), Algo: collective.Algorithm(algo), Stream: uintptr(stream),
		})
	})
}

// p2p_register_graph_buffers collectively registers the inputs of calls
// captured into CUDA graphs since the last time, so replays read them in
// place; *count receives their number (0 on backends without graphs).
//
//export p2p_register_graph_buffers
func p2p_register_graph_buffers(h C.uint64_t, count *C.int64_t) C.int {
	return withBackend(h, func(b collective.Backend) error {
		*count = 0
		g, ok := b.(collective.GraphBuffers)
		if !ok {
			return nil
		}
		n, err := g.RegisterGraphBuffers()
		*count = C.int64_t(n)
		return err
	})
}

// p2p_all_reduce_reject takes part in an all-reduce on behalf of a rank
// whose arguments Python rejected, so its peers fail with a mismatch
// instead of waiting for it; it returns code with message. Count, dtype, op
// and algo are what the rank asked for, as far as they are known: the
// backend picks the peers' kernel from them (the op too: some algorithms
// carry only sums).
//
//export p2p_all_reduce_reject
func p2p_all_reduce_reject(h C.uint64_t, code C.int32_t, message *C.char, count C.int64_t, dtype, op, algo C.int32_t, stream C.uint64_t) C.int {
	return withBackend(h, func(b collective.Backend) error {
		reject := status.Errorf(status.Code(code), "%s", C.GoString(message))
		return b.AllReduce(collective.AllReduce{Reject: reject, Count: int64(count), DType: reduce.DType(dtype),
			Op: reduce.Op(op), Algo: collective.Algorithm(algo), Stream: uintptr(stream)})
	})
}

// p2p_peer_ptr returns where this process maps rank's copy of the
// symmetric or registered range [ptr, ptr+nbytes).
//
//export p2p_peer_ptr
func p2p_peer_ptr(h C.uint64_t, ptr C.uint64_t, nbytes C.int64_t, rank C.int32_t, out *C.uint64_t) C.int {
	return withPeerMemory(h, func(pm collective.PeerMemory) error {
		a, err := pm.PeerAddress(uintptr(ptr), int64(nbytes), int(rank))
		*out = C.uint64_t(a)
		return err
	})
}

// p2p_stream_barrier enqueues a barrier among all ranks on a CUDA stream
// (the CPU backend waits on the host) on behalf of call (collective.Call),
// which a peer's timeout names.
//
//export p2p_stream_barrier
func p2p_stream_barrier(h C.uint64_t, stream C.uint64_t, call C.int) C.int {
	return withPeerMemory(h, func(pm collective.PeerMemory) error {
		return pm.StreamBarrier(uintptr(stream), collective.Call(call))
	})
}

func withPeerMemory(h C.uint64_t, f func(collective.PeerMemory) error) C.int {
	return withBackend(h, func(b collective.Backend) error {
		pm, ok := b.(collective.PeerMemory)
		if !ok {
			return status.Errorf(status.Unsupported, "this backend has no peer-addressable memory")
		}
		return f(pm)
	})
}

// withLauncher runs f on the backend's kernel launcher; what names the
// call in the error of backends without one.
func withLauncher(h C.uint64_t, what string, f func(comm.KernelLauncher) error) C.int {
	return withBackend(h, func(b collective.Backend) error {
		l, ok := b.(comm.KernelLauncher)
		if !ok {
			return status.Errorf(status.Unsupported, "%s need the GPU backend", what)
		}
		return f(l)
	})
}

// p2p_launch runs kernel expr of native/kernels/<file> on stream with the
// nbytes of params as its one by-value argument (GPU backend only).
//
//export p2p_launch
func p2p_launch(h C.uint64_t, file, expr *C.char, params unsafe.Pointer, nbytes C.int64_t, grid, block, shared C.uint32_t, stream C.uint64_t) C.int {
	return withLauncher(h, "kernel launches", func(l comm.KernelLauncher) error {
		if nbytes < 0 || nbytes > 4096 || (nbytes > 0 && params == nil) {
			return status.Errorf(status.InvalidArgument, "kernel parameters of %d bytes", nbytes)
		}
		args := C.GoBytes(params, C.int(nbytes))
		return l.Launch(C.GoString(file), C.GoString(expr), uint32(grid), uint32(block), uint32(shared), uintptr(stream), args)
	})
}

// p2p_prepare_kernel compiles and loads native/kernels/<file> (which
// declares expr) and the stream barrier's kernel (GPU backend only; see
// comm.KernelLauncher).
//
//export p2p_prepare_kernel
func p2p_prepare_kernel(h C.uint64_t, file, expr *C.char) C.int {
	return withLauncher(h, "kernels", func(l comm.KernelLauncher) error {
		return l.Prepare(C.GoString(file), C.GoString(expr))
	})
}

// p2p_device_info reports the GPU's multiprocessor count (0 on CPU).
//
//export p2p_device_info
func p2p_device_info(h C.uint64_t, sms *C.int32_t) C.int {
	return withBackend(h, func(b collective.Backend) error {
		*sms = 0
		if l, ok := b.(comm.KernelLauncher); ok {
			*sms = C.int32_t(l.SMCount())
		}
		return nil
	})
}

// p2p_wait_info reports what kernels launched with p2p_launch need to
// bound their waits like the library's own: this rank's signal block, the
// device address of the error word p2p_check reads, and the timeout in
// nanoseconds (GPU backend only).
//
//export p2p_wait_info
func p2p_wait_info(h C.uint64_t, signal, errWord, timeoutNs *C.uint64_t) C.int {
	return withLauncher(h, "device waits", func(l comm.KernelLauncher) error {
		s, e, t := l.WaitInfo()
		*signal, *errWord, *timeoutNs = C.uint64_t(s), C.uint64_t(e), C.uint64_t(t)
		return nil
	})
}

//export p2p_barrier
func p2p_barrier(h C.uint64_t) C.int {
	return withComm(h, func(c *comm.Comm) error { return c.Barrier() })
}

// p2p_host_allgather gathers nbytes from every rank into recv (rank r's at
// r*nbytes) on the host, through the bootstrap (comm.Comm.AllGather).
//
//export p2p_host_allgather
func p2p_host_allgather(h C.uint64_t, send unsafe.Pointer, nbytes C.int64_t, recv unsafe.Pointer) C.int {
	return withComm(h, func(c *comm.Comm) error {
		if nbytes < 0 || (nbytes > 0 && (send == nil || recv == nil)) {
			return status.Errorf(status.InvalidArgument, "host all-gather: %d bytes at %p into %p", int64(nbytes), send, recv)
		}
		if nbytes > bootstrap.MaxPayload {
			return status.Errorf(status.Capacity, "host all-gather: %d bytes exceeds the limit of %d", int64(nbytes), bootstrap.MaxPayload)
		}
		got, err := c.AllGather(C.GoBytes(send, C.int(nbytes)))
		if err != nil {
			return err
		}
		out := unsafe.Slice((*byte)(recv), int(nbytes)*len(got))
		for r, b := range got {
			copy(out[r*int(nbytes):], b)
		}
		return nil
	})
}

//export p2p_check
func p2p_check(h C.uint64_t) C.int {
	return withComm(h, func(c *comm.Comm) error { return c.Check() })
}

func withComm(h C.uint64_t, f func(*comm.Comm) error) C.int {
	return guard(func() error {
		c, err := handles.get(uint64(h))
		if err != nil {
			return err
		}
		return f(c)
	})
}

func withBackend(h C.uint64_t, f func(collective.Backend) error) C.int {
	return withComm(h, func(c *comm.Comm) error { return c.Do(f) })
}

// guard runs f, turning its error or panic into a status code and a
// message for p2p_last_error. No Go panic crosses the C boundary.
func guard(f func() error) (rc C.int) {
	defer func() {
		if p := recover(); p != nil {
			lastErrors.set(fmt.Sprintf("p2pcomm internal error: %v\n%s", p, debug.Stack()))
			rc = C.int(status.Internal)
		}
	}()
	if inForkedChild() {
		lastErrors.set(fmt.Sprintf("p2pcomm was called from a forked child (pid %d, loaded in %d); create communicators after fork", syscall.Getpid(), loadPid))
		return C.int(status.Fork)
	}
	err := f()
	if err != nil {
		lastErrors.set(err.Error())
	}
	return C.int(status.CodeOf(err))
}

// handleTable maps opaque handles to communicators: C never holds a Go
// pointer.
type handleTable struct {
	mu   sync.Mutex
	next uint64
	m    map[uint64]*comm.Comm
}

var handles = handleTable{m: map[uint64]*comm.Comm{}}

func (t *handleTable) add(c *comm.Comm) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.next++
	t.m[t.next] = c
	return t.next
}

func (t *handleTable) get(h uint64) (*comm.Comm, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if c, ok := t.m[h]; ok {
		return c, nil
	}
	return nil, status.Errorf(status.State, "communicator handle %d is not open (closed or never created)", h)
}

func (t *handleTable) take(h uint64) (*comm.Comm, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	c, ok := t.m[h]
	if !ok {
		return nil, status.Errorf(status.State, "communicator handle %d is not open (closed or never created)", h)
	}
	delete(t.m, h)
	return c, nil
}

// errorTable keeps the last error per OS thread: exports run on the
// caller's thread, so a Python thread reads back its own call's message.
// It holds one entry per thread that ever failed a call: a few strings.
type errorTable struct {
	mu sync.Mutex
	m  map[int]string
}

var lastErrors = errorTable{m: map[int]string{}}

func (t *errorTable) set(msg string) {
	t.mu.Lock()
	t.m[syscall.Gettid()] = msg
	t.mu.Unlock()
}

func (t *errorTable) get() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.m[syscall.Gettid()]
}

// p2p_topology writes the node of each rank into node_of_rank (n entries,
// at least the world size).
//
//export p2p_topology
func p2p_topology(h C.uint64_t, nodeOfRank *C.int32_t, n C.int32_t) C.int {
	return withComm(h, func(c *comm.Comm) error {
		top := c.Topology()
		if nodeOfRank == nil || int(n) < len(top.NodeOf) {
			return status.Errorf(status.InvalidArgument, "topology: room for %d ranks, the world has %d", n, len(top.NodeOf))
		}
		out := unsafe.Slice((*int32)(unsafe.Pointer(nodeOfRank)), int(n))
		for r, node := range top.NodeOf {
			out[r] = int32(node)
		}
		return nil
	})
}

// p2p_channel_sizes reports the sizes of the device structs
// MemoryChannel and PortChannel (channel.cuh).
//
//export p2p_channel_sizes
func p2p_channel_sizes(memoryChannel, portChannel *C.uint64_t) C.int {
	return guard(func() error {
		if memoryChannel == nil || portChannel == nil {
			return status.Errorf(status.InvalidArgument, "channel sizes: null output")
		}
		*memoryChannel = C.uint64_t(unsafe.Sizeof(proxy.MemoryChannel{}))
		*portChannel = C.uint64_t(unsafe.Sizeof(proxy.PortChannel{}))
		return nil
	})
}

// p2p_memory_channels builds memory channels over [ptr, ptr+nbytes) of
// symmetric or registered device memory: out (out_len bytes) receives one
// MemoryChannel per rank, entry r the channel to rank r (zero for this rank
// and ranks of other nodes); *set the set's id. Collective.
//
//export p2p_memory_channels
func p2p_memory_channels(h, ptr, nbytes C.uint64_t, out unsafe.Pointer, outLen C.uint64_t, set *C.uint64_t) C.int {
	return withComm(h, func(c *comm.Comm) error {
		bad := channelOut(out, uint64(outLen), set, c.Size(), unsafe.Sizeof(proxy.MemoryChannel{}))
		return c.WithChannels(func(ch *channel.Channels) error {
			if bad != nil {
				return ch.Reject(channel.Memory, bad)
			}
			id, handles, err := ch.MemoryChannels(uintptr(ptr), uint64(nbytes))
			if err != nil {
				return err
			}
			copy(unsafe.Slice((*proxy.MemoryChannel)(out), len(handles)), handles)
			*set = C.uint64_t(id)
			return nil
		})
	})
}

// p2p_port_channels builds port channels over [ptr, ptr+nbytes) of
// symmetric or registered memory: out (out_len bytes) receives one
// PortChannel per rank, entry r the channel to rank r (zero for this rank);
// *set the set's id. Collective; the first call opens the transports.
//
//export p2p_port_channels
func p2p_port_channels(h, ptr, nbytes C.uint64_t, out unsafe.Pointer, outLen C.uint64_t, set *C.uint64_t) C.int {
	return withComm(h, func(c *comm.Comm) error {
		bad := channelOut(out, uint64(outLen), set, c.Size(), unsafe.Sizeof(proxy.PortChannel{}))
		return c.WithChannels(func(ch *channel.Channels) error {
			if bad != nil {
				return ch.Reject(channel.Port, bad)
			}
			id, handles, err := ch.PortChannels(uintptr(ptr), uint64(nbytes))
			if err != nil {
				return err
			}
			copy(unsafe.Slice((*proxy.PortChannel)(out), len(handles)), handles)
			*set = C.uint64_t(id)
			return nil
		})
	})
}

// channelOut checks the output of a channel call: room for one entry of
// size bytes per rank, 8-byte aligned. A rank with a bad buffer still takes
// part in the call's first agreement (Channels.Reject), so its peers fail
// with its reason instead of waiting for it.
func channelOut(out unsafe.Pointer, outLen uint64, set *C.uint64_t, world int, size uintptr) error {
	if out == nil || set == nil || uintptr(out)%8 != 0 || outLen < uint64(world)*uint64(size) {
		return status.Errorf(status.InvalidArgument, "channels: output of %d bytes at %p for %d entries of %d bytes (8-byte aligned)",
			outLen, out, world, size)
	}
	clear(unsafe.Slice((*byte)(out), uint64(world)*uint64(size)))
	return nil
}

// p2p_channels_close ends the use of a channel set (its memory stays until
// the communicator closes). Not collective.
//
//export p2p_channels_close
func p2p_channels_close(h, set C.uint64_t) C.int {
	return withChannels(h, func(ch *channel.Channels) error { return ch.CloseSet(uint64(set)) })
}

// p2p_port_put queues, through the set's FIFO, a copy of bytes from src_off
// of this rank's range to dst_off of peer's. Host-reachable FIFOs only (the
// CPU backend).
//
//export p2p_port_put
func p2p_port_put(h, set C.uint64_t, peer C.int32_t, dstOff, srcOff, bytes C.uint64_t) C.int {
	return withChannels(h, func(ch *channel.Channels) error {
		return ch.Put(uint64(set), int(peer), uint64(dstOff), uint64(srcOff), uint64(bytes))
	})
}

// p2p_port_signal queues one signal to peer after this rank's earlier puts.
//
//export p2p_port_signal
func p2p_port_signal(h, set C.uint64_t, peer C.int32_t) C.int {
	return withChannels(h, func(ch *channel.Channels) error { return ch.Signal(uint64(set), int(peer)) })
}

// p2p_port_flush waits until every put and signal queued to peer landed.
//
//export p2p_port_flush
func p2p_port_flush(h, set C.uint64_t, peer C.int32_t) C.int {
	return withChannels(h, func(ch *channel.Channels) error { return ch.Flush(uint64(set), int(peer)) })
}

// p2p_port_wait waits until peer has signalled this rank count times in all
// through the set, bounded by P2PCOMM_TIMEOUT_MS.
//
//export p2p_port_wait
func p2p_port_wait(h, set C.uint64_t, peer C.int32_t, count C.uint64_t) C.int {
	return withChannels(h, func(ch *channel.Channels) error { return ch.Wait(uint64(set), int(peer), uint64(count)) })
}

func withChannels(h C.uint64_t, f func(*channel.Channels) error) C.int {
	return withComm(h, func(c *comm.Comm) error { return c.WithChannels(f) })
}

// p2p_kernel_compile compiles a user kernel for the communicator's GPU with
// native/kernels' headers on the include path; name is a kernel name or a
// name expression ("k<float>"). *kernel receives its id (GPU backend only).
//
//export p2p_kernel_compile
func p2p_kernel_compile(h C.uint64_t, source, name *C.char, kernel *C.uint64_t) C.int {
	return withUserKernels(h, func(u comm.UserKernels) error {
		if source == nil || name == nil || kernel == nil {
			return status.Errorf(status.InvalidArgument, "kernel compile: null argument")
		}
		id, err := u.CompileKernel(C.GoString(source), C.GoString(name))
		*kernel = C.uint64_t(id)
		return err
	})
}

// p2p_kernel_params writes the offset and size of each of the kernel's
// parameters (up to max) and *n, their number.
//
//export p2p_kernel_params
func p2p_kernel_params(h, kernel C.uint64_t, offsets, sizes *C.uint64_t, maxParams C.int32_t, n *C.int32_t) C.int {
	return withUserKernels(h, func(u comm.UserKernels) error {
		if n == nil || maxParams < 0 || (maxParams > 0 && (offsets == nil || sizes == nil)) {
			return status.Errorf(status.InvalidArgument, "kernel params: bad output arrays")
		}
		params, err := u.KernelParams(uint64(kernel))
		if err != nil {
			return err
		}
		*n = C.int32_t(len(params))
		if len(params) > int(maxParams) {
			return status.Errorf(status.Capacity, "kernel params: the kernel has %d parameters, room for %d", len(params), maxParams)
		}
		if len(params) > 0 {
			offs := unsafe.Slice((*uint64)(unsafe.Pointer(offsets)), len(params))
			szs := unsafe.Slice((*uint64)(unsafe.Pointer(sizes)), len(params))
			for i, p := range params {
				offs[i], szs[i] = p.Offset, p.Size
			}
		}
		return nil
	})
}

// p2p_kernel_launch runs a user kernel on stream with its parameters packed
// in params as p2p_kernel_params lays them out.
//
//export p2p_kernel_launch
func p2p_kernel_launch(h, kernel C.uint64_t, gx, gy, gz, bx, by, bz, shared C.uint32_t, stream C.uint64_t,
	params unsafe.Pointer, paramsLen C.uint64_t) C.int {
	return withUserKernels(h, func(u comm.UserKernels) error {
		if paramsLen > 1<<20 || (paramsLen > 0 && params == nil) {
			return status.Errorf(status.InvalidArgument, "kernel launch: %d bytes of parameters at %p", paramsLen, params)
		}
		var buf []byte
		if paramsLen > 0 {
			buf = C.GoBytes(params, C.int(paramsLen))
		}
		cfg := cuda.LaunchConfig{Grid: [3]uint32{uint32(gx), uint32(gy), uint32(gz)},
			Block: [3]uint32{uint32(bx), uint32(by), uint32(bz)}, SharedBytes: uint32(shared), Stream: uintptr(stream)}
		return u.LaunchKernel(uint64(kernel), cfg, buf)
	})
}

func withUserKernels(h C.uint64_t, f func(comm.UserKernels) error) C.int {
	return withBackend(h, func(b collective.Backend) error {
		u, ok := b.(comm.UserKernels)
		if !ok {
			return status.Errorf(status.Unsupported, "user kernels need the GPU backend")
		}
		return f(u)
	})
}
