// moe.cu: mixture-of-experts dispatch and combine kernels, launched from
// Python (python/p2pcomm/moe.py) through p2p_launch. Each call is a start
// barrier, the kernel that writes into peers, a middle barrier with a full
// system fence, and the kernel that reads what peers wrote. The barriers are
// either stream barrier kernels enqueued by the host or, in capturable calls
// (and the middle one of eager combine), steps inside those kernels
// (MoeSync: sync_enter, sync_go, sync_end, sync_wait), bounded like every wait of
// the library and reported through the communicator's ErrorWord. Every grid is 1-D with kThreads (512) threads per block
// and any number of blocks (the host passes num_sms); results never depend on
// the grid: every value is computed in a fixed order by exactly one thread.
//
// p2pcomm:no-spills (the kernels keep many loads in flight in registers, and a
// spill would quietly cost bandwidth; native/kernels' compile test holds it).
//
// Buffers (W ranks, Tm = max_tokens, K = topk, E experts, L = E / W, H = hidden):
//   xs      [Tm, H] T         symmetric: this rank's token rows (moe.py copies
//                             x there, or x is built there); destinations read
//                             (pull) the rows they need after the mid barrier
//   meta    [W, Tm, 3K+1] i32 symmetric: per [s, slot]: local expert of each k
//                             (-1: not on this rank) | weight bits of each k |
//                             source token | rank of pair k among source s's
//                             pairs of that expert, in (token, k) order
//   hdr     [W, L+1] i32      symmetric: per source s: tokens sent, then pairs
//                             sent per local expert
//   comb    [W, Tm+1, H] C    symmetric, on the source: [d, slot] = expert rank
//                             d's partial, pushed by d (MOE_COMB_PULL=1: on the
//                             expert rank, [s, slot] = its partial for source
//                             s, read by s); C (the transit) is float or T
//   status  [2, W] i32        symmetric: per call parity, each rank's check of
//                             its arguments in an eager call (moe_post_status)
//   send_slot [Tm, W] i32     local: slot of token t on rank d, -1: not sent
//   pair_rank [Tm*K + G*(W+E+8)] i32  local scratch: pair ranks
//                             (moe_dispatch_send), then per block b of G:
//                             tokens per destination, pairs per expert of b's
//                             tokens (moe_dispatch_count), then [G][8]
//                             MOE_PROFILE stamps
//   comb_rows [W*Tm, K] i32   local: output row of pair (s, slot, k), -1: none
// Byte layouts of the parameter structs are pinned below by static_asserts and
// mirrored by ctypes in moe.py (checked at import).
#include "p2p_common.cuh"

// kMoeMaxTopK bounds topk (one warp lane per k; moe.py checks it).
constexpr int kMoeMaxTopK = 32;
static_assert(kMoeMaxTopK <= 32, "one warp lane per k");
constexpr int kMoeWarps = kThreads / 32;
// Tuning knobs. Each has a default below and can be overridden for an
// experiment without editing this file, e.g.
//   P2PCOMM_NVRTC_OPTIONS="-DMOE_UNROLL=4 -DMOE_NC_LOADS=0"
// Results are the same bits for any value: the knobs change only how many
// loads are in flight, which load instruction reads rows, and the order in
// which independent items run.
#ifndef MOE_UNROLL
#define MOE_UNROLL 8  // packs per lane in flight in the dispatch row copies (4 before)
#endif
#ifndef MOE_COMB_GROUP
#define MOE_COMB_GROUP 4  // expert rows loaded together in the combine send
#endif
#ifndef MOE_COMB_UNROLL
#define MOE_COMB_UNROLL 4  // packs per lane per pass of the combine send (2 before)
#endif
#ifndef MOE_REDUCE_LOADS
#define MOE_REDUCE_LOADS 16  // partial loads in flight per lane in the combine reduce
#endif
#ifndef MOE_NC_LOADS
#define MOE_NC_LOADS 0  // 1: rows read through ld.global.nc (see ld_v16_stable); 0: ld.global.cg (measured faster: dispatch 1161 vs 1290 us in a graph, 4096 tokens)
#endif
#ifndef MOE_EXPAND_DYNAMIC
// 1: the expand's warps take work units (row pieces) from a shared counter
// as they finish the previous one; 0: unit u goes to warp u mod the grid's
// warps, whatever the units cost (rows with more local experts take more
// stores, rows from this rank no NVLink reads). 2 x H200, graph, x in the
// buffer: dispatch 418 -> 386 us at 4096 tokens, 34.6 -> 32.5 at 128.
#define MOE_EXPAND_DYNAMIC 1
#endif
#ifndef MOE_COMB_DYNAMIC
#define MOE_COMB_DYNAMIC 1  // the same for the combine's send kernel (combine 580 -> 524 us, 4096)
#endif
#ifndef MOE_PROFILE
// 1: thread 0 of every count and send block stamps %globaltimer (low 32
// bits) after each step into the stamp rows after pair_rank's scratch, and
// of every expand block into the last [G][8] words of out_info (unused
// rows of a capturable call's; tools/moe_send_profile.py reads both); 0:
// no stamps (the default).
#define MOE_PROFILE 0
#endif
#ifndef MOE_COMB_INTERLEAVE
#define MOE_COMB_INTERLEAVE 1  // 1: combine send items slot-major, sources rotated; 0: source-major (before)
#endif
#ifndef MOE_START_RELAXED
// 1: start flags stored and polled relaxed (they order no data: a peer posts
// once its earlier kernels, the readers, have finished; tools/flag_latency.cu:
// a round trip between two H200s 1.64 against 2.77 us with release/acquire);
// 0: release/acquire.
#define MOE_START_RELAXED 1
#endif
#ifndef MOE_START_SKIP
// 1: a capturable send kernel skips waiting at its start barrier when this
// rank passed the other kind's middle barrier since its previous call of
// this kind (see free_epoch in MoeSyncState); 0: it always waits.
#define MOE_START_SKIP 1
#endif
#ifndef MOE_COMB_HOIST
#define MOE_COMB_HOIST 1  // combine send, 16-bit partials: weights shuffled once per pass (0: per pack)
#endif
#ifndef MOE_COMB_PULL
// 1: partials stay on the expert rank and sources read them (measured slower:
// combine 1262 against 990 us, 4096 tokens, bf16, graph); 0: expert ranks push.
#define MOE_COMB_PULL 0
#endif

// kMoeUnroll: 16-byte packs per lane loaded before the first store in the
// row copies. Each pass waits one read latency, so 8 packs (4 KiB per
// warp, 64 KiB per SM in flight) halve the passes of the former 4.
constexpr int kMoeUnroll = MOE_UNROLL;
static_assert(kMoeUnroll >= 1, "MOE_UNROLL");

// ---------------------------------------------------------------- in-kernel barriers
// Capturable calls need no barrier kernels: the kernel that writes into
// peers (moe_dispatch_send, moe_combine_send) runs the start barrier itself
// (kSyncStart; skipped after the other kind's middle barrier, see
// free_epoch) and each of its blocks, once done, posts its middle flag
// into every peer (kSyncArrive); the kernel that reads what peers wrote
// (expand, reduce) first waits for every peer's flags (kSyncWait). A
// barrier kernel cost ~7-10 us of launch, fence and round trip; here the
// start barrier is at most one round trip by block 0 and the middle one
// mostly overlaps the kernel boundary. Eager calls keep their start barrier
// kernel (it also carries the argument checks) and use kSyncArrive /
// kSyncWait for combine.
constexpr int kSyncStart = 1;        // send kernels: barrier with every peer before writing into them
constexpr int kSyncArrive = 2;       // send kernels: every block posts its middle flags when done
constexpr int kSyncWait = 4;         // expand, reduce: wait for every peer's middle flag first
constexpr int kSyncArriveFirst = 8;  // expand: block 0 posts the middle flags itself (x was staged
                                     // after the send kernel), then waits like kSyncWait
constexpr int kSyncStageGo = 16;     // dispatch send: block 0 also posts stage_posted once past the
                                     // start barrier (moe_stage_gate releases x's copy on a side stream)
constexpr int kSyncStaged = 32;      // expand: also wait for every peer's staged flag, which each rank
                                     // posts once per capturable dispatch: moe_stage_done after x's copy
                                     // on the side stream, else the send kernel (kSyncPostStaged) or
                                     // the expand with kSyncArriveFirst
constexpr int kSyncPostStaged = 64;  // dispatch send (x needs no copy): block 0 posts the staged flags at once
constexpr int kSyncGridShift = 8;    // mode >> kSyncGridShift: the send kernel's grid (its blocks' middle flags)
constexpr int kMoeKinds = 2;         // 0: dispatch, 1: combine (also ErrorWord.step)
constexpr int kMoeDispatch = 0;
constexpr int kMoeSyncBlocks = 256;  // most blocks of a send kernel (moe.py caps num_sms)
enum MoeFlag { kMoeFlagStart = 0, kMoeFlagStaged = 1 };
// Flags of one rank (symmetric memory, zeroed), written only by their source
// and only growing: u64 [kind][MoeFlag][source rank] (start flags, and the
// dispatch's staged flags; the combine's unused), then the middle flags,
// one per send block: u64 [kind][source rank][block].
constexpr int kMoeMidFlagBase = kMoeKinds * 2 * kMaxRanks;
constexpr int kMoeFlagWords = kMoeMidFlagBase + kMoeKinds * kMaxRanks * kMoeSyncBlocks;

// MoeSyncState is one rank's local state of one kind (device memory,
// zeroed once; [kMoeKinds] of them): counter[b] is the calls run by block b
// of that kind's send kernel, so counter[b] + 1 is the current call's epoch,
// the same for every block and every rank (every rank runs the same calls
// with a grid it never changes); go is the latest epoch whose start barrier
// block 0 passed. free_epoch is the epoch of this kind's next send kernel
// when it needs no start barrier: since this kind's previous send kernel,
// this rank passed an in-kernel middle barrier of the other kind (that
// kernel's sync_wait sets it). Each peer posted those middle flags after
// everything it ran before, so it has finished reading what this call's
// send kernel overwrites: a combine's partials are read by the previous
// combine's reduce, which precedes the peer's dispatch send kernel; a
// dispatch's metadata, hdr and staged rows by the previous expand (which
// precedes the peer's combine send kernel) and combine sends (each of whose
// blocks posts its middle flag after its reads). stage_posted counts the send kernels
// with kSyncStageGo that passed their start barrier, stage_taken the
// moe_stage_gate launches (one per such call, on the side stream).
// work[e & 1] is the next work unit of call e (epoch e) for the kernel that
// hands its units out as warps free up (take_unit: the dispatch's expand,
// the combine's send kernel), and reduce_work[e & 1] the same for the
// kernel after that (moe_combine_reduce_self); the send kernel of call e
// zeroes both at (e + 1) & 1 at its start, after call e - 1 is done with
// them (stream order) and before call e + 1 uses them.
struct MoeSyncState {
  u64 counter[kMoeSyncBlocks];
  u64 go;
  u64 free_epoch;
  u64 stage_posted;
  u64 stage_taken;
  u32 work[2];
  u32 reduce_work[2];
  u32 pad[4];
};
static_assert(sizeof(MoeSyncState) == 2112, "MoeSyncState size (moe.py _SYNC_STATE_BYTES / kMoeKinds)");

