// allreduce_ll128.cu: one-shot all-reduce on LL128 lines, for medium
// messages. Like allreduce_oneshot_ll, every rank pushes its whole input into
// every peer's LL buffer and reduces every rank's copy in rank order, with no
// barrier; but a line is 128 bytes, 120 of data and an 8-byte flag, instead of
// 8 data bytes per 16 (NCCL's LL128). On two ranks a one-shot moves as many
// bytes over each link as a two-shot, in one one-way trip instead of two
// barriers: with 7% overhead instead of LL's 100%, it serves sizes where LL's
// doubled bytes cost more than the barriers saved.
//
// Why a flag per 128 bytes is enough: eight consecutive lanes of a warp store
// one 128-byte line with one 16-byte store instruction each (one warp-wide
// instruction, 128-byte aligned), and NVLink delivers such a line as a unit,
// the property NCCL's LL128 protocol rests on. A reader polls the line with
// the same warp-wide 16-byte loads until the flag lane sees the call's flag,
// then reads the line again: every byte of a line is there once its flag is.
// A line is written only by whole warps (lines past the data carry zeros), and
// every lane of a warp stays in step (warp-wide votes), or a line could split.
//
// Buffers and the call protocol are LL's (ll.cuh): the a and b regions of
// each half, end to end, hold world areas of 2 x slot bytes, area s (slots 2 s
// and 2 s + 1 of the two) for rank s's input; lines start 128-byte aligned. Other kernels leave plain data in those regions (the push kernels),
// so a flag is not a small count that such data could hold: it is the call
// epoch scrambled to 64 bits (ll128_flag).
#include "ll.cuh"

// p2pcomm:instantiate allreduce_oneshot_ll128<float>
// p2pcomm:instantiate allreduce_oneshot_ll128<double>
// p2pcomm:instantiate allreduce_oneshot_ll128<half16>
// p2pcomm:instantiate allreduce_oneshot_ll128<bf16>
// p2pcomm:instantiate allreduce_oneshot_ll128<int>
// p2pcomm:instantiate allreduce_oneshot_ll128<long long>

// A group is what one warp moves per step: 4 lines of 128 bytes (512 wire
// bytes, 16 per lane), 480 data bytes. Lane l holds bytes [16 l, 16 l + 16)
// of the group's wire bytes; lane 8 k + 7 ends line k and holds its flag.
constexpr i64 kL128Group = 512;
constexpr i64 kL128GroupData = 480;
constexpr i64 kL128LineData = 120;
// Groups per warp in flight: kL128SendUnroll loaded before their stores;
// on receiving, four on two ranks and one on more (oneshot_ll128_body).
constexpr int kL128SendUnroll = 4;

// ll128_flag: the flag of call epoch e, a bijection of e (so e and e - 2
// differ) that is never 0 (fresh memory) in practice, and unlike any value
// plain data is likely to hold.
DINLINE u64 ll128_flag(u64 e) {
  const u64 f = ~(e * 0x9e3779b97f4a7c15ull);
  return f != 0 ? f : 1;
}

DINLINE i64 ll128_groups(i64 nbytes) { return (nbytes + kL128GroupData - 1) / kL128GroupData; }

// ll128_area is rank src's area in owner's buffer.
DINLINE char* ll128_area(const AllReduceParams& p, const LLHalf& h, int owner, int src) {
  return ll_slot_a(p, h, owner, 0) + (i64)src * 2 * h.slot;
}

// The data words of a lane: word w of the data (8 bytes) for each of its two
// 8-byte halves; the flag lane's second half is the flag, no data.
DINLINE i64 ll128_word(i64 group, int lane) {
  return (group * kL128GroupData + (lane >> 3) * kL128LineData + (lane & 7) * 16) / 8;
}

DINLINE void ld2_volatile(const char* at, u64& a, u64& b) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(at) : "memory");
}
DINLINE void st2_volatile(char* at, u64 a, u64 b) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" :: "l"(at), "l"(a), "l"(b) : "memory");
}

