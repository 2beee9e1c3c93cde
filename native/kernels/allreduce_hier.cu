// allreduce_hier.cu: all-reduce across nodes in one launch. Inside a node
// ranks read each other's memory (CUDA IPC, as two-shot does); between
// nodes every byte goes through PortChannels, i.e. triggers the kernel
// pushes into FIFOs that the host's proxy runs on UCX. Nothing happens on
// the host per call or per chunk, so a call can be captured in a CUDA graph.
//
// What crosses nodes lives in pinned host memory mapped into the device
// (the "net" buffer: headers, partials' rings, results on their way): the
// kernel writes and reads it itself, so the proxy moves it with UCX alone
// and makes no CUDA call. A proxy that needed one (a copy between device and
// host memory) could stall for as long as this kernel runs: a synchronous
// copy, a module load or a cudaFree on another thread of the process holds
// the device until the running kernel ends, and this one ends only once the
// proxy moved its bytes (docs/DESIGN.md, "Channels and the proxy").
//
// Shape. L ranks per node, N nodes, W = L * N ranks. The rank of local
// index l owns shard l of the elements (slice_range over L); the ranks of
// local index l on all nodes form its group, which splits shard l into N
// parts (slice_range over N): the group rank on node m owns part m. Parts
// travel in chunks of at most chunk_elems elements, fewer where a part would
// otherwise leave blocks idle; chunk k of a part belongs to
// block k mod kHierBlocks, so each block is a pipeline of its own with a
// lane of port channels (semaphores of its own; blocks of a rail share its
// FIFO): the j-th signal block b gets from a peer is always that peer's
// block b's j-th.
//
// Per block b, with n this rank's node:
//   1. stage this block's chunks of the input (when not registered), start
//      barrier with the node's ranks (block b of each; signatures compared)
//   2. block 0 trades a header (epoch, signature) with every group rank,
//      its partials of chunk 0 (step 3's first) put ahead of it under the
//      header's signal: a trip less, which is most of a small call's time;
//      every block waits for its verdict: any difference on any node fails
//      the call on every rank alike (kErrMismatch, not fatal), nothing else
//      moves and what came early is not read
//   3. for j = 0, 1, ...: for each other node m, fold chunk j of part m over
//      the node's inputs (rank order, in the accumulator type: float32 for
//      16-bit floats) into a send slot and put it, with a signal, into node
//      m's group rank; then fold chunk j of the own part likewise, wait for
//      every other node's partial of it, fold the partials in node order,
//      round once into the results region and the net buffer, and put it
//      from there, with a signal, to every group rank. Ring slots are reused after kHierRing chunks: the
//      sender of chunk j waits for the owner's result of chunk j - kHierRing,
//      which the owner sends only after it has read that slot.
//   4. wait for every other part's results of this block's chunks, copy
//      them from the net buffer into the results region, then the middle
//      barrier with the node's ranks, and copy every local rank's results
//      of this block's chunks into out (reading their regions).
// Every element is op over nodes in node order of op over each node's ranks
// in rank order, computed once by its part's owner and copied: every rank
// holds the same bits (the CPU backend computes the same expression).
//
// Exchange (small shards): a call whose shard fits kHierBlocks chunks of
// the exchange area's slots (and, past two nodes, is small) skips the
// results' trip. The shard is one part that every group rank owns: each
// block folds its chunk of the whole shard once, puts it to every other
// node, waits for theirs and folds all in node order itself. The same
// expression over the same partials, so the same bits on every rank, in one
// trip instead of two (two nodes send the same bytes either way). No result
// comes back to say a slot was read, so the exchange area's slots alternate
// by call parity: a peer writes this rank's slot of parity p again only in
// the call after next, which it starts once it holds this rank's header of
// the call between, sent by a launch after the one that read the slot. (The
// parity is the blocks' call counter, which on a communicator across nodes
// only this kernel advances.)
//
// No end barrier: a node's peers read this rank's results region until
// their middle barrier's copies end, and this rank writes it again only
// after block b's next start barrier, which those peers reach after their
// copies. The net buffer's results are written by other nodes' owners only
// once they hold this rank's partials of the next call.
//
// Order of a peer's signals on block b's channel, per call: the header
// (block 0 only, with its partial 0), then for j = 0, 1, ...: its partial j
// of this rank's part (if that part has a chunk j for block b, and but for
// block 0's partial 0), then its result j of its own part (if that has
// one; never in an exchange). signals_before counts them; the channel's
// expected word keeps the running total across calls (only block b touches
// it).
#include "channel.cuh"

// p2pcomm:instantiate allreduce_hier<float>
// p2pcomm:instantiate allreduce_hier<double>
// p2pcomm:instantiate allreduce_hier<half16>
// p2pcomm:instantiate allreduce_hier<bf16>
// p2pcomm:instantiate allreduce_hier<int>
// p2pcomm:instantiate allreduce_hier<long long>