// MoeSync is the in-kernel barriers' part of the send, expand and reduce
// kernels' parameters (see above).
//
//   offset size field
//   0      64   peer_flags[8]   each rank's flags (kMoeFlagWords u64)
//   64     8    state           this rank's MoeSyncState[kMoeKinds]
//   72     8    signal          this rank's communicator Signal (Waiter)
//   80     8    err             the communicator's ErrorWord (Waiter)
//   88     8    timeout_ns      u64; 0 = kDefaultTimeoutNs
//   96     4    mode            kSync* bits; 0: none (barrier kernels order it)
//   100    4    kind            0 dispatch, 1 combine
//   total  104, aligned to 8
struct MoeSync {
  u64* peer_flags[kMaxRanks];
  MoeSyncState* state;
  Signal* signal;
  ErrorWord* err;
  u64 timeout_ns;
  int mode;
  int kind;
};
static_assert(sizeof(MoeSync) == 104, "MoeSync size");
static_assert(sizeof(MoeSync::peer_flags) + 4 * sizeof(void*) + 2 * sizeof(int) == 104, "MoeSync fields");

// MoeDispatchParams is the argument of moe_dispatch_count, moe_dispatch_send,
// moe_stage_gate and moe_stage_done.
//
//   offset size field
//   0      64   peer_meta[8]    each rank's meta
//   64     64   peer_hdr[8]     each rank's hdr
//   128    8    topk_idx        [T, K] i32 or i64 (idx_bytes)
//   136    8    topk_w          [T, K] f32
//   144    8    send_slot       [Tm, W] i32, local output
//   152    8    pair_rank       [Tm*K + G*(W+E+8)] i32, local scratch
//   160    4    num_tokens      T
//   164    4    max_tokens      Tm
//   168    4    hidden          H
//   172    4    topk            K
//   176    4    num_experts     E
//   180    4    rank
//   184    4    world           W
//   188    4    idx_bytes       4 or 8
//   192    4    counted         1: moe_dispatch_count ran first (its rows
//                               hold each block's counts); 0: each send
//                               block counts the tokens before its range
//   196    4    ids_shared      1: the send kernel copies the expert ids of
//                               tokens [0, its range's end) into shared
//                               memory first (dynamic shared 4 * (E + T*K))
//   200    8    status          [W] i32: each rank's argument check of this
//                               eager call (0: ok), posted before the start
//                               barrier; nullptr in capturable mode
//   208    104  sync            MoeSync (moe_dispatch_send)
//   total  312, aligned to 8
struct MoeDispatchParams {
  void* peer_meta[kMaxRanks];
  void* peer_hdr[kMaxRanks];
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
  int counted;
  int ids_shared;
  const int* status;
  MoeSync sync;
};
static_assert(sizeof(MoeDispatchParams) == 312, "MoeDispatchParams size");
// NVRTC has no offsetof: the field sizes add up to the size (no padding),
// which pins every offset in the table.
static_assert(sizeof(MoeDispatchParams::peer_meta) + sizeof(MoeDispatchParams::peer_hdr) == 128 &&
                  5 * sizeof(void*) + 10 * sizeof(int) + sizeof(MoeSync) == 312 - 128,
              "MoeDispatchParams fields");

// MoeExpandParams is the argument of moe_dispatch_expand.
//
//   offset size field
//   0      64   peer_xs[8]     each rank's xs: the sources' staged rows
//   64     8    meta           this rank's meta
//   72     8    hdr            this rank's hdr
//   80     8    out_x          [row_cap, H] T: expert-major rows
//   88     8    out_info       [4, row_cap] i32: local expert | source rank |
//                              source token | weight bits
//   96     8    expert_counts  [L + 1] i32: rows per local expert, then R
//   104    8    comb_rows      [W * Tm, K] i32, local output
//   112    8    row_cap        i64: rows of out_x (R eager, W*Tm*K capturable)
//   120    4    max_tokens     Tm
//   124    4    hidden         H
//   128    4    topk           K
//   132    4    num_local      L
//   136    4    world          W
//   140    4    rank
//   144    104  sync           MoeSync
//   total  248, aligned to 8
struct MoeExpandParams {
  void* peer_xs[kMaxRanks];
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
  int rank;
  MoeSync sync;
};
static_assert(sizeof(MoeExpandParams) == 248, "MoeExpandParams size");
static_assert(sizeof(MoeExpandParams::peer_xs) + 6 * sizeof(void*) + sizeof(MoeExpandParams::row_cap) +
                      6 * sizeof(int) + sizeof(MoeSync) == 248,
              "MoeExpandParams fields");

// MoeCombineParams is the argument of moe_combine_send and moe_combine_reduce.
//
//   offset size field
//   0      64   peer_comb[8]   each rank's comb ([W, Tm+1, H] C)
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
//   148    4    self_local     1: a world of 2 whose send kernel leaves this
//                               rank's own items to moe_combine_reduce_self,
//                               which sums them from expert_out (topk <=
//                               kCombWide); 0: every item's partial is sent
//   152    8    status         as in MoeDispatchParams (send)
//   160    104  sync           MoeSync
//   total  264, aligned to 8
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
  int self_local;
  const int* status;
  MoeSync sync;
};
static_assert(sizeof(MoeCombineParams) == 264, "MoeCombineParams size");
static_assert(sizeof(MoeCombineParams::peer_comb) == 64 &&
                  7 * sizeof(void*) + sizeof(MoeCombineParams::row_cap) + 8 * sizeof(int) + sizeof(MoeSync) ==
                      264 - 64,
              "MoeCombineParams fields");

// MoePostParams is the argument of moe_post_status.
//
//   offset size field
//   0      64   peer_status[8]  each rank's status row of this call's parity
//   64     8    topk_idx        [num_ids] i32 or i64; nullptr: none to check
//   72     4    num_ids         T * K
//   76     4    num_experts     E
//   80     4    idx_bytes       4 or 8
//   84     4    code            this rank's host-side check (0: passed)
//   88     4    id_code         the code to post for an expert id outside [-1, E)
//   92     4    rank
//   96     4    world           W
//   100    4    pad
//   total  104, aligned to 8
struct MoePostParams {
  int* peer_status[kMaxRanks];
  const void* topk_idx;
  int num_ids;
  int num_experts;
  int idx_bytes;
  int code;
  int id_code;
  int rank;
  int world;
  int pad;
};
static_assert(sizeof(MoePostParams) == 104, "MoePostParams size");
static_assert(sizeof(MoePostParams::peer_status) + sizeof(void*) + 8 * sizeof(int) == 104, "MoePostParams fields");

// p2pcomm:instantiate moe_post_status
// p2pcomm:instantiate moe_stage_gate
// p2pcomm:instantiate moe_stage_done
// p2pcomm:instantiate moe_dispatch_count<bf16>
// p2pcomm:instantiate moe_dispatch_count<half16>
// p2pcomm:instantiate moe_dispatch_count<float>
// p2pcomm:instantiate moe_dispatch_send<bf16>
// p2pcomm:instantiate moe_dispatch_send<half16>
// p2pcomm:instantiate moe_dispatch_send<float>
// p2pcomm:instantiate moe_dispatch_expand<bf16>
// p2pcomm:instantiate moe_dispatch_expand<half16>
// p2pcomm:instantiate moe_dispatch_expand<float>
// Combine kernels: <T, C>, C the partials' transit type (float, or T).
// p2pcomm:instantiate moe_combine_send<bf16, float>
// p2pcomm:instantiate moe_combine_send<bf16, bf16>
// p2pcomm:instantiate moe_combine_send<half16, float>
// p2pcomm:instantiate moe_combine_send<half16, half16>
// p2pcomm:instantiate moe_combine_send<float, float>
// The reduce's third argument: 0, ranks in groups of 4; 2 to 4, that many ranks in one group.
// p2pcomm:instantiate moe_combine_reduce<bf16, float, 0>
// p2pcomm:instantiate moe_combine_reduce<bf16, bf16, 0>
// p2pcomm:instantiate moe_combine_reduce<half16, float, 0>
// p2pcomm:instantiate moe_combine_reduce<half16, half16, 0>
// p2pcomm:instantiate moe_combine_reduce<float, float, 0>
// p2pcomm:instantiate moe_combine_reduce<bf16, float, 2>
// p2pcomm:instantiate moe_combine_reduce<bf16, bf16, 2>
// p2pcomm:instantiate moe_combine_reduce<half16, float, 2>
// p2pcomm:instantiate moe_combine_reduce<half16, half16, 2>
// p2pcomm:instantiate moe_combine_reduce<float, float, 2>
// p2pcomm:instantiate moe_combine_reduce<bf16, float, 3>
// p2pcomm:instantiate moe_combine_reduce<bf16, bf16, 3>
// p2pcomm:instantiate moe_combine_reduce<half16, float, 3>
// p2pcomm:instantiate moe_combine_reduce<half16, half16, 3>
// p2pcomm:instantiate moe_combine_reduce<float, float, 3>
// p2pcomm:instantiate moe_combine_reduce<bf16, float, 4>
// p2pcomm:instantiate moe_combine_reduce<bf16, bf16, 4>
// p2pcomm:instantiate moe_combine_reduce<half16, float, 4>
// p2pcomm:instantiate moe_combine_reduce<half16, half16, 4>
// p2pcomm:instantiate moe_combine_reduce<float, float, 4>
// p2pcomm:instantiate moe_combine_reduce_self<bf16, float>
// p2pcomm:instantiate moe_combine_reduce_self<bf16, bf16>
// p2pcomm:instantiate moe_combine_reduce_self<half16, float>
// p2pcomm:instantiate moe_combine_reduce_self<half16, half16>
// p2pcomm:instantiate moe_combine_reduce_self<float, float>

// ---------------------------------------------------------------- helpers

