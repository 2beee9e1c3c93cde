package gpucoll

import (
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/native/kernels"
)

// Launch geometry shared with p2p_common.cuh.
const (
	kThreads   = 512
	kMaxBlocks = 128
)

// kernelOf names the source file and kernel of each algorithm; kernels are
// templated on the element type.
var kernelOf = map[collective.Algorithm]struct{ file, name string }{
	collective.OneShot:           {"allreduce_oneshot.cu", "allreduce_oneshot"},
	collective.TwoShot:           {"allreduce_twoshot.cu", "allreduce_twoshot"},
	collective.Ring:              {"allreduce_ring.cu", "allreduce_ring"},
	collective.RecursiveDoubling: {"allreduce_rd.cu", "allreduce_rd"},
	collective.OneShotLL:         {"allreduce_ll.cu", "allreduce_oneshot_ll"},
	collective.TwoShotLL:         {"allreduce_ll.cu", "allreduce_twoshot_ll"},
	collective.OneShotPush:       {"allreduce_ll.cu", "allreduce_oneshot_push"},
	collective.TwoShotPush:       {"allreduce_ll.cu", "allreduce_twoshot_push"},
	collective.OneShotLL128:      {"allreduce_ll128.cu", "allreduce_oneshot_ll128"},
	collective.OneShotLamport:    {"allreduce_lamport.cu", "allreduce_oneshot_lamport"},
	collective.TwoShotLamport:    {"allreduce_lamport.cu", "allreduce_twoshot_lamport"},
}

// kernelCache compiles each source once per process (NVRTC, with the disk
// cache shared by all processes) and keeps every function it looked up.
type kernelCache struct {
	drv    *cuda.Driver
	device int
	arch   int
	extra  []string
	mu     sync.Mutex
	// funcs: all-reduce kernels by (algorithm, dtype), the hot path's lookup.
	funcs map[[2]int32]cuda.Function
	// byName: every kernel of every compiled file, by file and name expression.
	byName map[string]cuda.Function
	// shared: the dynamic shared memory each function of this cache's own
	// modules was allowed (allowShared); loaded.shared has the others'.
	shared map[cuda.Function]uint32
	// global: the functions of loaded's modules.
	global map[cuda.Function]bool
	// modules: the modules this cache loaded itself, unloaded by close (a
	// module holds device memory for its code and constants): users'
	// kernels, and the library's own where they did not go to loaded.
	modules []cuda.Module
}

func newKernelCache(drv *cuda.Driver, device, arch int, extra []string) *kernelCache {
	return &kernelCache{drv: drv, device: device, arch: arch, extra: extra, funcs: map[[2]int32]cuda.Function{},
		byName: map[string]cuda.Function{}, shared: map[cuda.Function]uint32{}, global: map[cuda.Function]bool{}}
}

// loaded holds the library's own kernel modules, loaded once per process
// into a device's primary context (which p2pcomm retains for the life of
// the process) and never unloaded: loading and unloading them with each
// communicator left about a megabyte of device memory behind per cycle, and
// a process that makes communicators one after another pays the load once.
// A reset of the primary context (cudaDeviceReset) while p2pcomm is in use
// is not supported: these modules would go with it. Locks are held only
// around the maps: a compile or a module load can take long, and another
// communicator's launch must not wait for it.
var loaded struct {
	mu       sync.Mutex
	files    map[loadedKey]map[string]cuda.Function // by name expression
	sharedMu sync.Mutex
	shared   map[cuda.Function]uint32 // the dynamic shared memory each was allowed
}

type loadedKey struct {
	ctx        cuda.Context
	file, opts string
	arch       int
}

// primaryKey is the key of file's module in loaded when the current context
// is the device's primary one, retained by EnsureContext; ok is false
// otherwise (a context of the caller's, which may go away: its modules are
// this cache's own). It retains nothing itself, so it never creates a
// primary context the process did not use.
func (k *kernelCache) primaryKey(file string, opts []string) (loadedKey, bool) {
	cur, err := k.drv.CurrentContext()
	if err != nil || cur == 0 || cur != k.drv.RetainedPrimary(k.device) {
		return loadedKey{}, false
	}
	return loadedKey{ctx: cur, file: file, opts: strings.Join(opts, "\x00"), arch: k.arch}, true
}

// allowShared lets fn take bytes of dynamic shared memory per block. Without
// the attribute a block gets 48 KiB less the kernel's static shared memory,
// which the driver does not report here, so a size just under 48 KiB could
// fail to launch: every size is set, once per function and again when it
// grows (one driver call, not one per launch).
func (k *kernelCache) allowShared(fn cuda.Function, bytes uint32) error {
	if bytes == 0 {
		return nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	allowed := k.shared
	if k.global[fn] {
		// Every communicator launches this function: one of them must not
		// lower what another set.
		loaded.sharedMu.Lock()
		defer loaded.sharedMu.Unlock()
		if loaded.shared == nil {
			loaded.shared = map[cuda.Function]uint32{}
		}
		allowed = loaded.shared
	}
	if allowed[fn] >= bytes {
		return nil
	}
	if err := k.drv.FuncSetAttribute(fn, cuda.FuncAttrMaxDynamicSharedSizeBytes, int(bytes)); err != nil {
		return err
	}
	allowed[fn] = bytes
	return nil
}

// close unloads the modules it loaded itself (not those of loaded); the
// cache is empty afterwards. The caller has made the device's context
// current and no kernel of these modules runs.
func (k *kernelCache) close() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	var errs []error
	for _, m := range k.modules {
		if err := k.drv.ModuleUnload(m); err != nil {
			errs = append(errs, err)
		}
	}
	k.modules = nil
	clear(k.funcs)
	clear(k.byName)
	clear(k.shared)
	clear(k.global)
	return errors.Join(errs...)
}

