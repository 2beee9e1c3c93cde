// copy.cu: a vectorized device-to-device copy (either side may be a peer
// buffer mapped through IPC), for staging outside the all-reduce kernels.
// No synchronization: ordering is the stream's.
#include "p2p_common.cuh"

// CopyParams is copy_bytes' single by-value argument.
//
//   offset size field
//   0      8    dst    destination (device address in this process)
//   8      8    src    source
//   16     8    bytes  i64 byte count (>= 0)
//   total  24, aligned to 8
struct CopyParams {
  void* dst;
  const void* src;
  i64 bytes;
};
static_assert(sizeof(CopyParams) == 24 && sizeof(CopyParams::dst) + sizeof(CopyParams::src) == 16,
              "CopyParams");

// p2pcomm:instantiate copy_bytes

// copy_bytes copies p.bytes bytes; any grid and block shape (grid-stride).
// 16-byte vectors when dst and src are both 16-byte aligned, else bytes.
__global__ void __launch_bounds__(kThreads, 1) copy_bytes(const CopyParams p) {
  const char* src = (const char*)p.src;
  char* dst = (char*)p.dst;
  const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  i64 head = 0;  // bytes copied as vectors
  if (aligned(src, kPackBytes) && aligned(dst, kPackBytes)) {
    const i64 packs = p.bytes / kPackBytes;
    for (i64 i = tid; i < packs; i += stride) st_v16(dst + i * kPackBytes, ld_v16(src + i * kPackBytes));
    head = packs * kPackBytes;
  }
  for (i64 i = head + tid; i < p.bytes; i += stride) dst[i] = src[i];
}
