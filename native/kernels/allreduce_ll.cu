// allreduce_ll.cu: low-latency (LL) all-reduce for small and medium
// messages. No barrier: every rank pushes its data straight into its peers'
// receive buffers as 16-byte lines {data0, flag, data1, flag} (8 data bytes,
// each 4-byte half stored together with the call's flag in one 16-byte
// store), and a receiver polls its own memory until the flags say "this
// call". The cost of a call is one one-way NVLink trip per exchange instead
// of a round trip per barrier plus remote reads; the price is twice the
// bytes on the wire, so these kernels serve messages up to a few MiB.
//
//   allreduce_oneshot_ll: send the whole input to every peer; each rank
//     reduces every rank's lines in rank order.
//   allreduce_twoshot_ll: send slice s of the input to rank s, which reduces
//     it and sends the result to every rank (reduce-scatter + all-gather).
//
// The LL call protocol (buffers, epochs, headers) is in ll.cuh: each half of
// a rank's LL buffer holds headers, then a slots (from rank s: its input, or
// its part of this rank's slice) and b slots (from rank s: its reduced slice).
//
// The output may be the input (in place): each output line is written by
// the thread that read that input line, after every read of it (two-shot:
// the result for a line only arrives after its input line was sent).
//
// The push kernels at the end (allreduce_oneshot_push, _twoshot_push) share
// the buffers and headers but send plain data and flag it per block.
#include "ll.cuh"

// p2pcomm:instantiate allreduce_oneshot_ll<float>
// p2pcomm:instantiate allreduce_oneshot_ll<double>
// p2pcomm:instantiate allreduce_oneshot_ll<half16>
// p2pcomm:instantiate allreduce_oneshot_ll<bf16>
// p2pcomm:instantiate allreduce_oneshot_ll<int>
// p2pcomm:instantiate allreduce_oneshot_ll<long long>
// p2pcomm:instantiate allreduce_twoshot_ll<float>
// p2pcomm:instantiate allreduce_twoshot_ll<double>
// p2pcomm:instantiate allreduce_twoshot_ll<half16>
// p2pcomm:instantiate allreduce_twoshot_ll<bf16>
// p2pcomm:instantiate allreduce_twoshot_ll<int>
// p2pcomm:instantiate allreduce_twoshot_ll<long long>

// ---------------------------------------------------------------- lines
// (ll_flag, ll_store, ll_try_load and ll_wait live in p2p_common.cuh.)

// gather_line fills v with every rank's line i: this rank's own value, the
// others polled from their slots (a or b region) of this rank's buffer.
// False when a wait failed.
DINLINE bool gather_line(const AllReduceParams& p, const LLHalf& h, const char* slots, i64 line, u64 own,
                         u64 (&v)[kMaxRanks]) {
#pragma unroll
  for (int s = 0; s < kMaxRanks; ++s) {
    if (s >= p.world) break;
    if (s == p.rank) {
      v[s] = own;
    } else if (!ll_wait(p, slots + (i64)s * h.slot + line * kLLLine, h.flag, s, kPhaseData, v[s])) {
      return false;
    }
  }
  return true;
}

template <typename T, typename O>
DINLINE void oneshot_ll_body(const AllReduceParams& p, const LLHalf& h, const O red) {
  const i64 nbytes = p.count * (i64)sizeof(T);
  const i64 lines = ll_lines(nbytes);
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
  const char* src = (const char*)p.local_src;
  const char* mine = ll_slot_a(p, h, p.rank, 0);
  const int divisor = p.op == kOpAvg ? p.world : 0;
  for (i64 i = first; i < lines; i += stride) {
    u64 v[kMaxRanks];
    if (!gather_line(p, h, mine, i, read_line<T>(src, i, nbytes), v)) return;
    write_line<T>((char*)p.out, i, nbytes, ll_combine<T>(v, p.world, divisor, red));
  }
}

