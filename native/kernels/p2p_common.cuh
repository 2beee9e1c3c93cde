// p2p_common.cuh: what every p2pcomm all-reduce kernel shares. Reads top to
// bottom, each layer using only what is above it: limits and enums, the
// layouts shared with the host and between ranks, element types and packs,
// memory and flag primitives, errors and bounded waits, barriers, partitions,
// and the data loops. NVRTC compiles this with no include paths, so it uses
// no system header; it is given to NVRTC by its bare name.
//
// Model: one process per GPU; every rank maps every peer's buffers and
// Signal block (CUDA IPC), so a kernel reads and writes peer memory over
// NVLink with plain loads and stores. Blocks of the same index on different
// ranks synchronize with each other through flags; blocks of one rank never
// wait for each other. Byte layouts are tabled in LAYOUT.md for the Go side.
#pragma once

// ---------------------------------------------------------------- limits

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define DINLINE static __device__ __forceinline__

// kMaxRanks is the largest world size; pointer tables have this many slots.
constexpr int kMaxRanks = 8;
// kMaxBlocks is the largest grid the host may launch; Signal has one counter
// and one set of flags per block index.
constexpr int kMaxBlocks = 128;
// kThreads is the block size the kernels are built for (launch bounds); the
// host launches between kMaxRanks and kThreads threads, normally kThreads.
constexpr int kThreads = 512;
// kPackBytes is the vector width of every data load and store.
constexpr int kPackBytes = 16;
// kDefaultTimeoutNs bounds every wait when the host passes timeout_ns = 0.
constexpr u64 kDefaultTimeoutNs = 60ull * 1000 * 1000 * 1000;
// P2P_UNROLL: packs per thread per loop iteration (more loads in flight);
// a compile-time knob the host may set with an NVRTC -D option.
#ifndef P2P_UNROLL
#define P2P_UNROLL 2
#endif
// kFlagFence (AllReduceParams.flags): a full system fence before each flag's
// release store, for barriers that publish writes made by earlier kernels.
constexpr unsigned kFlagFence = 1u;
// kFlagPull: two-shot gathers by reading peers' results (faster for large
// payloads on H200) instead of having them pushed.
constexpr unsigned kFlagPull = 2u;
// kFlagDirect: two-shot in place on registered buffers writes each reduced
// slice into every rank's peer_in (the owner alone touches its slice), then
// ends with a barrier, instead of going through scratch.
constexpr unsigned kFlagDirect = 4u;
// kCallShift: bits 8..15 of AllReduceParams.flags say which operation a
// barrier kernel serves (kCall*), so that a peer's timeout can name it: a
// barrier's wait reports step = -1 - call in the ErrorWord.
constexpr unsigned kCallShift = 8;
constexpr int kCallAllReduce = 0;      // an all-reduce's own barriers
constexpr int kCallStreamBarrier = 1;  // comm.stream_barrier()
constexpr int kCallMoeDispatch = 2;    // an MoE dispatch's barrier kernels
constexpr int kCallMoeCombine = 3;     // an MoE combine's barrier kernels
// Deferred one-shot (AllReduceParams.half_bytes != 0) always runs on the
// same grid, kDeferredGrid blocks (fewer under a lower block limit), and
// block b owns chunks b, b + grid, ... of kChunkPacks packs, whatever the
// size: see allreduce_oneshot.cu.
constexpr int kDeferredGrid = 16;
constexpr int kChunkPacks = kThreads;
// kStepBits: step flags carry (epoch << kStepBits) | step, step < 2^kStepBits.
constexpr int kStepBits = 5;
static_assert(2 * kMaxRanks - 3 < (1 << kStepBits), "ring steps must fit in the step bits");

// Op numbers are part of the C ABI (golib/reduce.Op).
enum Op { kOpSum = 0, kOpProd = 1, kOpMin = 2, kOpMax = 3, kOpAvg = 4, kNumOps = 5 };

// Phase selects a flag slot set in Signal and names the wait in ErrorWord.
// Separate slots per phase: a wait for phase X never sees a value that a
// peer wrote for phase Y, so each slot only ever holds one kind of progress.
enum Phase { kPhaseStart = 0, kPhaseMid = 1, kPhaseEnd = 2, kPhaseStep = 3, kNumPhases = 4 };
// kPhaseData names, in ErrorWord only, a wait for a peer's data lines (LL
// kernels: the flags travel inside the data, not in Signal).
constexpr int kPhaseData = kNumPhases;
// kPhaseMoeStart and kPhaseMoeMid name, in ErrorWord only, the in-kernel
// barriers of MoE dispatch and combine (moe.cu; ErrorWord.step = 0 for
// dispatch, 1 for combine): their flags live in the MoE buffers.
constexpr int kPhaseMoeStart = kNumPhases + 1;
constexpr int kPhaseMoeMid = kNumPhases + 2;

// Error codes written to ErrorWord.code. The host may itself store any
// nonzero code (e.g. kErrHostAbort) to make spinning kernels give up.
// kErrMismatch is not fatal: every rank skipped the data and the host clears it.
enum ErrCode { kErrNone = 0, kErrTimeout = 1, kErrBadParams = 2, kErrHostAbort = 3, kErrMismatch = 4 };

// ---------------------------------------------------------------- layouts
// Every struct below is filled or read by the Go host; LAYOUT.md tables the
// byte offsets and the static_asserts pin them.

