// allreduce_lamport.cu: one-shot all-reduce on plain data, for floating-point
// sums of medium size (TensorRT-LLM's "Lamport" one-shot). Every rank pushes
// its whole input into every peer's Lamport buffer and reduces every rank's
// copy in rank order, like allreduce_oneshot_ll, but with no flag at all: a
// free buffer holds a sentinel in every 32-bit word, and a word has arrived
// once it holds anything else. The payload crosses the link once, at full
// size (LL sends twice its bytes, LL128 1.07 times), and a reader needs no
// vote and no second read.
//
// The sentinel is 0x80000000: -0.0f, or a pair of 16-bit floats (+0, -0).
// Senders (and each rank for its own input, so that every rank reduces the
// same values) turn a data word equal to it into 0, which changes the sign of
// a zero and nothing else. So only sums and averages of float, half and
// bfloat16 run here; integers (0x80000000 is INT_MIN) and other ops do not.
//
// Buffers (peer_scratch[r]: rank r's): two halves of kLamportHalf bytes, one
// per call parity as in ll.cuh; a half holds world areas of
// lamport_area_bytes, area s for rank s's input. The call protocol, headers
// and epoch are LL's (ll.cuh, peer_in = the LL buffers), so a mismatched
// call is still seen as such. What keeps the areas free:
//   - a reader stores the sentinel back over every word it read, in the same
//     call. The sender next writes into that half two LL calls later, after
//     its call in between waited for this rank's header of that call, which
//     this rank sent after this call had ended.
//   - a call that ends in a mismatch reads nothing: every sender stores the
//     sentinel back over what it sent, after it (the same thread, the same
//     addresses), before its call ends, so again before the peer's next call
//     on that half can read.
//
// allreduce_twoshot_lamport: a reduce-scatter then an all-gather on the same
// buffers, for larger calls. The input splits into world slices of whole
// vectors; rank s sends slice j of its input to rank j, in the first half of
// area [s]; rank j reduces its slice as it arrives and sends the result to
// every peer, in the second half of area [j]. Each rank polls and reduces
// one slice instead of the whole input, and sends 2 (world - 1) slices
// instead of world - 1 inputs, at the cost of a second trip. Both stages
// free as above: a reader frees what it read; on a mismatch nothing was
// reduced, and each sender frees the slices it sent.
//
// Both kernels are bound to one block per SM (a grid is at most kMaxBlocks):
// registers for every peer's vector, which the default bound would spill.
#include "lamport.cuh"

// p2pcomm:instantiate allreduce_oneshot_lamport<float>
// p2pcomm:instantiate allreduce_oneshot_lamport<half16>
// p2pcomm:instantiate allreduce_oneshot_lamport<bf16>
// p2pcomm:instantiate allreduce_twoshot_lamport<float>
// p2pcomm:instantiate allreduce_twoshot_lamport<half16>
// p2pcomm:instantiate allreduce_twoshot_lamport<bf16>

// lamport_store_out writes vector v of the result, only the bytes below
// nbytes.
template <typename T>
DINLINE void lamport_store_out(const AllReduceParams& p, i64 nbytes, i64 v, u64 a, u64 b) {
  if ((v + 1) * kPackBytes <= nbytes) {
    st_v16((char*)p.out + v * kPackBytes, V16{(u32)a, (u32)(a >> 32), (u32)b, (u32)(b >> 32)});
  } else {
    write_line<T>((char*)p.out, 2 * v, nbytes, a);
    write_line<T>((char*)p.out, 2 * v + 1, nbytes, b);
  }
}

