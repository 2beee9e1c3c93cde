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
// Requires: out != peer_in[rank] when world > 1 (peers read peer_in until the
// end barrier; the host stages in-place calls). No scratch.
#include "p2p_common.cuh"

// p2pcomm:instantiate allreduce_oneshot<float>
// p2pcomm:instantiate allreduce_oneshot<double>
// p2pcomm:instantiate allreduce_oneshot<half16>
// p2pcomm:instantiate allreduce_oneshot<bf16>
// p2pcomm:instantiate allreduce_oneshot<int>
// p2pcomm:instantiate allreduce_oneshot<long long>

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) allreduce_oneshot(const AllReduceParams p) {
  __shared__ BlockState st;
  if (!check_params(p, Needs{false, false, false})) return;
  begin_block(p, st);

  const Range mine = block_range(0, p.count, PackOf<T>::kElems);
  stage_flat<T>(p);
  if (!barrier_all(p, st, kPhaseStart)) return;

  // Every rank adds in rank order 0..world-1, so all results are bit-identical.
  reduce_range<T>(ptrs_all(p.peer_in, p.world), p.world, ptrs1(p.out), 1, mine, p.op,
                  p.op == kOpAvg ? p.world : 0);

  barrier_all(p, st, kPhaseEnd);
}