// Signal is one rank's synchronization block, in that rank's device memory,
// mapped by every peer. Must be zeroed on every rank (and the ranks must
// pass a host barrier) before the first kernel; kernels never reset it.
//
//   offset  size   field
//   0       1024   counter[kMaxBlocks]   u64: calls run by block b (own use)
//   1024    4      abort_claim           u32: 0, or 1 once a block failed
//   1028    4      ll_done               u32: blocks of the running LL kernel that finished
//   1032    8      ll_epoch              u64: LL kernels completed (allreduce_ll.cu)
//   1040    112    pad0
//   1152    32768  flag[4][128][8]       u64: flag[phase][block][src rank]
//   total   33920 (= 265 * 128), aligned to 128
//
// counter[b] is read and advanced only by this rank's block b: its value + 1
// is the epoch of the current call, the same on every rank for block b
// because every rank launches the same grids in the same order.
// flag[ph][b][src] is written only by rank src's block b (remote store) and
// only grows, so waiting for "flag >= target" is exact and needs no reset.
struct alignas(128) Signal {
  u64 counter[kMaxBlocks];
  u32 abort_claim;
  u32 ll_done;
  u64 ll_epoch;
  u64 hier_verdict[2];  // allreduce_hier.cu: block 0's verdict on a call, for the other blocks, by call parity
  u32 pad0[24];
  u64 flag[kNumPhases][kMaxBlocks][kMaxRanks];
};
// NVRTC has no offsetof: each layout asserts its size and that the sizes of
// its fields add up to it (no padding), which pins every offset in the table.
static_assert(sizeof(Signal) == 33920, "Signal size");
static_assert(sizeof(Signal::counter) + sizeof(Signal::abort_claim) + sizeof(Signal::ll_done) +
                      sizeof(Signal::ll_epoch) + sizeof(Signal::hier_verdict) + sizeof(Signal::pad0) == 1152,
              "Signal.flag offset");
static_assert(sizeof(Signal::counter) == 1024 && sizeof(Signal::flag) == 32768, "Signal fields");

// ErrorWord reports the first failure of a rank's kernels. It lives in
// pinned host memory mapped into the device (cuMemHostAlloc DEVICEMAP) and
// is written with system-scope stores: fields first, code last.
//
//   offset size field
//   0      4    code     u32: ErrCode; 0 = no error
//   4      4    rank     i32: rank that recorded it
//   8      4    peer     i32: peer that never arrived (-1: none)
//   12     4    phase    i32: Phase of the wait (-1: none)
//   16     4    block    i32: blockIdx.x
//   20     4    step     i32: ring / recursive-doubling step; in barriers
//                            -1 - the kCall* they serve
//   24     8    expected u64: flag value waited for
//   32     8    seen     u64: flag value last read
//   total  40, aligned to 8
struct ErrorWord {
  u32 code;
  int rank;
  int peer;
  int phase;
  int block;
  int step;
  u64 expected;
  u64 seen;
};
static_assert(sizeof(ErrorWord) == 40 && 6 * sizeof(int) + 2 * sizeof(u64) == 40, "ErrorWord");

// AllReduceParams is the single by-value argument of every all-reduce
// kernel. All pointers are device addresses valid in this process and
// 16-byte aligned (Signal: 128-byte aligned); [rank] entries are local.
//
//   offset size field
//   0      64   peer_in[8]      each rank's input/staging buffer
//   64     64   peer_scratch[8] each rank's scratch buffer (null if unused)
//   128    64   peer_signal[8]  each rank's Signal
//   192    8    local_src       caller's input; null or == peer_in[rank]: no copy
//   200    8    out             result (local)
//   208    8    err             ErrorWord (mapped host memory), may be null
//   216    8    count           i64 elements
//   224    8    timeout_ns      u64; 0 = kDefaultTimeoutNs
//   232    4    rank            i32
//   236    4    world           i32, 1..kMaxRanks
//   240    4    op              i32, Op
//   244    4    signature       i32, the call's summary; ranks must agree
//   248    4    half_bytes      u32: deferred one-shot when nonzero (see oneshot)
//   252    4    flags           u32: kFlagFence
//   256    8    graph_slot      GraphSlot*, may be null (see with_graph_slot)
//   total  264, aligned to 8
struct GraphSlot;
struct AllReduceParams {
  void* peer_in[kMaxRanks];
  void* peer_scratch[kMaxRanks];
  Signal* peer_signal[kMaxRanks];
  const void* local_src;
  void* out;
  ErrorWord* err;
  i64 count;
  u64 timeout_ns;
  int rank;
  int world;
  int op;
  int signature;
  unsigned half_bytes;
  unsigned flags;
  const GraphSlot* graph_slot;
};
static_assert(sizeof(AllReduceParams) == 264, "AllReduceParams size");
static_assert(sizeof(AllReduceParams::peer_in) + sizeof(AllReduceParams::peer_scratch) +
                      sizeof(AllReduceParams::peer_signal) + sizeof(AllReduceParams::local_src) +
                      sizeof(AllReduceParams::out) + sizeof(AllReduceParams::err) ==
                  216,
              "AllReduceParams.count offset");
static_assert(sizeof(AllReduceParams::count) + sizeof(AllReduceParams::timeout_ns) +
                      4 * sizeof(int) + 2 * sizeof(unsigned) + sizeof(AllReduceParams::graph_slot) ==
                  264 - 216,
              "AllReduceParams tail");

// GraphSlot (device memory, one per call captured into a CUDA graph with an
// input the kernel had to stage) says where that input lives once the host
// has registered it on every rank (register_graph_buffers):
//
//   offset size field
//   0      8    ready       u64: 0 = stage as captured; 1 = read peer_in below
//   8      64   peer_in[8]  each rank's copy of the captured input
//   total  72, aligned to 8
struct GraphSlot {
  u64 ready;
  void* peer_in[kMaxRanks];
};
static_assert(sizeof(GraphSlot) == 72, "GraphSlot size");