// kHierBlocks is the grid (and the number of channel lanes); kHierRing
// the chunks in flight per block and peer; kMaxNodes the most nodes.
constexpr int kHierBlocks = 8;
constexpr int kHierRing = 2;
constexpr int kMaxNodes = kMaxRanks;
// kPhaseHierHeader and kPhaseHierVerdict name, in ErrorWord, the header
// wait and a block's wait for block 0's verdict (after the channel phases).
constexpr int kPhaseHierHeader = kPhaseFifoFlush + 1;
constexpr int kPhaseHierVerdict = kPhaseFifoFlush + 2;
// The net buffer (host memory, the port channels' range): results on their
// way (ring_offset bytes, at the offsets of the results region), then
//   the rings: send[G][N][R] slots, then recv[G][N][R] slots
//   then                          the exchange area: send[G][N][2] slots, then recv[G][N][2] slots, by call
//                                 parity, of kHierExchangeSlotBytes: kHierExchangeHead bytes (block 0's: the
//                                 call's header, this rank's in send[0][node], node m's in recv[0][m]), then
//                                 an exchange's partials
// A call is an exchange when its shard fits one exchange slot per block, and
// past two nodes (where an exchange sends more bytes than the two trips) is
// at most kHierExchangeSmallBytes of partials.
constexpr u64 kHierExchangeSlotBytes = 135168;  // 132 KiB: 128 KiB of partials and the header
constexpr u64 kHierExchangeHead = 16;
constexpr u64 kHierExchangeSmallBytes = 65536;  // 64 KiB
// An exchange's partials up to kHierSingleChunkBytes travel as one chunk,
// under the header's signal; larger ones as one chunk per block, so that
// every rail carries a share.
constexpr u64 kHierSingleChunkBytes = 16384;
static_assert(kHierSingleChunkBytes <= kHierExchangeSlotBytes - kHierExchangeHead, "a single chunk fits a slot");

// HierParams is the kernel's one by-value argument; LAYOUT.md tables it.
// Pointers are device addresses valid here; [i] entries are by local index
// unless said otherwise.
//
//   offset size field
//   0      64   peer_in[8]      each local rank's input or staging buffer
//   64     64   peer_hier[8]    each local rank's results region (device memory)
//   128    64   peer_signal[8]  each local rank's Signal
//   192    8    local_src       caller's input; null or == peer_in[local_rank]: no copy
//   200    8    out             result (local)
//   208    8    err             ErrorWord (mapped host memory), may be null
//   216    8    chans           PortChannel[kHierBlocks][nodes], device memory
//   224    8    net             this rank's net buffer (mapped host memory, device address)
//   232    8    count           i64 elements
//   240    8    timeout_ns      u64; 0 = kDefaultTimeoutNs
//   248    8    chunk_elems     i64: most elements per chunk, a multiple of 8
//   256    8    ring_offset     u64: bytes of the results region (the net buffer's headers and rings follow)
//   264    8    slot_bytes      u64: bytes of a ring slot, >= chunk_elems * sizeof(Acc)
//   272    4    local_rank      i32
//   276    4    local_size      i32: L, 1..kMaxRanks
//   280    4    node            i32
//   284    4    nodes           i32: N, 2..kMaxNodes
//   288    4    rank            i32: this rank (errors)
//   292    4    world           i32: W (avg's divisor)
//   296    4    op              i32, Op
//   300    4    signature       i32: the call's summary among the node's ranks (with where a registered
//                               input lies); kRejectSignature: this rank rejected it
//   304    4    flags           u32: kFlagFence
//   308    4    call_signature  i32: count, dtype and op only: what the nodes compare
//   312    32   global_of[8]    i32: global rank of each local index
//   344    32   group_of[8]     i32: global rank of each node's member of this rank's group
//   total  376, aligned to 8
struct HierParams {
  void* peer_in[kMaxRanks];
  char* peer_hier[kMaxRanks];
  Signal* peer_signal[kMaxRanks];
  const void* local_src;
  void* out;
  ErrorWord* err;
  const PortChannel* chans;
  char* net;
  i64 count;
  u64 timeout_ns;
  i64 chunk_elems;
  u64 ring_offset;
  u64 slot_bytes;
  int local_rank;
  int local_size;
  int node;
  int nodes;
  int rank;
  int world;
  int op;
  int signature;
  unsigned flags;
  int call_signature;
  int global_of[kMaxRanks];
  int group_of[kMaxNodes];
};
static_assert(sizeof(HierParams) == 376, "HierParams size");
static_assert(3 * 8 * sizeof(void*) + 5 * sizeof(void*) + 5 * 8 == 272, "HierParams.local_rank offset");
static_assert(272 + 10 * sizeof(int) == 312 && sizeof(HierParams::global_of) == 32, "HierParams tail");

// ---------------------------------------------------------------- geometry

// Plan is how one call's elements divide, the same on every rank of a group:
// shard [lo, hi), cut into nodes parts of psz elements (slice_range's cut:
// the last ones may be short or empty), each cut into chunks of ce. In an
// exchange (x) every part is the whole shard.
struct Plan {
  i64 lo, hi, psz, ce;
  bool x;
};

template <typename T> DINLINE Plan make_plan(const HierParams& h, int local_index) {
  typedef typename Num<T>::Acc Acc;
  constexpr int P = PackOf<T>::kElems;
  constexpr i64 kExchangeElems = (i64)((kHierExchangeSlotBytes - kHierExchangeHead) / sizeof(Acc)) / 8 * 8;
  const Range sh = slice_range(h.count, h.local_size, local_index, P);
  Plan pl;
  pl.lo = sh.begin;
  pl.hi = sh.end;
  const i64 n = sh.end - sh.begin;
  pl.x = n <= kHierBlocks * kExchangeElems && (h.nodes == 2 || (u64)n * sizeof(Acc) <= kHierExchangeSmallBytes);
  if (pl.x) {
    // One chunk, which rides with block 0's header, up to
    // kHierSingleChunkBytes; else one per block. Chunks hold a multiple of
    // 8 elements.
    const i64 per = (u64)n * sizeof(Acc) <= kHierSingleChunkBytes ? n : (n + kHierBlocks - 1) / kHierBlocks;
    pl.psz = n;
    pl.ce = per < 8 ? 8 : (per + 7) / 8 * 8;
    return pl;
  }
  pl.psz = (n + h.nodes - 1) / h.nodes;
  pl.psz = (pl.psz + P - 1) / P * P;
  // Chunks of at most a slot, and small enough that a part keeps every
  // block (each on its own rail) busy: the rails, not a chunk's size, set
  // the pace over tcp.
  const i64 even = ((pl.psz + kHierBlocks - 1) / kHierBlocks + 7) / 8 * 8;
  pl.ce = even < h.chunk_elems ? even : h.chunk_elems;
  return pl;
}

