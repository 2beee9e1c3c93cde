// channel.cuh: the device vocabulary kernels use to talk to one peer.
//
//   MemoryChannel  peer memory mapped over CUDA IPC: the kernel's own loads
//                  and stores move the data (put/get, read/write, LL packets),
//                  and a semaphore in the peer's memory orders it (signal/wait).
//   PortChannel    the kernel pushes 16-byte triggers into a FIFO in pinned
//                  host memory; a CPU proxy (golib/proxy) pops them and runs
//                  each as a transport put, signal or flush.
//
// Reads top to bottom: limits and codes, the layouts shared with Go (each
// pinned by static_assert here and by a Go test that reads this file), the
// trigger encoding, the FIFO push, then the two channels. Handles are plain
// structs passed to kernels by value; the host objects that filled them own
// the memory they point to and must outlive every kernel that uses them. A
// loop over calls on a handle held in an array in global memory should copy
// it into a local first (`const PortChannel c = chans[peer];`): the acquire
// that ends each wait and flush sends later reads of global memory past L1,
// so the array's handle would be read from L2 again at every call.
// Every wait is bounded by the handle's timeout_ns (0: kDefaultTimeoutNs)
// through spin_until, and a timeout records the peer and the phase below in
// the communicator's ErrorWord.
#pragma once
#include "p2p_common.cuh"

// DMETHOD marks handle methods (DINLINE's static cannot apply to members).
#define DMETHOD __device__ __forceinline__

// ---------------------------------------------------------------- limits and codes

// ErrorWord.phase of channel waits (after p2p_common.cuh's phases).
constexpr int kPhaseChannelWait = kNumPhases + 3;  // a semaphore wait (MemoryChannel or PortChannel)
constexpr int kPhaseFifoPush = kNumPhases + 4;     // a push waiting for a free FIFO slot
constexpr int kPhaseFifoFlush = kNumPhases + 5;    // a flush waiting for the proxy
static_assert(kPhaseChannelWait > kPhaseMoeMid, "channel phases follow the MoE phases");
// kErrProxy (ErrorWord.code): the proxy failed a trigger of this FIFO (its
// error is in FifoHostWords.error and, in full, on the host).
constexpr u32 kErrProxy = 5;
static_assert(kErrProxy > kErrMismatch, "codes are distinct");

// Trigger types (bit set in the type field): a put copies bytes, a signal
// adds one to the peer's semaphore after every earlier put of the channel,
// a flush makes the proxy wait until both are complete before it reports the
// trigger done.
constexpr u32 kTriggerPut = 1;
constexpr u32 kTriggerSignal = 2;
constexpr u32 kTriggerFlush = 4;

// Field widths of a trigger (see Trigger); the host refuses registrations
// that do not fit.
constexpr int kTriggerSizeBits = 31;
constexpr int kTriggerOffsetBits = 32;
constexpr int kTriggerMemoryBits = 8;
constexpr int kTriggerTypeBits = 3;
constexpr int kTriggerChannelBits = 10;
constexpr int kTriggerLapBit = 63;
constexpr int kTriggerFstLapBit = 31;
constexpr u32 kMaxMemories = 1u << kTriggerMemoryBits;
// kInlineMemory as a put's src_memory says its bytes travel in the FIFO: the
// pusher copied them into the payload slot of the entry's position (the ring
// is followed by slots payloads of kInlineBytes each), so the proxy sends
// them without a copy from device memory first. Registrations stop below it.
constexpr u32 kInlineMemory = kMaxMemories - 1;
constexpr u32 kInlineBytes = 64;
constexpr u32 kMaxChannels = 1u << kTriggerChannelBits;
static_assert(kTriggerOffsetBits + 2 * kTriggerMemoryBits + kTriggerTypeBits + kTriggerChannelBits <= kTriggerLapBit,
              "the second word's fields end below the lap bit");
static_assert(kTriggerSizeBits == kTriggerFstLapBit, "the first word's lap bit sits between size and src_offset");

// ---------------------------------------------------------------- layouts shared with Go

