// moe_dispatch.cu: mixture-of-experts dispatch, launched by golib/moe: each
// source ranks its tokens and writes their metadata into the destinations
// (moe_dispatch_count, moe_dispatch_send), and each destination pulls the
// rows it needs from the sources' staged copies into expert-major order
// (moe_dispatch_expand). Also the one-thread helpers that release and flag
// the copy of x into the staging buffer on a side stream (moe_stage_gate,
// moe_stage_done) and the eager calls' argument check (moe_post_status,
// which combine uses too). Buffers, layouts and barriers: moe_common.cuh.
//
// p2pcomm:no-spills (the kernels keep many loads in flight in registers, and a
// spill would quietly cost bandwidth; native/kernels' compile test holds it).
#include "moe_common.cuh"

// kMoeUnroll: 16-byte packs per lane loaded before the first store in the
// row copies. Each pass waits one read latency, so 8 packs (4 KiB per
// warp, 64 KiB per SM in flight) take half the passes of 4.
constexpr int kMoeUnroll = 8;

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

// ---------------------------------------------------------------- routing helpers

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
// kernel's metadata step, which would divide once per field and destination,
// is bound by issuing instructions. The float quotient is within
// one of the true one, and the two compares correct it (checked for every
// g < E <= 4096 and L <= 4096, golib/moe's bound on E).
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


// ---------------------------------------------------------------- staging x on a side stream

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