// ll128_wait polls this lane's 16 bytes of a group until every line of the
// group carries flag, then reads them again into a, b. Warp-collective: every
// lane calls it for the same group. Bounded like every wait: lane 0 watches
// the clock and the abort word and decides for the warp.
DINLINE bool ll128_wait(const AllReduceParams& p, const char* at, u64 flag, bool flag_lane, int peer, u64& a,
                        u64& b) {
  constexpr u32 kAll = 0xffffffffu;
  const Signal* self = abort_signal(p);
  const u64 timeout = timeout_of(p) != 0 ? timeout_of(p) : kDefaultTimeoutNs;
  const u64 start = global_timer_ns();
  for (u32 spin = 1;; ++spin) {
    ld2_volatile(at, a, b);
    if (__all_sync(kAll, !flag_lane || b == flag)) break;
    if ((spin & 63u) != 0) continue;
    int stop = 0;
    if ((threadIdx.x & 31u) == 0) {
      if (self != nullptr && ld_volatile_u32(&self->abort_claim) != 0) {
        stop = 1;
      } else if ((spin & 0x3fffu) == 0 && error_word(p) != nullptr &&
                 ld_volatile_u32(&error_word(p)->code) != 0 &&
                 ld_volatile_u32(&error_word(p)->code) != kErrMismatch) {
        stop = 1;
      } else if (global_timer_ns() - start > timeout) {
        stop = 2;
      }
    }
    // Lane 0 holds no flag: the flag seen is lane 7's.
    const u64 seen = __shfl_sync(kAll, b, 7);
    stop = __shfl_sync(kAll, stop, 0);
    if (stop == 2 && (threadIdx.x & 31u) == 0) report_error(p, kErrTimeout, peer, kPhaseData, -1, flag, seen);
    if (stop != 0) return false;
  }
  ld2_volatile(at, a, b);
  return true;
}

// ll128_load reads the data words of this lane for group g of src (nbytes
// long; zeros past the end).
template <typename T>
DINLINE void ll128_load(const char* src, i64 nbytes, i64 g, int lane, u64& a, u64& b) {
  const i64 w = ll128_word(g, lane);
  a = read_line<T>(src, w, nbytes);
  b = (lane & 7) == 7 ? 0 : read_line<T>(src, w + 1, nbytes);
}