// with_graph_slot returns the parameters of a call whose graph slot is
// ready: every rank's input read in place, nothing staged. The host sets
// ready on all ranks before any replay, so every rank of a call takes the
// same path. (Two-shot only: the path auto takes for large calls.)
DINLINE AllReduceParams with_graph_slot(const AllReduceParams& args) {
  AllReduceParams p = args;
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) p.peer_in[r] = args.graph_slot->peer_in[r];
  p.local_src = nullptr;
  return p;
}

// ---------------------------------------------------------------- element types

// half16 and bf16 are storage-only 16-bit floats (IEEE binary16 and
// bfloat16); arithmetic happens in float.
struct half16 { u16 bits; };
struct bf16 { u16 bits; };
static_assert(sizeof(half16) == 2 && sizeof(bf16) == 2, "16-bit float storage");

DINLINE float half_to_float(half16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
  return f;
}
DINLINE half16 float_to_half(float f) {  // round to nearest even
  half16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
DINLINE float bf16_to_float(bf16 h) { return __uint_as_float((u32)h.bits << 16); }
DINLINE bf16 float_to_bf16(float f) {  // round to nearest even; NaN stays (quiet) NaN
  u32 u = __float_as_uint(f);
  bf16 h;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    h.bits = (u16)((u >> 16) | 0x0040u);
  } else {
    h.bits = (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return h;
}

// Num<T> gives T's accumulator type and the conversions to and from it;
// 16-bit floats accumulate in float and are rounded once, at the store.
template <typename T> struct Num;
template <> struct Num<float> {
  typedef float Acc;
  DINLINE Acc to(float x) { return x; }
  DINLINE float from(Acc a) { return a; }
};
template <> struct Num<double> {
  typedef double Acc;
  DINLINE Acc to(double x) { return x; }
  DINLINE double from(Acc a) { return a; }
};
template <> struct Num<half16> {
  typedef float Acc;
  DINLINE Acc to(half16 x) { return half_to_float(x); }
  DINLINE half16 from(Acc a) { return float_to_half(a); }
};
template <> struct Num<bf16> {
  typedef float Acc;
  DINLINE Acc to(bf16 x) { return bf16_to_float(x); }
  DINLINE bf16 from(Acc a) { return float_to_bf16(a); }
};
template <> struct Num<int> {
  typedef int Acc;
  DINLINE Acc to(int x) { return x; }
  DINLINE int from(Acc a) { return a; }
};
template <> struct Num<long long> {
  typedef long long Acc;
  DINLINE Acc to(long long x) { return x; }
  DINLINE long long from(Acc a) { return a; }
};

// V16 is one 16-byte vector; Pack<T> views it as kPackBytes / sizeof(T)
// elements. Buffers are 16-byte aligned and packs start at multiples of the
// pack size, so every V16 access is aligned.
struct alignas(16) V16 { u32 x, y, z, w; };
template <typename T> struct PackOf { static constexpr int kElems = kPackBytes / (int)sizeof(T); };
template <typename T> union Pack {
  V16 v;
  T e[PackOf<T>::kElems];
};

// widen gives the floats of one pack of T (exact), narrow rounds floats
// to one pack of T with the bits of Num<T>::from: the pack-wide forms of
// Num's conversions, for kernels bound by issuing instructions (the MoE
// combine's send). bf16 widens by one shift or mask per element, where
// Num<bf16>::to on an extracted half takes two.
template <typename T>
DINLINE void widen(V16 raw, float (&f)[PackOf<T>::kElems]) {
  Pack<T> in;
  in.v = raw;
#pragma unroll
  for (int e = 0; e < PackOf<T>::kElems; ++e) f[e] = Num<T>::to(in.e[e]);
}
template <>
__device__ __forceinline__ void widen<bf16>(V16 raw, float (&f)[8]) {
  const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    f[2 * q] = __uint_as_float(w[q] << 16);             // element 2q: the low half
    f[2 * q + 1] = __uint_as_float(w[q] & 0xffff0000u);  // 2q + 1: the high half
  }
}

// narrow<bf16> on sm_80 and later: one cvt.rn.bf16x2.f32 per two elements
// (round to nearest even, as float_to_bf16) instead of ~7 integer
// instructions per element; float_to_bf16 still takes a pack with a NaN
// (its sum is NaN; inf - inf sends a NaN-free pack there too, with the same
// bits), whose payload cvt would not keep. The all-reduce kernels still
// convert element by element (Num<T>::from): moving them is not measured.
template <typename T>
DINLINE V16 narrow(const float (&f)[PackOf<T>::kElems]) {
  Pack<T> o;
#pragma unroll
  for (int e = 0; e < PackOf<T>::kElems; ++e) o.e[e] = Num<T>::from(f[e]);
  return o.v;
}
template <>
__device__ __forceinline__ V16 narrow<bf16>(const float (&f)[8]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const float any = ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
  if (any == any) {  // no NaN among them
    u32 w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[q]) : "f"(f[2 * q + 1]), "f"(f[2 * q]));
    return V16{w[0], w[1], w[2], w[3]};
  }
#endif
  Pack<bf16> o;
#pragma unroll
  for (int e = 0; e < 8; ++e) o.e[e] = float_to_bf16(f[e]);
  return o.v;
}

// UIntOf<N> is the unsigned integer of N bytes, for scalar (tail) moves.
template <int N> struct UIntOf;
template <> struct UIntOf<2> { typedef u16 type; };
template <> struct UIntOf<4> { typedef u32 type; };
template <> struct UIntOf<8> { typedef u64 type; };

// ---------------------------------------------------------------- memory primitives
// Data loads use ld.global.cg (L2, not L1): the data was written during this
// kernel by another agent, and L1 is not coherent. All asm is volatile with a
// memory clobber so the compiler keeps it on its side of __syncthreads.

