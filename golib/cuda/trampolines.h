// Trampolines: Go cannot call a C function pointer, so each driver or NVRTC
// signature gets one static inline function that casts the pointer and calls
// it. Handles (contexts, streams, modules, functions, events) travel as
// void*, device pointers as unsigned long long (CUdeviceptr), CUresult and
// nvrtcResult as int. No CUDA header is included: the build needs no CUDA.
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef unsigned long long p2p_dptr;

static inline int p2p_r_(void* f) { return ((int (*)(void))f)(); }
static inline int p2p_r_p(void* f, void* a) { return ((int (*)(void*))f)(a); }
static inline int p2p_r_u(void* f, unsigned a) { return ((int (*)(unsigned))f)(a); }
static inline int p2p_r_i_p(void* f, int a, void* b) { return ((int (*)(int, void*))f)(a, b); }
static inline int p2p_r_i_p_p(void* f, int a, void* b, void* c) { return ((int (*)(int, void*, void*))f)(a, b, c); }
static inline int p2p_r_p_i(void* f, void* a, int b) { return ((int (*)(void*, int))f)(a, b); }
static inline int p2p_r_p_u(void* f, void* a, unsigned b) { return ((int (*)(void*, unsigned))f)(a, b); }
static inline int p2p_r_p_u_p_u(void* f, void* a, unsigned b, void* c, unsigned d) {
  return ((int (*)(void*, unsigned, void*, unsigned))f)(a, b, c, d);
}
static inline int p2p_r_p_p(void* f, void* a, void* b) { return ((int (*)(void*, void*))f)(a, b); }
static inline int p2p_r_p_z(void* f, void* a, size_t b) { return ((int (*)(void*, size_t))f)(a, b); }
static inline int p2p_r_p_d(void* f, void* a, p2p_dptr b) { return ((int (*)(void*, p2p_dptr))f)(a, b); }
static inline int p2p_r_d(void* f, p2p_dptr a) { return ((int (*)(p2p_dptr))f)(a); }
static inline int p2p_r_p_i_i(void* f, void* a, int b, int c) { return ((int (*)(void*, int, int))f)(a, b, c); }
static inline int p2p_r_p_i_d(void* f, void* a, int b, p2p_dptr c) { return ((int (*)(void*, int, p2p_dptr))f)(a, b, c); }
static inline int p2p_r_p_p_p(void* f, void* a, void* b, void* c) { return ((int (*)(void*, void*, void*))f)(a, b, c); }
static inline int p2p_r_p_p_u(void* f, void* a, void* b, unsigned c) { return ((int (*)(void*, void*, unsigned))f)(a, b, c); }
static inline int p2p_r_p_p_d(void* f, void* a, void* b, p2p_dptr c) { return ((int (*)(void*, void*, p2p_dptr))f)(a, b, c); }
static inline int p2p_r_p_z_p_p(void* f, void* a, size_t b, void* c, void* d) {
	return ((int (*)(void*, size_t, void*, void*))f)(a, b, c, d);
}
static inline int p2p_r_p_z_u(void* f, void* a, size_t b, unsigned c) { return ((int (*)(void*, size_t, unsigned))f)(a, b, c); }
static inline int p2p_r_p_d_z(void* f, void* a, p2p_dptr b, size_t c) { return ((int (*)(void*, p2p_dptr, size_t))f)(a, b, c); }
static inline int p2p_r_d_u8_z_p(void* f, p2p_dptr a, unsigned char b, size_t c, void* d) {
	return ((int (*)(p2p_dptr, unsigned char, size_t, void*))f)(a, b, c, d);
}
static inline int p2p_r_d_u_z_p(void* f, p2p_dptr a, unsigned b, size_t c, void* d) {
	return ((int (*)(p2p_dptr, unsigned, size_t, void*))f)(a, b, c, d);
}
static inline int p2p_r_d_d_z_p(void* f, p2p_dptr a, p2p_dptr b, size_t c, void* d) {
	return ((int (*)(p2p_dptr, p2p_dptr, size_t, void*))f)(a, b, c, d);
}
static inline int p2p_r_p_d_u64_u(void* f, void* a, p2p_dptr b, uint64_t c, unsigned d) {
	return ((int (*)(void*, p2p_dptr, uint64_t, unsigned))f)(a, b, c, d);
}

// cuGetProcAddress_v2 (CUDA 12.0+) and the 11.3 form without the status out.
static inline int p2p_get_proc_v2(void* f, const char* sym, void** pfn, int ver, uint64_t flags, int* found) {
	return ((int (*)(const char*, void**, int, uint64_t, int*))f)(sym, pfn, ver, flags, found);
}
static inline int p2p_get_proc_v1(void* f, const char* sym, void** pfn, int ver, uint64_t flags) {
	return ((int (*)(const char*, void**, int, uint64_t))f)(sym, pfn, ver, flags);
}

// CUipcMemHandle is a 64-byte struct passed by value.
typedef struct { char reserved[64]; } p2p_ipc_handle;
static inline int p2p_ipc_open(void* f, p2p_dptr* out, const void* handle, unsigned flags) {
	p2p_ipc_handle h;
	memcpy(&h, handle, sizeof h);
	return ((int (*)(p2p_dptr*, p2p_ipc_handle, unsigned))f)(out, h, flags);
}

// cuStreamGetCaptureInfo as of CUDA 11.3 (what version 12000 resolves to);
// the graph and dependency outputs are optional and left NULL.
static inline int p2p_capture_info(void* f, void* stream, int* status, uint64_t* id) {
	return ((int (*)(void*, int*, uint64_t*, void*, void*, void*))f)(stream, status, id, NULL, NULL, NULL);
}

// p2p_launch builds the kernel parameter array on the C stack: params[i]
// points at blob+offsets[i]. cuLaunchKernel copies every parameter before it
// returns, so blob (Go memory holding no Go pointers, pinned for the call)
// is never kept.
#define P2P_MAX_PARAMS 32
static inline int p2p_launch1(void* f, void* fn, unsigned gx, unsigned gy, unsigned gz,
		unsigned bx, unsigned by, unsigned bz, unsigned shared, void* stream, char* arg) {
	void* params[1] = {arg};
	return ((int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
			unsigned, void*, void**, void**))f)(fn, gx, gy, gz, bx, by, bz, shared, stream,
			params, NULL);
}
static inline int p2p_launch(void* f, void* fn, unsigned gx, unsigned gy, unsigned gz,
		unsigned bx, unsigned by, unsigned bz, unsigned shared, void* stream,
		char* blob, const uint32_t* offsets, int n) {
	void* params[P2P_MAX_PARAMS];
	if (n > P2P_MAX_PARAMS) return 1; // CUDA_ERROR_INVALID_VALUE; checked in Go first
	for (int i = 0; i < n; i++) params[i] = blob + offsets[i];
	return ((int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
			unsigned, void*, void**, void**))f)(fn, gx, gy, gz, bx, by, bz, shared, stream,
			n > 0 ? params : NULL, NULL);
}

// NVRTC signatures beyond the shared ones above (nvrtcResult is an int).
static inline int p2p_nvrtc_create(void* f, void** prog, const char* src, const char* name,
		int n, char** headers, char** names) {
	return ((int (*)(void**, const char*, const char*, int, char**, char**))f)(prog, src, name, n, headers, names);
}
static inline int p2p_r_p_i_pp(void* f, void* a, int n, char** b) {
	return ((int (*)(void*, int, char**))f)(a, n, b);
}
static inline const char* p2p_s_i(void* f, int a) { return ((const char* (*)(int))f)(a); }