// Status words are stored with release and polled with acquire at system
// scope: a peer that sees this rank's word for a call sees it after every
// kernel this rank ran before (stream order), as a barrier's flag would.
DINLINE void st_status(int* p, int v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
DINLINE int ld_status(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// moe_post_status is an eager call's start barrier, on one block: this
// rank's check (the host's code; else id_code if an expert id is outside
// [-1, E), else 0), tagged with the call, into slot [rank] of every rank's
// status row; then thread q waits for rank q's word of this call in this
// rank's row. Once every word is in, every peer has finished what it ran
// before (stream order), and the send kernels (any_rejected) and the host
// read the checks. The words are the barrier's flags: one launch carries
// the checks and the barrier, and no copy per peer, since eager calls of
// small batches are bound by host time. With host_status the codes also go
// to the host, which needs nothing else from this call before its sync.
__global__ void __launch_bounds__(kThreads, 1) moe_post_status(const MoePostParams p) {
  int bad = 0;
  if (p.code == 0 && p.topk_idx != nullptr) {
    for (int i = (int)threadIdx.x; i < p.num_ids; i += (int)blockDim.x) {
      const long long id = p.idx_bytes == 8 ? ((const long long*)p.topk_idx)[i] : ((const int*)p.topk_idx)[i];
      bad |= id < -1 || id >= p.num_experts;
    }
  }
  bad = __syncthreads_or(bad);
  Waiter w;
  w.self = p.signal;
  w.err = p.err;
  w.timeout_ns = p.timeout_ns;
  w.rank = p.rank;
  const int t = (int)threadIdx.x;
  if (p.world > kMaxRanks || p.rank < 0 || p.rank >= p.world || p.tag < 1 || p.tag > kStatusTagMax) {
    if (t == 0) report_error(w, kErrBadParams, -1, -1, -1, 0, 0);
    return;
  }
  if (t >= p.world) return;
  const int code = p.code != 0 ? p.code : (bad ? p.id_code : 0);
  int* const row = (int*)pick((void* const*)p.peer_status, t);  // no copy of the table to the stack
  st_status(row + p.rank, code | p.tag << kStatusTagShift);
  const int* const mine = (const int*)pick((void* const*)p.peer_status, p.rank) + t;
  int word = 0;
  u64 seen = 0;
  const bool in = spin_until(
      w, [&] { return (seen = (u64)status_tag(word = ld_status(mine))) == (u64)p.tag; }, seen, t, kPhaseMoeStart,
      p.kind, (u64)p.tag);
  if (in && p.host_status != nullptr) p.host_status[t] = status_code(word);
}

// ---------------------------------------------------------------- dispatch

// block_tokens is this block's tokens [t0, t1): p2p_common's block_range
// of [0, T), the same partition in the count and send kernels.
DINLINE void block_tokens(int ntok, int& t0, int& t1) {
  const Range r = block_range(0, ntok, 1);
  t0 = (int)r.begin;
  t1 = (int)r.end;
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
// of this source. Rows do not move here: golib/moe has staged them in xs,
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

  // Steps 1-3 wrote only this rank's memory; what follows writes into peers.
  if (!sync_go(p.sync, p.rank, W, sb)) return false;

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
  // its own pointer, would issue 8 times the stores' address arithmetic.
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

// stage_rows copies this block's tokens' rows of x into xs (eager calls: a
// copy of its own would cost the host a call and run on a copy engine,
// slower than the SMs). Before sync_end, whose release covers the block's
// stores.
template <typename T>
DINLINE void stage_rows(const MoeDispatchParams& p) {
  int t0, t1;
  block_tokens(p.num_tokens, t0, t1);
  const i64 packs = (i64)p.hidden * (i64)sizeof(T) / 16;  // a row is whole packs (golib/moe checks)
  const V16* src = (const V16*)p.stage_src + (i64)t0 * packs;
  V16* dst = (V16*)p.stage_dst + (i64)t0 * packs;
  const i64 n = (i64)(t1 - t0) * packs, step = blockDim.x;
  i64 i = threadIdx.x;
  for (; i + 3 * step < n; i += 4 * step) {  // four loads in flight
    const V16 a = ld_v16_stable(src + i), b = ld_v16_stable(src + i + step);
    const V16 c = ld_v16_stable(src + i + 2 * step), d = ld_v16_stable(src + i + 3 * step);
    st_v16(dst + i, a);
    st_v16(dst + i + step, b);
    st_v16(dst + i + 2 * step, c);
    st_v16(dst + i + 3 * step, d);
  }
  for (; i < n; i += step) st_v16(dst + i, ld_v16_stable(src + i));
}

// read_counts, in the last block of an eager dispatch's send kernel (the
// one that wrote this rank's own hdr row), is the middle barrier for the
// host: it waits for every block of every peer's send kernel (sync_wait)
// and puts every rank's code and hdr into pinned host memory, where the
// host sizes the result after its one sync.
DINLINE void read_counts(const MoeDispatchParams& p, const MoeBegin& sb) {
  if (!sync_wait_as(p.sync, kSyncWait | (int)(gridDim.x << kSyncGridShift), sb.epoch, p.rank, p.world)) return;
  const int W = p.world, n = W * (p.num_experts / W + 1);
  const int* hdr = (const int*)pick(p.peer_hdr, p.rank);
  for (int i = (int)threadIdx.x; i < W + n; i += (int)blockDim.x) {
    p.counts_host[i] = i < W ? status_code(p.status[i]) : *(const volatile int*)(hdr + i - W);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) moe_dispatch_send(const MoeDispatchParams p) {
  __shared__ MoeBegin sb;
  if (!sync_enter(p.sync, p.rank, p.world, sb) || start_missed(p.status, p.rank, p.world)) return;
  bool ok;
  if (any_rejected(p.status, p.world)) {  // uniform
    ok = sync_go(p.sync, p.rank, p.world, sb);
  } else {
    if (p.stage_src != nullptr) stage_rows<T>(p);
    ok = dispatch_send_body<T>(p, sb);
  }
  if (!ok) return;
  sync_end(p.sync, p.rank, p.world);
  if (p.counts_host != nullptr && blockIdx.x == gridDim.x - 1) read_counts(p, sb);
}

// take_unit: the next work unit for the calling warp, from the call's

// moe_dispatch_expand runs on the destination after the mid barrier
// (sync_wait here, or in an eager call the send kernel's read_counts
// before the host's sync). Every
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
  const int tid = (int)threadIdx.x, lane = tid & 31, nw = (int)blockDim.x >> 5;
  const int L = p.num_local, W = p.world, K = p.topk, Tm = p.max_tokens;
  int* tot = sh;
  int* base = sh + L;
  if (!sync_wait(p.sync, p.rank, W)) return;
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

  const int MW = 3 * K + 1;
  // A row is row_bytes of data, then (fp8) scale_bytes of scales, which sit
  // apart in xs and in the outputs: pack j of the row is at j * 16 from the
  // data's start when j < data_packs, else from the scales' start moved back
  // by data_packs packs.
  const i64 row_bytes = p.row_bytes, scale_bytes = p.scale_bytes;
  const i64 data_packs = row_bytes / kPackBytes;
  const i64 packs = data_packs + scale_bytes / kPackBytes;
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
  i64 next = take_unit(work);
  for (i64 unit = next; unit < orders * parts; unit = next) {
    // The following unit's atomic goes out now, under this unit's copy.
    next = take_unit(work);
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
    const char* xs = (const char*)pick(p.peer_xs, s);
    const char* src = xs + (i64)m[2 * K] * row_bytes;
    const char* src_sc = xs + p.xs_scales + (i64)m[2 * K] * scale_bytes - data_packs * kPackBytes;
    const i64 c0 = piece_begin(packs, part, parts), c1 = piece_begin(packs, part + 1, parts);
    // Passes are warp-uniform (not per lane): every lane must reach the shuffle.
    for (i64 pass = c0; pass < c1; pass += 32 * kMoeUnroll) {
      const i64 i = pass + lane;
      V16 v[kMoeUnroll];  // every load of the pass in flight before the first store
#pragma unroll
      for (int u = 0; u < kMoeUnroll; ++u) {
        const i64 j = i + u * 32;
        if (j < c1) v[u] = ld_v16_stable((j < data_packs ? src : src_sc) + j * kPackBytes);
      }
      // One copy per valid k, its row taken from the lane that computed it
      // (a register shuffle instead of a shared-memory list per item).
      for (u32 rest = bal; rest != 0; rest &= rest - 1) {
        const i64 r = __shfl_sync(~0u, row, __ffs(rest) - 1);
        char* o = out + r * row_bytes;
        char* o_sc = (char*)p.out_scales + r * scale_bytes - data_packs * kPackBytes;
#pragma unroll
        for (int u = 0; u < kMoeUnroll; ++u) {
          const i64 j = i + u * 32;
          if (j < c1) st_v16((j < data_packs ? o : o_sc) + j * kPackBytes, v[u]);
        }
      }
    }
  }
}
