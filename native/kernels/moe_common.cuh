// moe_common.cuh: what the mixture-of-experts kernels (moe_dispatch.cu,
// moe_combine.cu, moe_staged.cu) share: limits, the buffers, the parameter layouts that
// golib/moe fills, the in-kernel barriers and a few work-splitting helpers.
// Each layer uses only what is above it.
//
// A call (dispatch or combine) is a start barrier, the kernel that writes
// into peers, a middle barrier, and the kernel that reads what peers wrote.
// An eager call's start barrier is moe_post_status, which exchanges every
// rank's check of its arguments; every other barrier is steps inside the
// kernels (MoeSync: sync_enter, sync_go, sync_end, sync_wait). Each wait is
// bounded like every wait of the library and reported through the
// communicator's ErrorWord. Every grid is 1-D with kThreads threads per block
// and any number of blocks (golib/moe passes the ep's agreed block count);
// results never depend on the grid: every value is computed in a fixed order
// by exactly one thread.
//
// Buffers (W ranks, Tm = max_tokens, K = topk, E experts, L = E / W, H = hidden):
//   xs      [Tm, H] T         symmetric: this rank's token rows (golib/moe
//                             copies x there, or x is built there);
//                             destinations read (pull) the rows they need
//                             after the mid barrier
//   meta    [W, Tm, 3K+1] i32 symmetric: per [s, slot]: local expert of each k
//                             (-1: not on this rank) | weight bits of each k |
//                             source token | rank of pair k among source s's
//                             pairs of that expert, in (token, k) order
//   hdr     [W, L+1] i32      symmetric: per source s: tokens sent, then pairs
//                             sent per local expert
//   comb    [W, Tm+1, H] C    symmetric, on the source: [d, slot] = expert rank
//                             d's partial, pushed by d; C (the transit) is
//                             float or T
//   status  [2, W] i32        symmetric: per call parity, each rank's check of
//                             its arguments in an eager call (moe_post_status;
//                             status words: see status_code)
//   send_slot [Tm, W] i32     local: slot of token t on rank d, -1: not sent
//   pair_rank [Tm*K + G*(W+E)] i32  local scratch: pair ranks
//                             (moe_dispatch_send), then per block b of G:
//                             tokens per destination, pairs per expert of b's
//                             tokens (moe_dispatch_count)
//   comb_rows [W*Tm, K] i32   local: output row of pair (s, slot, k), -1: none
// The parameter structs' byte layouts are tabled next to each struct and
// pinned by static_asserts; golib/moe's layout test checks its Go mirrors
// against the tables and against these declarations.
#pragma once
#include "p2p_common.cuh"

// ---------------------------------------------------------------- limits

// kMoeMaxTopK bounds topk (one warp lane per k; golib/moe checks it).
constexpr int kMoeMaxTopK = 32;
static_assert(kMoeMaxTopK <= 32, "one warp lane per k");
constexpr int kMoeWarps = kThreads / 32;

// ---------------------------------------------------------------- in-kernel barriers: layouts
// Capturable calls need no barrier kernels: the kernel that writes into
// peers (moe_dispatch_send, moe_combine_send) runs the start barrier itself
// (kSyncStart; skipped after the other kind's middle barrier, see
// free_epoch) and each of its blocks, once done, posts its middle flag
// into every peer (kSyncArrive); the kernel that reads what peers wrote
// (expand, reduce) first waits for every peer's flags (kSyncWait). A
// barrier kernel costs a launch, a fence and a round trip; here the start
// barrier is at most one round trip by block 0 and the middle one mostly
// overlaps the kernel boundary. Eager calls have moe_post_status for a
// start barrier (it carries the argument checks) and use kSyncArrive /
// kSyncWait for the middle one: in the eager dispatch, the send kernel's
// last block waits, and hands the host the counts it sizes the result by.
constexpr int kSyncStart = 1;        // send kernels: barrier with every peer before writing into them
constexpr int kSyncArrive = 2;       // send kernels: every block posts its middle flags when done
constexpr int kSyncWait = 4;         // expand, reduce: wait for every peer's middle flag first
constexpr int kSyncStageGo = 16;     // dispatch send: block 0 also posts stage_posted once past the
                                     // start barrier (moe_stage_gate releases x's copy on a side stream)
constexpr int kSyncStaged = 32;      // expand: also wait for every peer's staged flag, which each rank
                                     // posts once per capturable dispatch: moe_stage_done after x's copy
                                     // on the side stream, else the send kernel (kSyncPostStaged)
