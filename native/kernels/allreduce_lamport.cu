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
#include "lamport.cuh"

// p2pcomm:instantiate allreduce_oneshot_lamport<float>
// p2pcomm:instantiate allreduce_oneshot_lamport<half16>
// p2pcomm:instantiate allreduce_oneshot_lamport<bf16>

// lamport_recv reduces this thread's vectors for worlds of at most W ranks:
// every peer's vector polled once, any missing waited for in turn, each
// freed once read.
template <typename T, int W>
DINLINE bool lamport_recv(const AllReduceParams& p, u64 epoch, i64 vectors) {
  const i64 nbytes = p.count * (i64)sizeof(T);
  const char* src = (const char*)p.local_src;
  const int divisor = p.op == kOpAvg ? p.world : 0;
  i64 begin, end;
  lamport_span(vectors, begin, end);
  for (i64 v = begin + threadIdx.x; v < end; v += blockDim.x) {
    V16 x[W];
#pragma unroll
    for (int s = 0; s < W; ++s) {
      x[s] = kLamportFreeVector;
      if (s < p.world) {
        x[s] = s == p.rank ? lamport_load<T>(src, nbytes, v)
                           : ld_v16_volatile(lamport_area(p, epoch, p.rank, s) + v * kPackBytes);
      }
    }
#pragma unroll
    for (int s = 0; s < W; ++s) {
      if (s < p.world && s != p.rank) {
        char* at = lamport_area(p, epoch, p.rank, s) + v * kPackBytes;
        // A failed wait leaves the rest unread and unfreed: it timed out or
        // another block failed, and the communicator is unusable.
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
    const u64 a = ll_combine<T>(lo, p.world, divisor, OpSum{}), b = ll_combine<T>(hi, p.world, divisor, OpSum{});
    if ((v + 1) * kPackBytes <= nbytes) {
      st_v16((char*)p.out + v * kPackBytes, V16{(u32)a, (u32)(a >> 32), (u32)b, (u32)(b >> 32)});
    } else {
      write_line<T>((char*)p.out, 2 * v, nbytes, a);
      write_line<T>((char*)p.out, 2 * v + 1, nbytes, b);
    }
  }
  return true;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) allreduce_oneshot_lamport(const AllReduceParams p) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "Lamport words hold 16- or 32-bit floats");
  __shared__ BlockState st;
  LLHalf h;
  const i64 nbytes = p.count * (i64)sizeof(T);
  const i64 vectors = (nbytes + kPackBytes - 1) / kPackBytes;
  if (!lamport_params_ok(p, vectors)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) report_error(p, kErrBadParams, -1, -1, -1, 0, 0);
    return;
  }
  if (!ll_begin(p, 0, st, h)) return;
  ll_announce(p, h, kRowsStart, false);
  lamport_push<T>(p, st.epoch, vectors, false);
  if (ll_agree(p, h, st, kRowsStart)) {
    if (p.world <= 2) {
      lamport_recv<T, 2>(p, st.epoch, vectors);
    } else {
      lamport_recv<T, kMaxRanks>(p, st.epoch, vectors);
    }
  } else {
    // Nobody reads this call's areas: free what this thread sent.
    lamport_push<T>(p, st.epoch, vectors, true);
  }
  ll_end(p, st);
}
