// allreduce_rmsnorm.cu: an all-reduce (sum) fused with the residual add and
// the RMSNorm that follow it in tensor-parallel inference, in one launch. Per
// row of `hidden` elements:
//
//   sum          = round_T(x_0 + x_1 + ... + x_{world-1})   fp32, rank order
//   residual_out = round_T(float(sum) + float(residual))     one fp32 add
//   normed       = round_T(float(residual_out) * inv * float(weight)),
//                  inv = rsqrt(sum of float(residual_out)^2 / hidden + eps)
//
// sum is what the library's all-reduce gives, bit for bit (the same fp32
// additions in the same order as reduce_range_op and ll_combine, rounded once
// at the end); the RMSNorm reads residual_out as rounded to T. Everything is
// computed alike on every rank, so ranks with the same residual hold the same
// bits. Only 16-bit floats (half16, bf16) are instantiated.
//
//   allreduce_rmsnorm_oneshot_ll: small calls, no barrier. Every rank pushes
//     its x as LL lines into every peer's LL buffer (ll.cuh; the whole grid
//     sends), then block b reduces and normalizes rows b, b + grid, ...: a
//     row stays in one block, so the row's mean is a block reduction.
//   allreduce_rmsnorm_oneshot_lamport: the same shape on Lamport's plain
//     vectors (allreduce_lamport.cu: its buffers, sentinel and freeing), the
//     push spread evenly over the grid, a row's packs polled by its block.
//   allreduce_rmsnorm_twoshot: larger calls. Rows are cut into world slices
//     of whole rows. Each rank stages x, rank r reduces slice r from the
//     peers' staging, pushes the sums into every peer's scratch and
//     normalizes its slice; after the middle barrier every rank normalizes
//     the other slices from the sums in its scratch with its own residual.
//     Block b owns rows b, b + grid, ... of every slice in every phase
//     (barriers pair blocks by index). No end barrier, for the reasons of
//     allreduce_twoshot.cu: peers touch this rank's memory only before their
//     middle flag, and the next call writes theirs only after its start
//     barrier.
//
// A row's packs are spread over the block's threads (pack j of the row to
// thread j % kThreads), at most kRowPacks per thread, and each thread reads
// residual and writes residual_out at its own packs only: residual_out may
// be residual (in place). residual_out and normed (ar.out) must not overlap
// x, weight or each other otherwise.
#include "lamport.cuh"

// p2pcomm:no-spills
// p2pcomm:instantiate allreduce_rmsnorm_oneshot_ll<half16>
// p2pcomm:instantiate allreduce_rmsnorm_oneshot_ll<bf16>
// p2pcomm:instantiate allreduce_rmsnorm_oneshot_lamport<half16>
// p2pcomm:instantiate allreduce_rmsnorm_oneshot_lamport<bf16>
// p2pcomm:instantiate allreduce_rmsnorm_twoshot<half16>
// p2pcomm:instantiate allreduce_rmsnorm_twoshot<bf16>

// ---------------------------------------------------------------- limits and parameters

// kRMSNormMaxHidden is the longest row: a row is held in registers by one
// block, kRowPacks 16-byte packs per thread at most.
constexpr int kRMSNormMaxHidden = 16384;
constexpr int kRowPacks = kRMSNormMaxHidden / PackOf<bf16>::kElems / kThreads;
static_assert(kRowPacks * PackOf<bf16>::kElems * kThreads == kRMSNormMaxHidden, "rows split evenly");

