// moe.cu: mixture-of-experts dispatch and combine kernels, launched from
// Python (python/p2pcomm/moe.py) through p2p_launch. None of them waits on a
// peer: the host orders them with stream barriers (start barrier, kernel that
// writes into peers, mid barrier with a full system fence, kernel that reads
// what peers wrote). Every grid is 1-D with kThreads (512) threads per block
// and any number of blocks (the host passes num_sms); results never depend on
// the grid: every value is computed in a fixed order by exactly one thread.
//
// Buffers (W ranks, Tm = max_tokens, K = topk, E experts, L = E / W, H = hidden):
//   recv_x  [W, Tm, H] T      symmetric: row [s, slot] = token sent by source s
//   meta    [W, Tm, 3K+1] i32 symmetric: per [s, slot]: local expert of each k
//                             (-1: not on this rank) | weight bits of each k |
//                             source token | rank of pair k among source s's
//                             pairs of that expert, in (token, k) order
//   hdr     [W, L+1] i32      symmetric: per source s: tokens sent, then pairs
//                             sent per local expert
//   comb    [W, Tm+1, H] f32  symmetric: [d, slot] = partial of expert rank d
//   send_slot [Tm, W] i32     local: slot of token t on rank d, -1: not sent
//   pair_rank [Tm * K] i32    local scratch of moe_dispatch_send
//   comb_rows [W*Tm, K] i32   local: output row of pair (s, slot, k), -1: none
// Byte layouts of the parameter structs are pinned below by static_asserts and
// mirrored by ctypes in moe.py (checked at import).
#include "p2p_common.cuh"

// kMoeMaxTopK bounds topk (one warp lane per k).
constexpr int kMoeMaxTopK = 32;
constexpr int kMoeWarps = kThreads / 32;
// kMoeUnroll: 16-byte packs per lane in flight in the row copies.
constexpr int kMoeUnroll = 4;

// MoeDispatchParams is the argument of moe_dispatch_send.
//
//   offset size field
//   0      64   peer_recv_x[8]  each rank's recv_x
//   64     64   peer_meta[8]    each rank's meta
//   128    64   peer_hdr[8]     each rank's hdr
//   192    8    x               [T, H] T, local
//   200    8    topk_idx        [T, K] i32 or i64 (idx_bytes)
//   208    8    topk_w          [T, K] f32
//   216    8    send_slot       [Tm, W] i32, local output
//   224    8    pair_rank       [Tm * K] i32, local scratch
//   232    4    num_tokens      T
//   236    4    max_tokens      Tm
//   240    4    hidden          H
//   244    4    topk            K
//   248    4    num_experts     E
//   252    4    rank
//   256    4    world           W
//   260    4    idx_bytes       4 or 8
//   total  264, aligned to 8
struct MoeDispatchParams {
  void* peer_recv_x[kMaxRanks];
  void* peer_meta[kMaxRanks];
  void* peer_hdr[kMaxRanks];
  const void* x;
  const void* topk_idx;
  const float* topk_w;
  int* send_slot;
  int* pair_rank;
  int num_tokens;
  int max_tokens;
  int hidden;
  int topk;
  int num_experts;
  int rank;
  int world;
  int idx_bytes;
};
static_assert(sizeof(MoeDispatchParams) == 264, "MoeDispatchParams size");
// NVRTC has no offsetof: the field sizes add up to the size (no padding),
// which pins every offset in the table.
static_assert(sizeof(MoeDispatchParams::peer_recv_x) + sizeof(MoeDispatchParams::peer_meta) +
                      sizeof(MoeDispatchParams::peer_hdr) == 192 &&
                  5 * sizeof(void*) + 8 * sizeof(int) == 264 - 192,
              "MoeDispatchParams fields");

// MoeExpandParams is the argument of moe_dispatch_expand.
//
//   offset size field
//   0      8    recv_x         this rank's recv_x
//   8      8    meta           this rank's meta
//   16     8    hdr            this rank's hdr
//   24     8    out_x          [row_cap, H] T: expert-major rows
//   32     8    out_info       [4, row_cap] i32: local expert | source rank |
//                              source token | weight bits
//   40     8    expert_counts  [L + 1] i32: rows per local expert, then R
//   48     8    comb_rows      [W * Tm, K] i32, local output
//   56     8    row_cap        i64: rows of out_x (R eager, W*Tm*K capturable)
//   64     4    max_tokens     Tm
//   68     4    hidden         H
//   72     4    topk           K
//   76     4    num_local      L
//   80     4    world          W
//   84     4    pad
//   total  88, aligned to 8
struct MoeExpandParams {
  const void* recv_x;
  const int* meta;
  const int* hdr;
  void* out_x;
  int* out_info;
  int* expert_counts;
  int* comb_rows;
  i64 row_cap;
  int max_tokens;
  int hidden;
  int topk;
  int num_local;
  int world;
  int pad;
};
static_assert(sizeof(MoeExpandParams) == 88, "MoeExpandParams size");
static_assert(7 * sizeof(void*) + sizeof(MoeExpandParams::row_cap) + 6 * sizeof(int) == 88,
              "MoeExpandParams fields");