// Trigger is one FIFO entry, two 64-bit words:
//
//   fst  bits  0..30  size        bytes to put
//        bit  31      lap         a copy of snd's lap bit
//        bits 32..63  src_offset  bytes into the source memory
//   snd  bits  0..31  dst_offset  bytes into the destination memory
//        bits 32..39  src_memory  id of a local memory registered with the proxy
//        bits 40..47  dst_memory  id of a peer memory registered with the proxy
//        bits 48..50  type        kTrigger* bits; never 0
//        bits 51..60  channel     the channel's id in the proxy (peer, semaphore)
//        bits 61..62  0
//        bit  63      lap         1 on even laps of the ring, 0 on odd ones
//
// The device stores both words with one 16-byte store; the lap bit is in
// each word, so the proxy takes an entry only once both words show the lap
// it expects, whether or not the store reaches the host as one. A slot is
// never cleared because the previous lap's entry carries the other bit.
struct alignas(16) Trigger {
  u64 fst;
  u64 snd;
};
static_assert(sizeof(Trigger) == 16, "Trigger size");

// FifoDeviceWords lives in device memory: pushers' atomics on head stay on
// the GPU. tail_cache is the newest FifoHostWords.tail a pusher has read, so
// pushes read host memory only when the ring looks full.
//
//   offset size field
//   0      8    head        u64: next position to claim (atomicAdd)
//   8      120  pad0
//   128    8    tail_cache  u64: a tail value already seen (only grows)
//   136    120  pad1
//   total  256, aligned to 128
struct alignas(128) FifoDeviceWords {
  u64 head;
  u64 pad0[15];
  u64 tail_cache;
  u64 pad1[15];
};
static_assert(sizeof(FifoDeviceWords) == 256 && sizeof(FifoDeviceWords::head) + sizeof(FifoDeviceWords::pad0) == 128,
              "FifoDeviceWords layout");

// FifoHostWords lives in pinned host memory mapped into the device: the proxy
// writes it with plain stores and the GPU reads it over PCIe.
//
//   offset size field
//   0      8    tail   u64: positions popped; slot of position p is free once p < tail + slots
//   8      120  pad0
//   128    8    done   u64: positions handled; a flush at p is complete once done > p
//   136    4    error  u32: nonzero once the proxy failed (stored before done moves)
//   140    116  pad1
//   total  256, aligned to 128
struct alignas(128) FifoHostWords {
  u64 tail;
  u64 pad0[15];
  u64 done;
  u32 error;
  u32 pad1[29];
};
static_assert(sizeof(FifoHostWords) == 256 && sizeof(FifoHostWords::tail) + sizeof(FifoHostWords::pad0) == 128 &&
                  sizeof(FifoHostWords::done) + sizeof(FifoHostWords::error) + sizeof(FifoHostWords::pad1) == 128,
              "FifoHostWords layout");

// FifoHandle is what a kernel needs to push into one FIFO.
//
//   offset size field
//   0      8    ring   Trigger*: slots entries, then slots payloads of kInlineBytes,
//                      pinned host memory (device address)
//   8      8    dev    FifoDeviceWords* (device memory)
//   16     8    host   FifoHostWords* (pinned host memory, device address)
//   24     4    slots  u32: ring entries, a power of two
//   28     4    id     u32: the FIFO's index in its proxy (ErrorWord.step of FIFO waits)
//   total  32, aligned to 8
struct FifoHandle {
  Trigger* ring;
  FifoDeviceWords* dev;
  FifoHostWords* host;
  u32 slots;
  u32 id;
};
static_assert(sizeof(FifoHandle) == 32 && 3 * sizeof(void*) + 2 * sizeof(u32) == 32, "FifoHandle layout");

// PortChannel is a FIFO plus what one channel to one peer adds.
//
//   offset size field
//   0      32   fifo        FifoHandle
//   32     8    sem         u64*: inbound semaphore, device memory; the peer's proxy adds to it
//   40     8    expected    u64*: device memory; signals this channel has waited for
//   48     8    err         ErrorWord* (may be null)
//   56     8    timeout_ns  u64; 0 = kDefaultTimeoutNs
//   64     4    channel     u32: id in the proxy
//   68     4    dst_memory  u32: id of the peer's memory puts write into
//   72     4    src_memory  u32: id of the local memory puts read from
//   76     4    rank        i32: this rank (ErrorWord.rank)
//   80     4    peer        i32: the peer (ErrorWord.peer)
//   84     4    inline_max  u32: puts of at most this many bytes travel in the FIFO
//                           (0: none; at most kInlineBytes)
//   88     8    src_base    const char*: device address of src_memory (inline puts read it)
//   total  96, aligned to 8
//
// The inbound semaphore is device memory because the waiting GPU spins on
// it: a spin on device memory stays in L2, a spin on mapped host memory
// crosses PCIe each time. A transport that cannot write device memory may
// point sem at mapped host memory instead: only this pointer changes.
struct PortChannel;
// MemoryChannel is one peer's memory mapped here.
//
//   offset size field
//   0      8    remote      char*: the peer's buffer, mapped here over CUDA IPC
//   8      8    local       char*: this rank's buffer
//   16     8    packets     char*: this rank's packet buffer the peer's putPackets write
//   24     8    remote_sem  u64*: this rank's semaphore slot in the peer's memory
//   32     8    sem         u64*: the semaphore the peer signals, in local device memory
//   40     8    expected    u64*: device memory; signals this channel has waited for
//   48     8    err         ErrorWord* (may be null)
//   56     8    timeout_ns  u64; 0 = kDefaultTimeoutNs
//   64     4    rank        i32
//   68     4    peer        i32
//   total  72, aligned to 8
struct MemoryChannel;