// RMSNormParams is the one by-value argument of each kernel: the
// all-reduce's parameters, then the fused call's own. In ar: local_src = x
// ([rows][hidden]), out = normed ([rows][hidden]), count = rows * hidden,
// op = sum; peer_in = every rank's LL buffer (one-shots, half_bytes its half;
// Lamport's with peer_scratch = every rank's Lamport buffer) or staging
// (two-shot, with peer_scratch).
//
//   offset size field
//   0      264  ar            AllReduceParams
//   264    8    residual      const T*: [rows][hidden]
//   272    8    weight        const T*: [hidden]
//   280    8    residual_out  T*: [rows][hidden]; may equal residual
//   288    8    rows          i64, >= 0
//   296    4    hidden        i32: a multiple of 8, at most kRMSNormMaxHidden
//   300    4    eps           f32, >= 0
//   total  304, aligned to 8
struct RMSNormParams {
  AllReduceParams ar;
  const void* residual;
  const void* weight;
  void* residual_out;
  i64 rows;
  int hidden;
  float eps;
};
static_assert(sizeof(RMSNormParams) == 304, "RMSNormParams size");
static_assert(sizeof(RMSNormParams::ar) + sizeof(RMSNormParams::residual) + sizeof(RMSNormParams::weight) +
                      sizeof(RMSNormParams::residual_out) + sizeof(RMSNormParams::rows) +
                      sizeof(RMSNormParams::hidden) + sizeof(RMSNormParams::eps) ==
                  304,
              "RMSNormParams fields");

// rmsnorm_params_ok checks the fused call's own fields; uniform, like
// params_ok. A call with no rows (a rank taking part in a call it rejected)
// needs no tensors.
template <typename T>
DINLINE bool rmsnorm_params_ok(const RMSNormParams& q) {
  constexpr int P = PackOf<T>::kElems;
  const AllReduceParams& p = q.ar;
  if (q.rows < 0 || p.op != kOpSum || blockDim.x != (u32)kThreads) return false;
  if (q.rows == 0) return p.count == 0;
  if (q.hidden < P || q.hidden > kRMSNormMaxHidden || q.hidden % P != 0 || p.count != q.rows * (i64)q.hidden)
    return false;
  if (!(q.eps >= 0.0f)) return false;  // NaN too
  if (q.residual == nullptr || q.weight == nullptr || q.residual_out == nullptr) return false;
  return aligned(q.residual, kPackBytes) && aligned(q.weight, kPackBytes) && aligned(q.residual_out, kPackBytes);
}

// ---------------------------------------------------------------- row arithmetic

// ld_weight reads a pack of the weight through the read-only path: every
// row reads the whole weight, and the kernel never writes it.
DINLINE V16 ld_weight(const void* p) {
  V16 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// sum_ranks adds one pack of every rank in rank order 0..world-1 in fp32 and
// rounds once: the additions of the all-reduce kernels (OpSum), so the same
// bits as comm.all_reduce.
template <typename T>
DINLINE V16 sum_ranks(const V16 (&in)[kMaxRanks], int world) {
  constexpr int P = PackOf<T>::kElems;
  float acc[P], f[P];
  widen<T>(in[0], acc);
#pragma unroll
  for (int s = 1; s < kMaxRanks; ++s) {
    if (s < world) {
      widen<T>(in[s], f);
#pragma unroll
      for (int e = 0; e < P; ++e) acc[e] = acc[e] + f[e];
    }
  }
  Pack<T> o;
#pragma unroll
  for (int e = 0; e < P; ++e) o.e[e] = Num<T>::from(acc[e]);
  return o.v;
}

// add_residual_line is add_residual on the 8 data bytes of an LL line (the
// same arithmetic, element by element); the line's sum over the ranks is
// ll_combine's (ll.cuh), sum_ranks' on a line.
template <typename T>
DINLINE u64 add_residual_line(u64 sum, u64 residual, float& ss) {
  constexpr int N = kLLData / sizeof(T);
  Line<T> a, b;
  a.u = sum;
  b.u = residual;
#pragma unroll
  for (int e = 0; e < N; ++e) {
    a.e[e] = Num<T>::from(Num<T>::to(a.e[e]) + Num<T>::to(b.e[e]));
    const float r = Num<T>::to(a.e[e]);
    ss += r * r;
  }
  return a.u;
}

// add_residual returns round_T(float(sum) + float(residual)) of one pack and
// adds the squares of the rounded values to ss, in element order.
template <typename T>
DINLINE V16 add_residual(V16 sum, V16 residual, float& ss) {
  constexpr int P = PackOf<T>::kElems;
  float a[P], b[P];
  widen<T>(sum, a);
  widen<T>(residual, b);
#pragma unroll
  for (int e = 0; e < P; ++e) a[e] = a[e] + b[e];
  const V16 out = narrow<T>(a);
  widen<T>(out, a);
#pragma unroll
  for (int e = 0; e < P; ++e) ss += a[e] * a[e];
  return out;
}

// scale_pack returns round_T(float(v) * inv * float(w)) of one pack.
template <typename T>
DINLINE V16 scale_pack(V16 v, float inv, V16 w) {
  constexpr int P = PackOf<T>::kElems;
  float a[P], b[P];
  widen<T>(v, a);
  widen<T>(w, b);
#pragma unroll
  for (int e = 0; e < P; ++e) a[e] = a[e] * inv * b[e];
  return narrow<T>(a);
}

// block_sum returns the sum of v over the block's threads, the same bits on
// every thread, every call and every rank: a fixed tree of xor shuffles (the
// two lanes of a pair add the same two operands, and fp32 addition is
// commutative, so both hold the same bits), then the warps' sums in warp
// order. part holds one float per warp; the first barrier keeps a previous
// row's readers of part ahead of this row's writers.
DINLINE float block_sum(float v, float* part) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31u) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
  for (u32 w = 0; w < blockDim.x / 32; ++w) total += part[w];
  return total;
}