// MoeCombineParams is the argument of moe_combine_send and moe_combine_reduce.
//
//   offset size field
//   0      64   peer_comb[8]   each rank's comb ([W, Tm+1, H] f32)
//   64     8    expert_out     [row_cap, H] T, local (send)
//   72     8    meta           this rank's meta (send)
//   80     8    hdr            this rank's hdr (send)
//   88     8    comb_rows      [W * Tm, K] i32 (send)
//   96     8    send_slot      [Tm, W] i32 (reduce)
//   104    8    y              [T, H] T, local output (reduce)
//   112    8    row_cap        i64: rows of expert_out (send)
//   120    4    num_tokens     T (reduce)
//   124    4    max_tokens     Tm
//   128    4    hidden         H
//   132    4    topk           K
//   136    4    rank
//   140    4    world          W
//   144    4    num_local      L (send)
//   148    4    pad
//   total  152, aligned to 8
struct MoeCombineParams {
  void* peer_comb[kMaxRanks];
  const void* expert_out;
  const int* meta;
  const int* hdr;
  const int* comb_rows;
  const int* send_slot;
  void* y;
  i64 row_cap;
  int num_tokens;
  int max_tokens;
  int hidden;
  int topk;
  int rank;
  int world;
  int num_local;
  int pad;
};
static_assert(sizeof(MoeCombineParams) == 152, "MoeCombineParams size");
static_assert(sizeof(MoeCombineParams::peer_comb) == 64 &&
                  6 * sizeof(void*) + sizeof(MoeCombineParams::row_cap) + 8 * sizeof(int) == 152 - 64,
              "MoeCombineParams fields");

// p2pcomm:instantiate moe_dispatch_send<bf16>
// p2pcomm:instantiate moe_dispatch_send<half16>
// p2pcomm:instantiate moe_dispatch_send<float>
// p2pcomm:instantiate moe_dispatch_expand<bf16>
// p2pcomm:instantiate moe_dispatch_expand<half16>
// p2pcomm:instantiate moe_dispatch_expand<float>
// p2pcomm:instantiate moe_combine_send<bf16>
// p2pcomm:instantiate moe_combine_send<half16>
// p2pcomm:instantiate moe_combine_send<float>
// p2pcomm:instantiate moe_combine_reduce<bf16>
// p2pcomm:instantiate moe_combine_reduce<half16>
// p2pcomm:instantiate moe_combine_reduce<float>

// ---------------------------------------------------------------- helpers