DINLINE V16 ld_v16(const void* p) {
  V16 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
DINLINE void st_v16(void* p, V16 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
DINLINE u16 ld_bits(const u16* p) {
  u16 v;
  asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
  return v;
}
DINLINE u32 ld_bits(const u32* p) {
  u32 v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
DINLINE u64 ld_bits(const u64* p) {
  u64 v;
  asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
DINLINE void st_bits(u16* p, u16 v) { asm volatile("st.global.u16 [%0], %1;" :: "l"(p), "h"(v) : "memory"); }
DINLINE void st_bits(u32* p, u32 v) { asm volatile("st.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
DINLINE void st_bits(u64* p, u64 v) { asm volatile("st.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }

// ld_elem / st_elem move one T (the scalar tail) with the same cache policy.
template <typename T> DINLINE T ld_elem(const char* p) {
  typedef typename UIntOf<sizeof(T)>::type U;
  union { T t; U u; } c;
  c.u = ld_bits(reinterpret_cast<const U*>(p));
  return c.t;
}
template <typename T> DINLINE void st_elem(char* p, T x) {
  typedef typename UIntOf<sizeof(T)>::type U;
  union { T t; U u; } c;
  c.t = x;
  st_bits(reinterpret_cast<U*>(p), c.u);
}

// Flags: acquire loads and release stores at system scope (the peers are
// other GPUs). A waiter that sees a value also sees everything the writer's
// block wrote before it (see publish in the barriers below).
DINLINE u64 ld_flag_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
DINLINE void st_flag_release(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
DINLINE void st_flag_relaxed(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

// A poll of host memory (across PCIe): ld_poll in the loop, poll_acquired
// once it saw the value, together an acquire. Where the one-way acquire
// fence exists (sm_90, PTX 8.6), relaxed polls and one fence after them see
// the host's store sooner than acquire loads do (tools/fifo_latency.cu,
// rlx+facq); elsewhere the only fence is two-way, which costs more than the
// acquire loads, so they stay.
#if __CUDA_ARCH__ >= 900 && (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 8))
#define P2P_ACQUIRE_FENCE 1
#endif
DINLINE u64 ld_poll(const u64* p) {
#ifdef P2P_ACQUIRE_FENCE
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return ld_flag_acquire(p);
#endif
}
DINLINE void poll_acquired() {
#ifdef P2P_ACQUIRE_FENCE
  asm volatile("fence.acquire.sys;" ::: "memory");
#endif
}
DINLINE u32 ld_volatile_u32(const u32* p) { return *reinterpret_cast<const volatile u32*>(p); }
DINLINE u64 global_timer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---------------------------------------------------------------- reduction operators
// Integer sum and product wrap (two's complement) like torch; float min and
// max propagate NaN like torch.minimum / torch.maximum.

DINLINE int wrap_add(int a, int b) { return (int)((u32)a + (u32)b); }
DINLINE long long wrap_add(long long a, long long b) { return (long long)((u64)a + (u64)b); }
DINLINE float wrap_add(float a, float b) { return a + b; }
DINLINE double wrap_add(double a, double b) { return a + b; }
DINLINE int wrap_mul(int a, int b) { return (int)((u32)a * (u32)b); }
DINLINE long long wrap_mul(long long a, long long b) { return (long long)((u64)a * (u64)b); }
DINLINE float wrap_mul(float a, float b) { return a * b; }
DINLINE double wrap_mul(double a, double b) { return a * b; }
template <typename A> DINLINE bool is_nan(A a) { return a != a; }  // false for integers

// A reduction body is written once for an operator type O (o.apply(a, b)).
// A kernel holds two: OpSum for sum and avg, the common case, and OpOther
// for prod, min and max behind the runtime op, with one pack per thread per
// step. Four bodies, one per op, made NVRTC's build of every reducing kernel
// far longer (figures in docs/BENCHMARKS.md).
struct OpSum {
  static constexpr int kUnroll = P2P_UNROLL;
  template <typename A> DINLINE A apply(A a, A b) { return wrap_add(a, b); }
};
struct OpOther {
  static constexpr int kUnroll = 1;
  int op;  // kOpProd, kOpMin or kOpMax
  template <typename A> __device__ __forceinline__ A apply(A a, A b) const {
    if (op == kOpProd) return wrap_mul(a, b);
    if (is_nan(a)) return a;
    if (is_nan(b)) return b;
    return (op == kOpMin ? b < a : a < b) ? b : a;
  }
};

// is_other_op: the ops reduced with OpOther; sum and avg reduce with OpSum.
DINLINE bool is_other_op(int op) { return op == kOpProd || op == kOpMin || op == kOpMax; }

// divide_by finishes avg: float division, or floor division for integers
// (torch.div(rounding_mode="floor")). d >= 1.
DINLINE float divide_by(float a, int d) { return a / (float)d; }
DINLINE double divide_by(double a, int d) { return a / (double)d; }
DINLINE int divide_by(int a, int d) {
  int q = a / d;
  return (a % d != 0 && a < 0) ? q - 1 : q;
}
DINLINE long long divide_by(long long a, int d) {
  long long q = a / d;
  return (a % d != 0 && a < 0) ? q - 1 : q;
}

// ---------------------------------------------------------------- errors and bounded waits

// BlockState is per-block shared state: this call's epoch and the sticky
// abort flag every thread checks after a barrier.
struct BlockState {
  u64 epoch;
  int abort;
};

// Start flags carry (epoch << 32) | signature: one store tells a peer both
// that this rank arrived and which call it is making.
// kRejectSignature marks a rank that rejected its own arguments.
constexpr int kRejectSignature = -1;
DINLINE u64 start_value(u64 epoch, int signature) { return (epoch << 32) | (u64)(u32)signature; }

DINLINE bool aligned(const void* q, u64 a) { return ((u64)q & (a - 1)) == 0; }

DINLINE bool rank_ok(const AllReduceParams& p) {
  return p.world >= 1 && p.world <= kMaxRanks && p.rank >= 0 && p.rank < p.world;
}

// Waiter is what a bounded wait needs when the kernel's parameters are not
// AllReduceParams (MoE kernels): where to claim and record a failure (this
// rank's Signal, may be null; the host ErrorWord, may be null), how long to
// wait (0: kDefaultTimeoutNs) and the rank to record. report_error,
// spin_until and wait_flag take either, through the accessors below; for
// AllReduceParams they read the fields where they are used (the parameter
// bank), which keeps them out of the registers of the all-reduce kernels.
struct Waiter {
  Signal* self;
  ErrorWord* err;
  u64 timeout_ns;
  int rank;
};
DINLINE Signal* claim_signal(const AllReduceParams& p) { return rank_ok(p) ? p.peer_signal[p.rank] : nullptr; }
DINLINE const Signal* abort_signal(const AllReduceParams& p) { return p.peer_signal[p.rank]; }
DINLINE ErrorWord* error_word(const AllReduceParams& p) { return p.err; }
DINLINE u64 timeout_of(const AllReduceParams& p) { return p.timeout_ns; }
DINLINE int rank_of(const AllReduceParams& p) { return p.rank; }
DINLINE Signal* claim_signal(const Waiter& w) { return w.self; }
DINLINE const Signal* abort_signal(const Waiter& w) { return w.self; }
DINLINE ErrorWord* error_word(const Waiter& w) { return w.err; }
DINLINE u64 timeout_of(const Waiter& w) { return w.timeout_ns; }
DINLINE int rank_of(const Waiter& w) { return w.rank; }

// report_error records the first failure of this rank: the winner of the
// device-memory claim in its own Signal writes the host ErrorWord (fields,
// fence, then code) unless the host already stored a code. One thread calls.
template <typename P>
DINLINE void report_error(const P& p, u32 code, int peer, int phase, int step, u64 expected, u64 seen) {
  Signal* self = claim_signal(p);
  if (self != nullptr && aligned(self, 128) && atomicCAS(&self->abort_claim, 0u, 1u) != 0u) return;
  ErrorWord* const err = error_word(p);
  if (err == nullptr || !aligned(err, 8)) return;
  volatile ErrorWord* e = err;
  if (e->code != 0) return;
  e->rank = rank_of(p);
  e->peer = peer;
  e->phase = phase;
  e->block = (int)blockIdx.x;
  e->step = step;
  e->expected = expected;
  e->seen = seen;
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}

// record_mismatch records that peer made a different call, seen in phase.
// Unlike report_error it takes no abort claim: the communicator stays
// usable, so later calls must not see this rank as failed. Racing writers
// store the same kind of record; the host clears the code once it has read
// it.
DINLINE void record_mismatch(ErrorWord* err, int rank, int peer, int phase, u64 expected, u64 seen) {
  if (err == nullptr || !aligned(err, 8)) return;
  volatile ErrorWord* e = err;
  if (e->code != 0) return;
  e->rank = rank;
  e->peer = peer;
  e->phase = phase;
  e->block = (int)blockIdx.x;
  e->step = -1;
  e->expected = expected;
  e->seen = seen;
  __threadfence_system();
  e->code = kErrMismatch;
  __threadfence_system();
}

// report_mismatch is record_mismatch at the start barrier of a call.
DINLINE void report_mismatch(const AllReduceParams& p, int peer, u64 expected, u64 seen) {
  record_mismatch(p.err, p.rank, peer, kPhaseStart, expected, seen);
}

// spin_until polls arrived() (which reads what it waits for and leaves
// the last value read in seen) until it returns true, and returns true; it
// returns false after timeout_ns (recording kErrTimeout with the peer, the
// value expected and the value seen), or as soon as another block of this
// rank failed (abort_claim) or the host stored a code. Every device-side wait
// goes through here, so every one is bounded the same way.
template <typename P, typename Arrived>
DINLINE bool spin_until(const P& p, Arrived arrived, const u64& seen, int peer, int phase, int step,
                        u64 expected) {
  if (arrived()) return true;
  const Signal* self = abort_signal(p);
  const u64 timeout = timeout_of(p) != 0 ? timeout_of(p) : kDefaultTimeoutNs;
  const u64 start = global_timer_ns();
  for (u32 spin = 1;; ++spin) {
    if (arrived()) return true;
    if ((spin & 63u) != 0) continue;
    if (self != nullptr && ld_volatile_u32(&self->abort_claim) != 0) return false;
    // The host word is across PCIe: look at it rarely.
    // A mismatch recorded by an earlier call is not fatal: keep waiting.
    if ((spin & 0x3fffu) == 0 && error_word(p) != nullptr) {
      const u32 code = ld_volatile_u32(&error_word(p)->code);
      if (code != 0 && code != kErrMismatch) return false;
    }
    if (global_timer_ns() - start > timeout) {
      report_error(p, kErrTimeout, peer, phase, step, expected, seen);
      return false;
    }
  }
}

// wait_flag waits until *flag >= target (see spin_until). One thread per
// peer calls it; the caller turns false into BlockState.abort.
template <typename P>
DINLINE bool wait_flag(const P& p, const u64* flag, u64 target, int peer, int phase, int step) {
  u64 seen = 0;
  return spin_until(p, [&] { return (seen = ld_flag_acquire(flag)) >= target; }, seen, peer, phase, step, target);
}

// ---------------------------------------------------------------- LL lines
// An LL line is 16 bytes {data0, flag, data1, flag}: 8 data bytes, each
// 4-byte half stored together with a flag in one 16-byte store, so a reader
// that sees the flag twice sees the data without any other synchronization.

// kLLLine: bytes of one LL line; kLLData: data bytes it carries.
constexpr i64 kLLLine = 16;
constexpr i64 kLLData = 8;


// ll_flag is the flag of LL call epoch e: never 0 (fresh memory), and
// different for e and e - 2 (the previous call on the same half).
DINLINE u32 ll_flag(u64 e) { return (u32)e != 0u ? (u32)e : 1u; }

// ll_store writes 8 data bytes with the flag next to each 4-byte half, in
// one 16-byte store: a reader that sees both flags sees both halves.
DINLINE void ll_store(char* line, u64 data, u32 flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};"
               :: "l"(line), "r"((u32)data), "r"(flag), "r"((u32)(data >> 32)), "r"(flag) : "memory");
}

// ll_try_load reads a line; true when both halves carry flag.
DINLINE bool ll_try_load(const char* line, u32 flag, u64& data, u32& seen) {
  u32 d0, f0, d1, f1;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1) : "l"(line) : "memory");
  data = ((u64)d1 << 32) | d0;
  seen = f0 != flag ? f0 : f1;
  return f0 == flag && f1 == flag;
}

// ll_wait polls a line of this rank's buffer until it carries flag,
// bounded like every wait (spin_until).
template <typename P>
DINLINE bool ll_wait(const P& p, const char* line, u32 flag, int peer, int phase, u64& data) {
  u64 seen = 0;
  return spin_until(p, [&] {
    u32 f;
    const bool ok = ll_try_load(line, flag, data, f);
    seen = f;
    return ok;
  }, seen, peer, phase, -1, flag);
}

// ---------------------------------------------------------------- block prologue and barriers

// begin_block advances this block's call counter and initializes st. Every
// thread calls it after the (uniform) parameter check; it ends with
// __syncthreads so st is visible to all.
DINLINE void begin_block(const AllReduceParams& p, BlockState& st) {
  if (threadIdx.x == 0) {
    // Only block b of this rank touches counter[b]; stream order makes the
    // previous call's store visible here.
    Signal* self = p.peer_signal[p.rank];
    const u64 epoch = self->counter[blockIdx.x] + 1;
    self->counter[blockIdx.x] = epoch;
    st.epoch = epoch;
    st.abort = 0;
  }
  __syncthreads();
}

DINLINE u64 step_value(u64 epoch, int step) { return (epoch << kStepBits) | (u64)step; }

// publish makes every write this block made before the preceding
// __syncthreads visible system-wide, then stores v into a peer's flag slot:
// bar.sync orders the block's writes before this thread's fence, and the
// fence + release store order them before the flag (cumulativity).
DINLINE void publish(const AllReduceParams& p, Signal* to, int phase, int from_rank, u64 v) {
  // The release store is cumulative over what bar.sync ordered before it;
  // the full fence is for writes made by earlier kernels (kFlagFence).
  if (p.flags & kFlagFence) __threadfence_system();
  st_flag_release(&to->flag[phase][blockIdx.x][from_rank], v);
}

// staged_nothing: this kernel wrote nothing its peers will read before the
// start barrier (the input is peer_in[rank] already, written by earlier
// kernels of the stream, which peers read coherently; the deferred one-shot
// always stages), and the caller asked for no fence. Its start flag then
// orders no data and goes out relaxed, which reaches the peer sooner than a
// release store (tools/flag_latency.cu).
DINLINE bool staged_nothing(const AllReduceParams& p) {
  const bool staged = p.local_src != nullptr && (p.local_src != p.peer_in[p.rank] || p.half_bytes != 0);
  return !staged && (p.flags & kFlagFence) == 0;
}

// barrier_all: block b of every rank waits until block b of every other rank
// has reached the same phase of the same call. Thread t < world talks to rank
// t, in parallel. Returns false (uniformly) if any wait failed.
DINLINE bool barrier_all(const AllReduceParams& p, BlockState& st, int phase) {
  __syncthreads();  // this block's writes before the flags (see publish)
  const int t = (int)threadIdx.x;
  const int step = -1 - (int)((p.flags >> kCallShift) & 0xffu);
  if (t < p.world && t != p.rank) {
    const Signal* self = p.peer_signal[p.rank];
    const u64* slot = &self->flag[phase][blockIdx.x][t];
    if (phase == kPhaseStart) {
      // Peers skip the data together if any two ranks disagree on the call:
      // everyone compares with everyone, so the odd rank out is seen by all.
      const u64 mine = start_value(st.epoch, p.signature);
      if (staged_nothing(p)) {
        st_flag_relaxed(&p.peer_signal[t]->flag[phase][blockIdx.x][p.rank], mine);
      } else {
        publish(p, p.peer_signal[t], phase, p.rank, mine);
      }
      if (!wait_flag(p, slot, st.epoch << 32, t, phase, step)) {
        st.abort = 1;
      } else {
        const u64 theirs = ld_flag_acquire(slot);
        if (theirs != mine) {
          // A rank that rejected its own arguments already raised on the host.
          if (p.signature != kRejectSignature) report_mismatch(p, t, mine, theirs);
          st.abort = 1;
        }
      }
    } else {
      publish(p, p.peer_signal[t], phase, p.rank, st.epoch);
      if (!wait_flag(p, slot, st.epoch, t, phase, step)) st.abort = 1;
    }
  }
  __syncthreads();  // the acquires above before any thread reads peer data
  return st.abort == 0;
}

// sync_step: thread 0 optionally posts value to rank post_to's slot, then
// optionally waits for rank wait_from's slot to reach wait_value. Used by
// the ring and recursive doubling, which only talk to one or two peers.
DINLINE bool sync_step(const AllReduceParams& p, BlockState& st, int phase, int post_to,
                       u64 post_value, int wait_from, u64 wait_value, int step) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (post_to >= 0) publish(p, p.peer_signal[post_to], phase, p.rank, post_value);
    if (wait_from >= 0) {
      const Signal* self = p.peer_signal[p.rank];
      if (!wait_flag(p, &self->flag[phase][blockIdx.x][wait_from], wait_value, wait_from, phase,
                     step)) {
        st.abort = 1;
      }
    }
  }
  __syncthreads();
  return st.abort == 0;
}

// ---------------------------------------------------------------- partitions
// Same-index blocks on different ranks pair up through flags, so whenever a
// phase reads what another rank's block wrote in an earlier phase, both use
// the same block_range of the same element range.

struct Range {
  i64 begin, end;  // elements, [begin, end); empty when begin >= end
};

// block_range splits [lo, hi) (lo a multiple of pack) into gridDim.x runs of
// whole packs; run b may be empty, and only the run ending at hi may end
// inside a pack.
DINLINE Range block_range(i64 lo, i64 hi, int pack) {
  const i64 packs = (hi - lo + pack - 1) / pack;
  const i64 per = (packs + gridDim.x - 1) / gridDim.x;
  Range r;
  r.begin = lo + (i64)blockIdx.x * per * pack;
  if (r.begin > hi) r.begin = hi;
  r.end = r.begin + per * pack;
  if (r.end > hi) r.end = hi;
  return r;
}

// slice_range is slice s of count elements cut into world slices whose size
// is a multiple of pack (so every slice starts 16-byte aligned); trailing
// slices may be short or empty. Two-shot slices and ring chunks use it.
DINLINE Range slice_range(i64 count, int world, int s, int pack) {
  i64 size = (count + world - 1) / world;
  size = (size + pack - 1) / pack * pack;
  Range r;
  r.begin = (i64)s * size;
  if (r.begin > count) r.begin = count;
  r.end = r.begin + size;
  if (r.end > count) r.end = count;
  return r;
}

// region_bytes is the stride between scratch regions of one call:
// count * sizeof(T) rounded up to 128 bytes.
template <typename T> DINLINE i64 region_bytes(i64 count) {
  return (count * (i64)sizeof(T) + 127) / 128 * 128;
}

// ---------------------------------------------------------------- data loops
// Thread layout: thread t of the block handles packs t, t + blockDim.x, ...
// of the range. Sources are combined strictly in the order given, so a value
// computed on any rank is bit-identical to the same computation elsewhere.

// Ptrs is a small table of byte pointers (sources or destinations).
struct Ptrs {
  char* p[kMaxRanks];
};

// pick returns table[i] without dynamic indexing of the parameter array.
DINLINE void* pick(void* const* table, int i) {
  void* v = nullptr;
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) {
    if (r == i) v = table[r];
  }
  return v;
}

DINLINE Ptrs ptrs1(const void* a) {
  Ptrs t;
  t.p[0] = (char*)a;
  return t;
}
DINLINE Ptrs ptrs2(const void* a, const void* b) {
  Ptrs t;
  t.p[0] = (char*)a;
  t.p[1] = (char*)b;
  return t;
}
DINLINE Ptrs ptrs_all(void* const* table, int world) {
  Ptrs t;
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) t.p[r] = r < world ? (char*)table[r] : nullptr;
  return t;
}

// copy_range copies elements [r.begin, r.end) of src to the same positions
// of ndst destinations, bit for bit.
template <typename T>
DINLINE void copy_range(const char* src, const Ptrs& dst, int ndst, Range r) {
  constexpr int P = PackOf<T>::kElems;
  constexpr int U = P2P_UNROLL;
  const i64 stride = (i64)blockDim.x * P;
  for (i64 base = r.begin + (i64)threadIdx.x * P; base < r.end; base += U * stride) {
    V16 v[U];  // U loads in flight before the first store
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 i = base + u * stride;
      if (i + P <= r.end) v[u] = ld_v16(src + i * (i64)sizeof(T));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 i = base + u * stride;
      const i64 off = i * (i64)sizeof(T);
      if (i + P <= r.end) {
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
          if (d < ndst) st_v16(dst.p[d] + off, v[u]);
        }
      } else if (i < r.end) {  // the range's last, partial pack
        for (i64 k = i; k < r.end; ++k) {
          const i64 o = k * (i64)sizeof(T);
          const T x = ld_elem<T>(src + o);
          for (int d = 0; d < ndst; ++d) st_elem<T>(dst.p[d] + o, x);
        }
      }
    }
  }
}

