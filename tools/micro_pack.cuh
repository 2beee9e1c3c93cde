// micro_pack.cuh: the 16-byte loads and stores the standalone micro-benchmarks
// in this folder move rows with (the kernels' own are in native/kernels).
#pragma once

struct V16 {
  unsigned x, y, z, w;
};

// ld16: 16 bytes through L2 only (ld.global.cg, as the MoE kernels' rows).
__device__ __forceinline__ V16 ld16(const void* p) {
  V16 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// st16: a 16-byte store with the default (.wb) cache operator.
__device__ __forceinline__ void st16(void* p, V16 v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
