package cuda

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// nvrtcOrSkip loads NVRTC or skips, logging every place searched.
func nvrtcOrSkip(t *testing.T) *NVRTC {
	t.Helper()
	n, err := LoadNVRTC()
	if err != nil {
		t.Skipf("NVRTC not found (set %s or %s); searched %v: %v", EnvNVRTC, EnvNVIDIAPaths, NVRTCCandidates(), err)
	}
	major, minor := n.Version()
	t.Logf("NVRTC %d.%d from %s", major, minor, n.Path())
	return n
}

const testHeader = `#pragma once
template <typename T> struct Twice { static __device__ T of(T x) { return x + x; } };
`

const testKernel = `#include "twice.cuh"
struct Args { float* out; const float* in; int n; };
template <typename T, int kRanks>
__global__ void scale(const Args args) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < args.n) args.out[i] = Twice<float>::of(args.in[i]) * kRanks;
}
`

func TestCompile(t *testing.T) {
	n := nvrtcOrSkip(t)
	for _, arch := range []int{80, 90} {
		req := CompileRequest{
			Name: "scale.cu", Source: testKernel, Headers: map[string]string{"twice.cuh": testHeader},
			Arch: arch, Options: []string{"-std=c++17"},
			NameExpressions: []string{"scale<float, 2>", "scale<float, 8>"},
		}
		res, err := n.Compile(req)
		if err != nil {
			t.Fatalf("Compile(sm_%d) = %v", arch, err)
		}
		if !bytes.HasPrefix(res.CUBIN, []byte("\x7fELF")) {
			t.Errorf("Compile(sm_%d) CUBIN starts %q, want an ELF image", arch, res.CUBIN[:min(4, len(res.CUBIN))])
		}
		for _, e := range req.NameExpressions {
			if got := res.Lowered[e]; !strings.HasPrefix(got, "_Z") || !strings.Contains(got, "scale") {
				t.Errorf("Lowered[%q] = %q, want a mangled name of scale", e, got)
			}
		}
		if res.Lowered["scale<float, 2>"] == res.Lowered["scale<float, 8>"] {
			t.Errorf("two instantiations lowered to the same name %q", res.Lowered["scale<float, 2>"])
		}
	}
}

func TestCompileErrors(t *testing.T) {
	n := nvrtcOrSkip(t)
	_, err := n.Compile(CompileRequest{Name: "bad.cu", Source: "__global__ void k() { undeclared_thing = 1; }", Arch: 90})
	var ne *NVRTCError
	if !errors.As(err, &ne) || !strings.Contains(ne.Log, "undeclared_thing") || !strings.Contains(ne.Call, "bad.cu, sm_90") {
		t.Fatalf("Compile(bad) error = %v, want *NVRTCError naming bad.cu with the log", err)
	}
	if status.CodeOf(err) != status.CUDA {
		t.Errorf("status.CodeOf = %v, want CUDA", status.CodeOf(err))
	}
	if _, err := n.Compile(CompileRequest{Name: "x.cu", Source: "x"}); status.CodeOf(err) != status.InvalidArgument {
		t.Errorf("Compile(arch 0) = %v, want InvalidArgument", err)
	}
}

func TestCompileCachedWithNVRTC(t *testing.T) {
	n := nvrtcOrSkip(t)
	t.Setenv(EnvCacheDir, t.TempDir())
	req := CompileRequest{Name: "scale.cu", Source: testKernel, Headers: map[string]string{"twice.cuh": testHeader},
		Arch: 90, NameExpressions: []string{"scale<float, 4>"}}
	first, err := n.CompileCached(req)
	if err != nil || first.Cached {
		t.Fatalf("first CompileCached = cached %v, %v; want fresh compile", first.Cached, err)
	}
	second, err := n.CompileCached(req)
	if err != nil || !second.Cached || !bytes.Equal(first.CUBIN, second.CUBIN) ||
		second.Lowered["scale<float, 4>"] != first.Lowered["scale<float, 4>"] {
		t.Errorf("second CompileCached = cached %v, same CUBIN %v, lowered %v, %v; want cached copy of first",
			second.Cached, bytes.Equal(first.CUBIN, second.CUBIN), second.Lowered, err)
	}
}

func TestNVRTCCandidates(t *testing.T) {
	dir := t.TempDir()
	lib := filepath.Join(dir, "cu13", "lib")
	if err := os.MkdirAll(lib, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"libnvrtc.so", "libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc-builtins.so.13.0", "libnvrtc.alt.so.13"} {
		if err := os.WriteFile(filepath.Join(lib, f), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	t.Run("explicit path only", func(t *testing.T) {
		t.Setenv(EnvNVRTC, "/opt/x/libnvrtc.so.13")
		if got := NVRTCCandidates(); len(got) != 1 || got[0] != "/opt/x/libnvrtc.so.13" {
			t.Errorf("NVRTCCandidates() = %v, want only $%s", got, EnvNVRTC)
		}
	})
	t.Run("nvidia paths, newest first", func(t *testing.T) {
		t.Setenv(EnvNVRTC, "")
		t.Setenv(EnvNVIDIAPaths, "/does/not/exist:"+dir)
		got := NVRTCCandidates()
		want := []string{filepath.Join(lib, "libnvrtc.so.13"), filepath.Join(lib, "libnvrtc.so.12"), filepath.Join(lib, "libnvrtc.so")}
		if len(got) < 3 || strings.Join(got[:3], " ") != strings.Join(want, " ") {
			t.Errorf("NVRTCCandidates()[:3] = %v, want %v", got, want)
		}
		if last := got[len(got)-3:]; strings.Join(last, " ") != "libnvrtc.so.13 libnvrtc.so.12 libnvrtc.so" {
			t.Errorf("NVRTCCandidates() ends %v, want the loader names", last)
		}
	})
	t.Run("every candidate fails", func(t *testing.T) {
		_, err := openNVRTC([]string{filepath.Join(lib, "libnvrtc.so.12"), "libnvrtc_missing.so"})
		if !errors.Is(err, ErrNoNVRTC) || !strings.Contains(err.Error(), "libnvrtc_missing.so") ||
			!strings.Contains(err.Error(), "libnvrtc.so.12") {
			t.Errorf("openNVRTC(bad files) = %v, want ErrNoNVRTC listing both with dlerror text", err)
		}
	})
}