// part_range is part m of the shard, in elements.
DINLINE Range part_range(const Plan& pl, int m) {
  if (pl.x) return Range{pl.lo, pl.hi};
  Range r;
  r.begin = pl.lo + (i64)m * pl.psz;
  if (r.begin > pl.hi) r.begin = pl.hi;
  r.end = r.begin + pl.psz < pl.hi ? r.begin + pl.psz : pl.hi;
  return r;
}

// chunks_of is how many chunks of part m block b handles.
DINLINE i64 chunks_of(const Plan& pl, int m) {
  const Range pr = part_range(pl, m);
  const i64 chunks = (pr.end - pr.begin + pl.ce - 1) / pl.ce;
  return chunks > (i64)blockIdx.x ? (chunks - 1 - (i64)blockIdx.x) / kHierBlocks + 1 : 0;
}

// chunk_range is block b's j-th chunk of part m, in elements.
DINLINE Range chunk_range(const Plan& pl, int m, i64 j) {
  const Range pr = part_range(pl, m);
  Range r;
  r.begin = pr.begin + ((i64)blockIdx.x + j * kHierBlocks) * pl.ce;
  r.end = r.begin + pl.ce < pr.end ? r.begin + pl.ce : pr.end;
  return r;
}

// rides_header is whether chunk j's partial travels with the header's
// signal instead of one of its own: block 0's chunk 0.
DINLINE bool rides_header(i64 j) { return blockIdx.x == 0 && j == 0; }

// signals_before is how many signals block b gets from node m's group rank
// after the header and before iteration j: its partials of this rank's part
// (mine chunks in all; one may ride with the header) and its results of its
// own part (theirs chunks in all).
DINLINE u64 signals_before(i64 j, i64 mine, i64 theirs) {
  const i64 partials = j < mine ? j : mine;
  return (u64)(partials - (partials > 0 && blockIdx.x == 0 ? 1 : 0)) + (u64)(j < theirs ? j : theirs);
}

// partial_signal is how many signals partial j of this rank's part adds.
DINLINE u64 partial_signal(i64 j, i64 mine) { return j < mine && !rides_header(j) ? 1 : 0; }

// pick_int is pick for the int tables (no dynamic indexing of parameters,
// which would copy them to local memory).
DINLINE int pick_int(const int* table, int i) {
  int v = -1;
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) {
    if (r == i) v = table[r];
  }
  return v;
}

DINLINE char* own_hier(const HierParams& h) { return (char*)pick((void* const*)h.peer_hier, h.local_rank); }
DINLINE Signal* own_signal(const HierParams& h) { return (Signal*)pick((void* const*)h.peer_signal, h.local_rank); }

// slot_offset is where ring slot j of (this block, node m) lies in the net
// buffer: the send ring holds this rank's partials by destination node, the
// receive ring the partials arriving from node m.
DINLINE u64 slot_offset(const HierParams& h, bool recv, int m, i64 j) {
  const u64 s = ((u64)blockIdx.x * h.nodes + m) * kHierRing + (u64)(j % kHierRing);
  const u64 rings = (u64)kHierBlocks * h.nodes * kHierRing * h.slot_bytes;
  return h.ring_offset + (recv ? rings : 0) + s * h.slot_bytes;
}
DINLINE char* slot(const HierParams& h, bool recv, int m, i64 j) { return h.net + slot_offset(h, recv, m, j); }

// xslot_offset is where the exchange area's slot of (this block, node m)
// for call parity par lies: the send slot of this rank's own node holds its
// header and partial for every other node, the receive slots node m's.
DINLINE u64 xslot_offset(const HierParams& h, bool recv, int m, u64 par) {
  const u64 rings = (u64)kHierBlocks * h.nodes * kHierRing * h.slot_bytes;
  const u64 area = (u64)kHierBlocks * h.nodes * 2 * kHierExchangeSlotBytes;
  const u64 s = ((u64)blockIdx.x * h.nodes + m) * 2 + par;
  return h.ring_offset + 2 * rings + (recv ? area : 0) + s * kHierExchangeSlotBytes;
}

// send_offset is where this rank's partial of chunk j for node m lies (for
// m == node: its own part's), recv_offset where node m's lands here.
DINLINE u64 send_offset(const HierParams& h, const Plan& pl, int m, i64 j, u64 par) {
  return pl.x ? xslot_offset(h, false, h.node, par) + kHierExchangeHead : slot_offset(h, false, m, j);
}
DINLINE u64 recv_offset(const HierParams& h, const Plan& pl, int m, i64 j, u64 par) {
  return pl.x ? xslot_offset(h, true, m, par) + kHierExchangeHead : slot_offset(h, true, m, j);
}

// parts_of is how many distinct parts the plan cuts the shard into.
DINLINE int parts_of(const HierParams& h, const Plan& pl) { return pl.x ? 1 : h.nodes; }