DINLINE u32 lanemask_lt() {
  u32 m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// expert_at is global expert id q (flat [T, K] index) of topk_idx, or -1
// when it is -1 or outside [0, E) (capturable mode treats those as -1;
// eager mode checked them on the host).
DINLINE int expert_at(const MoeDispatchParams& p, i64 q) {
  const long long v = p.idx_bytes == 8 ? ((const long long*)p.topk_idx)[q]
                                       : (long long)((const int*)p.topk_idx)[q];
  return (v >= 0 && v < p.num_experts) ? (int)v : -1;
}

// dest_mask: bit d set when one of token t's experts lives on rank d.
DINLINE u32 dest_mask(const MoeDispatchParams& p, int t, int L) {
  u32 m = 0;
  for (int k = 0; k < p.topk; ++k) {
    const int g = expert_at(p, (i64)t * p.topk + k);
    if (g >= 0) m |= 1u << (g / L);
  }
  return m;
}

// block_exclusive_scan replaces a[0..n) (shared) by its exclusive prefix
// sums and returns the total. Every thread of the block calls it.
DINLINE int block_exclusive_scan(int* a, int n, int* wsum, int* carry) {
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = (int)blockDim.x >> 5;
  if (tid == 0) *carry = 0;
  __syncthreads();
  for (int base = 0; base < n; base += (int)blockDim.x) {
    const int i = base + tid;
    const int v = i < n ? a[i] : 0;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(~0u, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) wsum[warp] = x;
    __syncthreads();
    int off = *carry;
    for (int w = 0; w < warp; ++w) off += wsum[w];
    if (i < n) a[i] = off + x - v;
    __syncthreads();
    if (tid == 0) {
      int s = 0;
      for (int w = 0; w < nw; ++w) s += wsum[w];
      *carry += s;
    }
    __syncthreads();
  }
  return *carry;
}

// ---------------------------------------------------------------- dispatch

// moe_dispatch_send runs on the source rank between the start and mid
// barriers. Block b owns tokens [T*b/G, T*(b+1)/G). It counts, per
// destination and per expert, the tokens and pairs before its range (so the
// blocks need no cross-block sync), then ranks its own tokens (slot on each
// destination = tokens before it sent there) and pairs (rank among this
// source's pairs of the same expert, in (token, k) order), and finally
// copies each token row once per destination, with its metadata, straight
// into the destinations' recv_x and meta. The last block, whose counters
// end as totals, writes every destination's hdr row of this source.
// Dynamic shared memory: 4 * E bytes.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) moe_dispatch_send(const MoeDispatchParams p) {
  extern __shared__ int run_exp[];  // [E]: pairs of each expert so far
  __shared__ int run_dest[kMaxRanks];
  __shared__ int wcnt[kMoeWarps][kMaxRanks];
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = (int)blockDim.x >> 5;
  const int E = p.num_experts, K = p.topk, W = p.world, L = E / W, ntok = p.num_tokens;
  const int G = (int)gridDim.x, b = (int)blockIdx.x;
  const int t0 = (int)((i64)ntok * b / G), t1 = (int)((i64)ntok * (b + 1) / G);
  for (int e = tid; e < E; e += (int)blockDim.x) run_exp[e] = 0;
  if (tid < kMaxRanks) run_dest[tid] = 0;
  __syncthreads();

  // 1. Tokens and pairs before this block's range (integer counts: any order).
  for (int base = 0; base < t0; base += (int)blockDim.x) {
    const int t = base + tid;
    const u32 m = t < t0 ? dest_mask(p, t, L) : 0u;
    for (int d = 0; d < W; ++d) {
      const u32 bal = __ballot_sync(~0u, (m >> d) & 1u);
      if (lane == 0 && bal != 0) atomicAdd(&run_dest[d], __popc(bal));
    }
  }
  const i64 q0 = (i64)t0 * K, q1 = (i64)t1 * K;
  for (i64 base = 0; base < q0; base += blockDim.x) {
    const i64 q = base + tid;
    const int g = q < q0 ? expert_at(p, q) : -1;
    const u32 peers = __match_any_sync(~0u, g);
    if (g >= 0 && lane == __ffs(peers) - 1) atomicAdd(&run_exp[g], __popc(peers));
  }
  __syncthreads();

  // 2. Slots of this block's tokens on each destination, in token order.
  for (int base = t0; base < t1; base += (int)blockDim.x) {
    const int t = base + tid;
    const u32 m = t < t1 ? dest_mask(p, t, L) : 0u;
    u32 bal[kMaxRanks];
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      bal[d] = d < W ? __ballot_sync(~0u, (m >> d) & 1u) : 0u;
      if (d < W && lane == 0) wcnt[warp][d] = __popc(bal[d]);
    }
    __syncthreads();
    if (t < t1) {
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d) {
        if (d < W) {
          int slot = -1;
          if ((m >> d) & 1u) {
            slot = run_dest[d] + __popc(bal[d] & lanemask_lt());
            for (int w = 0; w < warp; ++w) slot += wcnt[w][d];
          }
          p.send_slot[(i64)t * W + d] = slot;
        }
      }
    }
    __syncthreads();
    if (tid < W) {
      int s = 0;
      for (int w = 0; w < nw; ++w) s += wcnt[w][tid];
      run_dest[tid] += s;
    }
    __syncthreads();
  }

  // 3. Rank of each pair among this source's pairs of its expert: warps in
  // turn, so ranks follow (token, k) order.
  for (i64 base = q0; base < q1; base += blockDim.x) {
    const i64 q = base + tid;
    const int g = q < q1 ? expert_at(p, q) : -1;
    const u32 peers = __match_any_sync(~0u, g);
    int r = -1;
    for (int w = 0; w < nw; ++w) {
      if (w == warp) {
        if (g >= 0) r = run_exp[g] + __popc(peers & lanemask_lt());
        __syncwarp();
        if (g >= 0 && lane == __ffs(peers) - 1) run_exp[g] += __popc(peers);
      }
      __syncthreads();
    }
    if (q < q1) p.pair_rank[q] = r;
  }
  __syncthreads();

  // 4. This source's totals into every destination's hdr (last block only).
  if (b == G - 1) {
    for (int i = tid; i < W * (L + 1); i += (int)blockDim.x) {
      const int d = i / (L + 1), j = i % (L + 1);
      int* hdr = (int*)pick(p.peer_hdr, d);
      hdr[p.rank * (L + 1) + j] = j == 0 ? run_dest[d] : run_exp[d * L + j - 1];
    }
  }

  // 5. Rows and metadata: one warp per token, each row read once.
  const i64 row_bytes = (i64)p.hidden * (i64)sizeof(T);
  const i64 packs = row_bytes / kPackBytes;
  const int MW = 3 * K + 1;
  for (int t = t0 + warp; t < t1; t += nw) {
    char* dst[kMaxRanks];
    int* mdst[kMaxRanks];
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      const int slot = d < W ? p.send_slot[(i64)t * W + d] : -1;
      const i64 at = (i64)p.rank * p.max_tokens + slot;
      dst[d] = slot >= 0 ? (char*)pick(p.peer_recv_x, d) + at * row_bytes : nullptr;
      mdst[d] = slot >= 0 ? (int*)pick(p.peer_meta, d) + at * MW : nullptr;
    }
    for (int j = lane; j < MW; j += 32) {
      int g = -1, v = 0;
      if (j < K) {
        g = expert_at(p, (i64)t * K + j);
      } else if (j < 2 * K) {
        v = __float_as_int(p.topk_w[(i64)t * K + j - K]);
      } else if (j == 2 * K) {
        v = t;
      } else {
        g = expert_at(p, (i64)t * K + j - 2 * K - 1);
        v = p.pair_rank[(i64)t * K + j - 2 * K - 1];
      }
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d) {
        if (mdst[d] == nullptr) continue;
        int out = v;
        if (j < K) out = (g >= 0 && g / L == d) ? g - d * L : -1;
        else if (j > 2 * K) out = (g >= 0 && g / L == d) ? v : -1;
        mdst[d][j] = out;
      }
    }
    const char* src = (const char*)p.x + (i64)t * row_bytes;
    for (i64 i = lane; i < packs; i += 32 * kMoeUnroll) {
      V16 v[kMoeUnroll];
#pragma unroll
      for (int u = 0; u < kMoeUnroll; ++u) {
        if (i + u * 32 < packs) v[u] = ld_v16(src + (i + u * 32) * kPackBytes);
      }
#pragma unroll
      for (int u = 0; u < kMoeUnroll; ++u) {
        if (i + u * 32 < packs) {
#pragma unroll
          for (int d = 0; d < kMaxRanks; ++d) {
            if (dst[d] != nullptr) st_v16(dst[d] + (i + u * 32) * kPackBytes, v[u]);
          }
        }
      }
    }
  }
}

