// host_calls.cu: which host calls, made on one thread while a kernel waits
// for a flag that another thread (a proxy) sets after an async copy, hold
// that copy back until the kernel ends. A held-back copy is a deadlock when
// the kernel needs it: the kernel times out here after 3 s instead.
//
//   nvcc -O2 -arch=sm_90 -o /tmp/host_calls tools/host_calls.cu -lcuda -lpthread
//   for c in none lazy_launch lazy_launch_same warm_other module_load malloc free \
//            mallochost hostregister devsync memcpy_sync streamcreate eventsync; do
//     /tmp/host_calls $c; CUDA_MODULE_LOADING=EAGER /tmp/host_calls $c; done
//
// The spinning kernel runs on the legacy default stream (torch's default),
// the proxy's copy on a non-blocking stream of its own, as in p2pcomm.
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>
static double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
__global__ void spin(volatile unsigned* flag, unsigned* seen, unsigned long long limit_ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    if (*flag) { *seen = 1; return; }
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > limit_ns) { *seen = 2; return; }
  }
}
__global__ void other(float* p) { p[threadIdx.x] += 1.f; }
__global__ void other2(float* p) { p[threadIdx.x] *= 2.f; }
__global__ void other3(float* p) { p[threadIdx.x] -= 1.f; }
static volatile unsigned* hflag; static unsigned* dseen; static void* dbuf; static void* hbuf; static cudaStream_t ps;
static double helper_dt;
static void* helper(void*) {
  usleep(100000);
  double t0 = now();
  cudaMemcpyAsync(hbuf, dbuf, 4096, cudaMemcpyDeviceToHost, ps);
  cudaStreamSynchronize(ps);
  helper_dt = now() - t0;
  *hflag = 1;
  return nullptr;
}
static const char* ptx_src;
int main(int argc, char** argv) {
  const char* which = argv[1];
  cudaSetDevice(0); cudaFree(0);
  cudaHostAlloc((void**)&hflag, 64, cudaHostAllocMapped);
  cudaMalloc(&dseen, 64); cudaMalloc(&dbuf, 1 << 20); cudaMallocHost(&hbuf, 1 << 20);
  cudaStreamCreateWithFlags(&ps, cudaStreamNonBlocking);
  float* fx; cudaMalloc(&fx, 4096); void* extra = nullptr; cudaMalloc(&extra, 1 << 20);
  // the helper's path warmed once
  cudaMemcpyAsync(hbuf, dbuf, 4096, cudaMemcpyDeviceToHost, ps); cudaStreamSynchronize(ps);
  if (!strcmp(which, "warm_other")) { other<<<1, 32>>>(fx); cudaDeviceSynchronize(); }
  *hflag = 0; cudaMemset(dseen, 0, 4); cudaDeviceSynchronize();
  unsigned* dflag; cudaHostGetDevicePointer((void**)&dflag, (void*)hflag, 0);
  spin<<<1, 1, 0, 0>>>(dflag, dseen, 3000000000ull);
  usleep(50000);
  pthread_t th; pthread_create(&th, nullptr, helper, nullptr);
  usleep(20000);
  double t0 = now();
  if (!strcmp(which, "lazy_launch") || !strcmp(which, "warm_other")) { other<<<1, 32, 0, ps>>>(fx); }
  else if (!strcmp(which, "lazy_launch_same")) { other2<<<1, 32>>>(fx); }
  else if (!strcmp(which, "module_load")) {
    CUmodule m; CUfunction f;
    const char* ptx = ".version 7.0\n.target sm_52\n.address_size 64\n.visible .entry k(.param .u64 p){ret;}\n";
    CUresult r = cuModuleLoadData(&m, ptx); if (r == 0) r = cuModuleGetFunction(&f, m, "k");
    if (r) printf("load err %d\n", r);
  }
  else if (!strcmp(which, "malloc")) { void* p; cudaMalloc(&p, 64 << 20); }
  else if (!strcmp(which, "free")) { cudaFree(extra); }
  else if (!strcmp(which, "mallochost")) { void* p; cudaMallocHost(&p, 8 << 20); }
  else if (!strcmp(which, "hostregister")) { void* p = malloc(8 << 20); cudaHostRegister(p, 8 << 20, 0); }
  else if (!strcmp(which, "devsync")) { cudaDeviceSynchronize(); }
  else if (!strcmp(which, "memcpy_sync")) { float h[4]; cudaMemcpy(h, fx, 16, cudaMemcpyDeviceToHost); }
  else if (!strcmp(which, "streamcreate")) { cudaStream_t s; cudaStreamCreate(&s); }
  else if (!strcmp(which, "eventsync")) { cudaEvent_t e; cudaEventCreate(&e); cudaEventRecord(e, 0); cudaEventSynchronize(e); }
  else if (!strcmp(which, "none")) {}
  double dt = now() - t0;
  pthread_join(th, nullptr);
  cudaDeviceSynchronize();
  unsigned seen = 0; cudaMemcpy(&seen, dseen, 4, cudaMemcpyDeviceToHost);
  printf("%-18s main call %7.1f ms  proxy copy %7.1f ms  kernel %s  err=%s\n", which, dt * 1e3, helper_dt * 1e3,
         seen == 1 ? "released by proxy" : seen == 2 ? "TIMED OUT (proxy blocked)" : "?", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
