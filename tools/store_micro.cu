// store_micro.cu: how fast a few SMs write expert-major rows, the dispatch
// expand's pattern at 128 tokens (each source row loaded once and stored
// into `copies` scattered output rows), on one GPU, all memory local.
//
//   expand  16-byte loads of a row piece, then one 16-byte store per copy
//   store   the same stores with no loads (the stores' own ceiling)
//   copy    one copy per row (the plain copy of tools/nvlink_micro.cu)
//
// Variants: threads per block (512 as the kernels, or 1024), the store's
// cache operator (default .wb, .cs streaming, L1::no_allocate), SM count.
// Build and run on a GPU host:
//   nvcc -O3 -arch=sm_90 -o /tmp/store_micro tools/store_micro.cu && /tmp/store_micro
// A second table: the combine send's reads (gather: 4 rows summed into 1)
// beside the expand's stores, at 128 and 4096 tokens' rows.
// Prints µs per call (globaltimer, first block in to last out; median of
// 30) and GB/s of bytes stored; the expand's output is checked once.
#include "cuda_check.h"
#include "micro_pack.cuh"

#include <algorithm>
#include <cstdio>
#include <vector>

constexpr int kRow = 14336;           // bytes: one bf16 row of H = 7168
constexpr int kPacks = kRow / 16;     // 896
constexpr int kUnroll = 8;            // packs per lane in flight
constexpr int kPass = 32 * kUnroll;   // packs per warp pass
constexpr int kMaxCopies = 8;

// st16m: st16 with cache operator M: 0 default (.wb), 1 .cs (streaming),
// 2 L1::no_allocate.
template <int M>
__device__ __forceinline__ void st16m(char* p, V16 v) {
  if (M == 0) {
    st16(p, v);
  } else if (M == 1) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  } else {
    asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
  }
}

__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Unit u: piece (u % parts) of source row (u / parts); warp w takes units
// w, w + warps, ... Source row r goes to output rows map[r * copies + c].
template <int THREADS, int M, bool LOADS>
__global__ void __launch_bounds__(THREADS, 1)
    expand(const char* src, char* out, const int* map, int rows, int copies, int parts,
           unsigned long long* stamps) {
  const unsigned long long t0 = now();
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (THREADS / 32), gw = blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5);
  const int passes = (kPacks + kPass - 1) / kPass;
  const int per = (passes + parts - 1) / parts * kPass;  // packs per piece, whole passes
  for (int u = gw; u < rows * parts; u += warps) {
    const int r = u / parts, part = u % parts;
    const int c0 = min(kPacks, part * per), c1 = min(kPacks, c0 + per);
    const char* s = src + (long long)r * kRow;
    for (int pass = c0; pass < c1; pass += kPass) {
      V16 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int i = pass + lane + 32 * k;
        if (LOADS) {
          if (i < c1) v[k] = ld16(s + (long long)i * 16);
        } else {
          v[k] = V16{(unsigned)r, (unsigned)i, 0u, 0u};
        }
      }
      for (int c = 0; c < copies; ++c) {
        char* o = out + (long long)map[r * copies + c] * kRow;
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          const int i = pass + lane + 32 * k;
          if (i < c1) st16m<M>(o + (long long)i * 16, v[k]);
        }
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    stamps[2 * blockIdx.x] = t0;
    stamps[2 * blockIdx.x + 1] = now();
  }
}