template <typename T, typename O>
DINLINE void twoshot_ll_body(const AllReduceParams& p, const LLHalf& h, const O red) {
  constexpr int P = PackOf<T>::kElems;
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
  const char* src = (const char*)p.local_src;
  const int divisor = p.op == kOpAvg ? p.world : 0;
  // Reduce my slice (lines counted from its start) and send the result.
  const Range own = slice_range(p.count, p.world, p.rank, P);
  const i64 own_at = own.begin * (i64)sizeof(T), own_bytes = (own.end - own.begin) * (i64)sizeof(T);
  const char* from_a = ll_slot_a(p, h, p.rank, 0);
  for (i64 j = first; j < ll_lines(own_bytes); j += stride) {
    u64 v[kMaxRanks];
    if (!gather_line(p, h, from_a, j, read_line<T>(src + own_at, j, own_bytes), v)) return;
    const u64 r = ll_combine<T>(v, p.world, divisor, red);
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      if (d < p.world && d != p.rank) ll_store(ll_slot_b(p, h, d, p.rank) + j * kLLLine, r, h.flag);
    }
    write_line<T>((char*)p.out + own_at, j, own_bytes, r);
  }
  // Collect every other slice's result.
  const char* from_b = ll_slot_b(p, h, p.rank, 0);
  for (int s = 0; s < p.world; ++s) {
    if (s == p.rank) continue;
    const Range sl = slice_range(p.count, p.world, s, P);
    const i64 at = sl.begin * (i64)sizeof(T), bytes = (sl.end - sl.begin) * (i64)sizeof(T);
    for (i64 j = first; j < ll_lines(bytes); j += stride) {
      u64 r;
      if (!ll_wait(p, from_b + (i64)s * h.slot + j * kLLLine, h.flag, s, kPhaseData, r)) return;
      write_line<T>((char*)p.out + at, j, bytes, r);
    }
  }
}

// ---------------------------------------------------------------- kernels

template <typename T>
__global__ void __launch_bounds__(kThreads) allreduce_oneshot_ll(const AllReduceParams p) {
  __shared__ BlockState st;
  LLHalf h;
  const i64 nbytes = p.count * (i64)sizeof(T);
  if (!ll_begin(p, ll_lines(nbytes), st, h)) return;
  ll_announce(p, h, kRowsStart, false);
  // Send: this thread's lines of the input to every peer, slot [rank].
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = first; i < ll_lines(nbytes); i += stride) {
    const u64 v = read_line<T>((const char*)p.local_src, i, nbytes);
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      if (d < p.world && d != p.rank) ll_store(ll_slot_a(p, h, d, p.rank) + i * kLLLine, v, h.flag);
    }
  }
  if (ll_agree(p, h, st, kRowsStart)) {
    if (is_other_op(p.op)) {
      oneshot_ll_body<T>(p, h, OpOther{p.op});
    } else {
      oneshot_ll_body<T>(p, h, OpSum{});
    }
  }
  ll_end(p, st);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) allreduce_twoshot_ll(const AllReduceParams p) {
  constexpr int P = PackOf<T>::kElems;
  __shared__ BlockState st;
  LLHalf h;
  // Slice 0 is the largest: it bounds what one slot must hold.
  const Range s0 = slice_range(p.count, p.world > 0 ? p.world : 1, 0, P);
  if (!ll_begin(p, ll_lines((s0.end - s0.begin) * (i64)sizeof(T)), st, h)) return;
  ll_announce(p, h, kRowsStart, false);
  // Send: slice s of the input to rank s, slot [rank] of its a region.
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
  for (int s = 0; s < p.world; ++s) {
    if (s == p.rank) continue;
    const Range sl = slice_range(p.count, p.world, s, P);
    const i64 at = sl.begin * (i64)sizeof(T), bytes = (sl.end - sl.begin) * (i64)sizeof(T);
    char* dst = ll_slot_a(p, h, s, p.rank);
    for (i64 j = first; j < ll_lines(bytes); j += stride) {
      ll_store(dst + j * kLLLine, read_line<T>((const char*)p.local_src + at, j, bytes), h.flag);
    }
  }
  if (ll_agree(p, h, st, kRowsStart)) {
    if (is_other_op(p.op)) {
      twoshot_ll_body<T>(p, h, OpOther{p.op});
    } else {
      twoshot_ll_body<T>(p, h, OpSum{});
    }
  }
  ll_end(p, st);
}

// ---------------------------------------------------------------- push kernels
// The same buffers, epochs and headers, but the data moves as plain 16-byte
// packs (full payload per byte on the wire) and each block's header goes
// out with a release store, as the flag that its data has landed. One
// one-way trip per exchange, no barrier round trip, no staging copy: for
// messages too large for LL's doubled bytes and too small for the barrier
// algorithms to amortize their syncs. The header's release store, after
// the block's barrier, is what publishes the block's data: no full system
// fence before it.
// Block b moves the same block_range of each run on every rank.

// p2pcomm:instantiate allreduce_oneshot_push<float>
// p2pcomm:instantiate allreduce_oneshot_push<double>
// p2pcomm:instantiate allreduce_oneshot_push<half16>
// p2pcomm:instantiate allreduce_oneshot_push<bf16>
// p2pcomm:instantiate allreduce_oneshot_push<int>
// p2pcomm:instantiate allreduce_oneshot_push<long long>
// p2pcomm:instantiate allreduce_twoshot_push<float>
// p2pcomm:instantiate allreduce_twoshot_push<double>
// p2pcomm:instantiate allreduce_twoshot_push<half16>
// p2pcomm:instantiate allreduce_twoshot_push<bf16>
// p2pcomm:instantiate allreduce_twoshot_push<int>
// p2pcomm:instantiate allreduce_twoshot_push<long long>