// A row is finished in two passes over this thread's packs of it (pack j of
// the row, at byte row_offset + j * 16, for j = threadIdx.x + k * blockDim.x,
// k < kRowPacks, j < packs):
//   1. store_residual: residual_out from the pack's sum, its squares into ss
//   2. normalize_row: the block's sum of ss, then normed from residual_out
// Pass 2 reads residual_out back after block_sum's barriers, which order
// every thread's pass-1 stores before it (the one-shot's pass 1 works on LL
// lines, so other threads wrote some of a thread's packs); no row is held in
// registers.

// row_pack is the byte offset of this thread's k-th pack of a row, or -1.
DINLINE i64 row_pack(const RMSNormParams& q, int packs, i64 row, int k) {
  const int j = (int)threadIdx.x + k * (int)blockDim.x;
  return j < packs ? (row * packs + j) * kPackBytes : -1;
}

template <typename T>
DINLINE void store_residual(const RMSNormParams& q, i64 off, V16 sum, V16 residual, float& ss) {
  st_v16((char*)q.residual_out + off, add_residual<T>(sum, residual, ss));
}

template <typename T>
DINLINE void normalize_row(const RMSNormParams& q, int packs, i64 row, float ss, float* part) {
  const float inv = rsqrtf(block_sum(ss, part) / (float)q.hidden + q.eps);
  V16 r[kRowPacks], w[kRowPacks];
  const i64 row_bytes = (i64)packs * kPackBytes;
#pragma unroll
  for (int k = 0; k < kRowPacks; ++k) {
    const i64 off = row_pack(q, packs, row, k);
    if (off < 0) continue;
    r[k] = ld_v16((const char*)q.residual_out + off);
    w[k] = ld_weight((const char*)q.weight + (off - row * row_bytes));
  }
#pragma unroll
  for (int k = 0; k < kRowPacks; ++k) {
    const i64 off = row_pack(q, packs, row, k);
    if (off >= 0) st_v16((char*)q.ar.out + off, scale_pack<T>(r[k], inv, w[k]));
  }
}

// bad_params records kErrBadParams once (block 0); the kernel then returns
// before any exchange.
DINLINE void bad_params(const AllReduceParams& p) {
  if (blockIdx.x == 0 && threadIdx.x == 0) report_error(p, kErrBadParams, -1, -1, -1, 0, 0);
}

// ---------------------------------------------------------------- one-shot, LL