DINLINE u64* word_at(const HierParams& h, u64 off) { return reinterpret_cast<u64*>(h.net + off); }

DINLINE Waiter waiter_of(const HierParams& h) { return Waiter{own_signal(h), h.err, h.timeout_ns, h.rank}; }

// ---------------------------------------------------------------- folds

// AccPack is one pack of T's elements in the accumulator type: 16 bytes of
// T widen to 16 or 32 bytes of Acc.
template <typename T> struct AccPack {
  typedef typename Num<T>::Acc Acc;
  static constexpr int kElems = PackOf<T>::kElems;
  static constexpr int kV16 = (int)sizeof(Acc) * kElems / kPackBytes;
  union {
    V16 v[kV16];
    Acc e[kElems];
  };
};

// fold_partial: dst[i - r.begin] = in_0[i] O in_1[i] O ... over the node's
// inputs (in local rank order), in Acc, unrounded, for i in r. Avg sums
// (the owner divides).
template <typename T, typename O>
DINLINE void fold_partial_op(const Ptrs& in, int nin, char* dst, Range r, const O red) {
  typedef typename Num<T>::Acc Acc;
  constexpr int P = PackOf<T>::kElems;
  for (i64 i = r.begin + (i64)threadIdx.x * P; i < r.end; i += (i64)blockDim.x * P) {
    const i64 off = i * (i64)sizeof(T);
    char* d = dst + (i - r.begin) * (i64)sizeof(Acc);
    if (i + P <= r.end) {
      V16 raw[kMaxRanks];  // every input's pack in flight before the math
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q) {
        if (q < nin) raw[q] = ld_v16(in.p[q] + off);
      }
      Pack<T> x;
      x.v = raw[0];
      AccPack<T> acc;
#pragma unroll
      for (int e = 0; e < P; ++e) acc.e[e] = Num<T>::to(x.e[e]);
#pragma unroll
      for (int q = 1; q < kMaxRanks; ++q) {
        if (q < nin) {
          x.v = raw[q];
#pragma unroll
          for (int e = 0; e < P; ++e) acc.e[e] = red.apply(acc.e[e], Num<T>::to(x.e[e]));
        }
      }
#pragma unroll
      for (int v = 0; v < AccPack<T>::kV16; ++v) st_v16(d + v * kPackBytes, acc.v[v]);
    } else {  // the range's last, partial pack
      for (i64 k = i; k < r.end; ++k) {
        const i64 o = k * (i64)sizeof(T);
        Acc acc = Num<T>::to(ld_elem<T>(in.p[0] + o));
#pragma unroll
        for (int q = 1; q < kMaxRanks; ++q) {
          if (q < nin) acc = red.apply(acc, Num<T>::to(ld_elem<T>(in.p[q] + o)));
        }
        st_elem<Acc>(dst + (k - r.begin) * (i64)sizeof(Acc), acc);
      }
    }
  }
}

// fold_finish: out[i] = out2[i] = p_0[i] O p_1[i] O ... over the nodes'
// partials (in node order, Acc), divided for avg, rounded once to T; n
// elements.
template <typename T, typename O>
DINLINE void fold_finish_op(const Ptrs& parts, int nparts, char* out, char* out2, i64 n, int divisor,
                            const O red) {
  typedef typename Num<T>::Acc Acc;
  constexpr int P = PackOf<T>::kElems;
  constexpr int AV = AccPack<T>::kV16;
  for (i64 i = (i64)threadIdx.x * P; i < n; i += (i64)blockDim.x * P) {
    const i64 aoff = i * (i64)sizeof(Acc);
    if (i + P <= n) {
      AccPack<T> acc, x;
#pragma unroll
      for (int v = 0; v < AV; ++v) acc.v[v] = ld_v16(parts.p[0] + aoff + v * kPackBytes);
#pragma unroll
      for (int m = 1; m < kMaxNodes; ++m) {
        if (m < nparts) {
#pragma unroll
          for (int v = 0; v < AV; ++v) x.v[v] = ld_v16(parts.p[m] + aoff + v * kPackBytes);
#pragma unroll
          for (int e = 0; e < P; ++e) acc.e[e] = red.apply(acc.e[e], x.e[e]);
        }
      }
      Pack<T> o;
#pragma unroll
      for (int e = 0; e < P; ++e) o.e[e] = Num<T>::from(finish(acc.e[e], divisor));
      st_v16(out + i * (i64)sizeof(T), o.v);
      st_v16(out2 + i * (i64)sizeof(T), o.v);
    } else {
      for (i64 k = i; k < n; ++k) {
        const i64 o = k * (i64)sizeof(Acc);
        Acc acc = ld_elem<Acc>(parts.p[0] + o);
#pragma unroll
        for (int m = 1; m < kMaxNodes; ++m) {
          if (m < nparts) acc = red.apply(acc, ld_elem<Acc>(parts.p[m] + o));
        }
        const T x = Num<T>::from(finish(acc, divisor));
        st_elem<T>(out + k * (i64)sizeof(T), x);
        st_elem<T>(out2 + k * (i64)sizeof(T), x);
      }
    }
  }
}

// fold_partial and fold_finish are called, not inlined: each has several
// call sites, and every inlined copy of their unrolled loops (times two ops)
// costs NVRTC seconds; a call per chunk costs the kernel nothing it would see.
template <typename T>
static __device__ __noinline__ void fold_partial(const Ptrs& in, int nin, char* dst, i64 begin, i64 end, int op) {
  const Range r{begin, end};
  if (is_other_op(op)) {
    fold_partial_op<T>(in, nin, dst, r, OpOther{op});
  } else {
    fold_partial_op<T>(in, nin, dst, r, OpSum{});
  }
}