// ---------------------------------------------------------------- trigger encoding

DINLINE u64 trigger_field(u64 v, int bits) { return v & ((1ull << bits) - 1); }

// make_trigger packs one request (lap bit clear); fields wider than their
// bits are cut, so the host registers only ids and sizes that fit.
DINLINE Trigger make_trigger(u32 type, u32 channel, u32 dst_memory, u64 dst_offset, u32 src_memory,
                             u64 src_offset, u64 size) {
  Trigger t;
  t.fst = trigger_field(size, kTriggerSizeBits) | (trigger_field(src_offset, kTriggerOffsetBits) << 32);
  t.snd = trigger_field(dst_offset, kTriggerOffsetBits) | (trigger_field(src_memory, kTriggerMemoryBits) << 32) |
          (trigger_field(dst_memory, kTriggerMemoryBits) << 40) | (trigger_field(type, kTriggerTypeBits) << 48) |
          (trigger_field(channel, kTriggerChannelBits) << 51);
  return t;
}

// lap_of is the lap bit an entry at position pos carries: 1 on the first
// lap, so zeroed memory never looks fresh.
DINLINE u64 lap_of(u64 pos, u32 slots) { return ((pos / slots) & 1ull) ^ 1ull; }

// ---------------------------------------------------------------- FIFO push

// fifo_push claims the next position, waits (bounded) until its slot is
// free, writes the entry and returns the position, or ~0 after a timeout or
// a proxy failure (recorded in err). Any thread may call it, concurrently.
// A put's or signal's store is a release: this thread's earlier writes are
// visible to the proxy (and the copy it starts); call __syncthreads first
// when other threads of the block wrote the data a put reads. A bare flush
// publishes nothing and is stored relaxed: the proxy runs entries in order.
// copy_inline copies a put's bytes (at most kInlineBytes) into a payload
// slot in mapped host memory, 8 bytes at a time where src allows. The loads
// skip L1, as the copy engine's reads would: other SMs may have written src.
DINLINE void copy_inline(char* slot, const char* src, u32 bytes) {
  volatile char* out = slot;
  u32 i = 0;
  if (aligned(src, 8)) {
    for (; i + 8 <= bytes; i += 8)
      *reinterpret_cast<volatile unsigned long long*>(slot + i) =
          __ldcg(reinterpret_cast<const unsigned long long*>(src + i));
  }
  for (; i < bytes; ++i) out[i] = __ldcg(src + i);
}