// ll_row_pass1 runs pass 1 over row, line by line (8 data bytes): thread t
// takes lines t, t + blockDim.x, ... (a pack's two lines from seven peers
// would hold more registers than a thread has). A line's sum adds this
// rank's x (read in place) and every peer's line, from this rank's a slot of
// that peer. The residual and every line are loaded before any wait, so
// their loads are in flight together; then one bounded wait (spin_until, one
// copy of it) polls the lines still missing, naming the lowest peer among
// them, until all are in. False when a wait failed (timeout or abort); the
// thread then stops.
template <typename T>
DINLINE bool ll_row_pass1(const RMSNormParams& q, const LLHalf& h, i64 row, float& ss) {
  const AllReduceParams& p = q.ar;
  const int lines = q.hidden * (int)sizeof(T) / (int)kLLData;
  const char* slots = ll_slot_a(p, h, p.rank, 0);
#pragma unroll 1
  for (int j = (int)threadIdx.x; j < lines; j += (int)blockDim.x) {
    const i64 i = row * lines + j;  // the line's index in x and in every slot
    const u64 residual = ld_bits(reinterpret_cast<const u64*>((const char*)q.residual + i * kLLData));
    u64 in[kMaxRanks];
    u32 pending = 0;  // peers whose line has not arrived
#pragma unroll
    for (int s = 0; s < kMaxRanks; ++s) {
      if (s < p.world) {
        u64 v;
        u32 seen;
        if (s == p.rank) {
          v = ld_bits(reinterpret_cast<const u64*>((const char*)p.local_src + i * kLLData));
        } else if (!ll_try_load(slots + (i64)s * h.slot + i * kLLLine, h.flag, v, seen)) {
          pending |= 1u << s;
        }
        in[s] = v;
      }
    }
    while (pending != 0) {
      const int peer = __ffs(pending) - 1;
      u64 seen = 0;
      const bool ok = spin_until(p, [&] {
#pragma unroll
        for (int s = 0; s < kMaxRanks; ++s) {
          if (((pending >> s) & 1u) == 0) continue;
          u64 v;
          u32 f;
          if (ll_try_load(slots + (i64)s * h.slot + i * kLLLine, h.flag, v, f)) {
            in[s] = v;
            pending &= ~(1u << s);
          }
          if (s == peer) seen = f;
        }
        return ((pending >> peer) & 1u) == 0;
      }, seen, peer, kPhaseData, -1, h.flag);
      if (!ok) return false;
    }
    const u64 r = add_residual_line<T>(ll_combine<T>(in, p.world, 0, OpSum{}), residual, ss);
    st_bits(reinterpret_cast<u64*>((char*)q.residual_out + i * kLLData), r);
  }
  return true;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) allreduce_rmsnorm_oneshot_ll(const RMSNormParams q) {
  constexpr int P = PackOf<T>::kElems;
  const AllReduceParams& p = q.ar;
  __shared__ BlockState st;
  __shared__ float part[kThreads / 32];
  LLHalf h;
  const i64 nbytes = p.count * (i64)sizeof(T);
  if (!rmsnorm_params_ok<T>(q)) {
    bad_params(p);
    return;
  }
  if (!ll_begin(p, ll_lines(nbytes), st, h)) return;
  ll_announce(p, h, kRowsStart, false);
  // Send: the whole grid spreads x over the peers, pack i as lines 2i and
  // 2i + 1 of this rank's a slot in each peer's buffer.
  const i64 nbpacks = nbytes / kPackBytes;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < nbpacks; i += (i64)gridDim.x * blockDim.x) {
    const V16 v = ld_v16((const char*)p.local_src + i * kPackBytes);
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      if (d >= p.world || d == p.rank) continue;
      char* line = ll_slot_a(p, h, d, p.rank) + 2 * i * kLLLine;
      ll_store(line, ((u64)v.y << 32) | v.x, h.flag);
      ll_store(line + kLLLine, ((u64)v.w << 32) | v.z, h.flag);
    }
  }
  if (ll_agree(p, h, st, kRowsStart)) {
    const int packs = q.hidden / P;
    for (i64 row = blockIdx.x; row < q.rows; row += gridDim.x) {
      float ss = 0.0f;
      // A thread whose wait failed takes the whole block out of the loop at
      // this barrier, which every thread reaches (the rank has failed: the
      // communicator is unusable, and the outputs undefined).
      if (__syncthreads_or(!ll_row_pass1<T>(q, h, row, ss))) break;
      normalize_row<T>(q, packs, row, ss, part);
    }
  }
  ll_end(p, st);
}

