package cuda

/*
#include <stdlib.h>
#include "trampolines.h"
*/
import "C"

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/dl"
	"github.com/p2pcomm/p2pcomm/golib/procenv"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// NVRTC is a loaded NVRTC library. Compile is safe for concurrent use.
type NVRTC struct {
	path         string
	major, minor int
	fn           nvrtcFuncs
	mu           sync.Mutex // serializes compiles: rare, and keeps memory bounded
}

type nvrtcFuncs struct {
	version, getErrorString, createProgram, destroyProgram, compileProgram unsafe.Pointer
	getProgramLogSize, getProgramLog, getCUBINSize, getCUBIN               unsafe.Pointer
	addNameExpression, getLoweredName                                      unsafe.Pointer
}

func (f *nvrtcFuncs) table() []struct {
	name string
	slot *unsafe.Pointer
} {
	return []struct {
		name string
		slot *unsafe.Pointer
	}{
		{"nvrtcVersion", &f.version}, {"nvrtcGetErrorString", &f.getErrorString},
		{"nvrtcCreateProgram", &f.createProgram}, {"nvrtcDestroyProgram", &f.destroyProgram},
		{"nvrtcCompileProgram", &f.compileProgram}, {"nvrtcGetProgramLogSize", &f.getProgramLogSize},
		{"nvrtcGetProgramLog", &f.getProgramLog}, {"nvrtcGetCUBINSize", &f.getCUBINSize},
		{"nvrtcGetCUBIN", &f.getCUBIN}, {"nvrtcAddNameExpression", &f.addNameExpression},
		{"nvrtcGetLoweredName", &f.getLoweredName},
	}
}

// Environment variables that steer the NVRTC search.
const (
	EnvNVRTC       = "P2PCOMM_NVRTC"        // full path of libnvrtc.so.*; only it is tried
	EnvNVIDIAPaths = "P2PCOMM_NVIDIA_PATHS" // ':'-joined dirs from the Python package (nvidia wheels)
)

var (
	nvrtcOnce sync.Once
	nvrtcLib  *NVRTC
	nvrtcErr  error
)

// LoadNVRTC finds and opens NVRTC once per process; later calls return the
// same library or error. Search order: $P2PCOMM_NVRTC alone if set; else the
// dirs in $P2PCOMM_NVIDIA_PATHS; the nvidia wheel dirs of libraries already
// mapped into the process (torch loads its wheels before us); $CUDA_HOME,
// $CUDA_PATH and /usr/local/cuda lib64; then the loader's own path. Newer
// majors come first. The error unwraps to ErrNoNVRTC and lists every place
// tried with dlopen's reason.
func LoadNVRTC() (*NVRTC, error) {
	nvrtcOnce.Do(func() { nvrtcLib, nvrtcErr = openNVRTC(NVRTCCandidates()) })
	return nvrtcLib, nvrtcErr
}

func openNVRTC(candidates []string) (*NVRTC, error) {
	var tried []string
	for _, c := range candidates {
		n, err := openNVRTCAt(c)
		if err == nil {
			return n, nil
		}
		tried = append(tried, err.Error())
	}
	if len(tried) == 0 {
		tried = []string{"no candidate paths"}
	}
	return nil, &LoadError{Lib: "NVRTC", Tried: tried, kind: ErrNoNVRTC}
}

func openNVRTCAt(path string) (*NVRTC, error) {
	if filepath.IsAbs(path) {
		// The wheel's libnvrtc has no RPATH; it dlopens libnvrtc-builtins
		// by soname when compiling. Loading the sibling first makes that
		// soname resolve to the same directory.
		for _, b := range siblingBuiltins(filepath.Dir(path)) {
			_, _ = dl.Open(b, dl.Now|dl.Global)
		}
	}
	lib, err := dl.Open(path, dl.Now|dl.Local)
	if err != nil {
		return nil, err
	}
	n := &NVRTC{path: path}
	for _, e := range n.fn.table() {
		if *e.slot, err = lib.Sym(e.name); err != nil {
			return nil, err
		}
	}
	var major, minor C.int
	if r := C.p2p_r_p_p(n.fn.version, unsafe.Pointer(&major), unsafe.Pointer(&minor)); r != 0 {
		return nil, fmt.Errorf("%s: nvrtcVersion failed: %d", path, int(r))
	}
	n.major, n.minor = int(major), int(minor)
	return n, nil
}

var (
	nvrtcName    = regexp.MustCompile(`^libnvrtc\.so(\.[0-9]+)*$`)
	builtinsName = regexp.MustCompile(`^libnvrtc-builtins\.so(\.[0-9]+)*$`)
)

func siblingBuiltins(dir string) []string {
	m, _ := filepath.Glob(filepath.Join(dir, "libnvrtc-builtins.so*"))
	var out []string
	for _, p := range m {
		if builtinsName.MatchString(filepath.Base(p)) {
			out = append(out, p)
		}
	}
	return out
}

