// Package fakecu is a fake CUDA driver in C for tests of package cuda: it
// serves cuGetProcAddress_v2 and records what the Go side passed, so that the
// trampolines, the entry-point table and kernel-parameter marshalling are
// tested without a GPU. Only tests import it.
package fakecu

/*
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef unsigned long long dptr;

static char missing[1024];        // "\n"-separated names to report as not found
static int init_result;           // what cuInit returns
static int last_version;          // cudaVersion of the last cuGetProcAddress
static unsigned long long last_flags;
static unsigned ipc_flags;        // flags of the last cuIpcOpenMemHandle

// A fake CUfunction: the sizes of its parameters, as the real driver knows
// them from the kernel's metadata.
typedef struct { int n; size_t sizes[8]; } fake_func;
static unsigned launch_dims[7];   // grid xyz, block xyz, shared bytes
static void* launch_stream;
static unsigned char launch_params[512];
static size_t launch_params_len;

// Calling any entry point through a pointer of another signature is fine on
// the x86-64 and aarch64 C ABIs for a function that ignores its arguments.
static int stub(void) { return 801; } // CUDA_ERROR_NOT_SUPPORTED
static int f_init(unsigned flags) { return init_result; }
static int f_version(int* v) { *v = 13000; return 0; }
static int f_err_name(int code, const char** s) {
	if (code == 2) { *s = "CUDA_ERROR_OUT_OF_MEMORY"; return 0; }
	*s = "CUDA_ERROR_FAKE";
	return 0;
}
static int f_count(int* n) { *n = 2; return 0; }
static int f_uuid(unsigned char* u, int dev) { for (int i = 0; i < 16; i++) u[i] = (unsigned char)(dev * 16 + i); return 0; }
static int f_busid(char* s, int len, int dev) { strncpy(s, dev == 0 ? "0000:1B:00.0" : "0000:43:00.0", len); return 0; }
static int f_alloc(dptr* p, size_t n) { void* m = malloc(n); if (!m) return 2; *p = (dptr)(uintptr_t)m; return 0; }
static int f_free(dptr p) { free((void*)(uintptr_t)p); return 0; }
static int f_memset8(dptr p, unsigned char v, size_t n, void* s) { memset((void*)(uintptr_t)p, v, n); return 0; }
static int f_dtoh(void* dst, dptr src, size_t n) { memcpy(dst, (void*)(uintptr_t)src, n); return 0; }
typedef struct { unsigned char b[64]; } handle64;
static int f_ipc_open(dptr* out, handle64 h, unsigned flags) {
	ipc_flags = flags;
	*out = 0x10000 + h.b[0] + h.b[63];
	return 0;
}
static int f_launch(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
		unsigned shared, void* stream, void** params, void** extra) {
	fake_func* f = fn;
	unsigned d[7] = {gx, gy, gz, bx, by, bz, shared};
	memcpy(launch_dims, d, sizeof d);
	launch_stream = stream;
	launch_params_len = 0;
	for (int i = 0; i < f->n; i++) {
		if (params == NULL || launch_params_len + f->sizes[i] > sizeof launch_params) return 1;
		memcpy(launch_params + launch_params_len, params[i], f->sizes[i]);
		launch_params_len += f->sizes[i];
	}
	return 0;
}

static int is_missing(const char* sym) {
	size_t n = strlen(sym);
	for (const char* p = missing; *p; ) {
		const char* e = strchr(p, '\n');
		size_t len = e ? (size_t)(e - p) : strlen(p);
		if (len == n && strncmp(p, sym, n) == 0) return 1;
		if (!e) break;
		p = e + 1;
	}
	return 0;
}

static int getproc_v2(const char* sym, void** pfn, int ver, unsigned long long flags, int* found) {
	last_version = ver;
	last_flags = flags;
	*pfn = NULL;
	if (is_missing(sym)) { *found = 1; return 500; }
	*found = 0;
	struct { const char* name; void* fn; } tab[] = {
		{"cuInit", (void*)f_init}, {"cuDriverGetVersion", (void*)f_version},
		{"cuGetErrorName", (void*)f_err_name}, {"cuDeviceGetCount", (void*)f_count},
		{"cuDeviceGetUuid", (void*)f_uuid}, {"cuDeviceGetPCIBusId", (void*)f_busid},
		{"cuMemAlloc", (void*)f_alloc}, {"cuMemFree", (void*)f_free},
		{"cuMemsetD8Async", (void*)f_memset8}, {"cuMemcpyDtoH", (void*)f_dtoh},
		{"cuIpcOpenMemHandle", (void*)f_ipc_open}, {"cuLaunchKernel", (void*)f_launch},
	};
	for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
		if (strcmp(tab[i].name, sym) == 0) { *pfn = tab[i].fn; return 0; }
	*pfn = (void*)stub;
	return 0;
}

static void* getproc_addr(void) { return (void*)getproc_v2; }
static void set_missing(const char* s) { strncpy(missing, s, sizeof missing - 1); }
static void set_init_result(int r) { init_result = r; }
static int get_last_version(void) { return last_version; }
static unsigned long long get_last_flags(void) { return last_flags; }
static unsigned get_ipc_flags(void) { return ipc_flags; }
static void* new_func(int n, const size_t* sizes) {
	fake_func* f = calloc(1, sizeof *f);
	f->n = n;
	memcpy(f->sizes, sizes, n * sizeof(size_t));
	return f;
}
static unsigned get_dim(int i) { return launch_dims[i]; }
static void* get_stream(void) { return launch_stream; }
static size_t get_params(unsigned char* out, size_t cap) {
	size_t n = launch_params_len < cap ? launch_params_len : cap;
	memcpy(out, launch_params, n);
	return launch_params_len;
}
*/
import "C"