// ---------------------------------------------------------------- one-shot, Lamport

// lamport_row finishes a row in registers. A thread's packs of the row are
// the same in both passes (pack t, t + blockDim.x, ...; kRowPacks at most),
// so residual_out stays in registers for the norm instead of being read
// back, and the residual and weight are loaded before any peer is polled.
// Every rank's pack is summed as it arrives from its area here, which is
// then freed. False, for the whole block, when a wait failed.
template <typename T, int W>
DINLINE bool lamport_row(const RMSNormParams& q, const LamportHalf& l, int packs, i64 row, float* part) {
  const AllReduceParams& p = q.ar;
  const i64 nbytes = p.count * (i64)sizeof(T), row_bytes = (i64)packs * kPackBytes;
  V16 res[kRowPacks], w[kRowPacks], own[kRowPacks];
#pragma unroll
  for (int k = 0; k < kRowPacks; ++k) {
    const i64 off = row_pack(q, packs, row, k);
    if (off < 0) continue;
    res[k] = ld_v16((const char*)q.residual + off);
    w[k] = ld_weight((const char*)q.weight + (off - row * row_bytes));
    own[k] = lamport_load<T, false>((const char*)p.local_src, nbytes, off / kPackBytes);
  }
  float ss = 0.0f;
  bool ok = true;
#pragma unroll
  for (int k = 0; k < kRowPacks; ++k) {
    const i64 off = row_pack(q, packs, row, k);
    if (off < 0 || !ok) continue;
    V16 in[kMaxRanks];
#pragma unroll
    for (int s = 0; s < W; ++s) {
      if (s < p.world) in[s] = s == p.rank ? own[k] : ld_v16_volatile(lamport_area(p, l, p.rank, s) + off);
    }
#pragma unroll
    for (int s = 0; s < W; ++s) {
      if (s < p.world && s != p.rank) {
        char* at = lamport_area(p, l, p.rank, s) + off;
        ok = ok && (lamport_arrived(in[s]) || lamport_wait(p, at, s, in[s]));
        st_v16(at, kLamportFreeVector);
      }
    }
    res[k] = add_residual<T>(sum_ranks<T>(in, p.world), res[k], ss);
    st_v16((char*)q.residual_out + off, res[k]);
  }
  if (__syncthreads_or(!ok)) return false;
  const float inv = rsqrtf(block_sum(ss, part) / (float)q.hidden + q.eps);
#pragma unroll
  for (int k = 0; k < kRowPacks; ++k) {
    const i64 off = row_pack(q, packs, row, k);
    if (off >= 0) st_v16((char*)q.ar.out + off, scale_pack<T>(res[k], inv, w[k]));
  }
  return true;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) allreduce_rmsnorm_oneshot_lamport(const RMSNormParams q) {
  constexpr int P = PackOf<T>::kElems;
  const AllReduceParams& p = q.ar;
  __shared__ BlockState st;
  __shared__ float part[kThreads / 32];
  LLHalf h;
  LamportHalf l;
  const i64 vectors = p.count * (i64)sizeof(T) / kPackBytes;  // rows of whole packs
  if (!rmsnorm_params_ok<T>(q)) {
    bad_params(p);
    return;
  }
  if (!lamport_begin(p, vectors, st, h, l)) return;
  lamport_push<T, false>(p, l, vectors, false);
  if (ll_agree(p, h, st, kRowsStart)) {
    const int packs = q.hidden / P;
    for (i64 row = blockIdx.x; row < q.rows; row += gridDim.x) {
      // As in the LL one-shot: a failed wait takes the whole block out.
      if (!(p.world <= 2   ? lamport_row<T, 2>(q, l, packs, row, part)
            : p.world <= 4 ? lamport_row<T, 4>(q, l, packs, row, part)
                           : lamport_row<T, kMaxRanks>(q, l, packs, row, part)))
        break;
    }
  } else {
    lamport_push<T, false>(p, l, vectors, true);
  }
  ll_end(p, st);
}