// gather is the combine send's pattern: unit u reads piece (u % parts) of
// the `copies` rows map[r * copies + c] of `in` (r = u / parts), sums them
// (as u32 here), and stores the one partial row r of `out`.
template <int THREADS>
__global__ void __launch_bounds__(THREADS, 1)
    gather(const char* in, char* out, const int* map, int rows, int copies, int parts, unsigned long long* stamps) {
  const unsigned long long t0 = now();
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (THREADS / 32), gw = blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5);
  const int passes = (kPacks + kPass - 1) / kPass;
  const int per = (passes + parts - 1) / parts * kPass;
  for (int u = gw; u < rows * parts; u += warps) {
    const int r = u / parts, part = u % parts;
    const int c0 = min(kPacks, part * per), c1 = min(kPacks, c0 + per);
    for (int pass = c0; pass < c1; pass += kPass) {
      V16 acc[kUnroll] = {};
      for (int c = 0; c < copies; ++c) {
        const char* s = in + (long long)map[r * copies + c] * kRow;
        V16 v[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          const int i = pass + lane + 32 * k;
          if (i < c1) v[k] = ld16(s + (long long)i * 16);
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          acc[k].x += v[k].x;
          acc[k].y += v[k].y;
          acc[k].z += v[k].z;
          acc[k].w += v[k].w;
        }
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int i = pass + lane + 32 * k;
        if (i < c1) st16(out + (long long)r * kRow + (long long)i * 16, acc[k]);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    stamps[2 * blockIdx.x] = t0;
    stamps[2 * blockIdx.x + 1] = now();
  }
}

typedef void (*Kernel)(const char*, char*, const int*, int, int, int, unsigned long long*);

struct Case {
  const char* name;
  Kernel k;
  int threads;
};

int main() {
  int rows = 256;  // 128 tokens from each of 2 sources, 4 local experts each (K = 8, W = 2)
  const int copies = 4, big = 8192;  // big: 4096 tokens from each of 2 sources
  CK(cudaSetDevice(0));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  char *src, *out;
  int* map;
  unsigned long long* stamps;
  CK(cudaMalloc(&src, (size_t)big * kRow));
  CK(cudaMalloc(&out, (size_t)big * copies * kRow));
  CK(cudaMalloc(&map, big * kMaxCopies * sizeof(int)));
  CK(cudaMalloc(&stamps, 2 * 1024 * sizeof(unsigned long long)));
  std::vector<unsigned char> h_src((size_t)rows * kRow);
  for (size_t i = 0; i < h_src.size(); ++i) h_src[i] = (unsigned char)(i * 2654435761u >> 13);
  CK(cudaMemcpy(src, h_src.data(), h_src.size(), cudaMemcpyHostToDevice));
  std::vector<int> h_map;
  // Output rows [0, rows * cp) in a random order, as expert-major order scatters a token's copies.
  auto set_map = [&](int cp) {
    h_map.resize(rows * cp);
    for (int i = 0; i < rows * cp; ++i) h_map[i] = i;
    unsigned s = 12345;
    for (int i = rows * cp - 1; i > 0; --i) {
      s = s * 1664525u + 1013904223u;
      std::swap(h_map[i], h_map[s % (i + 1)]);
    }
    CK(cudaMemcpy(map, h_map.data(), h_map.size() * sizeof(int), cudaMemcpyHostToDevice));
  };

  const Case cases[] = {
      {"expand 512 thr .wb", expand<512, 0, true>, 512},
      {"expand 512 thr .cs", expand<512, 1, true>, 512},
      {"expand 512 thr L1::no_alloc", expand<512, 2, true>, 512},
      {"expand 1024 thr .wb", expand<1024, 0, true>, 1024},
      {"expand 1024 thr .cs", expand<1024, 1, true>, 1024},
      {"store 512 thr .wb", expand<512, 0, false>, 512},
      {"store 1024 thr .wb", expand<1024, 0, false>, 1024},
  };
  std::vector<unsigned long long> h(2 * 1024);
  // median_us runs launch (g blocks) reps times and returns the median span,
  // first block in to last out, of all runs but the first (a warm-up).
  auto median_us = [&](int reps, int g, auto launch) {
    std::vector<double> us;
    for (int rep = 0; rep < reps; ++rep) {
      launch();
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(h.data(), stamps, 2 * g * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
      unsigned long long a = ~0ull, b = 0;
      for (int i = 0; i < g; ++i) {
        a = std::min(a, h[2 * i]);
        b = std::max(b, h[2 * i + 1]);
      }
      if (rep > 0) us.push_back((b - a) / 1e3);
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  };
  printf("| case | copies | SMs | pieces | us | GB/s stored |\n|---|---:|---:|---:|---:|---:|\n");
  for (int cp : {4, 1}) {
    set_map(cp);
    for (const Case& c : cases) {
      if (cp == 1 && c.k != cases[0].k && c.k != cases[3].k) continue;
      for (int g : {24, 48, sms}) {
        for (int parts : {1, 4}) {
          const double m = median_us(31, g, [&] { c.k<<<g, c.threads>>>(src, out, map, rows, cp, parts, stamps); });
          printf("| %s | %d | %d | %d | %.1f | %.0f |\n", c.name, cp, g, parts, m,
                 (double)rows * cp * kRow / (m * 1e3));
        }
      }
    }
  }
  // The combine send's reads (gather) and the expand's stores at both scales, 24 SMs, 512 threads.
  printf("\n| pattern | rows | SMs | pieces | us | GB/s read | GB/s stored |\n|---|---:|---:|---:|---:|---:|---:|\n");
  for (int n : {256, big}) {
    rows = n;
    set_map(copies);
    for (int g : {24, 48, sms}) {
      for (int which = 0; which < 3; ++which) {
        const int parts = n >= 4096 ? 1 : 4;
        const double m = median_us(11, g, [&] {
          if (which == 0) gather<512><<<g, 512>>>(out, src, map, rows, copies, parts, stamps);
          if (which == 1) expand<512, 0, false><<<g, 512>>>(src, out, map, rows, copies, parts, stamps);
          if (which == 2) expand<512, 0, true><<<g, 512>>>(src, out, map, rows, copies, parts, stamps);
        });
        const double many = (double)rows * copies * kRow, one = (double)rows * kRow;
        const char* name[] = {"gather 4 -> 1", "store 4", "expand 1 -> 4"};
        const double rd[] = {many, 0, one}, wr[] = {one, many, many};
        printf("| %s | %d | %d | %d | %.1f | %.0f | %.0f |\n", name[which], rows, g, parts, m, rd[which] / (m * 1e3),
               wr[which] / (m * 1e3));
      }
    }
  }
  rows = 256;
  CK(cudaMemcpy(src, h_src.data(), h_src.size(), cudaMemcpyHostToDevice));  // gather wrote partials there
  // Check the expand's output once (512 threads, .wb, 4 copies).
  set_map(copies);
  CK(cudaMemset(out, 0, (size_t)rows * copies * kRow));
  expand<512, 0, true><<<24, 512>>>(src, out, map, rows, copies, 4, stamps);
  CK(cudaDeviceSynchronize());
  std::vector<unsigned char> h_out((size_t)rows * copies * kRow);
  CK(cudaMemcpy(h_out.data(), out, h_out.size(), cudaMemcpyDeviceToHost));
  long bad = 0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < copies; ++c)
      for (int i = 0; i < kRow; ++i)
        bad += h_out[(size_t)h_map[r * copies + c] * kRow + i] != h_src[(size_t)r * kRow + i];
  printf("expand check: %s (%ld bytes differ)\n", bad ? "FAILED" : "ok", bad);
  return bad != 0;
}
