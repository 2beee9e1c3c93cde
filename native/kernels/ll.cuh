// ll.cuh: the LL call protocol, shared by the kernels that exchange data
// without a barrier (allreduce_ll.cu, allreduce_ll128.cu,
// allreduce_lamport.cu, allreduce_rmsnorm.cu): every rank's LL buffer, the
// call's epoch and half, and the header each block exchanges with every peer
// in every call.
//
// Buffers: peer_in[r] is rank r's LL buffer, two halves of half_bytes; a
// call uses half (epoch & 1), where epoch counts this rank's LL kernels
// (Signal.ll_epoch, advanced by the last block to finish). Each half holds
//   hdr [2 kMaxBlocks][kMaxRanks] lines: block b of rank s announces its call
//   a   [world] slots of slot bytes: from rank s, what it sends this rank
//       first (its input, or its part of this rank's slice)
//   b   [world] slots: from rank s, what it sends second (its reduced slice)
// (LL128 reads a and b end to end as world areas of two slots each.)
// A line written for call e is read in call e. Before a rank writes into a
// half for call e, the peer that reads it has finished call e - 2, the
// previous call on that half: this rank's call e - 1 waited for every peer's
// call e - 1 headers, which each peer sent only after its call e - 2 had
// completed (calls are ordered on one stream). So no barrier is needed, and
// flags (a function of the epoch, never 0, different for e and e - 2) need
// no reset. This holds for any mix of kernels that follow the protocol
// (ll_begin, ll_announce and ll_agree in every block, ll_end), whatever
// their grids and data partitions. A rank that makes a different call
// (signature in the headers) makes every rank skip the data and report
// kErrMismatch.
#pragma once
#include "p2p_common.cuh"

// kLLMaxGrid bounds the grid of these kernels: header rows [0, 128) announce
// a call, rows [128, 256) carry the push two-shot's second flag.
constexpr int kLLMaxGrid = kMaxBlocks;
constexpr i64 kLLHeaderBytes = 2 * (i64)kLLMaxGrid * kMaxRanks * kLLLine;
constexpr int kRowsStart = 0;
constexpr int kRowsGather = kLLMaxGrid;

// ---------------------------------------------------------------- buffers and checks

// LLHalf locates the half this call uses, in every rank's buffer.
struct LLHalf {
  u64 offset;  // of the half within each rank's buffer
  i64 slot;    // bytes per slot
  u32 flag;
};

DINLINE i64 ll_slot_bytes(const AllReduceParams& p) {
  return ((i64)p.half_bytes - kLLHeaderBytes) / (2 * p.world) / kLLLine * kLLLine;
}
DINLINE const char* ll_my_hdr(const AllReduceParams& p, const LLHalf& h, int rows, int src) {
  return (const char*)pick(p.peer_in, p.rank) + h.offset + ((i64)(rows + blockIdx.x) * kMaxRanks + src) * kLLLine;
}
DINLINE char* ll_slot_a(const AllReduceParams& p, const LLHalf& h, int owner, int src) {
  return (char*)pick(p.peer_in, owner) + h.offset + kLLHeaderBytes + (i64)src * h.slot;
}
DINLINE char* ll_slot_b(const AllReduceParams& p, const LLHalf& h, int owner, int src) {
  return ll_slot_a(p, h, owner, src) + (i64)p.world * h.slot;
}

// ll_lines is the number of lines of a run of nbytes bytes.
DINLINE i64 ll_lines(i64 nbytes) { return (nbytes + kLLData - 1) / kLLData; }