constexpr int kSyncPostStaged = 64;  // dispatch send (x needs no copy): block 0 posts the staged flags at once
constexpr int kSyncGridShift = 8;    // mode >> kSyncGridShift: the send kernel's grid (its blocks' middle flags)
constexpr int kMoeKinds = 2;         // 0: dispatch, 1: combine (also ErrorWord.step)
constexpr int kMoeDispatch = 0;
constexpr int kMoeSyncBlocks = 256;  // most blocks of a send kernel (golib/moe caps num_sms)
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
static_assert(sizeof(MoeSyncState) == 2112, "MoeSyncState size (golib/moe allocates kMoeKinds of them)");

// ---------------------------------------------------------------- parameter layouts

// MoeSync is the in-kernel barriers' part of the send, expand and reduce
// kernels' parameters (see above).
//
//   offset size field
//   0      64   peer_flags[8]   each rank's flags (kMoeFlagWords u64)
//   64     8    state           this rank's MoeSyncState[kMoeKinds]
//   72     8    signal          this rank's communicator Signal (Waiter)
//   80     8    err             the communicator's ErrorWord (Waiter)
//   88     8    timeout_ns      u64; 0 = kDefaultTimeoutNs
//   96     4    mode            kSync* bits; 0: none (an eager expand: the
//                               send kernel's last block and the host sync
//                               order it)
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
//   152    8    pair_rank       [Tm*K + G*(W+E)] i32, local scratch
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
//   200    8    status          [W] i32: each rank's status word of this
//                               eager call (see status_code), posted by the
//                               start barrier; nullptr in capturable mode
//   208    104  sync            MoeSync (moe_dispatch_send)
//   312    8    stage_src       eager: x [T, H] T, 16-byte aligned, which the
//                               send kernel copies into stage_dst; nullptr:
//                               x is staged already (or by a copy)
//   320    8    stage_dst       this rank's xs
//   328    8    counts_host     eager: [W + W * (L+1)] i32 pinned host memory,
//                               where the send kernel's last block puts every
//                               rank's code, then hdr, once every peer's send
//                               blocks are done; nullptr: capturable
//   total  336, aligned to 8
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
  const void* stage_src;
  void* stage_dst;
  int* counts_host;
};
static_assert(sizeof(MoeDispatchParams) == 336, "MoeDispatchParams size");
// NVRTC has no offsetof: the field sizes add up to the size (no padding),
// which pins every offset in the table.
static_assert(sizeof(MoeDispatchParams::peer_meta) + sizeof(MoeDispatchParams::peer_hdr) == 128 &&
                  8 * sizeof(void*) + 10 * sizeof(int) + sizeof(MoeSync) == 336 - 128,
              "MoeDispatchParams fields");

// MoeExpandParams is the argument of moe_dispatch_expand.
//
//   offset size field
//   0      64   peer_xs[8]     each rank's xs: the sources' staged rows
//   64     8    meta           this rank's meta
//   72     8    hdr            this rank's hdr
//   80     8    out_x          [row_cap, H] T (float8 when scale_bytes > 0):
//                              expert-major rows
//   88     8    out_info       [4, row_cap] i32: local expert | source rank |
//                              source token | weight bits
//   96     8    expert_counts  [L + 1] i32: rows per local expert, then R
//   104    8    comb_rows      [W * Tm, K] i32, local output
//   112    8    row_cap        i64: rows of out_x (R eager, W*Tm*K capturable)
//   120    4    max_tokens     Tm
//   124    4    row_bytes      bytes of a row: H * sizeof(T), or H (fp8)
//   128    4    topk           K
//   132    4    num_local      L
//   136    4    world          W
//   140    4    rank
//   144    104  sync           MoeSync
//   248    8    out_scales     [row_cap, H/128] f32: the rows' scales (fp8)
//   256    8    xs_scales      i64: where in each xs the staged rows' scales
//                              start (fp8: Tm * H)
//   264    4    scale_bytes    bytes of a row's scales: H/128 * 4 (fp8), or 0
//   268    4    pad            unused, to a multiple of 8
//   total  272, aligned to 8
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
  int row_bytes;
  int topk;
  int num_local;
  int world;
  int rank;
  MoeSync sync;
  float* out_scales;
  i64 xs_scales;
  int scale_bytes;
  int pad;
};
static_assert(sizeof(MoeExpandParams) == 272, "MoeExpandParams size");
static_assert(sizeof(MoeExpandParams::peer_xs) + 7 * sizeof(void*) + 2 * sizeof(i64) + 8 * sizeof(int) +
                      sizeof(MoeSync) == 272,
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
//   100    4    tag             this eager call's tag, in [1, kStatusTagMax]
//   104    8    signal          this rank's communicator Signal (Waiter)
//   112    8    err             the communicator's ErrorWord (Waiter)
//   120    8    timeout_ns      u64; 0 = kDefaultTimeoutNs
//   128    8    host_status     [W] i32 pinned host memory: every rank's code,
//                               once all are in; nullptr: not copied
//   136    4    kind            0 dispatch, 1 combine (names the call in errors)
//   140    4    pad
//   total  144, aligned to 8
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
  int tag;
  Signal* signal;
  ErrorWord* err;
  u64 timeout_ns;
  int* host_status;
  int kind;
  int pad;
};
static_assert(sizeof(MoePostParams) == 144, "MoePostParams size");
static_assert(sizeof(MoePostParams::peer_status) + 4 * sizeof(void*) + sizeof(u64) + 10 * sizeof(int) == 144,
              "MoePostParams fields");