// moe_dispatch_expand runs on the destination after the mid barrier. Every
// block computes, from hdr, each (source, local expert)'s first output row:
// experts in order, then sources in order; the sender's pair ranks place
// each pair within that run, so row order is (local expert, source, token,
// k). One warp per received (source, slot) writes its rows' metadata and
// copies the token row once per valid k. Block 0 writes expert_counts and R.
// Dynamic shared memory: 4 * (W + 1) * L bytes.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) moe_dispatch_expand(const MoeExpandParams p) {
  extern __shared__ int sh[];  // tot[L] (then expert bases) | base[W][L]
  __shared__ int wsum[kMoeWarps];
  __shared__ int carry;
  __shared__ int rows[kMoeWarps][kMoeMaxTopK];
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = (int)blockDim.x >> 5;
  const int L = p.num_local, W = p.world, K = p.topk, Tm = p.max_tokens;
  int* tot = sh;
  int* base = sh + L;
  for (int e = tid; e < L; e += (int)blockDim.x) {
    int acc = 0;
    for (int s = 0; s < W; ++s) {
      base[s * L + e] = acc;
      acc += p.hdr[s * (L + 1) + 1 + e];
    }
    tot[e] = acc;
    if (blockIdx.x == 0) p.expert_counts[e] = acc;
  }
  __syncthreads();
  const int R = block_exclusive_scan(tot, L, wsum, &carry);
  if (blockIdx.x == 0 && tid == 0) p.expert_counts[L] = R;
  for (int i = tid; i < W * L; i += (int)blockDim.x) base[i] += tot[i % L];
  __syncthreads();

  const int MW = 3 * K + 1;
  const i64 row_bytes = (i64)p.hidden * (i64)sizeof(T);
  const i64 packs = row_bytes / kPackBytes;
  int* info_le = p.out_info;
  int* info_src = p.out_info + p.row_cap;
  int* info_tok = p.out_info + 2 * p.row_cap;
  int* info_w = p.out_info + 3 * p.row_cap;
  const i64 items = (i64)W * Tm;
  for (i64 item = (i64)blockIdx.x * nw + warp; item < items; item += (i64)gridDim.x * nw) {
    const int s = (int)(item / Tm), slot = (int)(item % Tm);
    if (slot >= p.hdr[s * (L + 1)]) continue;  // warp-uniform
    const int* m = p.meta + item * MW;
    int row = -1;
    if (lane < K) {
      const int lid = m[lane], rk = m[2 * K + 1 + lane];
      if (lid >= 0 && lid < L && rk >= 0) {
        const i64 r = (i64)base[s * L + lid] + rk;
        if (r < p.row_cap) {
          row = (int)r;
          info_le[r] = lid;
          info_src[r] = s;
          info_tok[r] = m[2 * K];
          info_w[r] = m[K + lane];
        }
      }
      p.comb_rows[item * K + lane] = row;
    }
    const u32 bal = __ballot_sync(~0u, row >= 0);
    if (row >= 0) rows[warp][__popc(bal & lanemask_lt())] = row;
    __syncwarp();
    const int n = __popc(bal);
    const char* src = (const char*)p.recv_x + item * row_bytes;
    char* out = (char*)p.out_x;
    for (i64 i = lane; i < packs; i += 32 * kMoeUnroll) {
      V16 v[kMoeUnroll];
#pragma unroll
      for (int u = 0; u < kMoeUnroll; ++u) {
        if (i + u * 32 < packs) v[u] = ld_v16(src + (i + u * 32) * kPackBytes);
      }
      for (int j = 0; j < n; ++j) {
        char* o = out + (i64)rows[warp][j] * row_bytes;
#pragma unroll
        for (int u = 0; u < kMoeUnroll; ++u) {
          if (i + u * 32 < packs) st_v16(o + (i + u * 32) * kPackBytes, v[u]);
        }
      }
    }
    __syncwarp();  // rows[warp] is reused by the next item
  }
}