// ll_params_ok is params_ok for the LL kernels: uniform, so a false return
// lets the whole grid leave. need_lines is the most lines one slot holds.
DINLINE bool ll_params_ok(const AllReduceParams& p, i64 need_lines) {
  if (!rank_ok(p) || p.op < 0 || p.op >= kNumOps || p.count < 0) return false;
  if (gridDim.x < 1 || gridDim.x > (u32)kLLMaxGrid || gridDim.y != 1 || gridDim.z != 1) return false;
  if (blockDim.x < (u32)kMaxRanks || blockDim.x > (u32)kThreads || blockDim.y != 1 || blockDim.z != 1)
    return false;
  if (p.out == nullptr || !aligned(p.out, kPackBytes) || !aligned(p.local_src, kPackBytes)) return false;
  if (p.count > 0 && p.local_src == nullptr) return false;
  if (p.err != nullptr && !aligned(p.err, 8)) return false;
  if (p.half_bytes % kLLLine != 0 || (i64)p.half_bytes < kLLHeaderBytes) return false;
  if (need_lines * kLLLine > ll_slot_bytes(p)) return false;
  for (int r = 0; r < p.world; ++r) {
    if (p.peer_in[r] == nullptr || !aligned(p.peer_in[r], kPackBytes)) return false;
    if (p.peer_signal[r] == nullptr || !aligned(p.peer_signal[r], 128)) return false;
  }
  return true;
}

// ll_begin checks the parameters (block 0 records kErrBadParams) and reads
// this call's epoch. Every block reads it before any block can advance it.
DINLINE bool ll_begin(const AllReduceParams& p, i64 need_lines, BlockState& st, LLHalf& h) {
  if (!ll_params_ok(p, need_lines)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) report_error(p, kErrBadParams, -1, -1, -1, 0, 0);
    return false;
  }
  if (threadIdx.x == 0) {
    st.epoch = *reinterpret_cast<volatile u64*>(&p.peer_signal[p.rank]->ll_epoch) + 1;
    st.abort = 0;
  }
  __syncthreads();
  h.offset = (st.epoch & 1) * (u64)p.half_bytes;
  h.slot = ll_slot_bytes(p);
  h.flag = ll_flag(st.epoch);
  return true;
}

// ll_end: the last block to finish advances the epoch for the next call
// (the kernel boundary publishes it). Every block that began must end here.
DINLINE void ll_end(const AllReduceParams& p, const BlockState& st) {
  __syncthreads();
  if (threadIdx.x == 0) {
    Signal* self = p.peer_signal[p.rank];
    if (atomicAdd(&self->ll_done, 1u) == gridDim.x - 1) {
      self->ll_done = 0;
      self->ll_epoch = st.epoch;
    }
  }
}

// ll_announce: thread t tells rank t which call this is, in header row
// rows + b (block b to block b). Headers also make every block hear from
// every peer in every call, which the reuse argument above relies on. The
// host sizes the grid by payload, so block b also fills the rows b + grid,
// b + 2 grid, ... that a larger grid would use: a peer making a call of
// another size then reads a signature that differs (a mismatch) instead of
// waiting. A header's first 8 bytes read as one u64 are (flag << 32) |
// signature. With release (push kernels) only those 8 bytes are written,
// by a release store that also publishes every write this block made
// before it (bar.sync orders them before the store, which is cumulative).
DINLINE void ll_announce(const AllReduceParams& p, const LLHalf& h, int rows, bool release) {
  const int t = (int)threadIdx.x;
  if (release) __syncthreads();
  if (t >= p.world || t == p.rank) return;
  const u64 v = (u64)(u32)p.signature * 0x100000001ull;
  char* hdr = (char*)pick(p.peer_in, t) + h.offset + (i64)p.rank * kLLLine;
  for (u32 b = blockIdx.x; b < (u32)kLLMaxGrid; b += gridDim.x) {
    char* line = hdr + (i64)(rows + b) * kMaxRanks * kLLLine;
    if (release) {
      st_flag_release(reinterpret_cast<u64*>(line), ((u64)h.flag << 32) | (u32)p.signature);
    } else {
      ll_store(line, v, h.flag);
    }
  }
}