// peers_slot_a / peers_slot_b: slot [rank] of every peer's a / b region,
// peers in the order rank + 1, rank + 2, ... (world - 1 entries).
DINLINE Ptrs peers_slot_a(const AllReduceParams& p, const LLHalf& h) {
  Ptrs t;
#pragma unroll
  for (int k = 0; k < kMaxRanks - 1; ++k)
    t.p[k] = k < p.world - 1 ? ll_slot_a(p, h, (p.rank + 1 + k) % p.world, p.rank) : nullptr;
  t.p[kMaxRanks - 1] = nullptr;
  return t;
}

// rank_sources: for each rank r in rank order, where its run of data is:
// this rank's own input (mine), or what r pushed into region slots (a or
// b) of this rank's buffer.
DINLINE Ptrs rank_sources(const AllReduceParams& p, const char* mine, const char* slots, i64 slot) {
  Ptrs t;
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r)
    t.p[r] = r >= p.world ? nullptr : r == p.rank ? (char*)mine : (char*)slots + (i64)r * slot;
  return t;
}

DINLINE i64 push_lines(i64 nbytes) { return (nbytes + kLLLine - 1) / kLLLine; }

template <typename T>
__global__ void __launch_bounds__(kThreads) allreduce_oneshot_push(const AllReduceParams p) {
  constexpr int P = PackOf<T>::kElems;
  __shared__ BlockState st;
  LLHalf h;
  if (!ll_begin(p, push_lines(p.count * (i64)sizeof(T)), st, h)) return;
  const Range mine = block_range(0, p.count, P);
  copy_range<T>((const char*)p.local_src, peers_slot_a(p, h), p.world - 1, mine);
  ll_announce(p, h, kRowsStart, true);
  if (ll_agree(p, h, st, kRowsStart)) {
    // Every rank adds in rank order 0..world-1, so all results are bit-identical.
    reduce_range<T>(rank_sources(p, (const char*)p.local_src, ll_slot_a(p, h, p.rank, 0), h.slot), p.world,
                    ptrs1(p.out), 1, mine, p.op, p.op == kOpAvg ? p.world : 0);
  }
  ll_end(p, st);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) allreduce_twoshot_push(const AllReduceParams p) {
  constexpr int P = PackOf<T>::kElems;
  __shared__ BlockState st;
  LLHalf h;
  const Range s0 = slice_range(p.count, p.world > 0 ? p.world : 1, 0, P);
  if (!ll_begin(p, push_lines((s0.end - s0.begin) * (i64)sizeof(T)), st, h)) return;
  const char* src = (const char*)p.local_src;
  // 1. Slice s of the input (this block's part) to rank s, slot [rank] of a.
  for (int s = 0; s < p.world; ++s) {
    if (s == p.rank) continue;
    const Range sl = slice_range(p.count, p.world, s, P);
    copy_range<T>(src + sl.begin * (i64)sizeof(T), ptrs1(ll_slot_a(p, h, s, p.rank)), 1,
                  block_range(0, sl.end - sl.begin, P));
  }
  ll_announce(p, h, kRowsStart, true);
  if (ll_agree(p, h, st, kRowsStart)) {
    // 2. Reduce this block's part of my slice, once, into my output and
    // every peer's b slot [rank]: all ranks end bit-identical.
    const Range own = slice_range(p.count, p.world, p.rank, P);
    const i64 own_at = own.begin * (i64)sizeof(T);
    Ptrs dst;
    dst.p[0] = (char*)p.out + own_at;
#pragma unroll
    for (int k = 1; k < kMaxRanks; ++k)
      dst.p[k] = k < p.world ? ll_slot_b(p, h, (p.rank + k) % p.world, p.rank) : nullptr;
    reduce_range<T>(rank_sources(p, src + own_at, ll_slot_a(p, h, p.rank, 0), h.slot), p.world, dst, p.world,
                    block_range(0, own.end - own.begin, P), p.op, p.op == kOpAvg ? p.world : 0);
    ll_announce(p, h, kRowsGather, true);
    // 3. Every other slice's result, from my b slots.
    if (ll_agree(p, h, st, kRowsGather)) {
      for (int s = 0; s < p.world; ++s) {
        if (s == p.rank) continue;
        const Range sl = slice_range(p.count, p.world, s, P);
        copy_range<T>(ll_slot_b(p, h, p.rank, s), ptrs1((char*)p.out + sl.begin * (i64)sizeof(T)), 1,
                      block_range(0, sl.end - sl.begin, P));
      }
    }
  }
  ll_end(p, st);
}