template <typename P>
DINLINE u64 fifo_push(const FifoHandle& f, const P& w, int peer, Trigger t, const char* inline_src = nullptr) {
  // The cache only grows, so reading it first is safe, and the two loads
  // overlap instead of following each other.
  const u64 cached = *reinterpret_cast<volatile const u64*>(&f.dev->tail_cache);
  const u64 pos = atomicAdd(reinterpret_cast<unsigned long long*>(&f.dev->head), 1ull);
  if (pos >= cached + f.slots) {
    u64 tail = 0;
    const bool free = spin_until(w, [&] {
      tail = ld_flag_acquire(&f.host->tail);
      return pos < tail + f.slots || ld_volatile_u32(&f.host->error) != 0;
    }, tail, peer, kPhaseFifoPush, (int)f.id, pos + 1 - f.slots);
    if (!free) return ~0ull;
    if (ld_volatile_u32(&f.host->error) != 0) {
      report_error(w, kErrProxy, peer, kPhaseFifoPush, (int)f.id, pos, tail);
      return ~0ull;
    }
    atomicMax(reinterpret_cast<unsigned long long*>(&f.dev->tail_cache), (unsigned long long)tail);
  }
  Trigger* slot = &f.ring[pos & (f.slots - 1)];
  if (inline_src != nullptr) {
    // Before the entry's release store, which publishes these stores too.
    char* payload = reinterpret_cast<char*>(f.ring + f.slots) + (pos & (f.slots - 1)) * kInlineBytes;
    copy_inline(payload, inline_src, (u32)trigger_field(t.fst, kTriggerSizeBits));
  }
  const u64 lap = lap_of(pos, f.slots);
  const u64 fst = t.fst | lap << kTriggerFstLapBit, snd = t.snd | lap << kTriggerLapBit;
  if (((t.snd >> 48) & (kTriggerPut | kTriggerSignal)) != 0) {
    asm volatile("st.release.sys.global.v2.u64 [%0], {%1, %2};" :: "l"(slot), "l"(fst), "l"(snd) : "memory");
  } else {
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" :: "l"(slot), "l"(fst), "l"(snd) : "memory");
  }
  return pos;
}

// fifo_sync waits (bounded) until the proxy has handled position pos, and
// returns false on a timeout or a proxy failure (recorded in err).
template <typename P>
DINLINE bool fifo_sync(const FifoHandle& f, const P& w, int peer, u64 pos) {
  if (pos == ~0ull) return false;
  u64 done = 0;
  u32 polls = 0;
  // Each look at host memory crosses PCIe: the error word only every 32nd.
  const bool ok = spin_until(w, [&] {
    done = ld_poll(&f.host->done);
    return done > pos || ((++polls & 31u) == 0 && ld_volatile_u32(&f.host->error) != 0);
  }, done, peer, kPhaseFifoFlush, (int)f.id, pos + 1);
  poll_acquired();
  // done moves only past entries that succeeded, so done > pos needs no
  // second look at the error word (another PCIe round trip).
  if (ok && done <= pos) {
    report_error(w, kErrProxy, peer, kPhaseFifoFlush, (int)f.id, pos + 1, done);
    return false;
  }
  return ok;
}

// ---------------------------------------------------------------- semaphores

// sem_wait consumes one signal: it waits (bounded) until *sem reaches the
// next expected count. One thread per channel waits at a time.
template <typename P>
DINLINE bool sem_wait(const P& w, const u64* sem, u64* expected, int peer) {
  const u64 want = *expected + 1;
  u64 seen = 0;
  if (!spin_until(w, [&] { return (seen = ld_flag_acquire(sem)) >= want; }, seen, peer, kPhaseChannelWait, -1,
                  want)) {
    return false;
  }
  *expected = want;
  return true;
}

// sem_poll consumes one signal if it has arrived, without waiting.
DINLINE bool sem_poll(const u64* sem, u64* expected) {
  if (ld_flag_acquire(sem) <= *expected) return false;
  *expected += 1;
  return true;
}

// port_wait is sem_wait for a port channel, which also stops at a failure of
// the FIFO's proxy: the proxy lands what peers send as well (staged puts,
// their signals), so after it failed nothing more arrives, and the error
// names the proxy instead of timing out on the peer.
template <typename P>
DINLINE bool port_wait(const P& w, const FifoHandle& f, const u64* sem, u64* expected, int peer) {
  const u64 want = *expected + 1;
  u64 seen = 0;
  u32 polls = 0;
  bool failed = false;
  // Each look at host memory crosses PCIe: the error word only every 32nd.
  const bool ok = spin_until(w, [&] {
    if ((seen = ld_flag_acquire(sem)) >= want) return true;
    failed = (++polls & 31u) == 0 && ld_volatile_u32(&f.host->error) != 0;
    return failed;
  }, seen, peer, kPhaseChannelWait, -1, want);
  if (!ok) return false;
  if (failed) {
    report_error(w, kErrProxy, peer, kPhaseChannelWait, (int)f.id, want, seen);
    return false;
  }
  *expected = want;
  return true;
}

// ---------------------------------------------------------------- PortChannel

struct PortChannel {
  FifoHandle fifo;
  u64* sem;
  u64* expected;
  ErrorWord* err;
  u64 timeout_ns;
  u32 channel;
  u32 dst_memory;
  u32 src_memory;
  int rank;
  int peer;
  u32 inline_max;
  const char* src_base;