DINLINE u32 lanemask_lt() {
  u32 m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// any_rejected: whether a rank rejected its arguments in this eager call
// (status: every rank's check, posted into this rank before the start
// barrier; nullptr in capturable mode, which checks on the host only). The
// kernels that write into peers then write nothing, so a rejected call moves
// no data and the latest dispatch result stays valid; moe.py raises on every
// rank after its one host sync. The barrier kernel before this one ordered
// the peers' stores, and a kernel boundary leaves no stale L1 line.
DINLINE bool any_rejected(const int* status, int world) {
  if (status == nullptr) return false;
  bool bad = false;
  for (int q = 0; q < world; ++q) bad |= status[q] != 0;
  return bad;
}

// ld_v16_stable loads 16 bytes that nothing writes while the kernel runs:
// the caller's inputs, or rows that peers (or this rank's earlier kernel)
// wrote before the barrier that precedes these loads. The default is
// ld.global.cg (L2 only). MOE_NC_LOADS=1 takes the read-only path instead:
// the rows are read once, so nothing is allocated in L1, and L2 fetches 256
// bytes per miss; that path is only meant for experiments with barrier
// kernels (a kernel boundary leaves no stale L1 line; an in-kernel
// sync_wait orders the coherent loads, not necessarily the read-only ones).
DINLINE V16 ld_v16_stable(const void* p) {
#if MOE_NC_LOADS
  V16 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
#else
  return ld_v16(p);
#endif
}

// row_parts is how many pieces to cut each of n rows into so that the
// nwarps warps get about kRowSpread pieces each when rows are few (one
// warp per row left some warps two whole rows, or one row of twice the
// pairs, while others idled: the small-batch case), with no piece shorter
// than one warp pass of pass_packs packs. 1 when n >= kRowSpread * nwarps:
// the large case keeps one warp per row.
#ifndef MOE_ROW_SPREAD
#define MOE_ROW_SPREAD 4  // 1: pieces only when rows are fewer than warps (before)
#endif
constexpr int kRowSpread = MOE_ROW_SPREAD;
DINLINE int row_parts(i64 n, i64 nwarps, i64 packs, int pass_packs) {
  if (n <= 0 || n >= kRowSpread * nwarps) return 1;
  const i64 most = (packs + pass_packs - 1) / pass_packs;
  const i64 want = (kRowSpread * nwarps + n - 1) / n;
  const i64 parts = want < most ? want : most;
  return parts > 1 ? (int)parts : 1;
}

// piece_begin is the first pack of piece `part` of `parts` of a row of
// `packs` packs (piece_begin(parts) == packs).
DINLINE i64 piece_begin(i64 packs, int part, int parts) { return packs * part / parts; }

// received_tokens is the number of (source, slot) rows this rank received
// in the latest dispatch (hdr column 0 summed over sources).
DINLINE i64 received_tokens(const int* hdr, int W, int L) {
  i64 n = 0;
  for (int s = 0; s < W; ++s) n += hdr[s * (L + 1)];
  return n;
}

// most_sent is the largest number of tokens one source sent this rank: the
// slot-major item loops stop there instead of at max_tokens.
DINLINE int most_sent(const int* hdr, int W, int L) {
  int n = 0;
  for (int s = 0; s < W; ++s) n = max(n, hdr[s * (L + 1)]);
  return n;
}

// slot_major maps item order o (of most_sent * W) to (source, slot): slots
// ascending, and within a slot the sources rotated to start after this
// rank, so that consecutive warps talk to different peers (in source-major
// order every rank would read from, or write to, the same peer at once, and
// that one peer's NVLink port would bound the whole exchange).
// With n = W - 1 the rotation leaves this rank out (its own items are
// another kernel's).
DINLINE void slot_major(i64 o, int W, int rank, int& s, int& slot, int n) {
  slot = (int)(o / n);
  s = (int)((o % n + rank + 1) % W);
}
DINLINE void slot_major(i64 o, int W, int rank, int& s, int& slot) { slot_major(o, W, rank, s, slot, W); }

// expert_at is global expert id q (flat [T, K] index) of topk_idx, or -1
// when it is -1 or outside [0, E) (capturable mode treats those as -1;
// eager mode checked them on the host).
DINLINE int expert_at(const MoeDispatchParams& p, i64 q) {
  const long long v = p.idx_bytes == 8 ? ((const long long*)p.topk_idx)[q]
                                       : (long long)((const int*)p.topk_idx)[q];
  return (v >= 0 && v < p.num_experts) ? (int)v : -1;
}

// owner_of is the rank that owns global expert g in [0, E), g / L, without
// an integer division: a runtime division is ~25 instructions, and the send
// kernel's metadata step, which divided once per field and destination, was
// bound by issuing them (23 us at 4096 tokens). The float quotient is within
// one of the true one, and the two compares correct it (checked for every
// g < E <= 4096 and L <= 4096, moe.py's bound on E).
DINLINE int owner_of(int g, int L) {
  int q = __float2int_rz(__int2float_rn(g) * __frcp_rn(__int2float_rn(L)));
  if (q * L > g) --q;
  else if ((q + 1) * L <= g) ++q;
  return q;
}

// expert_id is expert_at, or read from sh, the send kernel's copy of the
// ids in shared memory, when there is one.
DINLINE int expert_id(const MoeDispatchParams& p, i64 q, const int* sh) {
  return sh != nullptr ? sh[q] : expert_at(p, q);
}

// dest_mask: bit d set when one of token t's experts lives on rank d.
DINLINE u32 dest_mask(const MoeDispatchParams& p, int t, int L, const int* sh) {
  u32 m = 0;
  for (int k = 0; k < p.topk; ++k) {
    const int g = expert_id(p, (i64)t * p.topk + k, sh);
    if (g >= 0) m |= 1u << owner_of(g, L);
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

// ---------------------------------------------------------------- in-kernel barrier steps
// (see MoeSync)

DINLINE Waiter waiter_of(const MoeSync& s, int rank) {
  Waiter w;
  w.self = s.signal;
  w.err = s.err;
  w.timeout_ns = s.timeout_ns;
  w.rank = rank;
  return w;
}

// outer_waiter bounds a wait on this rank's own progress (another block's
// go, the send kernel's stage_posted) at twice the bound, so that the wait
// on the peers behind it (block 0's, at the bound) is the one naming them.
DINLINE Waiter outer_waiter(const MoeSync& s, int rank) {
  Waiter w = waiter_of(s, rank);
  w.timeout_ns = 2 * (s.timeout_ns != 0 ? s.timeout_ns : kDefaultTimeoutNs);
  return w;
}

// moe_flag is flags[kind][which][src] of one rank's flag words.
DINLINE u64* moe_flag(u64* flags, int kind, int which, int src) {
  return flags + (kind * 2 + which) * kMaxRanks + src;
}
// moe_mid_flag is the middle flag of block b of src's send kernel.
DINLINE u64* moe_mid_flag(u64* flags, int kind, int src, int b) {
  return flags + kMoeMidFlagBase + (kind * kMaxRanks + src) * kMoeSyncBlocks + b;
}

// MoeBegin is a send kernel's start-barrier state, one per block (shared
// memory): the call's epoch, whether a wait gave up, and (block 0) whether
// go has been released, and whether the call skips the start barrier.
struct MoeBegin {
  u64 epoch;
  int ok;
  int released;
  int skip;
  int pad;
};

// The start barrier of a send kernel (kSyncStart) keeps it from writing into
// a peer that may still read the previous call's data. Only the stores into
// peers need it, so it is split around the kernel's local work: sync_enter
// at the kernel's start posts this rank's flags, and each block waits in
// sync_go just before its first store into a peer, block 0 for every
// peer's flag, the others for block 0's go. The dispatch's send kernel
// ranks its tokens in between (4 x H200, 128 tokens: dispatch 47 -> 45 us
// per call in a graph); the combine's has no local work to put there.

// Start flags (see MOE_START_RELAXED).
DINLINE void st_start_flag(u64* p, u64 v) {
#if MOE_START_RELAXED
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
  st_flag_release(p, v);
#endif
}
DINLINE u64 ld_start_flag(const u64* p) {
#if MOE_START_RELAXED
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return ld_flag_acquire(p);
#endif
}
// wait_start_flag: wait_flag for peer's start flag of epoch e here.
DINLINE bool wait_start_flag(const MoeSync& s, int rank, int peer, u64 e) {
  const u64* flag = moe_flag(s.peer_flags[rank], s.kind, kMoeFlagStart, peer);
  u64 seen = 0;
  return spin_until(waiter_of(s, rank), [&] { return (seen = ld_start_flag(flag)) >= e; }, seen, peer,
                    kPhaseMoeStart, s.kind, e);
}

// post_go: block 0's thread 0 releases go for epoch e (and x's staging
// copy, with kSyncStageGo).
DINLINE void post_go(const MoeSync& s, u64 e) {
  MoeSyncState* st = s.state + s.kind;
  st_flag_release(&st->go, e);
  if (s.mode & kSyncStageGo) st_flag_release(&st->stage_posted, st->stage_posted + 1);  // only here
}

// release_go: post_go once every peer's start flag is in (seen by other
// threads of the block before a bar.sync).
DINLINE void release_go(const MoeSync& s, MoeBegin& sb) {
  post_go(s, sb.epoch);
  sb.released = 1;
}

// sync_enter runs first in every block of a send kernel. It advances the
// block's call counter (always, whatever the mode: a later call may need
// it) and, with kSyncStart, block 0 posts the epoch into every peer's start
// flag (thread t into rank t). When the state's free_epoch says the call
// needs no start barrier, block 0 releases go at once and no block waits
// (the flags still go out: a peer whose own history differs may wait for
// them). Returns false, uniformly in the block, for a grid too large for
// the counters (then nothing else runs).
DINLINE bool sync_enter(const MoeSync& s, int rank, int world, MoeBegin& sb) {
  MoeSyncState* st = s.state + s.kind;
  const int t = (int)threadIdx.x;
  if (gridDim.x > kMoeSyncBlocks) {  // uniform; moe.py caps num_sms below this
    if (blockIdx.x == 0 && t == 0) report_error(waiter_of(s, rank), kErrBadParams, -1, -1, -1, 0, 0);
    return false;
  }
  if (t == 0) {
    sb.epoch = st->counter[blockIdx.x] + 1;  // only this block touches counter[b]
    st->counter[blockIdx.x] = sb.epoch;
    sb.ok = 1;
    // Written by an earlier kernel (stream order), the same for every block.
    sb.skip = MOE_START_SKIP && (s.mode & kSyncStart) && st->free_epoch == sb.epoch;
    sb.released = sb.skip;
    if (blockIdx.x == 0) {  // for the next call (see MoeSyncState)
      st->work[(sb.epoch + 1) & 1] = 0;
      st->reduce_work[(sb.epoch + 1) & 1] = 0;
    }
  }
  __syncthreads();
  if ((s.mode & kSyncStart) && blockIdx.x == 0 && t < world && t != rank) {
    // No fence: a peer waits for this flag only for this rank's earlier
    // kernels, which read what the peer is about to overwrite, and stream
    // order has finished them.
    st_start_flag(moe_flag(s.peer_flags[t], s.kind, kMoeFlagStart, rank), sb.epoch);
    // Nothing to copy: the staged flag orders no data (the middle flags
    // do), so it goes out now, relaxed, off the expand's path (posted after
    // the middle flags, a release more cost ~1 us per dispatch at 128 tokens).
    if (s.mode & kSyncPostStaged) st_start_flag(moe_flag(s.peer_flags[t], s.kind, kMoeFlagStaged, rank), sb.epoch);
  }
  if (sb.skip && blockIdx.x == 0 && t == 0) post_go(s, sb.epoch);
  return true;
}

// sync_try_go runs in every thread of every block between a dispatch send
// kernel's local steps: with kSyncStageGo, block 0 releases go (and with
// it x's staging copy) as soon as every peer's flag is in, rather than
// after the local steps. Never waits.
DINLINE void sync_try_go(const MoeSync& s, int rank, int world, MoeBegin& sb) {
  if (!(s.mode & kSyncStart) || !(s.mode & kSyncStageGo) || blockIdx.x != 0 || sb.released) return;  // uniform
  const int t = (int)threadIdx.x;
  bool in = true;
  if (t < world && t != rank) in = ld_start_flag(moe_flag(s.peer_flags[rank], s.kind, kMoeFlagStart, t)) >= sb.epoch;
  if (__syncthreads_and(in) && t == 0) release_go(s, sb);
  __syncthreads();  // sb.released, for every thread's next test
}

// sync_go runs in every thread of a block before the block's first store
// into a peer: block 0 waits for the peers' flags it has not seen and
// releases go, the other blocks wait for go. False, uniformly in the block,
// when a wait gave up (recorded in the ErrorWord): the block must then
// write nothing into peers and skip sync_end.
DINLINE bool sync_go(const MoeSync& s, int rank, int world, MoeBegin& sb) {
  if (!(s.mode & kSyncStart) || sb.skip) return true;  // uniform
  MoeSyncState* st = s.state + s.kind;
  const int t = (int)threadIdx.x;
  if (blockIdx.x == 0) {
    if (!sb.released) {  // uniform
      if (t < world && t != rank && !wait_start_flag(s, rank, t, sb.epoch)) sb.ok = 0;
      __syncthreads();
      if (t == 0 && sb.ok) release_go(s, sb);
    }
  } else if (t == 0) {
    if (!wait_flag(outer_waiter(s, rank), &st->go, sb.epoch, -1, kPhaseMoeStart, s.kind)) sb.ok = 0;
  }
  __syncthreads();
  return sb.ok != 0;
}

// sync_end runs last in every block of a send kernel whose waits in
// sync_go passed. With kSyncArrive the block posts the call's epoch into
// its middle flag in every peer, after a bar.sync: each poster's release
// is cumulative over the block's writes, so a peer that sees the flag sees
// them. No block waits for another: the last block's count and its fences
// (~2 us at 128 tokens) are gone. Epochs come from each block's own
// counter: they agree because a send kernel's grid never changes (moe.py
// launches it on the ep's fixed block count, which the waiters read from
// the mode).
DINLINE void sync_end(const MoeSync& s, int rank, int world) {
  if (!(s.mode & kSyncArrive)) return;
  const int t = (int)threadIdx.x;
  __syncthreads();
  if (t < world && t != rank) {
    st_flag_release(moe_mid_flag(s.peer_flags[t], s.kind, rank, (int)blockIdx.x),
                    s.state[s.kind].counter[blockIdx.x]);
  }
}

// sync_wait runs first in every block of a kernel that reads what peers
// wrote (expand, reduce): with kSyncWait it returns once every block of
// every peer's latest send kernel of the kind has posted this rank's epoch
// (its latest send kernel's, which has finished: stream order) into its
// middle flag here, and with kSyncStaged also every peer's staged flag
// (moe_stage_done); with kSyncArriveFirst block 0 posts all of this rank's
// flags first (the sources' rows were staged after the send kernel). False,
// uniformly in the block, when a wait gave up: the block must then read
// nothing.
DINLINE bool sync_wait(const MoeSync& s, int rank, int world) {
  if (!(s.mode & (kSyncWait | kSyncArriveFirst))) return true;
  __shared__ int ok;
  const u64 e = s.state[s.kind].counter[0];
  const int G = s.mode >> kSyncGridShift;  // the send kernel's blocks
  const int t = (int)threadIdx.x;
  if (t == 0) ok = 1;
  if ((s.mode & kSyncArriveFirst) && blockIdx.x == 0) {
    __threadfence_system();  // the send kernel's and the staging copy's writes before the flags
    for (int i = t; i < world * G; i += (int)blockDim.x) {
      const int d = i / G;
      if (d != rank) st_flag_release(moe_mid_flag(s.peer_flags[d], s.kind, rank, i % G), e);
    }
    if (t < world && t != rank) st_flag_release(moe_flag(s.peer_flags[t], s.kind, kMoeFlagStaged, rank), e);
  }
  __syncthreads();
  for (int i = t; i < world * G; i += (int)blockDim.x) {
    const int d = i / G;
    if (d != rank &&
        !wait_flag(waiter_of(s, rank), moe_mid_flag(s.peer_flags[rank], s.kind, d, i % G), e, d, kPhaseMoeMid,
                   s.kind)) {
      ok = 0;
    }
  }
  if ((s.mode & kSyncStaged) && t < world && t != rank &&
      !wait_flag(waiter_of(s, rank), moe_flag(s.peer_flags[rank], s.kind, kMoeFlagStaged, t), e, t, kPhaseMoeMid,
                 s.kind)) {
    ok = 0;
  }
  __syncthreads();
  if (ok && blockIdx.x == 0 && t == 0) {
    // Every peer has run all it enqueued before its send kernel of this
    // call: the other kind's next send kernel needs no start barrier.
    MoeSyncState* other = s.state + (kMoeKinds - 1 - s.kind);
    other->free_epoch = other->counter[0] + 1;
  }
  return ok != 0;
}

// moe_stage_gate runs on one thread on a side stream, just before the copy
// of x into xs there, in a capturable dispatch whose send kernel has
// kSyncStageGo: it returns once that send kernel has passed its start
// barrier, after which no peer reads the previous rows, so the copy runs
// while the send kernel ranks tokens and writes metadata instead of after
// it. (Bounded like every wait, at twice the bound, so that the send
// kernel's block 0 is the one naming a missing peer; a memcpy cannot be
// cancelled, so after such a timeout the copy runs all the same: the call
// has failed, and a peer still reading the previous rows 2 bounds late
// would be one that has stopped.)
__global__ void moe_stage_gate(const MoeDispatchParams p) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  MoeSyncState* st = p.sync.state + kMoeDispatch;
  const u64 e = st->stage_taken + 1;  // only this kernel, in side-stream order, touches it
  st->stage_taken = e;
  wait_flag(outer_waiter(p.sync, p.rank), &st->stage_posted, e, -1, kPhaseMoeStart, kMoeDispatch);
}

// moe_stage_done runs on one block on the side stream right after the copy
// of x into xs that moe_stage_gate released: thread t posts the call's
// epoch into rank t's staged flag, which the expand waits for with the
// middle flags (kSyncStaged). The send kernel's blocks post their middle
// flags themselves, so the copy, done long before them at 128 tokens, stays
// off the expand's path (before, the expand's block 0 posted every flag
// after the join: a kernel boundary and a round trip more). The epoch is
// counter[0], which the send kernel's block 0 advanced before it released
// the gate.
__global__ void moe_stage_done(const MoeDispatchParams p) {
  const int t = (int)threadIdx.x;
  if (blockIdx.x != 0 || t >= p.world || t == p.rank) return;
  __threadfence_system();  // the copy's writes (finished: stream order) before the flag
  const u64 e = p.sync.state[kMoeDispatch].counter[0];
  st_flag_release(moe_flag(p.sync.peer_flags[t], kMoeDispatch, kMoeFlagStaged, p.rank), e);
}

// ---------------------------------------------------------------- eager argument checks

// moe_post_status runs on one block before the start barrier of an eager
// call: this rank's check (the host's code; else id_code if an expert id
// is outside [-1, E), else 0) into slot [rank] of every rank's status row,
// where the send kernels (any_rejected) and the host read it after the
// barrier. One launch instead of a device check of the ids and a copy per
// peer (~50 us of host time per eager dispatch at 4 ranks).
__global__ void __launch_bounds__(kThreads, 1) moe_post_status(const MoePostParams p) {
  int bad = 0;
  if (p.code == 0 && p.topk_idx != nullptr) {
    for (int i = (int)threadIdx.x; i < p.num_ids; i += (int)blockDim.x) {
      const long long id = p.idx_bytes == 8 ? ((const long long*)p.topk_idx)[i] : ((const int*)p.topk_idx)[i];
      bad |= id < -1 || id >= p.num_experts;
    }
  }
  bad = __syncthreads_or(bad);
  if ((int)threadIdx.x < p.world && p.world <= kMaxRanks && p.rank >= 0 && p.rank < p.world) {
    int* row = (int*)pick((void* const*)p.peer_status, (int)threadIdx.x);  // no copy of the table to the stack
    row[p.rank] = p.code != 0 ? p.code : (bad ? p.id_code : 0);
  }
}

// ---------------------------------------------------------------- dispatch

// block_tokens is this block's tokens [t0, t1): p2p_common's block_range
// of [0, T), the same partition in the count and send kernels.
DINLINE void block_tokens(int ntok, int& t0, int& t1) {
  const Range r = block_range(0, ntok, 1);
  t0 = (int)r.begin;
  t1 = (int)r.end;
}

// prof_stamp records step i of this block (MOE_PROFILE; see its knob).
DINLINE void prof_stamp(const MoeDispatchParams& p, int i) {
#if MOE_PROFILE
  if (threadIdx.x == 0) {
    u32* row = (u32*)p.pair_rank + (i64)p.max_tokens * p.topk + (i64)gridDim.x * (p.world + p.num_experts);
    row[blockIdx.x * 8 + i] = (u32)global_timer_ns();
  }
#endif
}

// count_tokens adds, for tokens [t0, t1), the tokens sent to each
// destination into dest[] and the pairs of each expert into experts[]
// (shared counters; integer counts, so any order).
DINLINE void count_tokens(const MoeDispatchParams& p, int t0, int t1, int* dest, int* experts, const int* sh) {
  const int lane = (int)threadIdx.x & 31, K = p.topk, W = p.world, L = p.num_experts / W;
  for (int base = t0; base < t1; base += (int)blockDim.x) {
    const int t = base + (int)threadIdx.x;
    const u32 m = t < t1 ? dest_mask(p, t, L, sh) : 0u;
    for (int d = 0; d < W; ++d) {
      const u32 bal = __ballot_sync(~0u, (m >> d) & 1u);
      if (lane == 0 && bal != 0) atomicAdd(&dest[d], __popc(bal));
    }
  }
  for (i64 q = (i64)t0 * K + threadIdx.x; q < (i64)t1 * K; q += blockDim.x) {  // shared atomics beat __match_any_sync here
    const int g = expert_id(p, q, sh);
    if (g >= 0) atomicAdd(&experts[g], 1);
  }
}

// moe_dispatch_count runs on the source just before moe_dispatch_send, on
// the same grid: block b counts its own tokens (per destination, per
// expert) into its row of the scratch after pair_rank, where every later
// send block sums them (the kernel boundary orders the two). Dynamic shared
// memory: 4 * (W + E) bytes.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) moe_dispatch_count(const MoeDispatchParams p) {
  prof_stamp(p, 0);
  extern __shared__ int cnt[];  // [W] tokens per destination | [E] pairs per expert
  const int W = p.world, E = p.num_experts, n = W + E;
  for (int i = (int)threadIdx.x; i < n; i += (int)blockDim.x) cnt[i] = 0;
  __syncthreads();
  int t0, t1;
  block_tokens(p.num_tokens, t0, t1);
  count_tokens(p, t0, t1, cnt, cnt + W, nullptr);
  __syncthreads();
  int* row = p.pair_rank + (i64)p.max_tokens * p.topk + (i64)blockIdx.x * n;
  for (int i = (int)threadIdx.x; i < n; i += (int)blockDim.x) row[i] = cnt[i];
  prof_stamp(p, 1);
}

// MetaFields is what one lane loads for one token's metadata (see
// dispatch_send_body step 5): the token's slot on destination `lane` (-1:
// none, or lane >= W), and for each field j = lane + 32 i of its row, the
// global expert id the field depends on (-1: none) and its value.
constexpr int kFieldPasses = (3 * kMoeMaxTopK + 1 + 31) / 32;
struct MetaFields {
  int slot;
  int g[kFieldPasses];
  int v[kFieldPasses];
};

// load_fields fills f for token t (nothing to store when t >= t1): fields
// [0, K) the local expert of each k, [K, 2K) the weight bits, 2K the token,
// (2K, 3K] the pair ranks (their expert in g).
DINLINE void load_fields(const MoeDispatchParams& p, int t, int t1, MetaFields& f) {
  const int lane = (int)(threadIdx.x & 31), K = p.topk, MW = 3 * K + 1;
  f.slot = t < t1 && lane < p.world ? p.send_slot[(i64)t * p.world + lane] : -1;
#pragma unroll
  for (int i = 0; i < kFieldPasses; ++i) {
    const int j = lane + 32 * i;
    int g = -1, v = 0;
    if (t < t1 && j < MW) {
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
    }
    f.g[i] = g;
    f.v[i] = v;
  }
}

// moe_dispatch_send runs on the source rank between the start and mid
// barriers. Block b owns the tokens block_tokens gives it. It sums, per
// destination and per expert, the tokens and pairs of the blocks before it
// (moe_dispatch_count's rows: the kernel boundary is the only cross-block
// sync; without that kernel, p.counted == 0, it counts them itself), then
// ranks its own tokens (slot on each
// destination = tokens before it sent there) and pairs (rank among this
// source's pairs of the same expert, in (token, k) order), and finally
// writes each token's metadata into every destination's meta. The last
// block, whose counters end as totals, writes every destination's hdr row
// of this source. Rows do not move here: moe.py has staged them in xs,
// where the destinations read them after the mid barrier.
// Dynamic shared memory: 4 * E bytes.
template <typename T>
DINLINE bool dispatch_send_body(const MoeDispatchParams& p, MoeBegin& sb) {
  extern __shared__ int run_exp[];  // [E]: pairs of each expert so far; then, with p.ids_shared, [t1 * K] ids
  __shared__ int run_dest[kMaxRanks];
  __shared__ int wcnt[kMoeWarps][kMaxRanks];
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = (int)blockDim.x >> 5;
  const int E = p.num_experts, K = p.topk, W = p.world, L = E / W, ntok = p.num_tokens;
  const int G = (int)gridDim.x, b = (int)blockIdx.x;
  int t0, t1;
  block_tokens(ntok, t0, t1);
  for (int e = tid; e < E; e += (int)blockDim.x) run_exp[e] = 0;
  if (tid < kMaxRanks) run_dest[tid] = 0;
  // Small batches: every id this block reads below, loaded once, 4 loads in
  // flight per thread, instead of from global memory in each step (each
  // thread's K ids in turn for dest_mask): the steps are chains of loads
  // and block barriers there.
  const int* sh = nullptr;
  if (p.ids_shared) {  // uniform
    int* ids = run_exp + E;
    const i64 n = (i64)t1 * K;
    for (i64 base = tid; base < n; base += 4 * (i64)blockDim.x) {
      int v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = base + u * blockDim.x < n ? expert_at(p, base + u * blockDim.x) : -1;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (base + u * blockDim.x < n) ids[base + u * blockDim.x] = v[u];
      }
    }
    sh = ids;
  }
  __syncthreads();

  // 1. Tokens and pairs before this block's range: the sums of the earlier
  // blocks' counts (moe_dispatch_count), or, for small batches, where that
  // kernel's launch costs more than counting again, counted here.
  if (p.counted) {
    const int n = W + E;
    const int* rows = p.pair_rank + (i64)p.max_tokens * K;
    for (int i = tid; i < n; i += (int)blockDim.x) {
      int acc = 0;
      for (int bb = 0; bb < b; ++bb) acc += rows[(i64)bb * n + i];
      if (i < W) run_dest[i] = acc;
      else run_exp[i - W] = acc;
    }
  } else {
    count_tokens(p, 0, t0, run_dest, run_exp, sh);
  }
  const i64 q0 = (i64)t0 * K, q1 = (i64)t1 * K;
  __syncthreads();
  prof_stamp(p, 4);
  sync_try_go(p.sync, p.rank, W, sb);

  // 2. Slots of this block's tokens on each destination, in token order.
  for (int base = t0; base < t1; base += (int)blockDim.x) {
    const int t = base + tid;
    const u32 m = t < t1 ? dest_mask(p, t, L, sh) : 0u;
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

  prof_stamp(p, 5);
  sync_try_go(p.sync, p.rank, W, sb);
  // 3. Rank of each pair among this source's pairs of its expert: warps in
  // turn, so ranks follow (token, k) order; only the warps that hold pairs
  // (a block barrier each: 16 of them for the ~48 pairs of a block at 128
  // tokens).
  for (i64 base = q0; base < q1; base += blockDim.x) {
    const i64 q = base + tid;
    const int g = q < q1 ? expert_id(p, q, sh) : -1;
    const u32 peers = __match_any_sync(~0u, g);
    const int busy = (int)min((i64)nw, (q1 - base + 31) / 32);  // uniform
    int r = -1;
    for (int w = 0; w < busy; ++w) {
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
  prof_stamp(p, 6);

  // Steps 1-3 wrote only this rank's memory; what follows writes into peers.
  if (!sync_go(p.sync, p.rank, W, sb)) return false;
  prof_stamp(p, 3);

  // 4. This source's totals into every destination's hdr (last block only).
  if (b == G - 1) {
    for (int i = tid; i < W * (L + 1); i += (int)blockDim.x) {
      const int d = i / (L + 1), j = i % (L + 1);
      int* hdr = (int*)pick(p.peer_hdr, d);
      hdr[p.rank * (L + 1) + j] = j == 0 ? run_dest[d] : run_exp[d * L + j - 1];
    }
  }

  // 5. Metadata, a warp per token: lane d (< W) finds the token's row on
  // destination d, lane j the row's field j (and j + 32, ... for topk > 10);
  // then, for each destination the token goes to (a warp-uniform loop over
  // the set bits), every lane stores its field as that destination sees it.
  // The next token's loads are issued before this token's stores, which
  // the compiler could not do itself (the stores might alias them, as far
  // as it knows). Every lane looping over all 8 destinations, each with
  // its own pointer, took 17 us at 4096 tokens.
  const int MW = 3 * K + 1;
  int* const mine = lane < W ? (int*)pick(p.peer_meta, lane) + (i64)p.rank * p.max_tokens * MW : nullptr;
  MetaFields f;
  load_fields(p, t0 + warp, t1, f);
  for (int t = t0 + warp; t < t1; t += nw) {
    MetaFields next;
    load_fields(p, t + nw, t1, next);
    const u32 dests = __ballot_sync(~0u, f.slot >= 0);  // only lanes < W hold a slot
    int* const row = f.slot >= 0 ? mine + (i64)f.slot * MW : nullptr;  // lane d: the row on d
#pragma unroll
    for (int i = 0; i < kFieldPasses; ++i) {
      if (32 * i >= MW) break;  // warp-uniform
      const int j = lane + 32 * i;
      // The expert's rank, and the value a pair field carries there (local
      // id or pair rank); -1 on every other rank.
      const int owner = f.g[i] >= 0 ? owner_of(f.g[i], L) : -1;
      const bool pair_field = j < K || j > 2 * K;
      const int there = j < K ? f.g[i] - owner * L : f.v[i];
      for (u32 rest = dests; rest != 0; rest &= rest - 1) {
        const int d = __ffs(rest) - 1;
        int* const r = (int*)__shfl_sync(~0u, (unsigned long long)row, d);
        if (j < MW) r[j] = pair_field ? (owner == d ? there : -1) : f.v[i];
      }
    }
    f = next;
  }
  return true;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) moe_dispatch_send(const MoeDispatchParams p) {
  __shared__ MoeBegin sb;
  if (!p.counted) {  // no count kernel ran: its steps took no time (the counting is in step 1 then)
    prof_stamp(p, 0);
    prof_stamp(p, 1);
  }
  prof_stamp(p, 2);
  if (!sync_enter(p.sync, p.rank, p.world, sb)) return;
  const bool ok = any_rejected(p.status, p.world) ? sync_go(p.sync, p.rank, p.world, sb)  // uniform
                                                  : dispatch_send_body<T>(p, sb);
  if (!ok) return;
  sync_end(p.sync, p.rank, p.world);
  prof_stamp(p, 7);
}

// take_unit: the next work unit for the calling warp, from the call's
// shared counter (MoeSyncState.work; MOE_EXPAND_DYNAMIC, MOE_COMB_DYNAMIC).
DINLINE i64 take_unit(u32* work) {
  u32 u = 0;
  if ((threadIdx.x & 31) == 0) u = atomicAdd(work, 1u);
  return (i64)__shfl_sync(~0u, u, 0);
}

// expand_stamp records step i of this expand block (MOE_PROFILE): 0 start,
// 1 past sync_wait, 2 bases scanned, 3 every warp of the block done. Step 3
// writes them, only where the rows leave the last 8 G weights unused
// (capturable calls' row_cap; an eager call's info is exact).
DINLINE void expand_stamp(const MoeExpandParams& p, int i, i64 rows = 0) {
#if MOE_PROFILE
  __shared__ u32 st[4];
  if (i == 3) __syncthreads();
  if (threadIdx.x == 0) {
    st[i] = (u32)global_timer_ns();
    if (i == 3 && rows + (i64)gridDim.x * 8 <= p.row_cap) {
      u32* row = (u32*)(p.out_info + 4 * p.row_cap) - (i64)gridDim.x * 8;
      for (int j = 0; j < 4; ++j) row[blockIdx.x * 8 + j] = st[j];
    }
  }
#endif
}

// moe_dispatch_expand runs on the destination after the mid barrier (a
// barrier kernel, or sync_wait here). Every
// block computes, from hdr, each (source, local expert)'s first output row:
// experts in order, then sources in order; the sender's pair ranks place
// each pair within that run, so row order is (local expert, source, token,
// k). One warp per received (source, slot) writes its rows' metadata and
// reads the token row from the source's xs (over NVLink: a pull, so no
// received copy lands here first) and stores it once per valid k (rows are
// cut into pieces, one warp each, when the grid has more warps than
// received rows). Items go slot-major, sources rotated (see slot_major),
// each warp taking the next unit as it finishes one (take_unit).
// Block 0 writes expert_counts and R. Dynamic shared memory: 4 * (W + 1) * L bytes.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) moe_dispatch_expand(const MoeExpandParams p) {
  extern __shared__ int sh[];  // tot[L] (then expert bases) | base[W][L]
  __shared__ int wsum[kMoeWarps];
  __shared__ int carry;
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = (int)blockDim.x >> 5;
  const int L = p.num_local, W = p.world, K = p.topk, Tm = p.max_tokens;
  int* tot = sh;
  int* base = sh + L;
  expand_stamp(p, 0);
  if (!sync_wait(p.sync, p.rank, W)) return;
  expand_stamp(p, 1);
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
  expand_stamp(p, 2);

  const int MW = 3 * K + 1;
  const i64 row_bytes = (i64)p.hidden * (i64)sizeof(T);
  const i64 packs = row_bytes / kPackBytes;
  int* info_le = p.out_info;
  int* info_src = p.out_info + p.row_cap;
  int* info_tok = p.out_info + 2 * p.row_cap;
  int* info_w = p.out_info + 3 * p.row_cap;
  const i64 orders = (i64)most_sent(p.hdr, W, L) * W;
  const i64 gwarps = (i64)gridDim.x * nw;
  const int parts = row_parts(received_tokens(p.hdr, W, L), gwarps, packs, 32 * kMoeUnroll);
  char* out = (char*)p.out_x;
  MoeSyncState* const st = p.sync.state + kMoeDispatch;
  u32* const work = &st->work[st->counter[0] & 1];  // this call's (its send kernel's epoch)
  i64 next = MOE_EXPAND_DYNAMIC ? take_unit(work) : (i64)blockIdx.x * nw + warp;
  for (i64 unit = next; unit < orders * parts; unit = next) {
    // The following unit's atomic goes out now, under this unit's copy.
    next = MOE_EXPAND_DYNAMIC ? take_unit(work) : unit + gwarps;
    const int part = (int)(unit % parts);
    int s, slot;
    slot_major(unit / parts, W, p.rank, s, slot);
    if (slot >= p.hdr[s * (L + 1)]) continue;  // warp-uniform
    const i64 item = (i64)s * Tm + slot;
    const int* m = p.meta + item * MW;
    int row = -1;
    if (lane < K) {
      const int lid = m[lane], rk = m[2 * K + 1 + lane];
      if (lid >= 0 && lid < L && rk >= 0) {
        const i64 r = (i64)base[s * L + lid] + rk;
        if (r < p.row_cap) row = (int)r;
      }
      if (part == 0) {  // metadata once per item
        if (row >= 0) {
          info_le[row] = lid;
          info_src[row] = s;
          info_tok[row] = m[2 * K];
          info_w[row] = m[K + lane];
        }
        p.comb_rows[item * K + lane] = row;
      }
    }
    const u32 bal = __ballot_sync(~0u, row >= 0);
    const char* src = (const char*)pick(p.peer_xs, s) + (i64)m[2 * K] * row_bytes;
    const i64 c0 = piece_begin(packs, part, parts), c1 = piece_begin(packs, part + 1, parts);
    // Passes are warp-uniform (not per lane): every lane must reach the shuffle.
    for (i64 pass = c0; pass < c1; pass += 32 * kMoeUnroll) {
      const i64 i = pass + lane;
      V16 v[kMoeUnroll];  // every load of the pass in flight before the first store
#pragma unroll
      for (int u = 0; u < kMoeUnroll; ++u) {
        if (i + u * 32 < c1) v[u] = ld_v16_stable(src + (i + u * 32) * kPackBytes);
      }
      // One copy per valid k, its row taken from the lane that computed it
      // (a register shuffle instead of a shared-memory list per item).
      for (u32 rest = bal; rest != 0; rest &= rest - 1) {
        char* o = out + (i64)__shfl_sync(~0u, row, __ffs(rest) - 1) * row_bytes;
#pragma unroll
        for (int u = 0; u < kMoeUnroll; ++u) {
          if (i + u * 32 < c1) st_v16(o + (i + u * 32) * kPackBytes, v[u]);
        }
      }
    }
  }
  expand_stamp(p, 3, R);
}

// ---------------------------------------------------------------- combine

// kCombGroup: expert_out rows whose loads are in flight together in the
// combine send; items with more valid k's than that take the slower path.
constexpr int kCombGroup = MOE_COMB_GROUP;
// kCombUnroll: packs of T per lane per pass of the combine send.
constexpr int kCombUnroll = MOE_COMB_UNROLL;
// The combine reduce keeps kReduceLoads 16-byte partial loads in flight per
// lane: kReduceRanks ranks at a time, times the passes' packs.
constexpr int kReduceLoads = MOE_REDUCE_LOADS;
constexpr int kReduceRanks = 4;
// moe_combine_reduce<T, C, G> with G > 0 (G == world size) reduces all G
// ranks' partials in one group with kReduceOneLoads loads in flight per
// lane (kReduceFourLoads at G = 4), each pass summed and stored as soon as
// its loads are in. 2 x H200, bf16 partials, 4096 tokens, graph: reduce 160
// -> 111 us at G = 2, where a group of 4 ranks had kept only 8 loads in
// flight; at G = 4 on 4 x H200 194 -> 173 us, and 173 -> 150 with 24 loads
// instead of 16 (4 x 6 packs, 125-128 registers, no spills; 24 spill
// registers at G = 2 and, with half, at G = 3).
#ifndef MOE_REDUCE_ONE_LOADS
#define MOE_REDUCE_ONE_LOADS 16
#endif
#ifndef MOE_REDUCE_FOUR_LOADS
#define MOE_REDUCE_FOUR_LOADS 24
#endif
constexpr int kReduceOneLoads = MOE_REDUCE_ONE_LOADS;
constexpr int kReduceFourLoads = MOE_REDUCE_FOUR_LOADS;
__device__ constexpr int one_group_loads(int G) { return G == 4 ? kReduceFourLoads : kReduceOneLoads; }
static_assert(kCombGroup >= 1 && kCombGroup <= 32 && kCombUnroll >= 1 && kReduceLoads >= 8, "combine knobs");
// kCombWide: items with more than kCombGroup valid pairs and at most twice
// that load kCombWide rows at kCombWideUnroll packs per lane per pass.
#ifndef MOE_COMB_WIDE
#define MOE_COMB_WIDE 1  // 0: such items take combine_pieces_many (before)
#endif
constexpr int kCombWide = 2 * kCombGroup <= 32 ? 2 * kCombGroup : 32;
constexpr int kCombWideUnroll = kCombUnroll / 2 >= 1 ? kCombUnroll / 2 : 1;

// Transit<T, C> checks the combine transit type: float (exact partials) or
// T (each partial rounded once; half the bytes).
template <typename T, typename C> struct Transit {
  static constexpr bool kOk = sizeof(C) == sizeof(T) || sizeof(C) == sizeof(float);
  static constexpr int kIn = PackOf<T>::kElems / PackOf<C>::kElems;  // C packs per T pack
};

// store_partial rounds the float32 sums acc of one pack of T to C (exact
// for float) and stores them at pack c of the partial row dst.
template <typename T, typename C>
DINLINE void store_partial(C* dst, i64 c, const float (&acc)[PackOf<T>::kElems]) {
  constexpr int P = PackOf<T>::kElems, PC = PackOf<C>::kElems;
#pragma unroll
  for (int q = 0; q < P / PC; ++q) {
    float part[PC];
#pragma unroll
    for (int e = 0; e < PC; ++e) part[e] = acc[q * PC + e];
    st_v16(dst + c * P + q * PC, narrow<C>(part));
  }
}

// add_weighted: acc += weight * in, elementwise, each product and sum
// rounded to float32 (no FMA: the same bits as torch's mul, then add).
template <typename T>
DINLINE void add_weighted(float (&acc)[PackOf<T>::kElems], float weight, V16 raw) {
  float in[PackOf<T>::kElems];
  widen<T>(raw, in);
#pragma unroll
  for (int e = 0; e < PackOf<T>::kElems; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(weight, in[e]));
}

// ItemRows is one combine item's valid pairs, one per lane (lane = k):
// row is its expert_out row (-1: none), weight its topk weight. `valid`
// has bit k set for each valid pair, identical on every lane.
struct ItemRows {
  int row;
  float weight;
  u32 valid;
};

// take_group gives every lane the next kCombGroup valid pairs of `rest`
// (lowest k first) as expert_out rows and weights, through register
// shuffles, and clears them from rest. Missing ones are row 0 with weight 0;
// the caller bounds its loops by the count. Rows, not pointers: half the
// registers. Every lane must call it.
DINLINE int take_group(const ItemRows& it, u32& rest, int (&row)[kCombGroup], float (&wt)[kCombGroup]) {
  const int n = __popc(rest) < kCombGroup ? __popc(rest) : kCombGroup;
#pragma unroll
  for (int j = 0; j < kCombGroup; ++j) {
    const int from = rest != 0 ? __ffs(rest) - 1 : 0;
    const int r = __shfl_sync(~0u, it.row, from);
    wt[j] = __shfl_sync(~0u, it.weight, from);
    row[j] = r >= 0 ? r : 0;
    rest &= rest - 1;
  }
  return n;
}

// Combine send register layouts: the kCombRegs 16-byte loads of one pass
// in flight per lane, laid out as GL rows x UL packs: kCombGroup x
// kCombUnroll for items of up to kCombGroup valid pairs (most of them), and
// for more pairs twice the rows at half the packs (kCombWide x
// kCombWideUnroll; they took a one-pack loop before: 4x the passes, and at
// 128 tokens the few such items set the kernel's time). Tried and not kept:
// items of 1-2 pairs at twice the packs (2 x 8: c.send 834 against 668 us,
// 4096 tokens, bf16 partials), and items of 1-3 pairs as 1 x 16, 2 x 8 or
// 3 x 5 in whole passes (2 x H200: c.send 406 against 368 us;
// docs/experiments/moe-combine-fit.patch): more loads in flight is not
// what this kernel lacks.
constexpr int kCombRegs = kCombGroup * kCombUnroll;
static_assert(kCombWide * kCombWideUnroll <= kCombRegs && kCombWide <= 32, "the wide layout fits the registers");

// load_rows loads, for the first min(n, GL) valid pairs j of an item, UL
// packs per lane of row j from pass on (packs below c1) into raw[j * UL +
// u]. Lane j holds pair j's row (crow) and weight (cw): each is shuffled
// from there when used, which keeps the registers for the loads.
template <int GL, int UL>
DINLINE void load_rows(V16 (&raw)[kCombRegs], int crow, int n, const char* out, i64 row_bytes, int pass, int c1) {
  static_assert(GL * UL <= kCombRegs, "layout fits");
  const int lane = (int)(threadIdx.x & 31);
#pragma unroll
  for (int j = 0; j < GL; ++j) {
    if (j >= n) break;  // warp-uniform
    // One base per row; the packs are immediate offsets from it (registers).
    const char* src = out + (i64)__shfl_sync(~0u, crow, j) * row_bytes +
                      (i64)(pass + lane) * kPackBytes;
#pragma unroll
    for (int u = 0; u < UL; ++u) {
      if (pass + lane + 32 * u < c1) raw[j * UL + u] = ld_v16_stable(src + 32 * u * kPackBytes);
    }
  }
}

// sum_store sums each of the UL packs over the loaded rows in k order from
// +0 (weights shuffled from their lanes) and stores it as pack c of dst.
// Lanes past c1 sum registers that were not loaded and store nothing:
// every lane must reach the shuffles.
template <typename T, typename C, int GL, int UL>
DINLINE void sum_store(const V16 (&raw)[kCombRegs], float cw, int n, C* dst, int pass, int c1) {
  constexpr int P = PackOf<T>::kElems;
  const int lane = (int)(threadIdx.x & 31);
  C* const base = dst + (i64)(pass + lane) * P;  // packs at immediate offsets from it
  // 16-bit partials: the weights shuffled once per pass, not per pack (a shuffle and its divergence
  // check per use were issue slots): a combine 709-712 against 717-722 us, 4096 tokens, bf16. Float
  // partials keep the shuffle per use: hoisted, 1640 against 1467 us per combine.
  constexpr bool hoist = MOE_COMB_HOIST && sizeof(C) == sizeof(T) && sizeof(T) == 2;
  float wt[GL];
#pragma unroll
  for (int j = 0; j < GL; ++j) wt[j] = hoist ? __shfl_sync(~0u, cw, j) : 0.0f;
#pragma unroll
  for (int u = 0; u < UL; ++u) {
    float acc[P];
#pragma unroll
    for (int e = 0; e < P; ++e) acc[e] = 0.0f;
#pragma unroll
    for (int j = 0; j < GL; ++j) {
      if (j >= n) break;
      add_weighted<T>(acc, hoist ? wt[j] : __shfl_sync(~0u, cw, j), raw[j * UL + u]);
    }
    if (pass + lane + 32 * u < c1) store_partial<T, C>(base, 32 * u, acc);
  }
}

// combine_pieces_group: packs [c0, c1) of one item's partial when it has at
// most kCombWide valid pairs: per pass, every lane loads the packs of every
// row before any math (in one register array, whatever the layout: inlined
// variants with their own arrays would need the registers of all), then
// sums each pack over the rows in k order from +0 and stores it.
template <typename T, typename C>
DINLINE void combine_pieces_group(const ItemRows& it, const char* out, i64 row_bytes, C* dst, int c0, int c1) {
  // Lane j takes valid pair j's row and weight (pairs in k order).
  const int from = (int)(__fns(it.valid, 0, (int)(threadIdx.x & 31) + 1) & 31);  // past the last: any lane
  const int crow = __shfl_sync(~0u, it.row, from);
  const float cw = __shfl_sync(~0u, it.weight, from);
  const int n = __popc(it.valid) < kCombWide ? __popc(it.valid) : kCombWide;  // warp-uniform
  const bool wide = n > kCombGroup;
  for (int pass = c0; pass < c1; pass += 32 * (wide ? kCombWideUnroll : kCombUnroll)) {  // int: packs of one row
    V16 raw[kCombRegs];
    if (!wide) {
      load_rows<kCombGroup, kCombUnroll>(raw, crow, n, out, row_bytes, pass, c1);
      sum_store<T, C, kCombGroup, kCombUnroll>(raw, cw, n, dst, pass, c1);
    } else {
      load_rows<kCombWide, kCombWideUnroll>(raw, crow, n, out, row_bytes, pass, c1);
      sum_store<T, C, kCombWide, kCombWideUnroll>(raw, cw, n, dst, pass, c1);
    }
  }
}

// combine_pieces_many: items with more valid pairs than the wide layout
// holds (topk > 2 * kCombGroup only; with MOE_COMB_WIDE=0, more than
// kCombGroup), one pack per lane per pass and kCombGroup rows at a time,
// still summed in k order.
template <typename T, typename C>
DINLINE void combine_pieces_many(const ItemRows& it, const char* out, i64 row_bytes, C* dst, i64 c0, i64 c1) {
  constexpr int P = PackOf<T>::kElems;
  const int lane = (int)(threadIdx.x & 31);
  for (i64 pass = c0; pass < c1; pass += 32) {
    const i64 c = pass + lane;
    float acc[P];
#pragma unroll
    for (int e = 0; e < P; ++e) acc[e] = 0.0f;
    for (u32 rest = it.valid; rest != 0;) {  // warp-uniform: every lane shuffles
      int row[kCombGroup];
      float wt[kCombGroup];
      const int n = take_group(it, rest, row, wt);
      V16 raw[kCombGroup];
#pragma unroll
      for (int j = 0; j < kCombGroup; ++j) {
        if (j < n && c < c1) raw[j] = ld_v16_stable(out + (i64)row[j] * row_bytes + c * kPackBytes);
      }
#pragma unroll
      for (int j = 0; j < kCombGroup; ++j) {
        if (j < n && c < c1) add_weighted<T>(acc, wt[j], raw[j]);
      }
    }
    if (c < c1) store_partial<T, C>(dst, c, acc);
  }
}

// moe_combine_send runs on the expert rank between the start and mid
// barriers. Per received (source, slot): the partial sum over k ascending
// of weight_k * expert_out[row_k], each product and sum rounded to float32
// from +0, rounded once to C (exact for float) and stored into the source's
// comb[this rank, slot] (MOE_COMB_PULL=1: into this rank's comb[source,
// slot], where the source reads it); with self_local, only the items of
// the other sources. One warp per item (or per piece
// of it, when the grid has more warps than items). Items go slot-major with
// sources rotated by rank (see slot_major): in source-major order every
// expert rank wrote into the same source at once, and that one rank's
// NVLink ingress bounded the whole exchange. Each warp takes the next unit
// from work (this call's counter) as it finishes one.
template <typename T, typename C>
DINLINE void combine_send_body(const MoeCombineParams& p, u32* work) {
  static_assert(Transit<T, C>::kOk, "combine transit is float or T");
  constexpr int P = PackOf<T>::kElems;
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = (int)blockDim.x >> 5;
  const int L = p.num_local, W = p.world, K = p.topk, Tm = p.max_tokens, H = p.hidden;
  const int MW = 3 * K + 1;
  const i64 row_bytes = (i64)H * (i64)sizeof(T);
  const i64 ppr = H / P;  // packs per row
  const char* out = (const char*)p.expert_out;
  const int gwarps = (int)gridDim.x * nw;
  // Units in 32 bits (a 64-bit division per item cost spilled registers):
  // orders = W * Tm < 2^31 / K (moe.py checks), and parts is capped so that
  // no unit index passes 2^31.
  // With self_local this rank's own items are moe_combine_reduce_self's.
  const int srcs = p.self_local ? W - 1 : W;
  const int orders = srcs * Tm;  // not most_sent's bound: sm_80 would spill registers
  const i64 items = received_tokens(p.hdr, W, L) - (p.self_local ? p.hdr[p.rank * (L + 1)] : 0);
  int parts = row_parts(items, gwarps, ppr, 32 * kCombUnroll);
  if ((i64)orders * parts > (i64)(0x7fffffff - gwarps)) parts = max(1, (0x7fffffff - gwarps) / orders);
#if MOE_COMB_PULL
  C* const mine = (C*)pick(p.peer_comb, p.rank);
#endif
  int next = MOE_COMB_DYNAMIC ? (int)take_unit(work) : (int)blockIdx.x * nw + warp;
  for (int unit = next; unit < orders * parts; unit = next) {
    next = MOE_COMB_DYNAMIC ? (int)take_unit(work) : unit + gwarps;  // the atomic under this unit
    const int order = unit / parts;
    const int part = unit % parts;
#if MOE_COMB_INTERLEAVE
    int s, slot;
    slot_major(order, W, p.rank, s, slot, srcs);
#else
    const int s = (int)(order / Tm + (p.self_local && order / Tm >= p.rank)), slot = (int)(order % Tm);
#endif
    if (slot >= p.hdr[s * (L + 1)]) continue;  // warp-uniform
    const i64 item = (i64)s * Tm + slot;
    ItemRows it;
    it.row = -1;
    it.weight = 0.0f;
    if (lane < K) {
      it.row = p.comb_rows[item * K + lane];
      it.weight = __int_as_float(p.meta[item * MW + K + lane]);
      if (it.row >= p.row_cap) it.row = -1;
    }
    it.valid = __ballot_sync(~0u, it.row >= 0);
#if MOE_COMB_PULL
    C* dst = mine + ((i64)s * (Tm + 1) + slot) * (i64)H;
#else
    C* dst = (C*)pick(p.peer_comb, s) + ((i64)p.rank * (Tm + 1) + slot) * (i64)H;
#endif
    const i64 c0 = piece_begin(ppr, part, parts), c1 = piece_begin(ppr, part + 1, parts);
    // Up to kCombGroup pairs (most items) or twice that (at 128 tokens the
    // few such items set the kernel's time when they took the one-pack loop:
    // 4x the passes): kCombGroup * kCombUnroll loads in flight per lane.
    if (__popc(it.valid) <= (MOE_COMB_WIDE ? kCombWide : kCombGroup)) {
      combine_pieces_group<T, C>(it, out, row_bytes, dst, (int)c0, (int)c1);
    } else {
      combine_pieces_many<T, C>(it, out, row_bytes, dst, c0, c1);
    }
  }
}

template <typename T, typename C>
__global__ void __launch_bounds__(kThreads, 1) moe_combine_send(const MoeCombineParams p) {
  __shared__ MoeBegin sb;
  // The whole start barrier first: items that stay on this rank could run
  // under its round trip, but doing them first took the NVLink pushes' overlap
  // with local work away (combine 705-711 -> 768-775 us at 4096 tokens).
  if (!sync_enter(p.sync, p.rank, p.world, sb) || !sync_go(p.sync, p.rank, p.world, sb)) return;
  if (!any_rejected(p.status, p.world)) {  // uniform: else nothing reaches the sources
    combine_send_body<T, C>(p, &p.sync.state[p.sync.kind].work[sb.epoch & 1]);
  }
  sync_end(p.sync, p.rank, p.world);
}

// add_partial: acc += the T pack of partials held in Q packs of C, each
// widened to float and added in element order (rounded to float32).
template <typename T, typename C>
DINLINE void add_partial(float (&acc)[PackOf<T>::kElems], const V16 (&raw)[Transit<T, C>::kIn]) {
  constexpr int PC = PackOf<C>::kElems;
#pragma unroll
  for (int q = 0; q < Transit<T, C>::kIn; ++q) {
    float in[PC];
    widen<C>(raw[q], in);
#pragma unroll
    for (int e = 0; e < PC; ++e) acc[q * PC + e] = __fadd_rn(acc[q * PC + e], in[e]);
  }
}

// reduce_units runs this warp's units of moe_combine_reduce: one unit per
// (token, run of 32 * U packs); the token's slots are loaded once per lane,
// then the partials of R ranks at a time for all U packs. kOne: the world
// has R ranks, so there is one group, and each pass is summed and stored as
// soon as its loads are in: no accumulator is held across the loads, which
// leaves the registers for R * U * Q loads in flight.
template <typename T, typename C, int R, int U, bool kOne>
DINLINE void reduce_units(const MoeCombineParams& p) {
  constexpr int P = PackOf<T>::kElems, PC = PackOf<C>::kElems, Q = Transit<T, C>::kIn;
  static_assert(U >= 1, "reduce unroll");
  const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5), nw = (int)blockDim.x >> 5;
  const int W = p.world, H = p.hidden, Tm = p.max_tokens;
  const int groups = kOne ? 1 : (W + R - 1) / R;
  const i64 ppr = H / P;
  const i64 runs = (ppr + 32 * U - 1) / (32 * U);  // per token
#if !MOE_COMB_PULL
  const C* comb = (const C*)pick(p.peer_comb, p.rank);
#endif
  for (i64 unit = (i64)blockIdx.x * nw + warp; unit < (i64)p.num_tokens * runs; unit += (i64)gridDim.x * nw) {
    const i64 t = unit / runs, c0 = (unit % runs) * 32 * U + lane;
    float acc[U][P];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int e = 0; e < P; ++e) acc[u][e] = 0.0f;
    }
    for (int g = 0; g < groups; ++g) {
      const int d0 = g * R;
      int slot[R];  // all slot loads issued before the partials that need them
#pragma unroll
      for (int r = 0; r < R; ++r) slot[r] = d0 + r < W ? p.send_slot[t * W + d0 + r] : -1;
      V16 raw[R][U][Q];
#pragma unroll
      for (int r = 0; r < R; ++r) {
#if MOE_COMB_PULL
        const C* part = (const C*)pick(p.peer_comb, d0 + r) + ((i64)p.rank * (Tm + 1) + slot[r]) * (i64)H;
#else
        const C* part = comb + ((i64)(d0 + r) * (Tm + 1) + slot[r]) * (i64)H;
#endif
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const i64 c = c0 + 32 * u;
          if (slot[r] >= 0 && c < ppr) {
#pragma unroll
            for (int q = 0; q < Q; ++q) raw[r][u][q] = ld_v16_stable(part + c * P + q * PC);
          }
        }
      }
      if constexpr (kOne) {  // each pass summed and stored as soon as its loads are in
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const i64 c = c0 + 32 * u;
          if (c >= ppr) continue;
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (slot[r] >= 0) add_partial<T, C>(acc[u], raw[r][u]);
          }
          st_v16((char*)p.y + (t * ppr + c) * kPackBytes, narrow<T>(acc[u]));
        }
        continue;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (slot[r] < 0) continue;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (c0 + 32 * u < ppr) add_partial<T, C>(acc[u], raw[r][u]);  // else nothing loaded there
        }
      }
    }
    if (kOne) continue;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 c = c0 + 32 * u;
      if (c < ppr) st_v16((char*)p.y + (t * ppr + c) * kPackBytes, narrow<T>(acc[u]));
    }
  }
}