// load loads a compiled module whose one name expression is expr and
// returns that kernel; close unloads the module.
func (k *kernelCache) load(res cuda.CompileResult, expr string) (cuda.Function, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	lowered, ok := res.Lowered[expr]
	if !ok {
		return 0, fmt.Errorf("NVRTC did not lower the name expression %q", expr)
	}
	mod, err := k.drv.ModuleLoadData(res.CUBIN)
	if err != nil {
		return 0, fmt.Errorf("load the module of %s: %w", expr, err)
	}
	k.modules = append(k.modules, mod)
	fn, err := k.drv.ModuleFunction(mod, lowered)
	if err != nil {
		return 0, fmt.Errorf("find %s in its module: %w", expr, err)
	}
	return fn, nil
}

// request is the build of file for this cache's arch and options, with
// every instantiation the file declares (Precompile makes the same).
func (k *kernelCache) request(file string) (cuda.CompileRequest, error) {
	src, err := kernels.Source(file)
	if err != nil {
		return cuda.CompileRequest{}, err
	}
	return cuda.CompileRequest{Name: file, Source: src, Headers: kernels.Headers(), Arch: k.arch,
		Options: compileOptions(k.extra), NameExpressions: kernels.Instantiations(src)}, nil
}

// loadFile compiles file (through the disk cache) and loads it, returning
// its kernels by name expression and the module.
func (k *kernelCache) loadFile(file string, opts []string) (map[string]cuda.Function, cuda.Module, error) {
	nv, err := cuda.LoadNVRTC()
	if err != nil {
		return nil, 0, fmt.Errorf("GPU kernels need NVRTC: %w", err)
	}
	req, err := k.request(file)
	if err != nil {
		return nil, 0, err
	}
	req.Options = opts
	res, err := nv.CompileCached(req)
	if err != nil {
		return nil, 0, fmt.Errorf("compile %s for sm_%d: %w", file, k.arch, err)
	}
	mod, err := k.drv.ModuleLoadData(res.CUBIN)
	if err != nil {
		return nil, 0, fmt.Errorf("load %s: %w", file, err)
	}
	fns := map[string]cuda.Function{}
	for e, lowered := range res.Lowered {
		fn, err := k.drv.ModuleFunction(mod, lowered)
		if err != nil {
			_ = k.drv.ModuleUnload(mod)
			return nil, 0, fmt.Errorf("find %s in %s: %w", e, file, err)
		}
		fns[e] = fn
	}
	return fns, mod, nil
}

// function returns the all-reduce kernel of algo for dt.
func (k *kernelCache) function(algo collective.Algorithm, dt reduce.DType) (cuda.Function, error) {
	key := [2]int32{int32(algo), int32(dt)}
	k.mu.Lock()
	fn, ok := k.funcs[key]
	k.mu.Unlock()
	if ok {
		return fn, nil
	}
	src, ok := kernelOf[algo]
	if !ok {
		return 0, fmt.Errorf("no kernel for algorithm %s", algo)
	}
	fn, err := k.named(src.file, fmt.Sprintf("%s<%s>", src.name, cType[dt]))
	if err != nil {
		return 0, err
	}
	k.mu.Lock()
	k.funcs[key] = fn
	k.mu.Unlock()
	return fn, nil
}

// named compiles file (a .cu in native/kernels, once per process) and
// returns the kernel of one of its declared instantiations.
func (k *kernelCache) named(file, expr string) (cuda.Function, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	key := file + "\x00" + expr
	if fn, ok := k.byName[key]; ok {
		return fn, nil
	}
	opts := compileOptions(k.extra)
	lk, primary := k.primaryKey(file, opts)
	var fns map[string]cuda.Function
	if primary {
		loaded.mu.Lock()
		fns = loaded.files[lk]
		loaded.mu.Unlock()
	}
	if fns == nil {
		mine, mod, err := k.loadFile(file, opts)
		if err != nil {
			return 0, err
		}
		fns = mine
		own := !primary
		if primary {
			// Another communicator may have loaded it meanwhile: the first
			// one published is every communicator's, and a later one stays
			// this cache's own, unloaded at close.
			loaded.mu.Lock()
			if loaded.files == nil {
				loaded.files = map[loadedKey]map[string]cuda.Function{}
			}
			if first := loaded.files[lk]; first != nil {
				fns, own = first, true
			} else {
				loaded.files[lk] = fns
			}
			loaded.mu.Unlock()
		}
		if own {
			k.modules = append(k.modules, mod)
		}
	}
	for e, fn := range fns {
		k.byName[file+"\x00"+e] = fn
		k.global[fn] = primary // fns are loaded's exactly when the context is the primary one
	}
	fn, ok := k.byName[key]
	if !ok {
		return 0, fmt.Errorf("%s does not declare \"// p2pcomm:instantiate %s\"", file, expr)
	}
	return fn, nil
}
