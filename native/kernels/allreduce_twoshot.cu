// allreduce_twoshot.cu: reduce-scatter then all-gather, both in one launch.
// Each rank reads 1/world of every peer's input and writes 1/world of the
// result to every peer, so NVLink traffic per rank is ~2x the payload instead
// of one-shot's world x: the choice for medium and large messages.
//
// The vector is cut into world slices (slice_range); block b owns
// block_range b of every slice, in every phase (barriers pair blocks by index).
// Per block b:
//   1. fused staging: copy local_src -> peer_in[rank], range b of every slice
//   2. start barrier (all ranks): inputs staged, and every peer has started
//      this call, so its scratch is free to be written
//   3. reduce slice `rank` (range b) over peer_in[0..world-1] in rank order;
//      store the final values into peer_scratch[q] at the same positions for
//      every rank q (remote stores over NVLink, own scratch included)
//   4. mid barrier (all ranks): scratch range b of every slice is complete
//   5. copy own peer_scratch (range b of every slice) -> out (local)
// Large payloads (kFlagPull) instead keep the reduced slice local and let
// peers read it after the mid barrier, then end with a barrier.
// In place on registered buffers (kFlagDirect), step 3 stores the reduced
// slice into every rank's peer_in itself (only its owner reads or writes a
// slice, and each thread loads its elements before storing them), and an
// end barrier replaces steps 4-5: every rank's buffer holds the result once
// every peer has stored its slice there.
// Push: no end barrier: peers touch this rank's memory only in step 3, which
// precedes their mid flag, so when this kernel ends nobody still uses it;
// the next call writes peer scratch only after its own start barrier.
//
// Requires: peer_scratch on every rank of region_bytes<T>(count) bytes.
// out may equal peer_in[rank] (in place on a registered buffer): peers read
// range b of peer_in before the mid barrier, out is written after it.
#include "p2p_common.cuh"

// p2pcomm:instantiate allreduce_twoshot<float>
// p2pcomm:instantiate allreduce_twoshot<double>
// p2pcomm:instantiate allreduce_twoshot<half16>
// p2pcomm:instantiate allreduce_twoshot<bf16>
// p2pcomm:instantiate allreduce_twoshot<int>
// p2pcomm:instantiate allreduce_twoshot<long long>

template <typename T>
DINLINE void twoshot(const AllReduceParams& p, BlockState& st) {
  if (!check_params(p, Needs{true, true, false})) return;
  begin_block(p, st);
  constexpr int P = PackOf<T>::kElems;

  stage_sliced<T>(p);
  if (!barrier_all(p, st, kPhaseStart)) return;

  // Slice `rank` is reduced once, here, and copied everywhere: all ranks end
  // with bit-identical values.
  const Range own = slice_range(p.count, p.world, p.rank, P);
  if (p.flags & kFlagPull) {
    // Pull (kFlagPull, large payloads): the reduced slice stays in this rank's
    // scratch; after the mid barrier every rank reads the others' slices.
    // Peers then read this rank's scratch until they finish: end barrier.
    reduce_range<T>(ptrs_all(p.peer_in, p.world), p.world, ptrs1(p.peer_scratch[p.rank]), 1,
                    block_range(own.begin, own.end, P), p.op, p.op == kOpAvg ? p.world : 0);
    if (!barrier_all(p, st, kPhaseMid)) return;
    for (int k = 0; k < p.world; ++k) {
      const int s = (p.rank + k) % p.world;  // start with the own slice, then stagger peers
      const Range sl = slice_range(p.count, p.world, s, P);
      copy_range<T>((const char*)pick(p.peer_scratch, s), ptrs1(p.out), 1, block_range(sl.begin, sl.end, P));
  }
  barrier_all(p, st, kPhaseEnd);
  return;
  }
  // Push into every rank's scratch, or (kFlagDirect) into every rank's buffer itself; one call site for
  // both, since each inlined reduce_range is two reduction bodies unrolled over kMaxRanks (NVRTC time).
  const bool direct = (p.flags & kFlagDirect) != 0;
  reduce_range<T>(ptrs_all(p.peer_in, p.world), p.world, ptrs_all(direct ? p.peer_in : p.peer_scratch, p.world),
                  p.world, block_range(own.begin, own.end, P), p.op, p.op == kOpAvg ? p.world : 0);
  if (direct) {
    barrier_all(p, st, kPhaseEnd);
    return;
  }
  if (!barrier_all(p, st, kPhaseMid)) return;

  const char* scratch = (const char*)p.peer_scratch[p.rank];
  for (int s = 0; s < p.world; ++s) {
    const Range sl = slice_range(p.count, p.world, s, P);
    copy_range<T>(scratch, ptrs1(p.out), 1, block_range(sl.begin, sl.end, P));
  }
}

// A call captured into a CUDA graph may carry a graph slot: once the host has
// registered its input on every rank, the same code reads it in place. The
// common path keeps reading the parameters where they are (no copy).
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) allreduce_twoshot(const AllReduceParams p) {
  __shared__ BlockState st;
  if (p.graph_slot != nullptr && *reinterpret_cast<const volatile u64*>(&p.graph_slot->ready) != 0) {
    twoshot<T>(with_graph_slot(p), st);
  } else {
    twoshot<T>(p, st);
  }
}