// moe_combine_reduce runs on the source after the mid barrier (a barrier
// kernel, or sync_wait here): y[t] = sum over ranks d ascending (those token
// t went to) of d's partial for the slot of t on d (C widened to float32;
// from this rank's comb[d, slot], or with MOE_COMB_PULL=1 read from d's
// comb), in float32 from +0, rounded once to T; zeros for a token sent
// nowhere. G = 0: ranks in groups of kReduceRanks, kReduceLoads loads in
// flight per lane; G > 0 (the world size): one group, one_group_loads(G).
template <typename T, typename C, int G>
__global__ void __launch_bounds__(kThreads, 1) moe_combine_reduce(const MoeCombineParams p) {
  static_assert(Transit<T, C>::kOk, "combine transit is float or T");
  constexpr int Q = Transit<T, C>::kIn;
  if (!sync_wait(p.sync, p.rank, p.world)) return;
  if constexpr (G > 0) {
    reduce_units<T, C, G, one_group_loads(G) / (G * Q), true>(p);
  } else {
    reduce_units<T, C, kReduceRanks, kReduceLoads / (kReduceRanks * Q), false>(p);
  }
}

// round_transit: the float32 sums s of one pack of T as the send kernel's
// partial carries them: rounded once to C (exact for float).
template <typename T, typename C>
DINLINE void round_transit(float (&s)[PackOf<T>::kElems]) {
  if constexpr (sizeof(C) != sizeof(float)) {
    static_assert(sizeof(C) == sizeof(T), "16-bit partials are T");
    widen<C>(narrow<C>(s), s);
  }
}

