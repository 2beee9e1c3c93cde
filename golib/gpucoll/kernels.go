package gpucoll

import (
	"errors"
	"fmt"
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
}

// kernelCache compiles each source once per process (NVRTC, with the disk
// cache shared by all processes) and keeps every function it looked up.
type kernelCache struct {
	drv   *cuda.Driver
	arch  int
	extra []string
	mu    sync.Mutex
	// funcs: all-reduce kernels by (algorithm, dtype), the hot path's lookup.
	funcs map[[2]int32]cuda.Function
	// byName: every kernel of every compiled file, by file and name expression.
	byName map[string]cuda.Function
	// shared: the dynamic shared memory each function was allowed (allowShared).
	shared map[cuda.Function]uint32
	// modules: every module loaded, unloaded by close (a module holds device
	// memory for its code and constants).
	modules []cuda.Module
}

func newKernelCache(drv *cuda.Driver, arch int, extra []string) *kernelCache {
	return &kernelCache{drv: drv, arch: arch, extra: extra, funcs: map[[2]int32]cuda.Function{},
		byName: map[string]cuda.Function{}, shared: map[cuda.Function]uint32{}}
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
	if k.shared[fn] >= bytes {
		return nil
	}
	if err := k.drv.FuncSetAttribute(fn, cuda.FuncAttrMaxDynamicSharedSizeBytes, int(bytes)); err != nil {
		return err
	}
	k.shared[fn] = bytes
	return nil
}

// close unloads every module; the cache is empty afterwards. The caller has
// made the device's context current and no kernel of these modules runs.
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
	nv, err := cuda.LoadNVRTC()
	if err != nil {
		return 0, fmt.Errorf("GPU kernels need NVRTC: %w", err)
	}
	src, err := kernels.Source(file)
	if err != nil {
		return 0, err
	}
	res, err := nv.CompileCached(cuda.CompileRequest{
		Name: file, Source: src, Headers: kernels.Headers(), Arch: k.arch,
		Options: append([]string{"-std=c++17", "-default-device"}, k.extra...), NameExpressions: kernels.Instantiations(src),
	})
	if err != nil {
		return 0, fmt.Errorf("compile %s for sm_%d: %w", file, k.arch, err)
	}
	mod, err := k.drv.ModuleLoadData(res.CUBIN)
	if err != nil {
		return 0, fmt.Errorf("load %s: %w", file, err)
	}
	k.modules = append(k.modules, mod)
	for e, lowered := range res.Lowered {
		fn, err := k.drv.ModuleFunction(mod, lowered)
		if err != nil {
			return 0, fmt.Errorf("find %s in %s: %w", e, file, err)
		}
		k.byName[file+"\x00"+e] = fn
	}
	fn, ok := k.byName[key]
	if !ok {
		return 0, fmt.Errorf("%s does not declare \"// p2pcomm:instantiate %s\"", file, expr)
	}
	return fn, nil
}