template <typename T>
static __device__ __noinline__ void fold_finish(const Ptrs& parts, int nparts, char* out, char* out2, i64 n, int op,
                                                int divisor) {
  if (is_other_op(op)) {
    fold_finish_op<T>(parts, nparts, out, out2, n, divisor, OpOther{op});
  } else {
    fold_finish_op<T>(parts, nparts, out, out2, n, divisor, OpSum{});
  }
}

// copy_chunk copies elements [begin, end) of src to the same positions of dst.
template <typename T> DINLINE void copy_chunk(const char* src, char* dst, i64 begin, i64 end) {
  copy_range<T>(src, ptrs1(dst), 1, Range{begin, end});
}

// ---------------------------------------------------------------- waits and barriers

// await_signals waits (one thread) until channel c's semaphore reaches
// want, naming the group rank of node m on a timeout.
// A failure of the channel's proxy stops it too (kErrProxy): the proxy also
// lands what the peer sends, so after it failed nothing more arrives.
DINLINE bool await_signals(const HierParams& h, const PortChannel& c, u64 want, int m) {
  u64 seen = 0;
  u32 polls = 0;
  bool failed = false;
  const int peer = pick_int(h.group_of, m);
  const bool ok = spin_until(waiter_of(h), [&] {
    if ((seen = ld_flag_acquire(c.sem)) >= want) return true;
    failed = (++polls & 31u) == 0 && ld_volatile_u32(&c.fifo.host->error) != 0;
    return failed;
  }, seen, peer, kPhaseChannelWait, (int)blockIdx.x, want);
  if (ok && failed) {
    report_error(waiter_of(h), kErrProxy, peer, kPhaseChannelWait, (int)c.fifo.id, want, seen);
    return false;
  }
  return ok;
}

// Bits of BlockState.abort in this kernel: a wait failed (recorded, fatal),
// or a rank of the node made another call (a mismatch, not fatal).
constexpr int kAbortFailed = 1;
constexpr int kAbortMismatch = 2;

// node_barrier is barrier_all among the node's ranks, naming peers by their
// global rank. The start phase compares signatures.
DINLINE bool node_barrier(const HierParams& h, BlockState& st, int phase) {
  __syncthreads();  // this block's writes before the flags
  const int t = (int)threadIdx.x;
  if (t < h.local_size && t != h.local_rank) {
    const Waiter w = waiter_of(h);
    const u64* slot = &own_signal(h)->flag[phase][blockIdx.x][t];
    const u64 mine = phase == kPhaseStart ? start_value(st.epoch, h.signature) : st.epoch;
    if (h.flags & kFlagFence) __threadfence_system();
    Signal* to = (Signal*)pick((void* const*)h.peer_signal, t);
    st_flag_release(&to->flag[phase][blockIdx.x][h.local_rank], mine);
    u64 seen = 0;
    const u64 target = phase == kPhaseStart ? st.epoch << 32 : st.epoch;
    if (!spin_until(w, [&] { return (seen = ld_flag_acquire(slot)) >= target; }, seen, pick_int(h.global_of, t),
                    phase, -1 - kCallAllReduce, target)) {
      atomicOr(&st.abort, kAbortFailed);
    } else if (phase == kPhaseStart && ld_flag_acquire(slot) != mine) {
      atomicOr(&st.abort, kAbortMismatch);
    }
  }
  __syncthreads();
  return st.abort == 0;
}

// report_mismatch_of records that the group rank of node m (or a rank of
// this node) made a different call: not fatal, as in p2p_common.cuh.
DINLINE void report_mismatch_of(const HierParams& h, int peer, u64 expected, u64 seen) {
  if (h.signature == kRejectSignature) return;  // a rejecting rank raised on the host
  record_mismatch(h.err, h.rank, peer, kPhaseHierHeader, expected, seen);
}

// A header is start_value(epoch, x): x is the call's signature (count,
// dtype, op) when this rank's node agreed on it, else bad_header(culprit),
// naming a rank of the node that rejected its call or made another one.
DINLINE int bad_header(int culprit) { return (int)(0x80000000u | (u32)(culprit & 0xff)); }
DINLINE bool is_bad_header(u64 v) { return ((u32)v & 0x80000000u) != 0; }

// node_culprit (one thread, after the start barrier) is the rank of this
// node that spoiled the call: one that rejected its arguments if any, else
// one whose signature differs from this rank's; -1 if the node agreed.
DINLINE int node_culprit(const HierParams& h, const BlockState& st) {
  if (h.signature == kRejectSignature) return h.rank;
  int culprit = -1;
  const Signal* self = own_signal(h);
  const u64 mine = start_value(st.epoch, h.signature);
  for (int t = 0; t < h.local_size; ++t) {
    if (t == h.local_rank) continue;
    const u64 v = ld_flag_acquire(&self->flag[kPhaseStart][blockIdx.x][t]);
    if (v == start_value(st.epoch, kRejectSignature)) return pick_int(h.global_of, t);
    if (v != mine && culprit < 0) culprit = pick_int(h.global_of, t);
  }
  return culprit;
}

