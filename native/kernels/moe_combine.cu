// moe_combine.cu: mixture-of-experts combine, launched by golib/moe: each
// expert rank sums, per received token, its experts' outputs weighted in
// float32 (k ascending) and pushes that partial into the token's source
// (moe_combine_send); each source sums the partials of the ranks its token
// went to (d ascending) and rounds once (moe_combine_reduce, or
// moe_combine_reduce_self for a world of 2 that sums its own rows itself).
// Buffers, layouts and barriers: moe_common.cuh.
//
// p2pcomm:no-spills (the kernels keep many loads in flight in registers, and a
// spill would quietly cost bandwidth; native/kernels' compile test holds it).
#include "moe_common.cuh"

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

// ---------------------------------------------------------------- geometry

// kCombGroup: expert_out rows whose loads are in flight together in the
// combine send; items with more valid k's than that take a wider layout.
constexpr int kCombGroup = 4;
// kCombUnroll: packs of T per lane per pass of the combine send.
constexpr int kCombUnroll = 4;
// The combine reduce keeps kReduceLoads 16-byte partial loads in flight per
// lane: kReduceRanks ranks at a time, times the passes' packs.
constexpr int kReduceLoads = 16;
constexpr int kReduceRanks = 4;
// moe_combine_reduce<T, C, G> with G > 0 (G == world size) reduces all G
// ranks' partials in one group with kReduceOneLoads loads in flight per
// lane (kReduceFourLoads at G = 4), each pass summed and stored as soon as
// its loads are in: a group of 4 ranks at G = 2 keeps only 8 loads in
// flight, and the reduce waits on their latency. 24 loads fit the registers
// without spills only at G = 4 (4 x 6 packs); at G = 2 and 3 they spill.
constexpr int kReduceOneLoads = 16;
constexpr int kReduceFourLoads = 24;
__device__ constexpr int one_group_loads(int G) { return G == 4 ? kReduceFourLoads : kReduceOneLoads; }
static_assert(kCombGroup >= 1 && kCombGroup <= 32 && kCombUnroll >= 1 && kReduceLoads >= 8, "combine geometry");
// kCombWide: items with more than kCombGroup valid pairs and at most twice
// that load kCombWide rows at kCombWideUnroll packs per lane per pass.
constexpr int kCombWide = 2 * kCombGroup <= 32 ? 2 * kCombGroup : 32;
constexpr int kCombWideUnroll = kCombUnroll / 2 >= 1 ? kCombUnroll / 2 : 1;