// self_sum_store: for each of the UL packs of this pass, this rank's own
// term (the rows of the item in k order from +0, weighted, rounded to C:
// the partial the send kernel would have sent here) and the peer's partial
// pp (when has_peer), added from +0 in rank order, rounded to T and stored
// at y. has_self is false for a token that sent this rank nothing (no
// term). Weights as in sum_store (float partials shuffle them per use: the
// registers; so lanes past c1 sum what they did not load and store nothing).
template <typename T, typename C, int GL, int UL>
DINLINE void self_sum_store(const V16 (&raw)[kCombRegs], float cw, int n, bool has_self,
                            const V16 (&pp)[kCombUnroll][Transit<T, C>::kIn], bool has_peer, bool self_first, T* y,
                            int pass, int c1) {
  constexpr int P = PackOf<T>::kElems;
  constexpr bool hoist = MOE_COMB_HOIST && sizeof(C) == sizeof(T) && sizeof(T) == 2;
  const int lane = (int)(threadIdx.x & 31);
  float wt[GL];
#pragma unroll
  for (int j = 0; j < GL; ++j) wt[j] = hoist ? __shfl_sync(~0u, cw, j) : 0.0f;
#pragma unroll
  for (int u = 0; u < UL; ++u) {
    const int c = pass + lane + 32 * u;
    float mine[P], acc[P];
#pragma unroll
    for (int e = 0; e < P; ++e) mine[e] = acc[e] = 0.0f;
#pragma unroll
    for (int j = 0; j < GL; ++j) {
      if (j >= n) break;
      add_weighted<T>(mine, hoist ? wt[j] : __shfl_sync(~0u, cw, j), raw[j * UL + u]);
    }
    if (c >= c1) continue;
    round_transit<T, C>(mine);
    const auto add_mine = [&] {
#pragma unroll
      for (int e = 0; e < P; ++e) acc[e] = __fadd_rn(acc[e], mine[e]);
    };
    if (has_self && self_first) add_mine();
    if (has_peer) add_partial<T, C>(acc, pp[u]);
    if (has_self && !self_first) add_mine();
    st_v16((char*)y + (i64)c * kPackBytes, narrow<T>(acc));
  }
}

