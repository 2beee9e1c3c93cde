package gpucoll

import (
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

// kernelFile names the source of each algorithm's kernels; the kernel is
// the file's base name templated on the element type.
var kernelFile = map[collective.Algorithm]string{
	collective.OneShot:           "allreduce_oneshot",
	collective.TwoShot:           "allreduce_twoshot",
	collective.Ring:              "allreduce_ring",
	collective.RecursiveDoubling: "allreduce_rd",
}

// kernelCache compiles each source once per process (NVRTC, with the disk
// cache shared by all processes) and keeps every function it looked up.
type kernelCache struct {
	drv   *cuda.Driver
	arch  int
	extra []string
	mu    sync.Mutex
	funcs map[[2]int32]cuda.Function
	// byName holds kernels looked up by file and name expression (named).
	byName map[string]cuda.Function
}

func newKernelCache(drv *cuda.Driver, arch int, extra []string) *kernelCache {
	return &kernelCache{drv: drv, arch: arch, extra: extra, funcs: map[[2]int32]cuda.Function{},
		byName: map[string]cuda.Function{}}
}

func (k *kernelCache) function(algo collective.Algorithm, dt reduce.DType) (cuda.Function, error) {
	key := [2]int32{int32(algo), int32(dt)}
	k.mu.Lock()
	defer k.mu.Unlock()
	if fn, ok := k.funcs[key]; ok {
		return fn, nil
	}
	base, ok := kernelFile[algo]
	if !ok {
		return 0, fmt.Errorf("no kernel for algorithm %s", algo)
	}
	if err := k.load(base); err != nil {
		return 0, err
	}
	fn, ok := k.funcs[key]
	if !ok {
		return 0, fmt.Errorf("%s.cu does not instantiate %s<%s>", base, base, cType[dt])
	}
	return fn, nil
}

// load compiles base.cu and records every instantiation it declares.
func (k *kernelCache) load(base string) error {
	nv, err := cuda.LoadNVRTC()
	if err != nil {
		return fmt.Errorf("GPU kernels need NVRTC: %w", err)
	}
	src, err := kernels.Source(base + ".cu")
	if err != nil {
		return err
	}
	exprs := kernels.Instantiations(src)
	res, err := nv.CompileCached(cuda.CompileRequest{
		Name: base + ".cu", Source: src, Headers: kernels.Headers(), Arch: k.arch,
		Options: append([]string{"-std=c++17", "-default-device"}, k.extra...), NameExpressions: exprs,
	})
	if err != nil {
		return fmt.Errorf("compile %s.cu for sm_%d: %w", base, k.arch, err)
	}
	mod, err := k.drv.ModuleLoadData(res.CUBIN)
	if err != nil {
		return fmt.Errorf("load %s.cu: %w", base, err)
	}
	for algo, file := range kernelFile {
		if file != base {
			continue
		}
		for dt, ct := range cType {
			expr := fmt.Sprintf("%s<%s>", base, ct)
			name, ok := res.Lowered[expr]
			if !ok {
				continue
			}
			fn, err := k.drv.ModuleFunction(mod, name)
			if err != nil {
				return fmt.Errorf("find %s in %s.cu: %w", expr, base, err)
			}
			k.funcs[[2]int32{int32(algo), int32(dt)}] = fn
		}
	}
	return nil
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