// MoeStagedParams: moe_staged_expand and moe_staged_partials (moe_staged.cu),
// an ep of GPU tensors whose ranks span nodes.
//   offset size field
//   0      8    src        expand: the received rows, packed; partials: expert_out [R, H] of T
//   8      8    dst        expand: out_x [R, H] of T; partials: [items, H] of C
//   16     8    index      expand: [R] i32, the packed row of each output row;
//                          partials: [items, K] i32, expert_out row of each pair (-1: none)
//   24     8    weights    partials: [items, K] f32, each pair's weight
//   32     8    items      expand: R; partials: items (with items_at: the most there can be)
//   40     4    row_packs  16-byte packs of one row of T
//   44     4    topk       K
//   48     8    items_at   null, or the item count, in mapped host memory (calls in stream order)
//   total  56
struct MoeStagedParams {
  const char* src;
  char* dst;
  const int* index;  // expand: nullptr copies rows as they are
  const float* weights;
  i64 items;
  int row_packs;
  int topk;
  // Written by the host function ordered before the launch: calls in
  // stream order (and their replays in a CUDA graph) learn their count
  // when they run.
  const i64* items_at;
};
static_assert(sizeof(MoeStagedParams) == 56, "MoeStagedParams size");

// ---------------------------------------------------------------- helpers

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