// load_peer_partial loads UL packs per lane of the peer's partial from pass
// on (packs below c1) into pp; nothing when part is null.
template <typename T, typename C, int UL>
DINLINE void load_peer_partial(V16 (&pp)[kCombUnroll][Transit<T, C>::kIn], const C* part, int pass, int c1) {
  constexpr int P = PackOf<T>::kElems, PC = PackOf<C>::kElems;
  if (part == nullptr) return;  // warp-uniform
  const int lane = (int)(threadIdx.x & 31);
#pragma unroll
  for (int u = 0; u < UL; ++u) {
    const int c = pass + lane + 32 * u;
    if (c < c1) {
#pragma unroll
      for (int q = 0; q < Transit<T, C>::kIn; ++q) pp[u][q] = ld_v16_stable(part + (i64)c * P + q * PC);
    }
  }
}

// reduce_self_body: moe_combine_reduce_self's units, one per (token, piece
// of its row), handed out as warps free up (reduce_work). Per pass every
// lane loads its packs of the token's own rows here (the combine send's
// layouts) and of the peer's partial before any math.
template <typename T, typename C>
DINLINE void reduce_self_body(const MoeCombineParams& p) {
  constexpr int P = PackOf<T>::kElems;
  const int lane = (int)(threadIdx.x & 31), nw = (int)blockDim.x >> 5;
  const int rank = p.rank, peer = 1 - rank, K = p.topk, Tm = p.max_tokens, H = p.hidden, MW = 3 * K + 1;
  const i64 row_bytes = (i64)H * (i64)sizeof(T);
  const int ppr = H / P;
  const char* out = (const char*)p.expert_out;
  const int gwarps = (int)gridDim.x * nw;
  int parts = row_parts(p.num_tokens, gwarps, ppr, 32 * kCombUnroll);
  if ((i64)p.num_tokens * parts > (i64)(0x7fffffff - gwarps)) parts = max(1, (0x7fffffff - gwarps) / p.num_tokens);
#if MOE_COMB_PULL
  const C* const peer_base = (const C*)pick(p.peer_comb, peer) + (i64)rank * (Tm + 1) * H;
#else
  const C* const peer_base = (const C*)pick(p.peer_comb, rank) + (i64)peer * (Tm + 1) * H;
#endif
  MoeSyncState* const st = p.sync.state + p.sync.kind;
  u32* const work = &st->reduce_work[st->counter[0] & 1];  // this call's (its send kernel's epoch)
  const int units = p.num_tokens * parts;
  for (int unit = (int)take_unit(work), next; unit < units; unit = next) {
    next = (int)take_unit(work);  // the atomic under this unit
    const int t = unit / parts, part = unit % parts;
    const int sl = lane < 2 ? p.send_slot[(i64)t * 2 + lane] : -1;
    const int slot_self = __shfl_sync(~0u, sl, rank), slot_peer = __shfl_sync(~0u, sl, peer);
    int row = -1;
    float weight = 0.0f;
    if (slot_self >= 0 && lane < K) {
      const i64 item = (i64)rank * Tm + slot_self;
      row = p.comb_rows[item * K + lane];
      weight = __int_as_float(p.meta[item * MW + K + lane]);
      if (row >= p.row_cap) row = -1;
    }
    const u32 valid = __ballot_sync(~0u, row >= 0);
    // Lane j takes valid pair j's row and weight (pairs in k order).
    const int from = (int)(__fns(valid, 0, lane + 1) & 31);
    const int crow = __shfl_sync(~0u, row, from);
    const float cw = __shfl_sync(~0u, weight, from);
    const int n = __popc(valid);  // <= K <= kCombWide
    const bool wide = n > kCombGroup;
    // Float partials of a 16-bit T take two registers of the peer's per pack: one pack per lane
    // less in the narrow layout (sm_80 spilled with kCombUnroll).
    constexpr int UN = Transit<T, C>::kIn == 1 ? kCombUnroll : kCombUnroll - 1;
    const C* const pp_src = slot_peer >= 0 ? peer_base + (i64)slot_peer * H : nullptr;
    T* const y = (T*)p.y + (i64)t * H;
    const int c0 = (int)piece_begin(ppr, part, parts), c1 = (int)piece_begin(ppr, part + 1, parts);
    for (int pass = c0; pass < c1; pass += 32 * (wide ? kCombWideUnroll : UN)) {
      V16 raw[kCombRegs];  // one array for both layouts (see combine_pieces_group)
      V16 pp[kCombUnroll][Transit<T, C>::kIn];
      if (!wide) {
        load_rows<kCombGroup, UN>(raw, crow, n, out, row_bytes, pass, c1);
        load_peer_partial<T, C, UN>(pp, pp_src, pass, c1);
        self_sum_store<T, C, kCombGroup, UN>(raw, cw, n, slot_self >= 0, pp, pp_src != nullptr, rank == 0, y,
                                             pass, c1);
      } else {
        load_rows<kCombWide, kCombWideUnroll>(raw, crow, n, out, row_bytes, pass, c1);
        load_peer_partial<T, C, kCombWideUnroll>(pp, pp_src, pass, c1);
        self_sum_store<T, C, kCombWide, kCombWideUnroll>(raw, cw, n, slot_self >= 0, pp, pp_src != nullptr,
                                                         rank == 0, y, pass, c1);
      }
    }
  }
}

// moe_combine_reduce_self runs on the source after the mid barrier, in
// place of moe_combine_reduce, for a world of 2 with topk <= kCombWide
// when the send kernel left this rank's own items out (self_local): y[t]
// is the same sum in the same order, rounded the same way, but this
// rank's term is summed here from expert_out instead of being written
// into comb by the send kernel and read back. That takes this rank's own
// rows out of the send kernel, which then only reads what it pushes over
// NVLink, and saves writing and reading one partial row per token.
template <typename T, typename C>
__global__ void __launch_bounds__(kThreads, 1) moe_combine_reduce_self(const MoeCombineParams p) {
  static_assert(Transit<T, C>::kOk, "combine transit is float or T");
  if (!sync_wait(p.sync, p.rank, p.world)) return;
  if (p.world != 2 || p.topk > kCombWide || !p.self_local) {  // uniform; moe.py never launches it so
    if (blockIdx.x == 0 && threadIdx.x == 0) report_error(waiter_of(p.sync, p.rank), kErrBadParams, -1, -1, -1, 0, 0);
    return;
  }
  reduce_self_body<T, C>(p);
}
