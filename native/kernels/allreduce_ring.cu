// allreduce_ring.cu: ring reduce-scatter then ring all-gather, for
// topologies without full connectivity: rank r reads only its left
// neighbour's memory and posts flags only to its two neighbours.
//
// The vector is cut into world chunks (slice_range); block b owns
// block_range b of every chunk in every step. Rank r, left = r-1, right = r+1
// (mod world); steps k = 0 .. 2*world-3, pull model:
//   reduce-scatter, k = 0 .. world-2, chunk c = r-k-1:
//     acc = (k == 0 ? left.peer_in[c] : left.RS[c]) op own peer_in[c]
//     k <  world-2: store acc -> own RS[c]
//     k == world-2: acc is final (chunk r+1): store -> own AG[c] and out[c]
//   all-gather, t = k-(world-1) = 0 .. world-2, chunk g = r-t:
//     copy left.AG[g] -> own AG[g] and out[g]
// Before step k, r posts "step k ready" to right (its input for k == 0, else
// what step k-1 wrote) and waits for left's "step k ready". After the last
// step r posts "done" to left and waits for right's "done": right reads r's
// memory until its last step, so r must not return (and let the next call
// overwrite its buffers) before that.
//
// Order of reduction: chunk c is accumulated c, c+1, ..., c-1 (mod world),
// once, on rank c-1, and then only copied, so every rank ends with
// bit-identical values; they may differ in the last bit from one-shot's
// 0..world-1 order. 16-bit floats round to T after every step (partials
// travel as T, as in NCCL), unlike one-shot and two-shot.
//
// Requires: peer_scratch of 2 * region_bytes<T>(count) bytes on every rank
// (RS region, then AG region); out != peer_in[rank] (right reads it while r
// writes out). Every region is written at most once per call.
#include "p2p_common.cuh"

// p2pcomm:instantiate allreduce_ring<float>
// p2pcomm:instantiate allreduce_ring<double>
// p2pcomm:instantiate allreduce_ring<half16>
// p2pcomm:instantiate allreduce_ring<bf16>
// p2pcomm:instantiate allreduce_ring<int>
// p2pcomm:instantiate allreduce_ring<long long>

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) allreduce_ring(const AllReduceParams p) {
  __shared__ BlockState st;
  if (!check_params(p, Needs{p.world > 1, false, false})) return;
  begin_block(p, st);
  if (p.world == 1) {
    local_only<T>(p);
    return;
  }
  constexpr int P = PackOf<T>::kElems;
  const int w = p.world, r = p.rank;
  const int left = (r + w - 1) % w, right = (r + 1) % w;
  const i64 region = region_bytes<T>(p.count);
  char* const own_rs = (char*)p.peer_scratch[r];
  char* const own_ag = own_rs + region;
  char* const left_rs = (char*)pick(p.peer_scratch, left);
  char* const left_ag = left_rs + region;
  const char* const own_in = (const char*)p.peer_in[r];
  const char* const left_in = (const char*)pick(p.peer_in, left);

  stage_sliced<T>(p);
  for (int k = 0; k <= 2 * w - 3; ++k) {
    if (!sync_step(p, st, kPhaseStep, right, step_value(st.epoch, k), left, step_value(st.epoch, k), k))
      return;
    if (k < w - 1) {
      const int c = ((r - k - 1) % w + w) % w;
      const Range ch = slice_range(p.count, w, c, P);
      const Range mine = block_range(ch.begin, ch.end, P);
      const Ptrs src = ptrs2(k == 0 ? left_in : left_rs, own_in);
      if (k < w - 2) {
        reduce_range<T>(src, 2, ptrs1(own_rs), 1, mine, p.op, 0);
      } else {
        reduce_range<T>(src, 2, ptrs2(own_ag, p.out), 2, mine, p.op, p.op == kOpAvg ? w : 0);
      }
    } else {
      const int g = ((r - (k - (w - 1))) % w + w) % w;
      const Range ch = slice_range(p.count, w, g, P);
      copy_range<T>(left_ag, ptrs2(own_ag, p.out), 2, block_range(ch.begin, ch.end, P));
    }
  }
  sync_step(p, st, kPhaseEnd, left, st.epoch, right, st.epoch, -1);
}