DINLINE u32 lanemask_lt() {
  u32 m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// Status words (moe_post_status): a rank's check of its arguments in an
// eager call, code | tag << kStatusTagShift. The tag tells this call's word
// from the one two calls before in the same row; the code is 0 (passed) or
// a status code below 1 << kStatusTagShift.
constexpr int kStatusTagShift = 8;
constexpr int kStatusTagMax = (1 << (32 - kStatusTagShift)) - 1;
DINLINE int status_code(int word) { return word & ((1 << kStatusTagShift) - 1); }
DINLINE int status_tag(int word) { return (int)((unsigned)word >> kStatusTagShift); }

// any_rejected: whether a rank rejected its arguments in this eager call
// (status: every rank's check, in this rank's row once moe_post_status has
// returned; nullptr in capturable mode, which checks on the host only). The
// kernels that write into peers then write nothing, so a rejected call moves
// no data and the latest dispatch result stays valid; golib/moe reports the
// checks to every rank after its one host sync. moe_post_status ran before
// this kernel and saw every word, and a kernel boundary leaves no stale L1
// line.
DINLINE bool any_rejected(const int* status, int world) {
  if (status == nullptr) return false;
  bool bad = false;
  for (int q = 0; q < world; ++q) bad |= status_code(status[q]) != 0;
  return bad;
}

// start_missed: whether this rank's start barrier (moe_post_status) gave up
// before every rank's word of this call was in its row (recorded in the
// ErrorWord, naming the peer). The send kernels then write nothing into
// peers and post no middle flag: a peer that arrives late must time out at
// the middle barrier naming this rank, not pass it on flags over metadata
// this rank never wrote. This call's tag is this rank's own word's, stored
// before moe_post_status waited. A late word may land while the block
// reads the row, so the answer is agreed by the block (every thread
// calls); blocks may still differ, which changes nothing for the late
// peer: it waits for every block's middle flag. Capturable calls (no
// status row) skip it without a block barrier.
DINLINE bool start_missed(const int* status, int rank, int world) {
  if (status == nullptr) return false;  // uniform: a kernel parameter
  bool missed = false;
  if ((int)threadIdx.x < world) {
    missed = status_tag(*(const volatile int*)(status + threadIdx.x)) !=
             status_tag(*(const volatile int*)(status + rank));
  }
  return __syncthreads_or(missed) != 0;
}

// ld_v16_stable loads 16 bytes that nothing writes while the kernel runs:
// the caller's inputs, or rows that peers (or this rank's earlier kernel)
// wrote before the barrier that precedes these loads. It is ld.global.cg
// (L2 only), not the read-only path: an in-kernel sync_wait orders the
// coherent loads, not necessarily the read-only ones.
DINLINE V16 ld_v16_stable(const void* p) { return ld_v16(p); }

// row_parts is how many pieces to cut each of n rows into so that the
// nwarps warps get about kRowSpread pieces each when rows are few (one
// warp per row left some warps two whole rows, or one row of twice the
// pairs, while others idled: the small-batch case), with no piece shorter
// than one warp pass of pass_packs packs. 1 when n >= kRowSpread * nwarps:
// the large case keeps one warp per row.
constexpr int kRowSpread = 4;
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

// take_unit: the next work unit for the calling warp, from the call's
// shared counter (MoeSyncState.work, reduce_work). Warps take units as they
// finish the previous one, whatever each costs (rows with more local
// experts take more stores, rows from this rank no NVLink reads), instead
// of unit u going to warp u mod the grid's warps.
DINLINE i64 take_unit(u32* work) {
  u32 u = 0;
  if ((threadIdx.x & 31) == 0) u = atomicAdd(work, 1u);
  return (i64)__shfl_sync(~0u, u, 0);
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
// ranks its tokens in between; the combine's has no local work to put there.

// Start flags are stored and polled relaxed: they order no data (a peer
// posts once its earlier kernels, the readers, have finished), and a
// relaxed round trip between two GPUs is shorter than a release/acquire one.
DINLINE void st_start_flag(u64* p, u64 v) { st_flag_relaxed(p, v); }
DINLINE u64 ld_start_flag(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
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
  if (gridDim.x > kMoeSyncBlocks) {  // uniform; golib/moe caps num_sms below this
    if (blockIdx.x == 0 && t == 0) report_error(waiter_of(s, rank), kErrBadParams, -1, -1, -1, 0, 0);
    return false;
  }
  if (t == 0) {
    sb.epoch = st->counter[blockIdx.x] + 1;  // only this block touches counter[b]
    st->counter[blockIdx.x] = sb.epoch;
    sb.ok = 1;
    // Written by an earlier kernel (stream order), the same for every block.
    sb.skip = (s.mode & kSyncStart) && st->free_epoch == sb.epoch;
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
    // the middle flags it would cost the expand a release more).
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
// them. No block waits for another (a last block counting the others and
// fencing would sit on the path of every call). Epochs come from each
// block's own counter: they agree because a send kernel's grid never
// changes (golib/moe launches it on the ep's fixed block count, which the
// waiters read from the mode).
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
// (moe_stage_done). False, uniformly in the block, when a wait gave up: the
// block must then read nothing. sync_wait_as takes the mode and the epoch
// apart from s, for a send kernel's own block (the eager dispatch's last):
// there block 0's counter may not have moved yet, the block's own has.
DINLINE bool sync_wait_as(const MoeSync& s, int mode, u64 e, int rank, int world) {
  if (!(mode & kSyncWait)) return true;
  __shared__ int ok;
  const int G = mode >> kSyncGridShift;  // the send kernel's blocks
  const int t = (int)threadIdx.x;
  if (t == 0) ok = 1;
  __syncthreads();
  for (int i = t; i < world * G; i += (int)blockDim.x) {
    const int d = i / G;
    if (d != rank &&
        !wait_flag(waiter_of(s, rank), moe_mid_flag(s.peer_flags[rank], s.kind, d, i % G), e, d, kPhaseMoeMid,
                   s.kind)) {
      ok = 0;
    }
  }
  if ((mode & kSyncStaged) && t < world && t != rank &&
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
DINLINE bool sync_wait(const MoeSync& s, int rank, int world) {
  return sync_wait_as(s, s.mode, s.state[s.kind].counter[0], rank, world);
}