// header_wait polls a header's first 8 bytes with acquire loads until they
// carry flag (bounded like ll_wait); data holds the signature. Both kinds
// of header read the same here, so LL and push calls that meet (ranks that
// disagree on the algorithm) see a mismatch, not a timeout.
DINLINE bool header_wait(const AllReduceParams& p, const char* line, u32 flag, int peer, int phase, u64& data) {
  const u64* w = reinterpret_cast<const u64*>(line);
  u64 v = 0, seen = 0;
  const bool ok = spin_until(p, [&] {
    v = ld_flag_acquire(w);
    seen = v >> 32;
    return (u32)seen == flag;
  }, seen, peer, phase, -1, flag);
  data = (u64)(u32)v * 0x100000001ull;
  return ok;
}

// ll_agree waits for every peer's header in row rows + b and compares
// signatures; false (uniform over the block) when a peer is missing or made
// another call. What each peer released before its header (push kernels)
// is visible to the whole block afterwards (acquire load, then bar.sync).
DINLINE bool ll_agree(const AllReduceParams& p, const LLHalf& h, BlockState& st, int rows) {
  const int t = (int)threadIdx.x;
  if (t < p.world && t != p.rank) {
    const u64 mine = (u64)(u32)p.signature * 0x100000001ull;
    const int phase = rows == kRowsStart ? kPhaseStart : kPhaseMid;
    u64 theirs;
    const char* line = ll_my_hdr(p, h, rows, t);
    if (!header_wait(p, line, h.flag, t, phase, theirs)) {
      st.abort = 1;
    } else if (theirs != mine) {
      if (p.signature != kRejectSignature) report_mismatch(p, t, mine, theirs);
      st.abort = 1;
    }
  }
  __syncthreads();
  return st.abort == 0;
}

// ---------------------------------------------------------------- data words
// LL kernels move data 8 bytes at a time (a word); a run of nbytes may end
// inside its last word.

// Line<T> views 8 data bytes as elements of T.
template <typename T> union Line {
  u64 u;
  T e[kLLData / sizeof(T)];
};

// read_line returns bytes [8 i, 8 i + 8) of src, zero past nbytes.
template <typename T> DINLINE u64 read_line(const char* src, i64 i, i64 nbytes) {
  const i64 at = i * kLLData;
  if (at + kLLData <= nbytes) return ld_bits(reinterpret_cast<const u64*>(src + at));
  Line<T> l;
  l.u = 0;
  for (int k = 0; at + (i64)(k + 1) * (i64)sizeof(T) <= nbytes; ++k) l.e[k] = ld_elem<T>(src + at + k * sizeof(T));
  return l.u;
}

// write_line stores line i into dst, only the bytes below nbytes.
template <typename T> DINLINE void write_line(char* dst, i64 i, i64 nbytes, u64 v) {
  const i64 at = i * kLLData;
  if (at + kLLData <= nbytes) {
    st_bits(reinterpret_cast<u64*>(dst + at), v);
    return;
  }
  Line<T> l;
  l.u = v;
  for (int k = 0; at + (i64)(k + 1) * (i64)sizeof(T) <= nbytes; ++k) st_elem<T>(dst + at + k * sizeof(T), l.e[k]);
}

// ---------------------------------------------------------------- reduction of lines

// ll_combine reduces one line of every rank, in rank order 0..world-1 (the
// same order on every rank: bit-identical results).
template <typename T, typename O>
DINLINE u64 ll_combine(const u64 (&v)[kMaxRanks], int world, int divisor, const O red) {
  typedef typename Num<T>::Acc Acc;
  constexpr int N = (int)(kLLData / sizeof(T));
  Line<T> in, out;
  in.u = v[0];
  Acc acc[N];
#pragma unroll
  for (int j = 0; j < N; ++j) acc[j] = Num<T>::to(in.e[j]);
#pragma unroll
  for (int s = 1; s < kMaxRanks; ++s) {
    if (s < world) {
      in.u = v[s];
#pragma unroll
      for (int j = 0; j < N; ++j) acc[j] = red.apply(acc[j], Num<T>::to(in.e[j]));
    }
  }
#pragma unroll
  for (int j = 0; j < N; ++j) out.e[j] = Num<T>::from(finish(acc[j], divisor));
  return out.u;
}