// NVRTCCandidates returns the paths LoadNVRTC tries, in order, for logging.
func NVRTCCandidates() []string {
	if p := procenv.Get(EnvNVRTC); p != "" {
		return []string{p}
	}
	var dirs []string
	for _, d := range filepath.SplitList(procenv.Get(EnvNVIDIAPaths)) {
		if d != "" {
			dirs = append(dirs, d, filepath.Join(d, "lib"), filepath.Join(d, "*", "lib"))
		}
	}
	dirs = append(dirs, mappedNVIDIADirs()...)
	for _, env := range []string{"CUDA_HOME", "CUDA_PATH"} {
		if h := procenv.Get(env); h != "" {
			dirs = append(dirs, filepath.Join(h, "lib64"), filepath.Join(h, "lib"))
		}
	}
	dirs = append(dirs, "/usr/local/cuda/lib64")
	var out []string
	seen := map[string]bool{}
	for _, d := range dirs {
		m, _ := filepath.Glob(filepath.Join(d, "libnvrtc.so*"))
		var found []string
		for _, p := range m {
			if nvrtcName.MatchString(filepath.Base(p)) {
				found = append(found, p)
			}
		}
		// Within a dir, prefer the versioned soname (what the wheel ships)
		// and the newest major; the unversioned dev symlink comes last.
		sort.Slice(found, func(i, j int) bool { return sonameRank(found[i]) > sonameRank(found[j]) })
		for _, p := range found {
			if !seen[p] {
				seen[p] = true
				out = append(out, p)
			}
		}
	}
	return append(out, "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")
}

// sonameRank orders libnvrtc.so.13 > libnvrtc.so.12 > libnvrtc.so.
func sonameRank(p string) int {
	var major int
	if _, err := fmt.Sscanf(strings.TrimPrefix(filepath.Base(p), "libnvrtc.so."), "%d", &major); err != nil {
		return -1
	}
	return major
}

// mappedNVIDIADirs finds the site-packages/nvidia roots of libraries already
// mapped into this process (torch loads cuBLAS and friends from its wheels
// at import) and returns their */lib dirs, where the NVRTC wheel lives too.
func mappedNVIDIADirs() []string {
	data, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		return nil
	}
	roots := map[string]bool{}
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		i := strings.Index(line, "/")
		if i < 0 {
			continue
		}
		p := line[i:]
		j := strings.LastIndex(p, "/nvidia/")
		if j < 0 {
			continue
		}
		root := p[:j+len("/nvidia")]
		if !roots[root] {
			roots[root] = true
			out = append(out, filepath.Join(root, "*", "lib"))
		}
	}
	return out
}

// Path returns the file NVRTC was loaded from.
func (n *NVRTC) Path() string { return n.path }

// Version returns NVRTC's CUDA version.
func (n *NVRTC) Version() (major, minor int) { return n.major, n.minor }

// NVRTCError is a failed NVRTC call; for compilation it carries the log.
type NVRTCError struct {
	Code int    // the nvrtcResult
	Name string // nvrtcGetErrorString, e.g. "NVRTC_ERROR_COMPILATION"
	Call string // e.g. "nvrtcCompileProgram(allreduce_oneshot.cu, sm_90)"
	Log  string // the program log, if any
}

func (e *NVRTCError) Error() string {
	s := fmt.Sprintf("%s: %s (%d)", e.Call, e.Name, e.Code)
	if e.Log != "" {
		s += "\n" + strings.TrimRight(e.Log, "\x00\n")
	}
	return s
}

// StatusCode reports status.CUDA.
func (e *NVRTCError) StatusCode() status.Code { return status.CUDA }

func (n *NVRTC) check(call string, r C.int, log string) error {
	if r == 0 {
		return nil
	}
	name := C.GoString(C.p2p_s_i(n.fn.getErrorString, r))
	return &NVRTCError{Code: int(r), Name: name, Call: call, Log: log}
}

// CompileRequest describes one NVRTC compilation.
type CompileRequest struct {
	Name            string            // file name shown in messages, e.g. "allreduce_oneshot.cu"
	Source          string            // the .cu text
	Headers         map[string]string // #include name -> text
	Arch            int               // SM version, e.g. 90 for -arch=sm_90 (CUBIN output)
	Options         []string          // extra nvrtc options, e.g. "-std=c++17"
	NameExpressions []string          // template instantiations to lower, e.g. "allreduce<float, 4>"
}

// CompileResult is NVRTC's output.
type CompileResult struct {
	CUBIN   []byte            // the SASS image for cuModuleLoadData
	Lowered map[string]string // name expression -> mangled kernel name
	Log     string            // warnings, if any
	Cached  bool              // served from the disk cache
}

func (r CompileRequest) options() []string {
	return append([]string{fmt.Sprintf("-arch=sm_%d", r.Arch)}, r.Options...)
}

