// allreduce_rd.cu: recursive doubling for power-of-two worlds. In step s
// (s = 0 .. log2(world)-1) rank r exchanges its whole current vector with
// partner r ^ (1 << s) and both combine the two in the same order (the lower
// rank's vector first), so after the last step every rank holds bit-identical
// values. log2(world) rounds of latency, world-independent reads per step;
// each rank reads only from its log2(world) partners.
//
// Non-power-of-two worlds are rejected (kErrBadParams): the host falls back
// to two-shot for them.
//
// Buffers: V_0 = peer_in; V_s (1 <= s < L) = scratch region s-1; the last
// step writes out. Per block b (block_range b of [0, count) everywhere):
//   1. fused staging: copy local_src -> peer_in[rank], range b
//   for s in 0 .. L-1, partner q = r ^ (1 << s):
//     2. post "V_s ready" to q, wait for q's "V_s ready"
//     3. V_{s+1} (or out) = V_s(lower of r, q) op V_s(higher), range b
//   4. end barrier (all ranks): partners read this rank's V_s until their
//      step s is done; nobody may return before all have finished.
// Each V_s is written once per call, so no step overwrites what a partner
// may still read. 16-bit floats round to T after every step, unlike
// one-shot and two-shot.
//
// Requires: world a power of two; peer_scratch of
// (log2(world) - 1) * region_bytes<T>(count) bytes (none for world <= 2);
// out != peer_in[rank].
#include "p2p_common.cuh"

// p2pcomm:instantiate allreduce_rd<float>
// p2pcomm:instantiate allreduce_rd<double>
// p2pcomm:instantiate allreduce_rd<half16>
// p2pcomm:instantiate allreduce_rd<bf16>
// p2pcomm:instantiate allreduce_rd<int>
// p2pcomm:instantiate allreduce_rd<long long>

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) allreduce_rd(const AllReduceParams p) {
  __shared__ BlockState st;
  if (!check_params(p, Needs{p.world > 2, false, true})) return;
  begin_block(p, st);
  if (p.world == 1) {
    local_only<T>(p);
    return;
  }
  constexpr int P = PackOf<T>::kElems;
  const int r = p.rank;
  const i64 region = region_bytes<T>(p.count);
  const Range mine = block_range(0, p.count, P);

  stage_flat<T>(p);
  for (int s = 0; (1 << s) < p.world; ++s) {
    const int q = r ^ (1 << s);
    if (!sync_step(p, st, kPhaseStep, q, step_value(st.epoch, s), q, step_value(st.epoch, s), s))
      return;
    const char* own = s == 0 ? (const char*)p.peer_in[r] : (const char*)p.peer_scratch[r] + (s - 1) * region;
    const char* other = s == 0 ? (const char*)pick(p.peer_in, q)
                               : (const char*)pick(p.peer_scratch, q) + (s - 1) * region;
    const bool last = (2 << s) >= p.world;
    char* dst = last ? (char*)p.out : (char*)p.peer_scratch[r] + s * region;
    const Ptrs src = r < q ? ptrs2(own, other) : ptrs2(other, own);
    reduce_range<T>(src, 2, ptrs1(dst), 1, mine, p.op, last && p.op == kOpAvg ? p.world : 0);
  }
  barrier_all(p, st, kPhaseEnd);
}
