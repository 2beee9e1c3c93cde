// lamport.cuh: Lamport buffers, shared by the kernels that send plain data
// whose arrival the data itself tells (allreduce_lamport.cu, whose header
// says how the buffers stay free, and allreduce_rmsnorm.cu): the sentinel,
// the areas, the push every rank makes, and the wait for a peer's vector.
#pragma once
#include "ll.cuh"

constexpr u32 kLamportFree = 0x80000000u;
// kLamportHalf: the bytes of one half, shared by the world's areas
// (gpucoll lamportHalfBytes).
constexpr i64 kLamportHalf = 8ll << 20;
// A 32-bit division: a 64-bit one is a called subroutine.
DINLINE i64 lamport_area_bytes(int world) {
  return (i64)((u32)kLamportHalf / (u32)world / (u32)kPackBytes * (u32)kPackBytes);
}

// LamportHalf locates a call's areas: the offset of the half of its parity
// in every rank's buffer, and the bytes of one area. A thread computes it
// once (lamport_half), not per vector: the size of an area is a division.
struct LamportHalf {
  i64 offset;
  i64 area;
};
DINLINE LamportHalf lamport_half(const AllReduceParams& p, u64 epoch) {
  return LamportHalf{(i64)(epoch & 1) * kLamportHalf, lamport_area_bytes(p.world)};
}

// lamport_area is rank src's area in owner's buffer.
DINLINE char* lamport_area(const AllReduceParams& p, const LamportHalf& l, int owner, int src) {
  return (char*)pick(p.peer_scratch, owner) + l.offset + (i64)src * l.area;
}

DINLINE u32 lamport_word(u32 w) { return w == kLamportFree ? 0u : w; }

// lamport_load reads vector v of src (nbytes long; zeros past the end) as
// it travels: no word equal to the sentinel. Without Tail, nbytes is whole
// vectors (rows of packs), and the element loop for a tail, which would put
// a local array on the stack, is left out.
template <typename T, bool Tail = true>
DINLINE V16 lamport_load(const char* src, i64 nbytes, i64 v) {
  V16 x;
  if (!Tail || (v + 1) * kPackBytes <= nbytes) {
    x = ld_v16(src + v * kPackBytes);
  } else {
    const u64 a = read_line<T>(src, 2 * v, nbytes), b = read_line<T>(src, 2 * v + 1, nbytes);
    x = V16{(u32)a, (u32)(a >> 32), (u32)b, (u32)(b >> 32)};
  }
  return V16{lamport_word(x.x), lamport_word(x.y), lamport_word(x.z), lamport_word(x.w)};
}

DINLINE bool lamport_arrived(const V16& x) {
  return x.x != kLamportFree && x.y != kLamportFree && x.z != kLamportFree && x.w != kLamportFree;
}

DINLINE V16 ld_v16_volatile(const char* at) {
  V16 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(at) : "memory");
  return v;
}

constexpr V16 kLamportFreeVector = {kLamportFree, kLamportFree, kLamportFree, kLamportFree};

// lamport_span is this block's run of vectors [begin, end): the vectors
// split evenly over the grid in whole warps' worth, so that every block (and
// SM) moves its share at every size; a grid-wide stride would leave the last
// blocks idle when there are fewer vectors than threads. A thread pushes and
// reduces the same vectors (in place, it reads its input before it writes).
DINLINE void lamport_span(i64 vectors, i64& begin, i64& end) {
  const i64 per = ((vectors + gridDim.x - 1) / gridDim.x + 31) / 32 * 32;
  begin = min(vectors, (i64)blockIdx.x * per);
  end = min(vectors, begin + per);
}

// lamport_push stores (or, with free, frees again) this thread's vectors of
// the input in every peer's area [rank]. One vector at a time: a thread with
// more in flight took longer at every size (docs/BENCHMARKS.md).
template <typename T, bool Tail = true>
DINLINE void lamport_push(const AllReduceParams& p, const LamportHalf& l, i64 vectors, bool free) {
  const i64 nbytes = p.count * (i64)sizeof(T);
  const char* src = (const char*)p.local_src;
  i64 begin, end;
  lamport_span(vectors, begin, end);
  for (i64 v = begin + threadIdx.x; v < end; v += blockDim.x) {
    const V16 x = free ? kLamportFreeVector : lamport_load<T, Tail>(src, nbytes, v);
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      if (d < p.world && d != p.rank) st_v16(lamport_area(p, l, d, p.rank) + v * kPackBytes, x);
    }
  }
}

// lamport_wait polls a peer's vector until every word arrived.
DINLINE bool lamport_wait(const AllReduceParams& p, const char* at, int peer, V16& x) {
  u32 a = 0, b = 0, c = 0, d = 0;
  u64 seen = 0;
  const bool ok = spin_until(p, [&] {
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(at) : "memory");
    seen = ((u64)b << 32) | a;
    return a != kLamportFree && b != kLamportFree && c != kLamportFree && d != kLamportFree;
  }, seen, peer, kPhaseData, -1, 0);
  x = V16{a, b, c, d};
  return ok;
}

// lamport_params_ok checks what a Lamport kernel needs beyond the LL
// protocol: sum or avg, every rank's buffer, vectors that fit one area.
// Uniform over the grid.
DINLINE bool lamport_params_ok(const AllReduceParams& p, i64 vectors) {
  bool ok = p.world > 0 && p.world <= kMaxRanks && (p.op == kOpSum || p.op == kOpAvg) &&
            vectors * kPackBytes <= lamport_area_bytes(p.world);
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) {
    if (r < p.world) ok = ok && p.peer_scratch[r] != nullptr && aligned(p.peer_scratch[r], kPackBytes);
  }
  return ok;
}

// lamport_begin starts a Lamport kernel whose areas hold need vectors from
// each rank: the checks (block 0 records kErrBadParams), the LL call
// protocol's start (ll_begin, ll_announce) and the call's half. False: the
// block leaves at once.
DINLINE bool lamport_begin(const AllReduceParams& p, i64 need, BlockState& st, LLHalf& h, LamportHalf& l) {
  if (!lamport_params_ok(p, need)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) report_error(p, kErrBadParams, -1, -1, -1, 0, 0);
    return false;
  }
  if (!ll_begin(p, 0, st, h)) return false;
  ll_announce(p, h, kRowsStart, false);
  l = lamport_half(p, st.epoch);
  return true;
}
