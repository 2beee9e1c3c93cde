// channel_test.cu: kernels the proxy tests compile (every arch) and run
// (on a GPU): one that calls every channel method, functional checks of
// MemoryChannel and PortChannel on one GPU, and the FIFO benchmark.
#include "channel.cuh"

// p2pcomm:instantiate every_method
// p2pcomm:instantiate memory_channel_check
// p2pcomm:instantiate port_channel_check
// p2pcomm:instantiate fifo_bench

struct alignas(16) Quad { u32 a, b, c, d; };

// every_method exists to be compiled: each method of both channels, each
// overload, every element width of read and write.
__global__ void every_method(const MemoryChannel m, const PortChannel p, u64* out) {
  const u32 tid = threadIdx.x, n = blockDim.x;
  m.put(0, 0, 4096, tid, n);
  m.get(4096, 0, 4096, tid, n);
  m.putPackets(0, 0, 256, tid, n, ll_flag(1));
  bool ok = m.unpackPackets(0, 0, 256, tid, n, ll_flag(1));
  __syncthreads();
  if (tid == 0) {
    m.write<u16>(1, (u16)2);
    m.write<u32>(1, 3u);
    m.write<u64>(1, 4ull);
    m.write<Quad>(1, Quad{1, 2, 3, 4});
    u64 s = m.read<u16>(1) + m.read<u32>(1) + m.read<u64>(1) + m.read<Quad>(1).d;
    m.signal();
    ok = ok && m.wait();
    s += m.poll();
    s += p.put(0, 0, 64) + p.put(0, 64);
    s += p.signal();
    s += p.putWithSignal(0, 0, 64) + p.putWithSignal(0, 64);
    ok = ok && p.putWithSignalAndFlush(0, 0, 64) && p.putWithSignalAndFlush(0, 64);
    ok = ok && p.flush() && p.wait();
    s += p.poll();
    out[0] = s;
    out[1] = ok;
  }
}

// memory_channel_check runs on one block with remote = another buffer of
// the same GPU and remote_sem == sem (the channel signals itself). local
// holds 3 * bytes: [0, bytes) random input; the kernel fills [bytes, 2 bytes)
// by put + get and [2 bytes, 3 bytes) by LL packets through remote (which
// holds bytes of data and then 2 * bytes of lines). out[k] for the host.
__global__ void memory_channel_check(const MemoryChannel m, u64 bytes, u32 flag, u64* out) {
  const u32 tid = threadIdx.x, n = blockDim.x;
  m.put(0, 0, bytes, tid, n);
  __syncthreads();
  m.get(bytes, 0, bytes, tid, n);
  m.putPackets(bytes, 0, bytes, tid, n, flag);
  const bool unpacked = m.unpackPackets(2 * bytes, bytes, bytes, tid, n, flag);
  __syncthreads();
  if (tid == 0) {
    const u64 before = m.read<u64>(0);
    m.write<u64>(0, ~before);
    out[0] = m.read<u64>(0);
    m.write<u64>(0, before);
    out[1] = m.poll();  // nothing signalled yet
    m.signal();
    m.signal();
    out[2] = m.wait();
    out[3] = m.poll();
    out[4] = m.poll();  // both consumed
  }
  __syncthreads();
  if (!unpacked) out[5] = 1;
}

// port_channel_check has thread 0 put chunks of chunk bytes with a signal
// each to the channel's own peer (itself, on one GPU), flush, then consume
// every signal. out[0] = flush ok, out[1] = signals consumed, out[2] = the
// FIFO position of the last push.
__global__ void port_channel_check(const PortChannel p, u64 chunks, u64 chunk, u64* out) {
  if (threadIdx.x != 0) return;
  u64 last = 0;
  for (u64 c = 0; c + 1 < chunks; ++c) last = p.putWithSignal(c * chunk, c * chunk, chunk);
  const bool ok = p.putWithSignalAndFlush((chunks - 1) * chunk, (chunks - 1) * chunk, chunk) && p.flush();
  u64 got = 0;
  for (u64 c = 0; c < chunks && p.wait(); ++c) ++got;
  out[0] = ok;
  out[1] = got;
  out[2] = last;
}

// BenchArgs: block b pushes into ch[b % fifos].
struct BenchArgs {
  PortChannel ch[8];
  u64* samples;  // latency: iters round trips in ns; rate: per block {ns, pushes}
  u32 fifos;
  u32 iters;
  u32 latency;  // 1: block 0 times flush round trips; 0: every warp pushes
  u32 pad;
};

// fifo_bench: latency mode times one flush (push + proxy + done seen by the
// GPU) iters times; rate mode has lane 0 of every warp push iters empty
// puts, then the block's last warp flushes, and records the block's time.
__global__ void fifo_bench(const BenchArgs a) {
  const PortChannel& ch = a.ch[blockIdx.x % a.fifos];
  if (a.latency) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    for (u32 i = 0; i < a.iters; ++i) {
      const u64 t0 = global_timer_ns();
      if (!ch.flush()) return;
      a.samples[i] = global_timer_ns() - t0;
    }
    return;
  }
  __syncthreads();
  const u64 t0 = global_timer_ns();
  if ((threadIdx.x & 31) == 0) {
    for (u32 i = 0; i < a.iters; ++i) {
      if (ch.put(0, 0, 0) == ~0ull) break;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool ok = ch.flush();
    a.samples[2 * blockIdx.x] = global_timer_ns() - t0;
    a.samples[2 * blockIdx.x + 1] = ok ? (u64)a.iters * (blockDim.x / 32) : 0;
  }
}