// finish applies avg's division on the step that produces final values.
template <typename A> DINLINE A finish(A a, int divisor) {
  return divisor > 0 ? divide_by(a, divisor) : a;
}

// reduce_range_op: dst[d][i] = src[0][i] O src[1][i] O ... (left to right,
// in Acc), divided by divisor when divisor > 0 (avg), rounded once to T.
template <typename T, typename O>
DINLINE void reduce_range_op(const Ptrs& src, int nsrc, const Ptrs& dst, int ndst, Range r,
                             int divisor, const O red) {
  typedef typename Num<T>::Acc Acc;
  constexpr int P = PackOf<T>::kElems;
  constexpr int U = O::kUnroll;
  const i64 stride = (i64)blockDim.x * P;
  for (i64 base = r.begin + (i64)threadIdx.x * P; base < r.end; base += U * stride) {
    // U packs per thread, all loads of all sources in flight before any math.
    V16 raw[U][kMaxRanks];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 i = base + u * stride;
      if (i + P <= r.end) {
#pragma unroll
        for (int s = 0; s < kMaxRanks; ++s) {
          if (s < nsrc) raw[u][s] = ld_v16(src.p[s] + i * (i64)sizeof(T));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 i = base + u * stride;
      const i64 off = i * (i64)sizeof(T);
      if (i + P <= r.end) {
        Pack<T> in;
        in.v = raw[u][0];
        Acc acc[P];
#pragma unroll
        for (int j = 0; j < P; ++j) acc[j] = Num<T>::to(in.e[j]);
#pragma unroll
        for (int s = 1; s < kMaxRanks; ++s) {
          if (s < nsrc) {
            in.v = raw[u][s];
#pragma unroll
            for (int j = 0; j < P; ++j) acc[j] = red.apply(acc[j], Num<T>::to(in.e[j]));
          }
        }
        Pack<T> o;
#pragma unroll
        for (int j = 0; j < P; ++j) o.e[j] = Num<T>::from(finish(acc[j], divisor));
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
          if (d < ndst) st_v16(dst.p[d] + off, o.v);
        }
      } else if (i < r.end) {  // the range's last, partial pack: scalar
        for (i64 k = i; k < r.end; ++k) {
          const i64 at = k * (i64)sizeof(T);
          Acc acc = Num<T>::to(ld_elem<T>(src.p[0] + at));
          for (int s = 1; s < nsrc; ++s) acc = red.apply(acc, Num<T>::to(ld_elem<T>(src.p[s] + at)));
          const T x = Num<T>::from(finish(acc, divisor));
          for (int d = 0; d < ndst; ++d) st_elem<T>(dst.p[d] + at, x);
        }
      }
    }
  }
}