// lamport_reduce_at reduces vector off of every rank, in rank order, for
// worlds of at most W ranks: own is this rank's; each peer's is polled once
// in its area of this rank's buffer (mine: area 0, areas of area bytes), any
// missing waited for in turn, and freed once read. False when a wait failed,
// leaving the rest unread and unfreed: it timed out or another block failed,
// and the communicator is unusable.
template <typename T, int W>
DINLINE bool lamport_reduce_at(const AllReduceParams& p, char* mine, i64 area, i64 off, const V16& own, u64& a,
                               u64& b) {
  V16 x[W];
#pragma unroll
  for (int s = 0; s < W; ++s) {
    x[s] = kLamportFreeVector;
    if (s < p.world) x[s] = s == p.rank ? own : ld_v16_volatile(mine + s * area + off);
  }
#pragma unroll
  for (int s = 0; s < W; ++s) {
    if (s < p.world && s != p.rank) {
      char* at = mine + s * area + off;
      if (!lamport_arrived(x[s]) && !lamport_wait(p, at, s, x[s])) return false;
      st_v16(at, kLamportFreeVector);
    }
  }
  u64 lo[kMaxRanks], hi[kMaxRanks];
#pragma unroll
  for (int s = 0; s < kMaxRanks; ++s) {
    const V16 y = s < W ? x[s] : V16{0, 0, 0, 0};
    lo[s] = ((u64)y.y << 32) | y.x;
    hi[s] = ((u64)y.w << 32) | y.z;
  }
  const int divisor = p.op == kOpAvg ? p.world : 0;
  a = ll_combine<T>(lo, p.world, divisor, OpSum{});
  b = ll_combine<T>(hi, p.world, divisor, OpSum{});
  return true;
}

// lamport_recv reduces this thread's vectors (lamport_reduce_at).
template <typename T, int W>
DINLINE bool lamport_recv(const AllReduceParams& p, const LamportHalf& l, i64 vectors) {
  const i64 nbytes = p.count * (i64)sizeof(T);
  const char* src = (const char*)p.local_src;
  char* const mine = lamport_area(p, l, p.rank, 0);
  i64 begin, end;
  lamport_span(vectors, begin, end);
  for (i64 v = begin + threadIdx.x; v < end; v += blockDim.x) {
    u64 a, b;
    if (!lamport_reduce_at<T, W>(p, mine, l.area, v * kPackBytes, lamport_load<T>(src, nbytes, v), a, b)) return false;
    lamport_store_out<T>(p, nbytes, v, a, b);
  }
  return true;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) allreduce_oneshot_lamport(const AllReduceParams p) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "Lamport words hold 16- or 32-bit floats");
  __shared__ BlockState st;
  LLHalf h;
  LamportHalf l;
  const i64 vectors = (p.count * (i64)sizeof(T) + kPackBytes - 1) / kPackBytes;
  if (!lamport_begin(p, vectors, st, h, l)) return;
  lamport_push<T>(p, l, vectors, false);
  if (ll_agree(p, h, st, kRowsStart)) {
    if (p.world <= 2) {
      lamport_recv<T, 2>(p, l, vectors);
    } else if (p.world <= 4) {
      lamport_recv<T, 4>(p, l, vectors);
    } else {
      lamport_recv<T, kMaxRanks>(p, l, vectors);
    }
  } else {
    // Nobody reads this call's areas: free what this thread sent.
    lamport_push<T>(p, l, vectors, true);
  }
  ll_end(p, st);
}

// ---------------------------------------------------------------- two-shot

// lamport_slice_vectors is the vectors of every slice but the last (which
// may be shorter, or empty). A slice and its result each take half an area.
DINLINE i64 lamport_slice_vectors(const AllReduceParams& p, i64 vectors) { return (vectors + p.world - 1) / p.world; }

// lamport_scatter stores (or, with free, frees again) this thread's vectors
// of every peer's slice, vector i of slice d into area [rank] of rank d.
// Index i of every slice belongs to the same thread in both stages.
template <typename T>
DINLINE void lamport_scatter(const AllReduceParams& p, const LamportHalf& l, i64 vectors, i64 sv, bool free) {
  const i64 nbytes = p.count * (i64)sizeof(T);
  const char* src = (const char*)p.local_src;
  i64 begin, end;
  lamport_span(sv, begin, end);
  for (i64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      const i64 v = d * sv + i;
      if (d < p.world && d != p.rank && v < vectors) {
        st_v16(lamport_area(p, l, d, p.rank) + i * kPackBytes,
               free ? kLamportFreeVector : lamport_load<T>(src, nbytes, v));
      }
    }
  }
}

