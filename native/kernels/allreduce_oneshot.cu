// allreduce_oneshot.cu: every rank reads every peer's whole input and
// reduces it. Lowest latency for small messages: one start barrier, one pass
// over NVLink, one end barrier.
//
// Per block b (same partition of [0, count) in every phase):
//   1. fused staging: copy local_src -> peer_in[rank] (block_range b), if needed
//   2. start barrier with block b of every rank (their range b is staged)
//   3. out[range b] = in_0 op in_1 op ... op in_{world-1} (rank order)
//   4. end barrier: no rank returns while a peer may still read its peer_in
//
// Deferred mode: see oneshot_deferred; the host sizes half_bytes (a multiple
// of 16) and passes peer_in = each rank's two halves.
// Requires: out != peer_in[rank] when world > 1 (peers read peer_in until the
// end barrier; the host stages in-place calls). No scratch.
#include "p2p_common.cuh"

// p2pcomm:instantiate allreduce_oneshot<float>
// p2pcomm:instantiate allreduce_oneshot<double>
// p2pcomm:instantiate allreduce_oneshot<half16>
// p2pcomm:instantiate allreduce_oneshot<bf16>
// p2pcomm:instantiate allreduce_oneshot<int>
// p2pcomm:instantiate allreduce_oneshot<long long>

// Deferred mode (half_bytes != 0), for small calls: no end barrier. The
// input is always staged, into one of two halves of peer_in picked by the
// parity of this block's epoch, and block b owns the same chunks (b, b +
// grid, ... of kChunkPacks packs) in every deferred call, on a fixed grid.
// So when block b overwrites a half, the only readers of that region were
// the peers' blocks b two epochs ago, and each of them has since passed a
// barrier with this block (the previous kernel's, which every algorithm
// syncs transitively with all ranks): they are done reading it.
template <typename T>
DINLINE void oneshot_deferred(const AllReduceParams& p, BlockState& st) {
  constexpr int P = PackOf<T>::kElems;
  constexpr i64 kChunk = (i64)kChunkPacks * P;  // elements
  const u64 half = (st.epoch & 1) * (u64)p.half_bytes;
  const i64 step = (i64)gridDim.x * kChunk;
  if (p.local_src != nullptr) {
    char* staged = (char*)p.peer_in[p.rank] + half;
    for (i64 c = (i64)blockIdx.x * kChunk; c < p.count; c += step) {
      copy_range<T>((const char*)p.local_src, ptrs1(staged), 1, Range{c, c + kChunk < p.count ? c + kChunk : p.count});
    }
  }
  if (!barrier_all(p, st, kPhaseStart)) return;
  Ptrs in;
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) in.p[r] = r < p.world ? (char*)p.peer_in[r] + half : nullptr;
  // Every rank adds in rank order 0..world-1, so all results are bit-identical.
  for (i64 c = (i64)blockIdx.x * kChunk; c < p.count; c += step) {
    reduce_range<T>(in, p.world, ptrs1(p.out), 1, Range{c, c + kChunk < p.count ? c + kChunk : p.count}, p.op,
                    p.op == kOpAvg ? p.world : 0);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) allreduce_oneshot(const AllReduceParams p) {
  __shared__ BlockState st;
  if (!check_params(p, Needs{false, false, false})) return;
  begin_block(p, st);
  if (p.half_bytes != 0) {
    oneshot_deferred<T>(p, st);
    return;
  }

  const Range mine = block_range(0, p.count, PackOf<T>::kElems);
  stage_flat<T>(p);
  if (!barrier_all(p, st, kPhaseStart)) return;

  // Every rank adds in rank order 0..world-1, so all results are bit-identical.
  reduce_range<T>(ptrs_all(p.peer_in, p.world), p.world, ptrs1(p.out), 1, mine, p.op,
                  p.op == kOpAvg ? p.world : 0);

  barrier_all(p, st, kPhaseEnd);
}