// reduce_range dispatches on the runtime op (avg reduces as sum; the caller
// passes divisor = world on the step that produces final values).
template <typename T>
DINLINE void reduce_range(const Ptrs& src, int nsrc, const Ptrs& dst, int ndst, Range r, int op,
                          int divisor) {
  if (is_other_op(op)) {
    reduce_range_op<T>(src, nsrc, dst, ndst, r, divisor, OpOther{op});
  } else {
    reduce_range_op<T>(src, nsrc, dst, ndst, r, divisor, OpSum{});
  }
}

// ---------------------------------------------------------------- staging and checks

// needs_staging: the caller's input is not already this rank's peer_in.
DINLINE bool needs_staging(const AllReduceParams& p) {
  return p.local_src != nullptr && p.local_src != p.peer_in[p.rank];
}

// stage_flat copies this block's block_range of [0, count) of local_src into
// peer_in[rank] (the fused staging copy), for kernels whose peers read the
// input with that partition.
template <typename T> DINLINE void stage_flat(const AllReduceParams& p) {
  if (!needs_staging(p)) return;
  copy_range<T>((const char*)p.local_src, ptrs1(p.peer_in[p.rank]), 1,
                block_range(0, p.count, PackOf<T>::kElems));
}

// stage_sliced is stage_flat for kernels whose peers read the input by
// slice: this block copies its block_range of every slice.
template <typename T> DINLINE void stage_sliced(const AllReduceParams& p) {
  if (!needs_staging(p)) return;
  constexpr int P = PackOf<T>::kElems;
  for (int s = 0; s < p.world; ++s) {
    const Range sl = slice_range(p.count, p.world, s, P);
    copy_range<T>((const char*)p.local_src, ptrs1(p.peer_in[p.rank]), 1,
                  block_range(sl.begin, sl.end, P));
  }
}

