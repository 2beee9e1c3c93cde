// nvlink_micro.cu: the NVLink ceilings the MoE kernels work against, measured
// with the access patterns they could use. One process drives every GPU
// (peer access on); each GPU moves `per_peer` bytes to or from every other
// GPU at once (an all-to-all, like dispatch and combine), in 14 KiB chunks
// (one bf16 row of H = 7168), chunks interleaved over peers.
//
//   push-lsu  16-byte loads of local rows, 16-byte stores into the peer
//   pull-lsu  16-byte loads from the peer, stores into local memory
//   push-tma  bulk copy (cp.async.bulk) local -> shared, shared -> peer
//   pull-tma  bulk copy peer -> shared, shared -> local
//   local-*   the same with both sides local (the HBM ceiling per SM count)
//   push-ce   copy engines (cudaMemcpyAsync, one stream per peer; no SM)
//   push-mix, pull-mix  the copy engines move the first `ce %` of every
//             region while push-lsu / pull-lsu move the rest at the same
//             time: whether the engines add to what the SMs reach
//
// Build and run on a GPU host (two or more GPUs with peer access):
//   nvcc -O3 -arch=sm_90 -o /tmp/nvlink_micro tools/nvlink_micro.cu && /tmp/nvlink_micro
// Prints one row per (mode, SMs): GB/s per GPU of bytes moved (remote bytes
// for push/pull), the slowest GPU's median over repetitions. Every mode's
// result is checked against the source bytes once.
#include "cuda_check.h"
#include "micro_pack.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

constexpr int kMaxPeers = 8;
constexpr int kChunk = 14336;  // bytes: one bf16 row of 7168
constexpr int kThreads = 512;

struct Job {
  const char* src[kMaxPeers];
  char* dst[kMaxPeers];
  int n;          // peers (pairs of regions)
  int rot;        // rotation so that GPUs start on different peers
  long long per;  // bytes per region
};

// Chunk c -> region (c + rot) % n, offset (c / n) * kChunk.
__device__ __forceinline__ void chunk_at(const Job& j, long long c, const char*& s, char*& d) {
  const int r = (int)((c + j.rot) % j.n);
  const long long off = (c / j.n) * kChunk;
  s = j.src[r] + off;
  d = j.dst[r] + off;
}

template <int U>
__global__ void __launch_bounds__(kThreads, 1) copy_lsu(const Job j) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const long long chunks = (j.per / kChunk) * j.n;
  constexpr int packs = kChunk / 16;
  for (long long c = (long long)blockIdx.x * nw + warp; c < chunks; c += (long long)gridDim.x * nw) {
    const char* s;
    char* d;
    chunk_at(j, c, s, d);
    for (int pass = 0; pass < packs; pass += 32 * U) {
      V16 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = pass + lane + 32 * u;
        if (i < packs) v[u] = ld16(s + i * 16);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = pass + lane + 32 * u;
        if (i < packs) st16(d + i * 16, v[u]);
      }
    }
  }
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// copy_tma: one thread per block runs a pipeline of S stages of one chunk
// each: bulk load into a stage (completing on its mbarrier), then bulk store
// from it; a stage is reloaded once the store issued from it has read it.
template <int S>
__global__ void copy_tma(const Job j, int* err) {
  extern __shared__ __align__(128) char stage[];
  __shared__ __align__(8) unsigned long long bar[S];
  if (threadIdx.x != 0) return;
  const long long chunks = (j.per / kChunk) * j.n;
  const long long first = blockIdx.x, step = gridDim.x;
  const long long mine = first < chunks ? (chunks - first + step - 1) / step : 0;
  for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bar[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  auto load = [&](long long k) {
    const int s = (int)(k % S);
    const char* src;
    char* dst;
    chunk_at(j, first + k * step, src, dst);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&bar[s])), "r"(kChunk)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_addr(stage + (long long)s * kChunk)),
        "l"(src), "r"(kChunk), "r"(smem_addr(&bar[s]))
        : "memory");
  };
  for (long long k = 0; k < mine && k < S; ++k) load(k);
  for (long long k = 0; k < mine; ++k) {
    const int s = (int)(k % S);
    const unsigned parity = (unsigned)((k / S) & 1);
    unsigned done = 0;
    for (long long spin = 0; !done; ++spin) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(smem_addr(&bar[s])), "r"(parity)
          : "memory");
      if (spin > (1ll << 26)) {  // bounded: report and stop
        atomicExch(err, 1);
        return;
      }
    }
    const char* src;
    char* dst;
    chunk_at(j, first + k * step, src, dst);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                 "r"(smem_addr(stage + (long long)s * kChunk)), "r"(kChunk)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // The stage of k - 1 is free once its store has read it (at most the
    // store just issued still reading), then it takes chunk k - 1 + S.
    if (k >= 1 && k - 1 + S < mine) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      load(k - 1 + S);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Gpu {
  char* send;  // [n_gpus][per]: region p is for peer p
  char* recv;  // [n_gpus][per]: region p came from peer p
  cudaStream_t st;
  cudaEvent_t a, b, fork;
  int* err;
  cudaStream_t ce[kMaxPeers];
  cudaEvent_t join[kMaxPeers];
};