// exchange_headers (block 0, thread 0) sends this rank's header to every
// group rank and compares theirs; ok is true when all made the same call
// and no node failed its start barrier. False when a wait failed (recorded).
// With early (this rank's plan), the partials of block 0's chunk 0 already
// folded into the send slots go under the header's signal: in an exchange
// in the same put (they follow the header in the slot), else ahead of it.
template <typename T>
DINLINE bool exchange_headers(const HierParams& h, const BlockState& st, int culprit, const u64* base, const Plan* early,
                              bool& ok) {
  typedef typename Num<T>::Acc Acc;
  const u64 par = st.epoch & 1;
  const u64 mine = start_value(st.epoch, culprit < 0 ? h.call_signature : bad_header(culprit));
  const u64 out = xslot_offset(h, false, h.node, par), in = xslot_offset(h, true, h.node, par);
  *word_at(h, out) = mine;
  __threadfence_system();  // before the trigger the proxy copies it after
  for (int m = 0; m < h.nodes; ++m) {
    if (m == h.node) continue;
    u64 bytes = 8;
    if (early != nullptr && chunks_of(*early, m) > 0) {
      const Range r = chunk_range(*early, m, 0);
      const u64 data = (u64)(r.end - r.begin) * sizeof(Acc);
      if (early->x) {
        bytes = kHierExchangeHead + data;
      } else if (h.chans[m].put(recv_offset(h, *early, h.node, 0, par), send_offset(h, *early, m, 0, par), data) ==
                 ~0ull) {
        return false;
      }
    }
    if (h.chans[m].putWithSignal(in, out, bytes) == ~0ull) return false;
  }
  ok = culprit < 0;
  for (int m = 0; m < h.nodes; ++m) {
    if (m == h.node) continue;
    if (!await_signals(h, h.chans[m], base[m] + 1, m)) return false;
    const u64 theirs = ld_flag_acquire(word_at(h, xslot_offset(h, true, m, par)));
    if ((theirs >> 32) != st.epoch) {  // the ranks' call counts parted: nothing is consistent any more
      report_error(waiter_of(h), kErrBadParams, pick_int(h.group_of, m), kPhaseHierHeader, -1, mine, theirs);
      return false;
    }
    if (ok && theirs != mine) {
      // Name the rank that spoiled it on its node, else the group rank
      // whose node made another call.
      report_mismatch_of(h, is_bad_header(theirs) ? (int)(theirs & 0xff) : pick_int(h.group_of, m), mine, theirs);
      ok = false;
    }
  }
  return true;
}

// ---------------------------------------------------------------- the kernel

// hier_params_check returns 0 when the parameters are usable, else the
// number of the first check that failed (ErrorWord.step: the host names it).
template <typename T>
DINLINE int hier_params_check(const HierParams& h) {
  if (h.local_size < 1 || h.local_size > kMaxRanks || h.local_rank < 0 || h.local_rank >= h.local_size) return 1;
  if (h.nodes < 2 || h.nodes > kMaxNodes || h.node < 0 || h.node >= h.nodes) return 2;
  if (h.op < 0 || h.op >= kNumOps || h.count < 0 || h.world != h.local_size * h.nodes) return 3;
  if (gridDim.x != (u32)kHierBlocks || gridDim.y != 1 || gridDim.z != 1) return 4;
  if (blockDim.x < (u32)kMaxRanks || blockDim.x > (u32)kThreads || blockDim.y != 1 || blockDim.z != 1) return 5;
  typedef typename Num<T>::Acc Acc;
  if (h.chunk_elems <= 0 || h.chunk_elems % 8 != 0 || (u64)h.chunk_elems * sizeof(Acc) > h.slot_bytes) return 6;
  if (h.slot_bytes % kPackBytes != 0 || h.ring_offset % kPackBytes != 0 || h.chans == nullptr) return 7;
  if (h.net == nullptr || !aligned(h.net, kPackBytes)) return 14;
  if (h.out == nullptr || !aligned(h.out, kPackBytes)) return 8;
  if (!aligned(h.local_src, kPackBytes)) return 9;
  if (h.err != nullptr && !aligned(h.err, 8)) return 10;
  for (int q = 0; q < h.local_size; ++q) {
    if (h.peer_in[q] == nullptr || !aligned(h.peer_in[q], kPackBytes)) return 11;
    if (h.peer_hier[q] == nullptr || !aligned(h.peer_hier[q], kPackBytes)) return 12;
    if (h.peer_signal[q] == nullptr || !aligned(h.peer_signal[q], 128)) return 13;
  }
  return 0;
}