// local_only handles world == 1 for kernels whose general path needs a peer:
// the reduction of one value is the value itself (avg divides by 1).
template <typename T> DINLINE void local_only(const AllReduceParams& p) {
  const void* src = p.local_src != nullptr ? p.local_src : p.peer_in[p.rank];
  if (src == p.out) return;
  copy_range<T>((const char*)src, ptrs1(p.out), 1, block_range(0, p.count, PackOf<T>::kElems));
}

// Needs says what a kernel requires of its parameters beyond the common
// checks.
struct Needs {
  bool scratch;          // peer_scratch[r] must be set for r < world
  bool out_may_alias_in; // out == peer_in[rank] is safe (two-shot only)
  bool pow2_world;       // world must be a power of two
};

// params_ok checks the launch and parameters; the result is the same for
// every thread of every block (it reads only uniform values), so a false
// return lets the whole grid leave before any barrier.
DINLINE bool params_ok(const AllReduceParams& p, Needs n) {
  if (!rank_ok(p) || p.op < 0 || p.op >= kNumOps || p.count < 0) return false;
  if (gridDim.x < 1 || gridDim.x > (u32)kMaxBlocks || gridDim.y != 1 || gridDim.z != 1) return false;
  if (blockDim.x < (u32)kMaxRanks || blockDim.x > (u32)kThreads || blockDim.y != 1 || blockDim.z != 1)
    return false;
  if (n.pow2_world && (p.world & (p.world - 1)) != 0) return false;
  if (p.out == nullptr || !aligned(p.out, kPackBytes) || !aligned(p.local_src, kPackBytes)) return false;
  if (p.err != nullptr && !aligned(p.err, 8)) return false;
  for (int r = 0; r < p.world; ++r) {
    if (p.peer_in[r] == nullptr || !aligned(p.peer_in[r], kPackBytes)) return false;
    if (p.peer_signal[r] == nullptr || !aligned(p.peer_signal[r], 128)) return false;
    if (n.scratch && (p.peer_scratch[r] == nullptr || !aligned(p.peer_scratch[r], kPackBytes)))
      return false;
  }
  if (!n.out_may_alias_in && p.out == p.peer_in[p.rank] && p.world > 1) return false;
  if (n.scratch && p.out == p.peer_scratch[p.rank]) return false;
  return true;
}

// check_params runs params_ok and, on failure, has block 0 record
// kErrBadParams. Returns the (uniform) verdict.
DINLINE bool check_params(const AllReduceParams& p, Needs n) {
  if (params_ok(p, n)) return true;
  if (blockIdx.x == 0 && threadIdx.x == 0) report_error(p, kErrBadParams, -1, -1, -1, 0, 0);
  return false;
}