// Transit<T, C> checks the combine transit type: float (exact partials) or
// T (each partial rounded once; half the bytes).
template <typename T, typename C> struct Transit {
  static constexpr bool kOk = sizeof(C) == sizeof(T) || sizeof(C) == sizeof(float);
  static constexpr int kIn = PackOf<T>::kElems / PackOf<C>::kElems;  // C packs per T pack
};

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
// kCombWideUnroll: a one-pack loop would take 4x the passes, and for small
// batches the few such items set the kernel's time). More loads in flight
// for items of few pairs is not what this kernel lacks (docs/BENCHMARKS.md,
// tried and not kept).
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
  // check per use are issue slots). Float partials keep the shuffle per use: hoisted, their
  // registers crowd out the loads in flight.
  constexpr bool hoist = sizeof(C) == sizeof(T) && sizeof(T) == 2;
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
// holds (topk > 2 * kCombGroup only), one pack per lane per pass and
// kCombGroup rows at a time,
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
// comb[this rank, slot] (a push: leaving the partials here for the source
// to read would make its reduce wait on NVLink reads); with self_local,
// only the items of the other sources. One warp per item (or per piece
// of it, when the grid has more warps than items). Items go slot-major with
// sources rotated by rank (see slot_major): in source-major order every
// expert rank wrote into the same source at once, and that one rank's
// NVLink ingress bounded the whole exchange. Each warp takes the next unit
// from work (this call's counter) as it finishes one.
template <typename T, typename C>
DINLINE void combine_send_body(const MoeCombineParams& p, u32* work) {
  static_assert(Transit<T, C>::kOk, "combine transit is float or T");
  constexpr int P = PackOf<T>::kElems;
  const int tid = (int)threadIdx.x, lane = tid & 31, nw = (int)blockDim.x >> 5;
  const int L = p.num_local, W = p.world, K = p.topk, Tm = p.max_tokens, H = p.hidden;
  const int MW = 3 * K + 1;
  const i64 row_bytes = (i64)H * (i64)sizeof(T);
  const i64 ppr = H / P;  // packs per row
  const char* out = (const char*)p.expert_out;
  const int gwarps = (int)gridDim.x * nw;
  // Units in 32 bits (a 64-bit division per item cost spilled registers):
  // orders = W * Tm < 2^31 / K (golib/moe checks), and parts is capped so that
  // no unit index passes 2^31.
  // With self_local this rank's own items are moe_combine_reduce_self's.
  const int srcs = p.self_local ? W - 1 : W;
  const int orders = srcs * Tm;  // not most_sent's bound: sm_80 would spill registers
  const i64 items = received_tokens(p.hdr, W, L) - (p.self_local ? p.hdr[p.rank * (L + 1)] : 0);
  int parts = row_parts(items, gwarps, ppr, 32 * kCombUnroll);
  if ((i64)orders * parts > (i64)(0x7fffffff - gwarps)) parts = max(1, (0x7fffffff - gwarps) / orders);
  int next = (int)take_unit(work);
  for (int unit = next; unit < orders * parts; unit = next) {
    next = (int)take_unit(work);  // the atomic under this unit
    const int order = unit / parts;
    const int part = unit % parts;
    int s, slot;
    slot_major(order, W, p.rank, s, slot, srcs);
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
    C* dst = (C*)pick(p.peer_comb, s) + ((i64)p.rank * (Tm + 1) + slot) * (i64)H;
    const i64 c0 = piece_begin(ppr, part, parts), c1 = piece_begin(ppr, part + 1, parts);
    // Up to kCombGroup pairs (most items) or twice that (for small batches
    // the few such items would set the kernel's time in the one-pack loop:
    // 4x the passes): kCombGroup * kCombUnroll loads in flight per lane.
    if (__popc(it.valid) <= kCombWide) {
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
  // under its round trip, but doing them first takes the NVLink pushes'
  // overlap with local work away.
  if (!sync_enter(p.sync, p.rank, p.world, sb) || start_missed(p.status, p.rank, p.world) ||
      !sync_go(p.sync, p.rank, p.world, sb)) {
    return;
  }
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
  const C* comb = (const C*)pick(p.peer_comb, p.rank);
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
        const C* part = comb + ((i64)(d0 + r) * (Tm + 1) + slot[r]) * (i64)H;
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

// moe_combine_reduce runs on the source after the mid barrier (sync_wait
// here): y[t] = sum over ranks d ascending (those token
// t went to) of d's partial for the slot of t on d (C widened to float32;
// from this rank's comb[d, slot]), in float32 from +0, rounded once to T;
// zeros for a token sent nowhere. G = 0: ranks in groups of kReduceRanks,
// kReduceLoads loads in flight per lane; G > 0 (the world size): one group,
// one_group_loads(G).
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
  constexpr bool hoist = sizeof(C) == sizeof(T) && sizeof(T) == 2;
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
  const C* const peer_base = (const C*)pick(p.peer_comb, rank) + (i64)peer * (Tm + 1) * H;
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
  if (p.world != 2 || p.topk > kCombWide || !p.self_local) {  // uniform; golib/moe never launches it so
    if (blockIdx.x == 0 && threadIdx.x == 0) report_error(waiter_of(p.sync, p.rank), kErrBadParams, -1, -1, -1, 0, 0);
    return;
  }
  reduce_self_body<T, C>(p);
}
