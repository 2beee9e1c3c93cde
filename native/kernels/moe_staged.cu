// moe_staged.cu: the device half of golib/moe's staged path, an ep of GPU
// tensors whose ranks span nodes. The host moves rows between ranks and
// decides their order; these kernels do the work that would otherwise take
// the rows through the host twice: moe_staged_expand lays the received rows
// out in expert-major order (without an index it copies rows as they
// are), moe_staged_partials computes each received token's weighted
// partial from the expert outputs, with the host path's bits (float32 from
// +0, k ascending, each product and sum rounded, the partial rounded once
// to C). One block per row or item, any grid; the item count comes with
// the launch or, in calls in stream order, from the host function before
// it (MoeStagedParams::items_at).
#include "moe_common.cuh"

// p2pcomm:instantiate moe_staged_expand
// p2pcomm:instantiate moe_staged_partials<bf16, float>
// p2pcomm:instantiate moe_staged_partials<bf16, bf16>
// p2pcomm:instantiate moe_staged_partials<half16, float>
// p2pcomm:instantiate moe_staged_partials<half16, half16>
// p2pcomm:instantiate moe_staged_partials<float, float>

// staged_items is the launch's item count: p.items, or what the host
// function before it left at p.items_at (never more than p.items). One
// thread of each block reads the mapped word: every thread reading it
// across the bus cost milliseconds per launch. Every thread must call it.
DINLINE i64 staged_items(const MoeStagedParams& p) {
  if (p.items_at == nullptr) return p.items;
  __shared__ i64 n;
  if (threadIdx.x == 0) {
    const i64 v = *reinterpret_cast<const volatile i64*>(p.items_at);
    n = v < 0 ? 0 : (v > p.items ? p.items : v);
  }
  __syncthreads();
  return n;
}

__global__ void __launch_bounds__(kThreads, 1) moe_staged_expand(const MoeStagedParams p) {
  const i64 rb = (i64)p.row_packs * kPackBytes;
  const i64 items = staged_items(p);
  for (i64 r = blockIdx.x; r < items; r += gridDim.x) {
    const char* src = p.src + (p.index != nullptr ? (i64)p.index[r] : r) * rb;  // no index: a plain copy
    char* dst = p.dst + r * rb;
    for (int c = threadIdx.x; c < p.row_packs; c += blockDim.x) st_v16(dst + (i64)c * kPackBytes, ld_v16(src + (i64)c * kPackBytes));
  }
}

template <typename T, typename C>
__global__ void __launch_bounds__(kThreads, 1) moe_staged_partials(const MoeStagedParams p) {
  constexpr int P = PackOf<T>::kElems;
  const int K = p.topk;
  const i64 items = staged_items(p);
  for (i64 i = blockIdx.x; i < items; i += gridDim.x) {
    const int* rows = p.index + i * K;
    const float* w = p.weights + i * K;
    C* dst = reinterpret_cast<C*>(p.dst) + i * p.row_packs * P;
    for (int c = threadIdx.x; c < p.row_packs; c += blockDim.x) {
      float acc[P];
#pragma unroll
      for (int e = 0; e < P; ++e) acc[e] = 0.0f;
      for (int k = 0; k < K; ++k) {
        const int row = rows[k];
        if (row >= 0) add_weighted<T>(acc, w[k], ld_v16(p.src + ((i64)row * p.row_packs + c) * kPackBytes));
      }
      store_partial<T, C>(dst, c, acc);
    }
  }
}
