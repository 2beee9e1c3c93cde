package gpucoll

import (
	"fmt"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/native/kernels"
)

// compileOptions are the NVRTC options of the library's kernels: extra is
// P2PCOMM_NVRTC_OPTIONS. They are part of the kernel cache's key.
func compileOptions(extra []string) []string {
	return append([]string{"-std=c++17", "-default-device"}, extra...)
}

// Built is one file Precompile built: how long it took and whether the
// kernel cache already held it.
type Built struct {
	File    string  `json:"file"`
	Seconds float64 `json:"seconds"`
	Cached  bool    `json:"cached"`
}

// Precompile builds files of native/kernels (every one when files is empty)
// for sm_<arch> with the options a communicator uses, into the kernel
// cache, so that a job's first calls load them instead of compiling:
// minutes on a small host, and a rank still compiling while its peers wait
// for it can outlast P2PCOMM_TIMEOUT_MS. Files build side by side, one per
// core; done hears of each as it ends (one at a time). Needs NVRTC, no GPU.
func Precompile(arch int, files, extra []string, done func(Built)) ([]Built, error) {
	nv, err := cuda.LoadNVRTC()
	if err != nil {
		return nil, status.Errorf(status.Unsupported, "precompile needs NVRTC (pip install nvidia-cuda-nvrtc, or set %s): %v",
			cuda.EnvNVRTC, err)
	}
	all := kernels.Kernels()
	if len(files) == 0 {
		files = all
	}
	for _, f := range files {
		if !slices.Contains(all, f) {
			return nil, status.Errorf(status.InvalidArgument, "precompile: no kernel file %q (there are %v)", f, all)
		}
	}
	if arch < 50 || arch > 200 {
		return nil, status.Errorf(status.InvalidArgument, "precompile: sm_%d is not a GPU architecture", arch)
	}
	var (
		mu    sync.Mutex
		built []Built
		errs  []error
		wg    sync.WaitGroup
	)
	slots := make(chan struct{}, runtime.GOMAXPROCS(0))
	for _, file := range files {
		wg.Add(1)
		go func() {
			defer wg.Done()
			slots <- struct{}{}
			defer func() { <-slots }()
			start := time.Now()
			req, err := (&kernelCache{arch: arch, extra: extra}).request(file)
			var res cuda.CompileResult
			if err == nil {
				res, err = nv.CompileCached(req)
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, fmt.Errorf("compile %s for sm_%d: %w", file, arch, err))
				return
			}
			b := Built{File: file, Seconds: time.Since(start).Seconds(), Cached: res.Cached}
			built = append(built, b)
			if done != nil {
				done(b)
			}
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		return built, errs[0]
	}
	return built, nil
}