template <typename T>
DINLINE void hier(const HierParams& h, BlockState& st) {
  typedef typename Num<T>::Acc Acc;
  if (const int check = hier_params_check<T>(h)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) report_error(waiter_of(h), kErrBadParams, -1, -1, check, 0, 0);
    return;
  }
  if (threadIdx.x == 0) {
    Signal* self = own_signal(h);
    st.epoch = self->counter[blockIdx.x] + 1;
    self->counter[blockIdx.x] = st.epoch;
    st.abort = 0;
  }
  __syncthreads();
  const PortChannel* chans = h.chans + (u64)blockIdx.x * h.nodes;
  const int n = h.node;
  const Plan mine = make_plan<T>(h, h.local_rank);
  // This block's signal counts from each node before this call.
  __shared__ u64 base[kMaxNodes];
  __shared__ int verdict;
  if (threadIdx.x < (u32)h.nodes) base[threadIdx.x] = threadIdx.x == (u32)n ? 0 : *chans[threadIdx.x].expected;

  // 1. Stage this block's chunks of every shard (what the node's ranks read
  // of this input), then the start barrier.
  void* const own_in = pick(h.peer_in, h.local_rank);
  if (h.local_src != nullptr && h.local_src != own_in) {
    for (int q = 0; q < h.local_size; ++q) {
      const Plan pq = make_plan<T>(h, q);
      for (int m = 0; m < parts_of(h, pq); ++m) {
        const i64 J = chunks_of(pq, m);
        for (i64 j = 0; j < J; ++j) {
          const Range r = chunk_range(pq, m, j);
          copy_chunk<T>((const char*)h.local_src, (char*)own_in, r.begin, r.end);
        }
      }
    }
  }
  const bool node_ok = node_barrier(h, st, kPhaseStart);
  if (st.abort & kAbortFailed) return;  // a peer never came: fatal, recorded
  if (!node_ok && threadIdx.x < (u32)h.local_size && threadIdx.x != (u32)h.local_rank) {
    const u64 theirs = ld_flag_acquire(&own_signal(h)->flag[kPhaseStart][blockIdx.x][threadIdx.x]);
    const u64 mine = start_value(st.epoch, h.signature);
    if (theirs != mine) report_mismatch_of(h, pick_int(h.global_of, (int)threadIdx.x), mine, theirs);
  }

  // 2. The call's verdict, the same on every rank of every node. Block 0's
  // partials of chunk 0 go with the header, a trip less: folded only where
  // the node agreed (else its inputs need not fit this rank's plan), and
  // read only once every node agreed, when every plan is the same.
  const u64 par = st.epoch & 1;
  // In this rank's Signal (device memory), not the net buffer: the other
  // blocks poll it all through block 0's exchange, and polls of host memory
  // from several SMs slow block 0's own reads across PCIe.
  u64* const verdict_word = &own_signal(h)->hier_verdict[par];
  const Ptrs ins = ptrs_all(const_cast<void* const*>(h.peer_in), h.local_size);
  if (blockIdx.x == 0) {
    const bool early = node_ok && h.signature != kRejectSignature;
    if (early) {
      for (int m = 0; m < h.nodes; ++m) {
        if (m == n || chunks_of(mine, m) == 0) continue;
        const Range r = chunk_range(mine, m, 0);
        fold_partial<T>(ins, h.local_size, h.net + send_offset(h, mine, m, 0, par), r.begin, r.end, h.op);
        if (mine.x) break;  // one partial, for every node
      }
      __syncthreads();  // every thread's partials before the triggers
    }
    if (threadIdx.x == 0) {
      bool ok = false;
      const int culprit = early ? -1 : node_culprit(h, st);
      const bool alive = exchange_headers<T>(h, st, culprit, base, early ? &mine : nullptr, ok);
      verdict = alive ? (ok ? 1 : 2) : 0;
      if (alive) st_flag_release(verdict_word, (st.epoch << 2) | (ok ? 1u : 2u));
      for (int m = 0; m < h.nodes; ++m) {
        if (m != n) base[m] += 1;  // the header
      }
    }
  } else if (threadIdx.x == 0) {
    // Block 0 waits up to a timeout for each other node's header; wait past
    // all of them so that its verdict, or the peer it names, comes first.
    Waiter w = waiter_of(h);
    w.timeout_ns = (w.timeout_ns != 0 ? w.timeout_ns : kDefaultTimeoutNs) * (u64)(h.nodes + 1);
    u64 seen = 0;
    const bool came = spin_until(w, [&] { return ((seen = ld_flag_acquire(verdict_word)) >> 2) == st.epoch; },
                                 seen, h.rank, kPhaseHierVerdict, (int)blockIdx.x, st.epoch << 2);
    verdict = came ? (int)(seen & 3) : 0;
  }
  __syncthreads();
  if (verdict != 1) {
    if (verdict == 2 && threadIdx.x < (u32)h.nodes && threadIdx.x != (u32)n) {
      *chans[threadIdx.x].expected = base[threadIdx.x];
    }
    return;  // 0: a failure was recorded; 2: a mismatch on some node
  }

  char* const results = own_hier(h);
  if (mine.x) {
    // 3x. The exchange: this block's chunk of the whole shard (block 0's
    // went with the header) to every node, theirs folded here.
    const bool has = chunks_of(mine, n) > 0;
    const u64 own_off = send_offset(h, mine, n, 0, par);
    if (has && !rides_header(0)) {
      const Range r = chunk_range(mine, n, 0);
      fold_partial<T>(ins, h.local_size, h.net + own_off, r.begin, r.end, h.op);
      __syncthreads();  // every thread's partial before the triggers
      if (threadIdx.x == 0) {
        __threadfence_system();
        const u64 bytes = (u64)(r.end - r.begin) * sizeof(Acc);
        for (int m = 0; m < h.nodes; ++m) {
          if (m != n && chans[m].putWithSignal(recv_offset(h, mine, n, 0, par), own_off, bytes) == ~0ull) st.abort = 1;
        }
      }
    }
    if (threadIdx.x == 0) {
      for (int m = 0; m < h.nodes; ++m) {
        if (m == n || st.abort) continue;
        const u64 want = base[m] + (has && !rides_header(0) ? 1 : 0);
        if (!await_signals(h, chans[m], want, m)) {
          st.abort = 1;
        } else {
          *chans[m].expected = want;
        }
      }
    }
    __syncthreads();
    if (st.abort) return;
    if (has) {
      const Range r = chunk_range(mine, n, 0);
      Ptrs parts;
#pragma unroll
      for (int m = 0; m < kMaxNodes; ++m) {
        parts.p[m] = m < h.nodes ? h.net + (m == n ? own_off : recv_offset(h, mine, m, 0, par)) : nullptr;
      }
      char* const to = results + (r.begin - mine.lo) * (i64)sizeof(T);
      fold_finish<T>(parts, h.nodes, to, to, r.end - r.begin, h.op, h.op == kOpAvg ? h.world : 0);
    }
  } else {
    // 3. The pipeline.
    i64 jmax = 0;
    for (int m = 0; m < h.nodes; ++m) {
      const i64 J = chunks_of(mine, m);
      jmax = J > jmax ? J : jmax;
    }
    const i64 own = chunks_of(mine, n);  // chunks of this rank's part: each other node sends that many partials
    bool ok = true;
    for (i64 j = 0; j < jmax && ok; ++j) {
      for (int s = 1; s < h.nodes && ok; ++s) {
        const int m = (n + s) % h.nodes;
        const i64 theirs = chunks_of(mine, m);  // chunks of part m: its owner returns that many results
        if (j >= theirs) continue;
        if (j >= kHierRing && threadIdx.x == 0) {
          // The slot's previous chunk, j - kHierRing: read by its owner once
          // the owner's result of it is here.
          const i64 jr = j - kHierRing;
          const u64 want = base[m] + signals_before(jr, own, theirs) + partial_signal(jr, own) + 1;
          if (!await_signals(h, chans[m], want, m)) st.abort = 1;
        }
        __syncthreads();
        if (st.abort) {
          ok = false;
          break;
        }
        if (rides_header(j)) continue;  // sent with the header
        const Range r = chunk_range(mine, m, j);
        fold_partial<T>(ins, h.local_size, slot(h, false, m, j), r.begin, r.end, h.op);
        __syncthreads();  // every thread's partial before the trigger
        if (threadIdx.x == 0) {
          __threadfence_system();
          const u64 bytes = (u64)(r.end - r.begin) * sizeof(Acc);
          if (chans[m].putWithSignal(slot_offset(h, true, n, j), slot_offset(h, false, m, j), bytes) == ~0ull) {
            st.abort = 1;
          }
        }
      }
      if (!ok || j >= own) continue;
      // The own part's chunk j: this node's partial, then every node's.
      const Range r = chunk_range(mine, n, j);
      fold_partial<T>(ins, h.local_size, slot(h, false, n, j), r.begin, r.end, h.op);
      if (threadIdx.x == 0) {
        for (int m = 0; m < h.nodes; ++m) {
          if (m == n || st.abort) continue;
          const u64 want = base[m] + signals_before(j, own, chunks_of(mine, m)) + partial_signal(j, own);
          if (!await_signals(h, chans[m], want, m)) st.abort = 1;
        }
      }
      __syncthreads();
      if (st.abort) {
        ok = false;
        break;
      }
      Ptrs parts;
  #pragma unroll
      for (int m = 0; m < kMaxNodes; ++m) parts.p[m] = m < h.nodes ? slot(h, m != n, m, j) : nullptr;
      const u64 off = (u64)(r.begin - mine.lo) * sizeof(T);
      fold_finish<T>(parts, h.nodes, results + off, h.net + off, r.end - r.begin, h.op, h.op == kOpAvg ? h.world : 0);
      __syncthreads();  // every thread's results before the triggers
      if (threadIdx.x == 0) {
        __threadfence_system();
        const u64 bytes = (u64)(r.end - r.begin) * sizeof(T);
        for (int m = 0; m < h.nodes; ++m) {
          if (m != n && chans[m].putWithSignal(off, off, bytes) == ~0ull) st.abort = 1;
        }
      }
    }
    __syncthreads();
    if (!ok || st.abort) return;

    // 4. Every other part's results of this block's chunks, then the node.
    if (threadIdx.x == 0) {
      for (int m = 0; m < h.nodes; ++m) {
        if (m == n) continue;
        const i64 theirs = chunks_of(mine, m);
        const u64 total = base[m] + signals_before(own > theirs ? own : theirs, own, theirs);
        if (!await_signals(h, chans[m], total, m)) {
          st.abort = 1;
          break;
        }
        *chans[m].expected = total;
      }
    }
    __syncthreads();
    if (st.abort == 0) {
      // Other parts' results, from the net buffer to where the node reads them.
      const char* const from = h.net - mine.lo * (i64)sizeof(T);  // by element
      char* const to = results - mine.lo * (i64)sizeof(T);
      for (int m = 0; m < h.nodes; ++m) {
        if (m == n) continue;
        const i64 J = chunks_of(mine, m);
        for (i64 j = 0; j < J; ++j) {
          const Range r = chunk_range(mine, m, j);
          copy_chunk<T>(from, to, r.begin, r.end);
        }
      }
    }
  }
  // A rank that misses a result must not let its node read its region:
  // without its mid flag they time out naming it instead.
  if (st.abort) return;
  if (!node_barrier(h, st, kPhaseMid)) return;
  for (int q = 0; q < h.local_size; ++q) {
    const int lq = (h.local_rank + q) % h.local_size;  // own shard first, then stagger peers
    const Plan pq = make_plan<T>(h, lq);
    const char* const src = (const char*)pick((void* const*)h.peer_hier, lq) - pq.lo * (i64)sizeof(T);  // by element
    for (int m = 0; m < parts_of(h, pq); ++m) {
      const i64 J = chunks_of(pq, m);
      for (i64 j = 0; j < J; ++j) {
        const Range r = chunk_range(pq, m, j);
        copy_chunk<T>(src, (char*)h.out, r.begin, r.end);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) allreduce_hier(const HierParams h) {
  __shared__ BlockState st;
  hier<T>(h, st);
}