  DMETHOD Waiter waiter() const { return Waiter{nullptr, err, timeout_ns, rank}; }
  DMETHOD Trigger trigger(u32 type, u64 dst_offset, u64 src_offset, u64 bytes) const {
    return make_trigger(type, channel, dst_memory, dst_offset, src_memory, src_offset, bytes);
  }

  // push queues one trigger and returns its FIFO position (~0 on failure).
  DMETHOD u64 push(u32 type, u64 dst_offset, u64 src_offset, u64 bytes) const {
    if ((type & kTriggerPut) != 0 && bytes != 0 && bytes <= inline_max) {
      return fifo_push(fifo, waiter(), peer,
                       make_trigger(type, channel, dst_memory, dst_offset, kInlineMemory, 0, bytes),
                       src_base + src_offset);
    }
    return fifo_push(fifo, waiter(), peer, trigger(type, dst_offset, src_offset, bytes));
  }

  // put asks the proxy to copy bytes from src_offset of the local memory to
  // dst_offset of the peer's (offsets below 4 GiB, bytes below 2 GiB). One thread
  // calls it; it returns at once. Returns the FIFO position. A put of at most
  // inline_max bytes reads its source here, into the FIFO; a larger one is
  // read by the proxy's transport until the channel's next flush.
  DMETHOD u64 put(u64 dst_offset, u64 src_offset, u64 bytes) const {
    return push(kTriggerPut, dst_offset, src_offset, bytes);
  }
  DMETHOD u64 put(u64 offset, u64 bytes) const { return put(offset, offset, bytes); }

  // signal adds one to the peer's semaphore once every earlier put of this
  // channel has landed there.
  DMETHOD u64 signal() const { return push(kTriggerSignal, 0, 0, 0); }

  // putWithSignal is put then signal, in one trigger.
  DMETHOD u64 putWithSignal(u64 dst_offset, u64 src_offset, u64 bytes) const {
    return push(kTriggerPut | kTriggerSignal, dst_offset, src_offset, bytes);
  }
  DMETHOD u64 putWithSignal(u64 offset, u64 bytes) const { return putWithSignal(offset, offset, bytes); }

  // putWithSignalAndFlush is putWithSignal, then waits until the proxy has
  // completed it (the source may be overwritten). False on failure.
  DMETHOD bool putWithSignalAndFlush(u64 dst_offset, u64 src_offset, u64 bytes) const {
    return fifo_sync(fifo, waiter(), peer,
                     push(kTriggerPut | kTriggerSignal | kTriggerFlush, dst_offset, src_offset, bytes));
  }
  DMETHOD bool putWithSignalAndFlush(u64 offset, u64 bytes) const {
    return putWithSignalAndFlush(offset, offset, bytes);
  }

  // flush waits until every earlier put and signal of this channel is
  // complete: the proxy handles triggers in FIFO order and reports this one
  // done only after the transport's flush of the peer. False on failure.
  DMETHOD bool flush() const { return fifo_sync(fifo, waiter(), peer, push(kTriggerFlush, 0, 0, 0)); }

  // wait consumes one signal from the peer (bounded); poll consumes one if
  // it has arrived. One thread per channel.
  DMETHOD bool wait() const { return port_wait(waiter(), fifo, sem, expected, peer); }
  DMETHOD bool poll() const { return sem_poll(sem, expected); }
};
static_assert(sizeof(PortChannel) == 96, "PortChannel size");
static_assert(sizeof(FifoHandle) + 5 * sizeof(void*) + 4 * sizeof(u32) + 2 * sizeof(int) == 96,
              "PortChannel fields");

// ---------------------------------------------------------------- MemoryChannel

// load_any / store_any move one T of 2, 4, 8 or 16 bytes with the data
// loads' cache policy (L2: the peer writes during the kernel).
template <typename T> DINLINE T load_any(const char* p) {
  if constexpr (sizeof(T) == 16) {
    union { V16 v; T t; } c;
    c.v = ld_v16(p);
    return c.t;
  } else {
    return ld_elem<T>(p);
  }
}
template <typename T> DINLINE void store_any(char* p, T x) {
  if constexpr (sizeof(T) == 16) {
    union { V16 v; T t; } c;
    c.t = x;
    st_v16(p, c.v);
  } else {
    st_elem<T>(p, x);
  }
}