import (
	"errors"
	"strings"
	"unsafe"
)

// Library is a fake libcuda.so.1: Sym serves only cuGetProcAddress_v2.
type Library struct{}

// Sym returns the fake cuGetProcAddress_v2.
func (Library) Sym(name string) (unsafe.Pointer, error) {
	if name == "cuGetProcAddress_v2" {
		return C.getproc_addr(), nil
	}
	return nil, errors.New("fakecu: no symbol " + name)
}

// SetMissing makes cuGetProcAddress report these entry points as absent.
func SetMissing(names ...string) {
	s := C.CString(strings.Join(names, "\n"))
	defer C.free(unsafe.Pointer(s))
	C.set_missing(s)
}

// SetInitResult sets the CUresult the fake cuInit returns.
func SetInitResult(r int) { C.set_init_result(C.int(r)) }

// LastProcQuery returns the version and flags of the last cuGetProcAddress.
func LastProcQuery() (version int, flags uint64) {
	return int(C.get_last_version()), uint64(C.get_last_flags())
}

// LastIPCFlags returns the flags of the last cuIpcOpenMemHandle.
func LastIPCFlags() uint32 { return uint32(C.get_ipc_flags()) }

// NewFunction returns a fake CUfunction whose parameters have these sizes.
func NewFunction(sizes ...int) uintptr {
	cs := make([]C.size_t, 8)
	for i, s := range sizes {
		cs[i] = C.size_t(s)
	}
	return uintptr(C.new_func(C.int(len(sizes)), &cs[0]))
}

// Launch is what the fake cuLaunchKernel saw last.
type Launch struct {
	Grid, Block [3]uint32
	Shared      uint32
	Stream      uintptr
	Params      []byte // every parameter's bytes, concatenated
}

// LastLaunch returns the last launch.
func LastLaunch() Launch {
	var l Launch
	for i := 0; i < 3; i++ {
		l.Grid[i] = uint32(C.get_dim(C.int(i)))
		l.Block[i] = uint32(C.get_dim(C.int(i + 3)))
	}
	l.Shared = uint32(C.get_dim(6))
	l.Stream = uintptr(C.get_stream())
	buf := make([]byte, 512)
	n := C.get_params((*C.uchar)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)))
	l.Params = buf[:n]
	return l
}
