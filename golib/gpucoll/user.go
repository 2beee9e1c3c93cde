package gpucoll

import (
	"fmt"
	"sync"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/native/kernels"
)

// userKernels are kernels compiled from callers' own sources; an id is an
// index plus one, so 0 is never a kernel. Their modules belong to the
// kernel cache and unload with it at Close.
type userKernels struct {
	mu  sync.Mutex
	fns []userKernel
}

type userKernel struct {
	name   string
	fn     cuda.Function
	params []cuda.Param // nil until KernelParams or a launch asks
}

// CompileKernel compiles source with NVRTC for this GPU, with
// native/kernels' headers (channel.cuh, p2p_common.cuh) on the include
// path, through the shared compile cache, and returns an id for the kernel
// that the name expression name (a kernel name, or a template
// instantiation such as "my_kernel<float>") stands for. Not collective.
func (b *Backend) CompileKernel(source, name string) (uint64, error) {
	if err := b.usable(); err != nil {
		return 0, err
	}
	if source == "" || name == "" {
		return 0, status.Errorf(status.InvalidArgument, "compile a kernel: empty source or name")
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return 0, err
	}
	nv, err := cuda.LoadNVRTC()
	if err != nil {
		return 0, fmt.Errorf("user kernels need NVRTC: %w", err)
	}
	res, err := nv.CompileCached(cuda.CompileRequest{
		Name: "kernel.cu", Source: source, Headers: kernels.Headers(), Arch: b.arch,
		Options: append([]string{"-std=c++17"}, b.opts.NVRTCOptions...), NameExpressions: []string{name},
	})
	if err != nil {
		return 0, fmt.Errorf("compile kernel %s for sm_%d: %w", name, b.arch, err)
	}
	fn, err := b.kernels.load(res, name)
	if err != nil {
		return 0, err
	}
	b.user.mu.Lock()
	defer b.user.mu.Unlock()
	b.user.fns = append(b.user.fns, userKernel{name: name, fn: fn})
	return uint64(len(b.user.fns)), nil
}

// kernel returns the user kernel of id with its parameter layout.
func (b *Backend) kernel(id uint64) (*userKernel, error) {
	b.user.mu.Lock()
	defer b.user.mu.Unlock()
	if id == 0 || id > uint64(len(b.user.fns)) {
		return nil, status.Errorf(status.InvalidArgument, "kernel %d was not compiled by this communicator", id)
	}
	k := &b.user.fns[id-1]
	if k.params == nil {
		params, err := b.drv.FuncParams(k.fn)
		if err != nil {
			return nil, fmt.Errorf("parameters of kernel %s: %w", k.name, err)
		}
		k.params = append([]cuda.Param{}, params...)
	}
	return k, nil
}

// KernelParams returns where each parameter of kernel id lies in the
// buffer LaunchKernel takes.
func (b *Backend) KernelParams(id uint64) ([]cuda.Param, error) {
	if err := b.usable(); err != nil {
		return nil, err
	}
	k, err := b.kernel(id)
	if err != nil {
		return nil, err
	}
	return append([]cuda.Param(nil), k.params...), nil
}

// LaunchKernel runs kernel id on cfg with its parameters packed in params
// as KernelParams lays them out. It does not wait for the GPU.
func (b *Backend) LaunchKernel(id uint64, cfg cuda.LaunchConfig, params []byte) error {
	if err := b.Check(); err != nil {
		return err
	}
	k, err := b.kernel(id)
	if err != nil {
		return err
	}
	args := make([][]byte, len(k.params))
	for i, p := range k.params {
		if p.Offset+p.Size > uint64(len(params)) {
			return status.Errorf(status.InvalidArgument, "launch %s: parameter %d lies at [%d, %d) of a %d-byte buffer",
				k.name, i, p.Offset, p.Offset+p.Size, len(params))
		}
		args[i] = params[p.Offset : p.Offset+p.Size]
	}
	if err := b.drv.EnsureContext(b.device); err != nil {
		return err
	}
	if err := b.kernels.allowShared(k.fn, cfg.SharedBytes); err != nil {
		return fmt.Errorf("launch %s with %d bytes of dynamic shared memory: %w", k.name, cfg.SharedBytes, err)
	}
	if err := b.drv.LaunchParams(k.fn, cfg, args...); err != nil {
		return fmt.Errorf("launch %s: %w", k.name, err)
	}
	return nil
}