enum Mode { kPushLsu, kPullLsu, kPushTma, kPullTma, kLocalLsu, kLocalTma, kPushCe, kPushMix, kPullMix };
const char* kModeName[] = {"push-lsu", "pull-lsu", "push-tma", "pull-tma", "local-lsu",
                           "local-tma", "push-ce",  "push-mix", "pull-mix"};
constexpr int kModes = 9;

static Job make_job(std::vector<Gpu>& g, int me, Mode m, long long per) {
  const int n = (int)g.size();
  Job j{};
  j.per = per;
  j.rot = me;
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    const bool local = m == kLocalLsu || m == kLocalTma;
    const bool pull = m == kPullLsu || m == kPullTma || m == kPullMix;
    if (local) {
      j.src[j.n] = g[me].send + p * per;
      j.dst[j.n] = g[me].recv + p * per;
    } else if (pull) {
      j.src[j.n] = g[p].send + me * per;
      j.dst[j.n] = g[me].recv + p * per;
    } else {
      j.src[j.n] = g[me].send + p * per;
      j.dst[j.n] = g[p].recv + me * per;
    }
    ++j.n;
  }
  return j;
}

constexpr int kTmaStages = 12;  // 12 * 14 KiB = 168 KiB of shared memory per block

// The copy engines' share of a region: all of it for push-ce, ce_pct % (in
// whole chunks) for the mixed modes, none otherwise.
static long long ce_bytes(Mode m, long long per, int ce_pct) {
  if (m == kPushCe) return per;
  if (m != kPushMix && m != kPullMix) return 0;
  return per / kChunk * ce_pct / 100 * kChunk;
}

static void launch(std::vector<Gpu>& g, int me, Mode m, int sms, long long per, int unroll, int ce_pct) {
  CK(cudaSetDevice(me));
  Job j = make_job(g, me, m, per);
  const long long ce = ce_bytes(m, per, ce_pct);
  if (ce > 0) {  // fork to one stream per peer and join back
    CK(cudaEventRecord(g[me].fork, g[me].st));
    for (int r = 0; r < j.n; ++r) {
      CK(cudaStreamWaitEvent(g[me].ce[r], g[me].fork, 0));
      CK(cudaMemcpyAsync(j.dst[r], j.src[r], ce, cudaMemcpyDefault, g[me].ce[r]));
      CK(cudaEventRecord(g[me].join[r], g[me].ce[r]));
    }
    if (ce == per) {
      for (int r = 0; r < j.n; ++r) CK(cudaStreamWaitEvent(g[me].st, g[me].join[r], 0));
      return;
    }
    for (int r = 0; r < j.n; ++r) {  // the SMs take the rest of each region
      j.src[r] += ce;
      j.dst[r] += ce;
    }
    j.per = per - ce;
  }
  if (m == kPushTma || m == kPullTma || m == kLocalTma) {
    copy_tma<kTmaStages><<<sms, 32, kTmaStages * kChunk, g[me].st>>>(j, g[me].err);
  } else if (unroll == 4) {
    copy_lsu<4><<<sms, kThreads, 0, g[me].st>>>(j);
  } else if (unroll == 16) {
    copy_lsu<16><<<sms, kThreads, 0, g[me].st>>>(j);
  } else {
    copy_lsu<8><<<sms, kThreads, 0, g[me].st>>>(j);
  }
  CK(cudaGetLastError());
  for (int r = 0; ce > 0 && r < j.n; ++r) CK(cudaStreamWaitEvent(g[me].st, g[me].join[r], 0));
}