// ---------------------------------------------------------------- two-shot, barriers

// row_slice is the rows of slice s, [begin, end), of which block b owns
// begin + b, begin + b + grid, ...
DINLINE Range row_slice(const RMSNormParams& q, int s) {
  const i64 per = (q.rows + q.ar.world - 1) / q.ar.world;
  Range r;
  r.begin = per * s < q.rows ? per * s : q.rows;
  r.end = r.begin + per < q.rows ? r.begin + per : q.rows;
  return r;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) allreduce_rmsnorm_twoshot(const RMSNormParams q) {
  constexpr int P = PackOf<T>::kElems;
  const AllReduceParams& p = q.ar;
  __shared__ BlockState st;
  __shared__ float part[kThreads / 32];
  if (!params_ok(p, Needs{true, false, false}) || !rmsnorm_params_ok<T>(q)) {
    bad_params(p);
    return;
  }
  begin_block(p, st);
  const int packs = q.rows > 0 ? q.hidden / P : 0;
  const char* x = (const char*)p.local_src;
  // 1. Stage this block's rows of every slice: the peers' block b reads them.
  if (p.world > 1) {
    for (int s = 0; s < p.world; ++s) {
      const Range sl = row_slice(q, s);
      for (i64 row = sl.begin + blockIdx.x; row < sl.end; row += gridDim.x)
        copy_range<T>(x, ptrs1(p.peer_in[p.rank]), 1, Range{row * q.hidden, (row + 1) * q.hidden});
    }
  }
  if (!barrier_all(p, st, kPhaseStart)) return;
  // 2. Reduce this rank's slice, once, from every rank's x (this rank's in
  // place), push each sum into every peer's scratch, and normalize here.
  const Range own = row_slice(q, p.rank);
  for (i64 row = own.begin + blockIdx.x; row < own.end; row += gridDim.x) {
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < kRowPacks; ++k) {
      const i64 off = row_pack(q, packs, row, k);
      if (off < 0) continue;
      const V16 residual = ld_v16((const char*)q.residual + off);
      V16 in[kMaxRanks];
#pragma unroll
      for (int s = 0; s < kMaxRanks; ++s) {
        if (s < p.world) in[s] = ld_v16((s == p.rank ? x : (const char*)p.peer_in[s]) + off);
      }
      const V16 sum = sum_ranks<T>(in, p.world);
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d) {
        if (d < p.world && d != p.rank) st_v16((char*)p.peer_scratch[d] + off, sum);
      }
      store_residual<T>(q, off, sum, residual, ss);
    }
    normalize_row<T>(q, packs, row, ss, part);
  }
  // 3. Every other slice, from the sums its owner pushed here (its block b,
  // before its middle flag).
  if (!barrier_all(p, st, kPhaseMid)) return;
  const char* sums = (const char*)p.peer_scratch[p.rank];
  for (int k = 1; k < p.world; ++k) {
    const Range sl = row_slice(q, (p.rank + k) % p.world);
    for (i64 row = sl.begin + blockIdx.x; row < sl.end; row += gridDim.x) {
      V16 sum[kRowPacks], residual[kRowPacks];
#pragma unroll
      for (int u = 0; u < kRowPacks; ++u) {
        const i64 off = row_pack(q, packs, row, u);
        if (off < 0) continue;
        sum[u] = ld_v16(sums + off);
        residual[u] = ld_v16((const char*)q.residual + off);
      }
      float ss = 0.0f;
#pragma unroll
      for (int u = 0; u < kRowPacks; ++u) {
        const i64 off = row_pack(q, packs, row, u);
        if (off >= 0) store_residual<T>(q, off, sum[u], residual[u], ss);
      }
      normalize_row<T>(q, packs, row, ss, part);
    }
  }
}