// lamport_reduce_slice reduces this thread's vectors of this rank's slice
// (lamport_reduce_at), writes the result and sends it to every peer, in the
// second half of area [rank]. The result goes out as every rank will store it: a
// word equal to the sentinel becomes 0 here too.
template <typename T, int W>
DINLINE bool lamport_reduce_slice(const AllReduceParams& p, const LamportHalf& l, i64 vectors, i64 sv) {
  const i64 nbytes = p.count * (i64)sizeof(T), second = l.area / 2 / kPackBytes * kPackBytes;
  const char* src = (const char*)p.local_src;
  char* const mine = lamport_area(p, l, p.rank, 0);
  i64 begin, end;
  lamport_span(sv, begin, end);
  for (i64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const i64 v = p.rank * sv + i;
    if (v >= vectors) break;
    u64 a, b;
    if (!lamport_reduce_at<T, W>(p, mine, l.area, i * kPackBytes, lamport_load<T>(src, nbytes, v), a, b)) return false;
    const V16 r = {lamport_word((u32)a), lamport_word((u32)(a >> 32)), lamport_word((u32)b),
                   lamport_word((u32)(b >> 32))};
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      if (d < p.world && d != p.rank) st_v16(lamport_area(p, l, d, p.rank) + second + i * kPackBytes, r);
    }
    lamport_store_out<T>(p, nbytes, v, ((u64)r.y << 32) | r.x, ((u64)r.w << 32) | r.z);
  }
  return true;
}

// lamport_gather waits for this thread's vectors of every peer's result,
// writes them and frees them.
template <typename T>
DINLINE bool lamport_gather(const AllReduceParams& p, const LamportHalf& l, i64 vectors, i64 sv) {
  const i64 nbytes = p.count * (i64)sizeof(T), second = l.area / 2 / kPackBytes * kPackBytes;
  char* const mine = lamport_area(p, l, p.rank, 0) + second;
  i64 begin, end;
  lamport_span(sv, begin, end);
  for (i64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
#pragma unroll
    for (int s = 0; s < kMaxRanks; ++s) {
      const i64 v = s * sv + i;
      if (s < p.world && s != p.rank && v < vectors) {
        char* at = mine + s * l.area + i * kPackBytes;
        V16 x = ld_v16_volatile(at);
        if (!lamport_arrived(x) && !lamport_wait(p, at, s, x)) return false;
        st_v16(at, kLamportFreeVector);
        lamport_store_out<T>(p, nbytes, v, ((u64)x.y << 32) | x.x, ((u64)x.w << 32) | x.z);
      }
    }
  }
  return true;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) allreduce_twoshot_lamport(const AllReduceParams p) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "Lamport words hold 16- or 32-bit floats");
  __shared__ BlockState st;
  LLHalf h;
  LamportHalf l;
  const i64 vectors = (p.count * (i64)sizeof(T) + kPackBytes - 1) / kPackBytes;
  const i64 sv = p.world > 0 ? lamport_slice_vectors(p, vectors) : 0;
  if (!lamport_begin(p, 2 * sv, st, h, l)) return;
  lamport_scatter<T>(p, l, vectors, sv, false);
  if (ll_agree(p, h, st, kRowsStart)) {
    // A failed wait leaves the rest as it is: the communicator is unusable.
    const bool ok = p.world <= 2   ? lamport_reduce_slice<T, 2>(p, l, vectors, sv)
                    : p.world <= 4 ? lamport_reduce_slice<T, 4>(p, l, vectors, sv)
                                   : lamport_reduce_slice<T, kMaxRanks>(p, l, vectors, sv);
    if (ok) lamport_gather<T>(p, l, vectors, sv);
  } else {
    lamport_scatter<T>(p, l, vectors, sv, true);
  }
  ll_end(p, st);
}