// ---------------------------------------------------------------- combine

// kCombGroup: expert_out rows loaded together per pack in the combine send.
constexpr int kCombGroup = 8;
constexpr int kCombUnroll = 2;

// moe_combine_send runs on the expert rank between the start and mid
// barriers. One warp per received (source, slot): the partial sum over k
// ascending of weight_k * expert_out[row_k], each product and sum rounded
// to float32 (no FMA: the same bits as torch's mul then add), stored as
// float32 into the source's comb[this rank, slot].
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) moe_combine_send(const MoeCombineParams p) {
  __shared__ int rows[kMoeWarps][kMoeMaxTopK];
  __shared__ float wts[kMoeWarps][kMoeMaxTopK];
  constexpr int P = PackOf<T>::kElems;
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = (int)blockDim.x >> 5;
  const int L = p.num_local, W = p.world, K = p.topk, Tm = p.max_tokens, H = p.hidden;
  const int MW = 3 * K + 1;
  const i64 row_bytes = (i64)H * (i64)sizeof(T);
  const i64 ppr = H / P;  // packs per row
  const char* out = (const char*)p.expert_out;
  const i64 items = (i64)W * Tm;
  for (i64 item = (i64)blockIdx.x * nw + warp; item < items; item += (i64)gridDim.x * nw) {
    const int s = (int)(item / Tm), slot = (int)(item % Tm);
    if (slot >= p.hdr[s * (L + 1)]) continue;  // warp-uniform
    int row = -1;
    float w = 0.0f;
    if (lane < K) {
      row = p.comb_rows[item * K + lane];
      w = __int_as_float(p.meta[item * MW + K + lane]);
      if (row >= p.row_cap) row = -1;
    }
    const u32 bal = __ballot_sync(~0u, row >= 0);
    if (row >= 0) {
      const int j = __popc(bal & lanemask_lt());
      rows[warp][j] = row;
      wts[warp][j] = w;
    }
    __syncwarp();
    const int n = __popc(bal);
    float* dst = (float*)pick(p.peer_comb, s) + ((i64)p.rank * (Tm + 1) + slot) * (i64)H;
    for (i64 c = lane; c < ppr; c += 32 * kCombUnroll) {
      float acc[kCombUnroll][P];
#pragma unroll
      for (int u = 0; u < kCombUnroll; ++u) {
#pragma unroll
        for (int e = 0; e < P; ++e) acc[u][e] = 0.0f;
      }
      for (int j0 = 0; j0 < n; j0 += kCombGroup) {
        V16 raw[kCombUnroll][kCombGroup];
#pragma unroll
        for (int jj = 0; jj < kCombGroup; ++jj) {
          if (j0 + jj < n) {
            const char* r = out + (i64)rows[warp][j0 + jj] * row_bytes;
#pragma unroll
            for (int u = 0; u < kCombUnroll; ++u) {
              const i64 cc = c + u * 32;
              if (cc < ppr) raw[u][jj] = ld_v16(r + cc * kPackBytes);
            }
          }
        }
#pragma unroll
        for (int jj = 0; jj < kCombGroup; ++jj) {
          if (j0 + jj < n) {
            const float wj = wts[warp][j0 + jj];
#pragma unroll
            for (int u = 0; u < kCombUnroll; ++u) {
              if (c + u * 32 < ppr) {
                Pack<T> in;
                in.v = raw[u][jj];
#pragma unroll
                for (int e = 0; e < P; ++e) acc[u][e] = __fadd_rn(acc[u][e], __fmul_rn(wj, Num<T>::to(in.e[e])));
              }
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kCombUnroll; ++u) {
        const i64 cc = c + u * 32;
        if (cc < ppr) {
#pragma unroll
          for (int q = 0; q < P / 4; ++q) {
            V16 v;
            v.x = __float_as_uint(acc[u][4 * q]);
            v.y = __float_as_uint(acc[u][4 * q + 1]);
            v.z = __float_as_uint(acc[u][4 * q + 2]);
            v.w = __float_as_uint(acc[u][4 * q + 3]);
            st_v16(dst + cc * P + 4 * q, v);
          }
        }
      }
    }
    __syncwarp();  // rows[warp] / wts[warp] are reused by the next item
  }
}

// moe_combine_reduce runs on the source after the mid barrier: y[t] = sum
// over ranks d ascending (those token t went to) of comb[d, slot of t on d],
// in float32 from +0, rounded once to T; zeros for a token sent nowhere.
// One thread per 16-byte pack of y.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) moe_combine_reduce(const MoeCombineParams p) {
  constexpr int P = PackOf<T>::kElems;
  constexpr int Q = P / 4;  // float32 packs per T pack
  const int W = p.world, H = p.hidden, Tm = p.max_tokens;
  const i64 ppr = H / P;
  const i64 total = (i64)p.num_tokens * ppr;
  const float* comb = (const float*)pick(p.peer_comb, p.rank);
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    const i64 t = i / ppr, c = i % ppr;
    V16 raw[kMaxRanks][Q];
    bool has[kMaxRanks];
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      const int slot = d < W ? p.send_slot[t * W + d] : -1;
      has[d] = slot >= 0;
      if (has[d]) {
        const float* part = comb + ((i64)d * (Tm + 1) + slot) * (i64)H + c * P;
#pragma unroll
        for (int q = 0; q < Q; ++q) raw[d][q] = ld_v16(part + 4 * q);
      }
    }
    float acc[P];
#pragma unroll
    for (int e = 0; e < P; ++e) acc[e] = 0.0f;
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      if (has[d]) {
#pragma unroll
        for (int q = 0; q < Q; ++q) {
          acc[4 * q] = __fadd_rn(acc[4 * q], __uint_as_float(raw[d][q].x));
          acc[4 * q + 1] = __fadd_rn(acc[4 * q + 1], __uint_as_float(raw[d][q].y));
          acc[4 * q + 2] = __fadd_rn(acc[4 * q + 2], __uint_as_float(raw[d][q].z));
          acc[4 * q + 3] = __fadd_rn(acc[4 * q + 3], __uint_as_float(raw[d][q].w));
        }
      }
    }
    Pack<T> o;
#pragma unroll
    for (int e = 0; e < P; ++e) o.e[e] = Num<T>::from(acc[e]);
    st_v16((char*)p.y + (t * ppr + c) * kPackBytes, o.v);
  }
}
