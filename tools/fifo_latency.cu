// fifo_latency.cu: the floor under a PortChannel flush. A kernel's thread
// writes a 16-byte entry into pinned host memory, a host thread spinning on
// that memory answers by storing a done count there, and the kernel polls
// the count: what a FIFO round trip costs with no proxy logic at all, in the
// variants a FIFO could use.
//
//   store    two8-rel   8-byte relaxed store, then 8-byte release store
//            v2-rel     one 16-byte st.release.sys.v2 (channel.cuh's
//                       fifo_push for a put or a signal)
//            v2-rlx     one 16-byte st.relaxed.sys.v2 (no fence: the floor
//                       for an entry that publishes no data; fifo_push's bare
//                       flush)
//            claim+v2   v2-rlx after what a pusher does first: an atomicAdd on
//                       a head in device memory beside a load of a tail cache
//   poll     acq        one thread polls with ld.acquire.sys
//            rlx+fence  one thread polls with ld.relaxed.sys, one fence after
//            4warps     four warps poll relaxed, unsynchronized, the first to
//                       see the count tells the others through shared memory
//            rlx+facq   one thread polls with ld.relaxed.sys, then
//                       fence.acquire.sys (the one-way acquire fence of sm_90;
//                       channel.cuh's fifo_sync there)
//            kN-acq     one thread keeps N polls in flight, issued ~200 ns
//                       apart, each ld.acquire.sys, and looks at them in turn
//                       (meant to see the count one spacing after it lands
//                       instead of up to a whole PCIe read later)
//            kN-rlx     the same with ld.relaxed.sys, then fence.acquire.sys
//
// Build and run on a GPU host:
//   nvcc -O3 -arch=sm_90 -o /tmp/fifo_latency tools/fifo_latency.cu -lpthread && /tmp/fifo_latency
// Prints p50 / p99 in us of 20000 round trips per variant (%globaltimer).
#include "cuda_check.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

typedef unsigned long long u64;
constexpr int kIters = 20000;

struct alignas(128) Shared {
  u64 fst, snd;     // the entry (one slot, reused: the host answers before the next)
  u64 pad[14];
  u64 done;         // the host's answer
  u64 pad2[15];
};

__device__ __forceinline__ u64 now() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void store(Shared* s, u64 v, int how, u64* head) {
  if (how == 3) {
    const u64 cached = *reinterpret_cast<volatile u64*>(head + 16);
    const u64 pos = atomicAdd(reinterpret_cast<unsigned long long*>(head), 1ull);
    v += (pos < cached) ? 1 : 0;  // never true: keeps both loads
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(&s->fst), "l"(v), "l"(v) : "memory");
  } else if (how == 0) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(&s->fst), "l"(v) : "memory");
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(&s->snd), "l"(v) : "memory");
  } else if (how == 1) {
    asm volatile("st.release.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(&s->fst), "l"(v), "l"(v) : "memory");
  } else {
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(&s->fst), "l"(v), "l"(v) : "memory");
  }
}

__device__ __forceinline__ u64 load(const u64* p, bool acquire) {
  u64 v;
  if (acquire) {
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  } else {
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  }
  return v;
}

// staggered keeps K polls of *p in flight, each issued gap SM cycles after
// the one before, and returns once one reads at least v.
template <int K, bool ACQ>
__device__ __forceinline__ void staggered(const u64* p, u64 v, long long gap) {
  u64 r[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    r[k] = load(p, ACQ);
    const long long t = clock64();
    while (clock64() - t < gap) {
    }
  }
  const u64 start = now();
  for (;;) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (r[k] >= v) return;
      r[k] = load(p, ACQ);
    }
    if (now() - start > 2000000000ull) return;
  }
}

// One block of 128 threads; thread 0 stores; poll mode 2 uses lane 0 of
// every warp.
__global__ void roundtrips(Shared* s, int how, int poll, u64 base, u64* ns, u64* head) {
  __shared__ volatile u64 seen;
  const int tid = threadIdx.x;
  for (int i = 1; i <= kIters; ++i) {
    const u64 v = base + i;
    if (tid == 0) seen = 0;
    __syncthreads();
    const u64 t0 = now();
    if (tid == 0) store(s, v, how, head);
    if (poll == 2) {
      if ((tid & 31) == 0) {
        const u64 start = now();
        while (seen < v && load(&s->done, false) < v) {
          if (now() - start > 2000000000ull) break;
        }
        seen = v;
        asm volatile("fence.acq_rel.sys;" ::: "memory");
      }
    } else if (tid == 0 && poll >= 4) {
      if (poll == 4) staggered<4, true>(&s->done, v, 400);
      if (poll == 5) staggered<4, false>(&s->done, v, 400);
      if (poll == 6) staggered<8, false>(&s->done, v, 250);
      if (poll >= 5) asm volatile("fence.acquire.sys;" ::: "memory");
    } else if (tid == 0) {
      const u64 start = now();
      while (load(&s->done, poll == 0) < v) {
        if (now() - start > 2000000000ull) break;
      }
      if (poll == 1) asm volatile("fence.acq_rel.sys;" ::: "memory");
      if (poll == 3) asm volatile("fence.acquire.sys;" ::: "memory");
    }
    __syncthreads();
    if (tid == 0) ns[i - 1] = now() - t0;
  }
}

int main() {
  Shared* s = nullptr;
  CK(cudaHostAlloc(&s, sizeof(Shared), cudaHostAllocMapped));
  memset((void*)s, 0, sizeof(Shared));
  Shared* sd = nullptr;
  CK(cudaHostGetDevicePointer(&sd, s, 0));
  u64* ns = nullptr;
  CK(cudaMalloc(&ns, kIters * sizeof(u64)));
  u64* head = nullptr;  // head, then a tail cache 128 bytes on (as FifoDeviceWords)
  CK(cudaMalloc(&head, 32 * sizeof(u64)));
  CK(cudaMemset(head, 0, 32 * sizeof(u64)));
  std::atomic<bool> stop{false};
  // The host's side: answer each fresh entry with its value.
  std::thread host([&] {
    volatile u64* snd = &s->snd;
    volatile u64* done = &s->done;
    u64 last = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      const u64 v = *snd;
      if (v != last) {
        last = v;
        *done = v;
      }
    }
  });
  const char* stores[] = {"two8-rel", "v2-rel", "v2-rlx", "claim+v2"};
  const char* polls[] = {"acq", "rlx+fence", "4warps", "rlx+facq", "k4-acq", "k4-rlx", "k8-rlx"};
  printf("| store | poll | p50 us | p99 us |\n|---|---|---:|---:|\n");
  std::vector<u64> h(kIters);
  u64 base = 0;
  for (int how = 0; how < 4; ++how) {
    for (int poll = 0; poll < 7; ++poll) {
      roundtrips<<<1, 128>>>(sd, how, poll, base, ns, head);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      base += kIters;
      CK(cudaMemcpy(h.data(), ns, kIters * sizeof(u64), cudaMemcpyDeviceToHost));
      std::sort(h.begin(), h.end());
      printf("| %s | %s | %.2f | %.2f |\n", stores[how], polls[poll], h[kIters / 2] / 1e3, h[kIters * 99 / 100] / 1e3);
    }
  }
  stop = true;
  host.join();
  return 0;
}