func (r CompileRequest) headerNames() []string {
	names := make([]string, 0, len(r.Headers))
	for h := range r.Headers {
		names = append(names, h)
	}
	sort.Strings(names)
	return names
}

// Compile compiles req to CUBIN. Compile errors are *NVRTCError with the log.
func (n *NVRTC) Compile(req CompileRequest) (CompileResult, error) {
	if req.Arch <= 0 || req.Source == "" {
		return CompileResult{}, status.Errorf(status.InvalidArgument,
			"compile %s: need a source and an SM arch (got arch %d)", req.Name, req.Arch)
	}
	n.mu.Lock()
	defer n.mu.Unlock()

	hdrNames := req.headerNames()
	hdrTexts := make([]string, len(hdrNames))
	for i, h := range hdrNames {
		hdrTexts[i] = req.Headers[h]
	}
	cSrc, cName := C.CString(req.Source), C.CString(req.Name)
	defer C.free(unsafe.Pointer(cSrc))
	defer C.free(unsafe.Pointer(cName))
	cHdr, freeHdr := cStrings(hdrTexts)
	defer freeHdr()
	cHdrNames, freeHdrNames := cStrings(hdrNames)
	defer freeHdrNames()

	var prog unsafe.Pointer
	if err := n.check("nvrtcCreateProgram("+req.Name+")", C.p2p_nvrtc_create(n.fn.createProgram,
		&prog, cSrc, cName, C.int(len(hdrNames)), cHdr, cHdrNames), ""); err != nil {
		return CompileResult{}, err
	}
	defer C.p2p_r_p(n.fn.destroyProgram, unsafe.Pointer(&prog))

	cExprs, freeExprs := cStrings(req.NameExpressions)
	defer freeExprs()
	for i, e := range req.NameExpressions {
		if err := n.check("nvrtcAddNameExpression("+e+")",
			C.p2p_r_p_p(n.fn.addNameExpression, prog, unsafe.Pointer(exprAt(cExprs, i))), ""); err != nil {
			return CompileResult{}, err
		}
	}
	opts := req.options()
	cOpts, freeOpts := cStrings(opts)
	defer freeOpts()
	r := C.p2p_r_p_i_pp(n.fn.compileProgram, prog, C.int(len(opts)), cOpts)
	log := n.programLog(prog)
	call := fmt.Sprintf("nvrtcCompileProgram(%s, sm_%d)", req.Name, req.Arch)
	if err := n.check(call, r, log); err != nil {
		return CompileResult{}, err
	}

	res := CompileResult{Log: log, Lowered: map[string]string{}}
	var size C.size_t
	if err := n.check("nvrtcGetCUBINSize", C.p2p_r_p_p(n.fn.getCUBINSize, prog, unsafe.Pointer(&size)), ""); err != nil {
		return CompileResult{}, err
	}
	if size == 0 {
		return CompileResult{}, status.Errorf(status.CUDA, "%s: NVRTC produced no CUBIN (is -arch a real sm_XX?)", call)
	}
	buf := C.malloc(size)
	defer C.free(buf)
	if err := n.check("nvrtcGetCUBIN", C.p2p_r_p_p(n.fn.getCUBIN, prog, buf), ""); err != nil {
		return CompileResult{}, err
	}
	res.CUBIN = C.GoBytes(buf, C.int(size))
	for i, e := range req.NameExpressions {
		var lowered *C.char
		if err := n.check("nvrtcGetLoweredName("+e+")", C.p2p_r_p_p_p(n.fn.getLoweredName, prog,
			unsafe.Pointer(exprAt(cExprs, i)), unsafe.Pointer(&lowered)), ""); err != nil {
			return CompileResult{}, err
		}
		res.Lowered[e] = C.GoString(lowered)
	}
	return res, nil
}

func (n *NVRTC) programLog(prog unsafe.Pointer) string {
	var size C.size_t
	if C.p2p_r_p_p(n.fn.getProgramLogSize, prog, unsafe.Pointer(&size)) != 0 || size <= 1 {
		return ""
	}
	buf := C.malloc(size)
	defer C.free(buf)
	if C.p2p_r_p_p(n.fn.getProgramLog, prog, buf) != 0 {
		return ""
	}
	return C.GoString((*C.char)(buf))
}

// cStrings copies ss into a C array of C strings; free releases all of it.
func cStrings(ss []string) (**C.char, func()) {
	if len(ss) == 0 {
		return nil, func() {}
	}
	arr := (**C.char)(C.malloc(C.size_t(len(ss)) * C.size_t(unsafe.Sizeof(uintptr(0)))))
	elems := unsafe.Slice(arr, len(ss))
	for i, s := range ss {
		elems[i] = C.CString(s)
	}
	return arr, func() {
		for _, p := range elems {
			C.free(unsafe.Pointer(p))
		}
		C.free(unsafe.Pointer(arr))
	}
}

func exprAt(arr **C.char, i int) *C.char { return unsafe.Slice(arr, i+1)[i] }
