// flag_latency.cu: what one flag exchange between GPUs costs, the unit of
// every barrier in the MoE kernels (start and middle flags). One process
// drives every GPU (peer access on); flags live in the receiver's memory and
// only grow, as in moe_common.cuh.
//
//   pingpong  GPU 0 and GPU 1, one thread each: 0 stores i into 1's flag,
//             1 waits for it and stores i into 0's flag: round trip per i
//   barrier   every GPU, one block, thread t trades round i's flag with GPU
//             t (store into t's flag, wait for t's in its own), then the
//             block's bar.sync: one all-to-all barrier per i, as the send
//             kernels' start barrier (block 0's part of it)
//
// Each in three flavours of store / poll: release.sys / acquire.sys (what
// p2p_common.cuh uses), relaxed.sys / relaxed.sys (volatile-like), and
// release.sys / relaxed.sys polls then one fence.acq_rel.sys.
//
// Build and run on a GPU host (two or more GPUs with peer access):
//   nvcc -O3 -arch=sm_90 -o /tmp/flag_latency tools/flag_latency.cu && /tmp/flag_latency
// Prints us per round trip (pingpong) or per barrier, median of 5 runs of
// 2000 rounds, GPU 0's %globaltimer.
#include "cuda_check.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

typedef unsigned long long u64;
constexpr int kMaxGpus = 8;
constexpr int kRounds = 2000;

enum Flavour { kAcqRel = 0, kRelaxed = 1, kRelaxedPollFence = 2 };

__device__ __forceinline__ void put(u64* p, u64 v, int f) {
  if (f == kRelaxed) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  } else {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  }
}

__device__ __forceinline__ u64 get(const u64* p, int f) {
  u64 v;
  if (f == kAcqRel) {
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  } else {
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  }
  return v;
}

__device__ __forceinline__ bool wait_for(const u64* p, u64 target, int f) {
  u64 t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (get(p, f) < target) {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > 2000000000ull) return false;  // 2 s: a peer that never came
  }
  if (f == kRelaxedPollFence) asm volatile("fence.acq_rel.sys;" ::: "memory");
  return true;
}

// pingpong: on GPU `me` (0 or 1); mine is my flag, theirs the peer's.
__global__ void pingpong(u64* mine, u64* theirs, int me, int f, u64 base, u64* ns, int* ok) {
  u64 t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (int i = 1; i <= kRounds; ++i) {
    const u64 v = base + i;
    if (me == 0) {
      put(theirs, v, f);
      if (!wait_for(mine, v, f)) { *ok = 0; return; }
    } else {
      if (!wait_for(mine, v, f)) { *ok = 0; return; }
      put(theirs, v, f);
    }
  }
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  *ns = t1 - t0;
}

// barrier: flags[g] is GPU g's row of kMaxGpus flags (one per source).
struct Table {
  u64* flags[kMaxGpus];
};
__global__ void barrier(Table t, int me, int n, int f, u64 base, u64* ns, int* ok) {
  const int p = (int)threadIdx.x;
  u64 t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (int i = 1; i <= kRounds; ++i) {
    const u64 v = base + i;
    if (p < n && p != me) {
      put(t.flags[p] + me, v, f);
      if (!wait_for(t.flags[me] + p, v, f)) *ok = 0;
    }
    __syncthreads();
  }
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (p == 0) *ns = t1 - t0;
}

int main() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  n = std::min(n, kMaxGpus);
  if (n < 2) {
    fprintf(stderr, "needs 2 GPUs\n");
    return 1;
  }
  Table tab{};
  std::vector<u64*> ns(n);
  std::vector<int*> ok(n);
  std::vector<cudaStream_t> st(n);
  for (int g = 0; g < n; ++g) {
    CK(cudaSetDevice(g));
    for (int h = 0; h < n; ++h) {
      if (h != g) {
        int can = 0;
        CK(cudaDeviceCanAccessPeer(&can, g, h));
        if (!can) {
          fprintf(stderr, "no P2P %d -> %d\n", g, h);
          return 1;
        }
        CK(cudaDeviceEnablePeerAccess(h, 0));
      }
    }
    CK(cudaMalloc(&tab.flags[g], kMaxGpus * sizeof(u64)));
    CK(cudaMemset(tab.flags[g], 0, kMaxGpus * sizeof(u64)));
    CK(cudaMalloc(&ns[g], sizeof(u64)));
    CK(cudaMallocManaged(&ok[g], sizeof(int)));
    *ok[g] = 1;
    CK(cudaStreamCreateWithFlags(&st[g], cudaStreamNonBlocking));
  }
  for (int g = 0; g < n; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaDeviceSynchronize());
  }
  const char* names[] = {"release/acquire", "relaxed/relaxed", "release/relaxed+fence"};
  u64 base = 0;  // flags only grow: every run continues from the last value
  printf("| test | GPUs | flavour | us per round (median of 5) | min |\n|---|---:|---|---:|---:|\n");
  for (int test = 0; test < 2; ++test) {
    const int gpus = test == 0 ? 2 : n;
    for (int f = 0; f < 3; ++f) {
      std::vector<double> us;
      for (int rep = 0; rep < 5; ++rep) {
        for (int g = 0; g < gpus; ++g) {
          CK(cudaSetDevice(g));
          if (test == 0) {
            pingpong<<<1, 1, 0, st[g]>>>(tab.flags[g] + (1 - g), tab.flags[1 - g] + g, g, f, base, ns[g], ok[g]);
          } else {
            barrier<<<1, 32, 0, st[g]>>>(tab, g, gpus, f, base, ns[g], ok[g]);
          }
          CK(cudaGetLastError());
        }
        for (int g = 0; g < gpus; ++g) {
          CK(cudaSetDevice(g));
          CK(cudaStreamSynchronize(st[g]));
        }
        base += kRounds;
        for (int g = 0; g < gpus; ++g) {
          if (!*ok[g]) {
            fprintf(stderr, "GPU %d timed out (test %d flavour %d)\n", g, test, f);
            return 1;
          }
        }
        u64 t = 0;
        CK(cudaSetDevice(0));
        CK(cudaMemcpy(&t, ns[0], sizeof(u64), cudaMemcpyDeviceToHost));
        us.push_back(t / 1e3 / kRounds);
      }
      std::sort(us.begin(), us.end());
      printf("| %s | %d | %s | %.2f | %.2f |\n", test == 0 ? "pingpong" : "barrier", gpus, names[f], us[2], us[0]);
    }
  }
  return 0;
}