int main() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) {
    printf("needs 2+ GPUs\n");
    return 1;
  }
  const long long per_peer = (48ll << 20) / kChunk * kChunk;  // ~48 MiB per peer
  std::vector<Gpu> g(n);
  for (int i = 0; i < n; ++i) {
    CK(cudaSetDevice(i));
    for (int p = 0; p < n; ++p) {
      if (p != i) {
        cudaError_t e = cudaDeviceEnablePeerAccess(p, 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CK(e);
      }
    }
    CK(cudaMalloc(&g[i].send, n * per_peer));
    CK(cudaMalloc(&g[i].recv, n * per_peer));
    CK(cudaMalloc(&g[i].err, sizeof(int)));
    CK(cudaMemset(g[i].err, 0, sizeof(int)));
    CK(cudaStreamCreateWithFlags(&g[i].st, cudaStreamNonBlocking));
    CK(cudaEventCreate(&g[i].a));
    CK(cudaEventCreate(&g[i].b));
    CK(cudaEventCreateWithFlags(&g[i].fork, cudaEventDisableTiming));
    for (int r = 0; r < kMaxPeers; ++r) {
      CK(cudaStreamCreateWithFlags(&g[i].ce[r], cudaStreamNonBlocking));
      CK(cudaEventCreateWithFlags(&g[i].join[r], cudaEventDisableTiming));
    }
    CK(cudaFuncSetAttribute(copy_tma<kTmaStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, kTmaStages * kChunk));
    std::vector<unsigned> h(n * per_peer / 4);
    for (size_t k = 0; k < h.size(); ++k) h[k] = (unsigned)(k * 2654435761u) ^ (unsigned)(i * 977);
    CK(cudaMemcpy(g[i].send, h.data(), n * per_peer, cudaMemcpyHostToDevice));
  }
  printf("| mode | SMs | unroll | CE %% | GB/s per GPU | us |\n|---|---:|---:|---:|---:|---:|\n");
  struct Cfg {
    Mode m;
    int sms, unroll, ce_pct = 0;
  };
  std::vector<Cfg> cfgs;
  for (int sms : {24, 48, 132}) {
    for (Mode m : {kPushLsu, kPullLsu, kPushTma, kPullTma, kLocalLsu, kLocalTma}) cfgs.push_back({m, sms, 8});
  }
  cfgs.push_back({kLocalLsu, 24, 16});
  cfgs.push_back({kPushLsu, 24, 16});
  cfgs.push_back({kPullLsu, 24, 16});
  cfgs.push_back({kPushLsu, 24, 4});
  cfgs.push_back({kPushCe, 0, 0});
  for (int pct : {20, 35, 50}) {
    cfgs.push_back({kPushMix, 24, 8, pct});
    cfgs.push_back({kPullMix, 24, 8, pct});
  }
  std::vector<bool> checked(kModes, false);
  for (const Cfg& c : cfgs) {
    for (int i = 0; i < n; ++i) {
      CK(cudaSetDevice(i));
      CK(cudaMemset(g[i].recv, 0xff, n * per_peer));
      CK(cudaDeviceSynchronize());
    }
    std::vector<double> best(n, 0);
    std::vector<std::vector<float>> ms(n);
    for (int rep = 0; rep < 6; ++rep) {
      for (int i = 0; i < n; ++i) {
        CK(cudaSetDevice(i));
        CK(cudaEventRecord(g[i].a, g[i].st));
      }
      const int iters = 5;
      for (int it = 0; it < iters; ++it)
        for (int i = 0; i < n; ++i) launch(g, i, c.m, c.sms, per_peer, c.unroll, c.ce_pct);
      for (int i = 0; i < n; ++i) {
        CK(cudaSetDevice(i));
        CK(cudaEventRecord(g[i].b, g[i].st));
      }
      for (int i = 0; i < n; ++i) {
        CK(cudaSetDevice(i));
        CK(cudaStreamSynchronize(g[i].st));
        float t;
        CK(cudaEventElapsedTime(&t, g[i].a, g[i].b));
        if (rep > 0) ms[i].push_back(t / iters);
      }
    }
    double worst = 0;
    for (int i = 0; i < n; ++i) {
      std::sort(ms[i].begin(), ms[i].end());
      worst = std::max(worst, (double)ms[i][ms[i].size() / 2]);
      int e = 0;
      CK(cudaSetDevice(i));
      CK(cudaMemcpy(&e, g[i].err, sizeof(int), cudaMemcpyDeviceToHost));
      if (e) printf("GPU %d: mbarrier wait timed out\n", i);
    }
    const double bytes = (double)(n - 1) * per_peer;
    const bool lsu = c.m == kPushLsu || c.m == kPullLsu || c.m == kLocalLsu || c.m == kPushMix || c.m == kPullMix;
    printf("| %s | %d | %d | %lld | %.0f | %.1f |\n", kModeName[c.m], c.sms, lsu ? c.unroll : 0,
           ce_bytes(c.m, per_peer, c.ce_pct) * 100 / per_peer, bytes / (worst * 1e-3) / 1e9, worst * 1e3);
    fflush(stdout);
    if (!checked[c.m]) {  // every destination region equals its source region
      checked[c.m] = true;
      std::vector<char> want(per_peer), got(per_peer);
      long long bad = 0;
      for (int i = 0; i < n; ++i) {
        const Job j = make_job(g, i, c.m, per_peer);
        for (int r = 0; r < j.n; ++r) {
          CK(cudaMemcpy(want.data(), j.src[r], per_peer, cudaMemcpyDefault));
          CK(cudaMemcpy(got.data(), j.dst[r], per_peer, cudaMemcpyDefault));
          if (memcmp(want.data(), got.data(), per_peer) != 0) ++bad;
        }
      }
      if (bad) printf("CHECK FAILED: %s: %lld regions differ\n", kModeName[c.m], bad);
    }
  }
  return 0;
}