// oneshot_ll128_recv reduces this warp's groups, U at a time, for worlds of
// at most W ranks (registers: two words per rank per group).
template <typename T, int W, int U, typename O>
DINLINE bool oneshot_ll128_recv(const AllReduceParams& p, const LLHalf& h, u64 flag, i64 groups, const O red) {
  const i64 nbytes = p.count * (i64)sizeof(T);
  const int lane = (int)(threadIdx.x & 31u);
  const bool flag_lane = (lane & 7) == 7;
  const i64 nwarps = (i64)gridDim.x * (blockDim.x / 32);
  const i64 warp = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const char* src = (const char*)p.local_src;
  const int divisor = p.op == kOpAvg ? p.world : 0;
  for (i64 g0 = warp; g0 < groups; g0 += U * nwarps) {
    // Every rank's words of U groups: this rank's from its input, the
    // others' polled once; all seen with their flags (the usual case past
    // the first groups): read them again for the data. Else wait for each
    // in turn.
    u64 va[U * W], vb[U * W];
    bool ready = true;
#pragma unroll
    for (int k = 0; k < U * W; ++k) {
      const int u = k / W, s = k % W;
      const i64 g = g0 + u * nwarps;
      va[k] = vb[k] = 0;
      if (g < groups && s < p.world) {
        if (s == p.rank) {
          ll128_load<T>(src, nbytes, g, lane, va[k], vb[k]);
        } else {
          ld2_volatile(ll128_area(p, h, p.rank, s) + g * kL128Group + lane * 16, va[k], vb[k]);
          ready = ready && (!flag_lane || vb[k] == flag);
        }
      }
    }
    const bool all = __all_sync(0xffffffffu, ready);
#pragma unroll
    for (int k = 0; k < U * W; ++k) {
      const int u = k / W, s = k % W;
      const i64 g = g0 + u * nwarps;
      if (g < groups && s < p.world && s != p.rank) {
        const char* at = ll128_area(p, h, p.rank, s) + g * kL128Group + lane * 16;
        if (all) {
          ld2_volatile(at, va[k], vb[k]);
        } else if (!ll128_wait(p, at, flag, flag_lane, s, va[k], vb[k])) {
          return false;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 g = g0 + u * nwarps;
      if (g < groups) {
        u64 a[kMaxRanks], b[kMaxRanks];
#pragma unroll
        for (int s = 0; s < kMaxRanks; ++s) {
          a[s] = s < W ? va[u * W + s] : 0;
          b[s] = s < W ? vb[u * W + s] : 0;
        }
        const i64 w = ll128_word(g, lane);
        write_line<T>((char*)p.out, w, nbytes, ll_combine<T>(a, p.world, divisor, red));
        if (!flag_lane) write_line<T>((char*)p.out, w + 1, nbytes, ll_combine<T>(b, p.world, divisor, red));
      }
    }
  }
  return true;
}

// Two ranks keep four groups per warp in flight; more ranks one.
template <typename T, typename O>
DINLINE bool oneshot_ll128_body(const AllReduceParams& p, const LLHalf& h, u64 flag, i64 groups, const O red) {
  if (p.world <= 2) return oneshot_ll128_recv<T, 2, 4>(p, h, flag, groups, red);
  return oneshot_ll128_recv<T, kMaxRanks, 1>(p, h, flag, groups, red);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) allreduce_oneshot_ll128(const AllReduceParams p) {
  __shared__ BlockState st;
  LLHalf h;
  const i64 nbytes = p.count * (i64)sizeof(T);
  const i64 groups = ll128_groups(nbytes);
  // Lines are stored and polled by whole warps, and start 128-byte aligned
  // in every area (ll128_area).
  bool aligned128 = p.world > 0 && p.world <= kMaxRanks && p.half_bytes % kL128Group == 0 &&
                    ((i64)p.half_bytes - kLLHeaderBytes) / (2 * p.world) % 64 == 0;
  for (int r = 0; r < p.world && r < kMaxRanks; ++r) aligned128 = aligned128 && aligned(p.peer_in[r], 128);
  if ((blockDim.x & 31u) != 0 || !aligned128) {
    if (blockIdx.x == 0 && threadIdx.x == 0) report_error(p, kErrBadParams, -1, -1, -1, 0, 0);
    return;
  }
  // An area is two LL slots: ll_begin checks a slot against half of it.
  if (!ll_begin(p, (groups * kL128Group / 2 + kLLLine - 1) / kLLLine, st, h)) return;
  ll_announce(p, h, kRowsStart, false);
  const u64 flag = ll128_flag(st.epoch);
  const int lane = (int)(threadIdx.x & 31u);
  const bool flag_lane = (lane & 7) == 7;
  const i64 nwarps = (i64)gridDim.x * (blockDim.x / 32);
  const i64 warp = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  // Send: this warp's groups of the input to every peer, area [rank]; the
  // loads of kL128SendUnroll groups before their stores.
  for (i64 g0 = warp; g0 < groups; g0 += kL128SendUnroll * nwarps) {
    u64 a[kL128SendUnroll], b[kL128SendUnroll];
#pragma unroll
    for (int u = 0; u < kL128SendUnroll; ++u) {
      const i64 g = g0 + u * nwarps;
      if (g < groups) ll128_load<T>((const char*)p.local_src, nbytes, g, lane, a[u], b[u]);
    }
    __syncwarp();  // the loads branch by lane at the tail: a line goes out in one instruction of the whole warp
#pragma unroll
    for (int u = 0; u < kL128SendUnroll; ++u) {
      const i64 g = g0 + u * nwarps;
      if (g >= groups) break;
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d) {
        if (d < p.world && d != p.rank)
          st2_volatile(ll128_area(p, h, d, p.rank) + g * kL128Group + lane * 16, a[u], flag_lane ? flag : b[u]);
      }
    }
  }
  if (ll_agree(p, h, st, kRowsStart)) {
    if (is_other_op(p.op)) {
      oneshot_ll128_body<T>(p, h, flag, groups, OpOther{p.op});
    } else {
      oneshot_ll128_body<T>(p, h, flag, groups, OpSum{});
    }
  }
  ll_end(p, st);
}