// copy_v16 copies bytes (a multiple of 16, both ends 16-byte aligned) with
// threads tid, tid + nthreads, ... each moving 16 bytes at a time.
DINLINE void copy_v16(char* dst, const char* src, u64 bytes, u32 tid, u32 nthreads) {
  const u64 n = bytes / kPackBytes;
  constexpr int U = P2P_UNROLL;
  for (u64 i = tid; i < n; i += (u64)U * nthreads) {
    V16 v[U];  // U loads in flight before the first store
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const u64 k = i + (u64)u * nthreads;
      if (k < n) v[u] = ld_v16(src + k * kPackBytes);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const u64 k = i + (u64)u * nthreads;
      if (k < n) st_v16(dst + k * kPackBytes, v[u]);
    }
  }
}

struct MemoryChannel {
  char* remote;
  char* local;
  char* packets;
  u64* remote_sem;
  u64* sem;
  u64* expected;
  ErrorWord* err;
  u64 timeout_ns;
  int rank;
  int peer;

  DMETHOD Waiter waiter() const { return Waiter{nullptr, err, timeout_ns, rank}; }

  // put copies bytes from local + src_offset to remote + dst_offset; get
  // copies the other way. Threads tid of nthreads share the work (every one
  // of them must call). Offsets, bytes and both buffers are 16-byte aligned.
  DMETHOD void put(u64 dst_offset, u64 src_offset, u64 bytes, u32 tid, u32 nthreads) const {
    copy_v16(remote + dst_offset, local + src_offset, bytes, tid, nthreads);
  }
  DMETHOD void get(u64 dst_offset, u64 src_offset, u64 bytes, u32 tid, u32 nthreads) const {
    copy_v16(local + dst_offset, remote + src_offset, bytes, tid, nthreads);
  }

  // read returns element index of the peer's buffer viewed as T; write
  // stores one there. T is 2, 4, 8 or 16 bytes, index in elements.
  template <typename T> DMETHOD T read(u64 index) const { return load_any<T>(remote + index * sizeof(T)); }
  template <typename T> DMETHOD void write(u64 index, T value) const {
    store_any<T>(remote + index * sizeof(T), value);
  }

  // signal adds one to the peer's semaphore with a system-scope release:
  // the peer's wait then sees this thread's earlier writes, and the block's
  // when the caller runs __syncthreads first. One thread calls it.
  DMETHOD void signal() const {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" :: "l"(remote_sem), "l"(1ull) : "memory");
  }
  // wait consumes one signal from the peer (bounded); poll consumes one if
  // it has arrived. One thread per channel.
  DMETHOD bool wait() const { return sem_wait(waiter(), sem, expected, peer); }
  DMETHOD bool poll() const { return sem_poll(sem, expected); }

  // putPackets sends bytes (a multiple of 8) from local + src_offset as LL
  // lines into the peer's packet buffer at dst_offset (16-byte aligned):
  // 2 * bytes land there, each 8 data bytes with flag twice. The peer needs
  // no signal: unpackPackets sees each line arrive. flag is ll_flag(epoch)
  // of a call epoch that differs from the previous use of those lines.
  DMETHOD void putPackets(u64 dst_offset, u64 src_offset, u64 bytes, u32 tid, u32 nthreads, u32 flag) const {
    const u64 lines = bytes / kLLData;
    for (u64 i = tid; i < lines; i += nthreads) {
      const u64 v = ld_bits(reinterpret_cast<const u64*>(local + src_offset + i * kLLData));
      ll_store(remote + dst_offset + i * kLLLine, v, flag);
    }
  }
  // unpackPackets waits (bounded) for the lines of bytes data bytes at
  // packets + pkt_offset to carry flag and stores their data at
  // local + dst_offset (8-byte aligned). False if a line never came.
  DMETHOD bool unpackPackets(u64 dst_offset, u64 pkt_offset, u64 bytes, u32 tid, u32 nthreads, u32 flag) const {
    const u64 lines = bytes / kLLData;
    const Waiter w = waiter();
    for (u64 i = tid; i < lines; i += nthreads) {
      u64 v;
      if (!ll_wait(w, packets + pkt_offset + i * kLLLine, flag, peer, kPhaseData, v)) return false;
      st_bits(reinterpret_cast<u64*>(local + dst_offset + i * kLLData), v);
    }
    return true;
  }
};
static_assert(sizeof(MemoryChannel) == 72 && 8 * sizeof(void*) + 2 * sizeof(int) == 72, "MemoryChannel layout");
