// landing_latency.cu: how soon a kernel that is already running sees a few
// bytes that a host thread hands to the GPU, the last step of a staged put
// (a receiving proxy lands a small entry and its signal while the peer's
// kernel waits). A kernel spins on a flag; for each of 20000 rounds the host
// delivers the next value in one of the ways below and waits until the kernel
// answered in a mapped host word. Round trip from the host's call to the
// answer (p50 / p99 us), the host call alone (p50 us), and how many rounds
// the kernel read the data word stale after it saw the flag:
//
//   host-store     the host stores the flag in mapped host memory; the kernel
//                  polls it there (relaxed loads, one acquire fence): the
//                  floor, no stream work at all
//   wv64           cuStreamWriteValue64 of the flag (device memory) on a
//                  non-blocking stream
//   batch3         cuStreamBatchMemOp: a data word and the flag (device
//                  memory), then a count in mapped host memory, each with
//                  the write's memory barrier
//   batch3-prio    the same on a stream of the greatest priority
//   hbatch3        batch3 with the flag in mapped host memory, polled there
//                  (a staged put's landing and signal as the proxy's copier
//                  queues them for a port channel's host semaphore)
//   htod+wv64      cuMemcpyHtoDAsync of 8 bytes from pinned memory, then
//                  cuStreamWriteValue64 of the flag
//
// Build and run on a GPU host:
//   nvcc -O3 -arch=sm_90 -o /tmp/landing_latency tools/landing_latency.cu -lcuda && /tmp/landing_latency
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "cuda_check.h"

#define CKD(x)                                                                   \
  do {                                                                           \
    CUresult r_ = (x);                                                           \
    if (r_ != CUDA_SUCCESS) {                                                    \
      const char* s_ = "?";                                                      \
      cuGetErrorString(r_, &s_);                                                 \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_);             \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

typedef unsigned long long u64;
constexpr int kRounds = 20000;

__device__ __forceinline__ u64 now() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// waiter answers each value of *flag from base+1 to base+rounds in *ack
// (mapped host memory); gives up after 2 s without news.
// With check, it counts in *bad the rounds whose data word it read stale.
__global__ void waiter(const u64* flag, const u64* data, u64* ack, u64 base, int rounds, int host_flag, int check,
                       u64* bad) {
  if (threadIdx.x != 0) return;
  for (int i = 1; i <= rounds; ++i) {
    const u64 want = base + i;
    const u64 start = now();
    u64 v = 0;
    for (;;) {
      if (host_flag) {
        asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
      } else {
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
      }
      if (v >= want) break;
      if (now() - start > 2000000000ull) return;
    }
    if (host_flag) asm volatile("fence.acquire.sys;" ::: "memory");
    if (check && *reinterpret_cast<const volatile u64*>(data) != want) *bad += 1;
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(ack), "l"(want) : "memory");
  }
}

static double us_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

int main() {
  CK(cudaSetDevice(0));
  CK(cudaFree(0));
  u64 *dflag = nullptr, *ddata = nullptr;
  CK(cudaMalloc(&dflag, 256));
  CK(cudaMalloc(&ddata, 256));
  CK(cudaMemset(dflag, 0, 256));
  CK(cudaMemset(ddata, 0, 256));
  u64* bad = nullptr;
  CK(cudaMalloc(&bad, 8));
  u64* host = nullptr;  // [0] the host flag, [16] the answer, [32] the copier's count, [48] a pinned source
  CK(cudaHostAlloc(&host, 4096, cudaHostAllocMapped));
  memset(host, 0, 4096);
  u64* hostd = nullptr;
  CK(cudaHostGetDevicePointer(&hostd, host, 0));
  volatile u64* ack = host + 16;
  cudaStream_t run, copy, prio;
  CK(cudaStreamCreateWithFlags(&run, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
  int lo = 0, hi = 0;
  CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  CK(cudaStreamCreateWithPriority(&prio, cudaStreamNonBlocking, hi));

  enum How { kHostStore, kWv64, kBatch3, kBatch3Prio, kHBatch3, kHtoD, kCount };
  const char* names[] = {"host-store", "wv64", "batch3", "batch3-prio", "hbatch3", "htod+wv64"};
  printf("| delivery | round trip p50 us | p99 us | host call p50 us | stale data |\n|---|---:|---:|---:|---:|\n");
  u64 base = 0;
  std::vector<double> rt(kRounds), call(kRounds);
  for (int how = 0; how < kCount; ++how) {
    const bool host_flag = how == kHostStore || how == kHBatch3;
    CK(cudaMemsetAsync(bad, 0, 8, run));  // ordered before the waiter on its stream
    waiter<<<1, 32, 0, run>>>(host_flag ? hostd : dflag, ddata, hostd + 16, base, kRounds, host_flag,
                              how != kHostStore && how != kWv64, bad);
    CK(cudaGetLastError());
    cudaStream_t s = how == kBatch3Prio ? prio : copy;
    for (int i = 1; i <= kRounds; ++i) {
      const u64 v = base + i;
      const auto t0 = std::chrono::steady_clock::now();
      switch (how) {
        case kHostStore:
          __atomic_store_n(&host[0], v, __ATOMIC_RELEASE);
          break;
        case kWv64:
          CKD(cuStreamWriteValue64((CUstream)s, (CUdeviceptr)dflag, v, 0));
          break;
        case kHtoD:
          host[48] = v;
          CKD(cuMemcpyHtoDAsync((CUdeviceptr)ddata, host + 48, 8, (CUstream)s));
          CKD(cuStreamWriteValue64((CUstream)s, (CUdeviceptr)dflag, v, 0));
          break;
        default: {
          CUstreamBatchMemOpParams p[3];
          memset(p, 0, sizeof(p));
          const CUdeviceptr flag = host_flag ? (CUdeviceptr)hostd : (CUdeviceptr)dflag;
          const CUdeviceptr addr[3] = {(CUdeviceptr)ddata, flag, (CUdeviceptr)(hostd + 32)};
          for (int k = 0; k < 3; ++k) {
            p[k].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
            p[k].writeValue.address = addr[k];
            p[k].writeValue.value64 = v;
          }
          CKD(cuStreamBatchMemOp((CUstream)s, 3, p, 0));
          break;
        }
      }
      call[i - 1] = us_since(t0);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
      while (*ack < v) {
        if (std::chrono::steady_clock::now() > deadline) {
          fprintf(stderr, "%s: no answer for %llu\n", names[how], v);
          return 1;
        }
      }
      rt[i - 1] = us_since(t0);
    }
    CK(cudaStreamSynchronize(run));
    CK(cudaStreamSynchronize(s));
    base += kRounds;
    std::sort(rt.begin(), rt.end());
    std::sort(call.begin(), call.end());
    u64 stale = 0;
    CK(cudaMemcpy(&stale, bad, 8, cudaMemcpyDeviceToHost));
    char stale_text[32] = "-";  // host-store and wv64 write no data word
    if (how != kHostStore && how != kWv64) snprintf(stale_text, sizeof(stale_text), "%llu", stale);
    printf("| %s | %.2f | %.2f | %.2f | %s |\n", names[how], rt[kRounds / 2], rt[kRounds * 99 / 100],
           call[kRounds / 2], stale_text);
  }
  return 0;
}
