package kernels_test

import (
	"context"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/native/kernels"
)

// TestMain points the NVRTC search at the local Python's nvidia wheels when
// nothing else says where NVRTC is, as the Python package does at run time.
func TestMain(m *testing.M) {
	if os.Getenv(cuda.EnvNVRTC) == "" && os.Getenv(cuda.EnvNVIDIAPaths) == "" {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		out, err := exec.CommandContext(ctx, "python3", "-c",
			"import nvidia; print(':'.join(nvidia.__path__))").Output()
		cancel()
		if err == nil {
			os.Setenv(cuda.EnvNVIDIAPaths, strings.TrimSpace(string(out)))
		}
	}
	os.Exit(m.Run())
}

// TestEveryKernelCompiles compiles each .cu file for sm_80 and sm_90 with
// the instantiations it declares, and checks that each one lowers.
func TestEveryKernelCompiles(t *testing.T) {
	names := kernels.Kernels()
	if len(names) == 0 {
		t.Skip("no .cu files in native/kernels yet")
	}
	n, err := cuda.LoadNVRTC()
	if err != nil {
		t.Skipf("NVRTC not found (set %s or %s); searched %v: %v",
			cuda.EnvNVRTC, cuda.EnvNVIDIAPaths, cuda.NVRTCCandidates(), err)
	}
	major, minor := n.Version()
	t.Logf("NVRTC %d.%d from %s", major, minor, n.Path())
	headers := kernels.Headers()
	for _, name := range names {
		src, err := kernels.Source(name)
		if err != nil {
			t.Fatal(err)
		}
		exprs := kernels.Instantiations(src)
		for _, arch := range []int{80, 90} {
			t.Run(name+"/sm_"+strconv.Itoa(arch), func(t *testing.T) {
				t.Parallel() // NVRTC compiles are independent: use every core
				res, err := n.Compile(cuda.CompileRequest{Name: name, Source: src, Headers: headers,
					Arch: arch, Options: []string{"-std=c++17"}, NameExpressions: exprs})
				if err != nil {
					t.Fatalf("compile %s for sm_%d: %v", name, arch, err)
				}
				if len(res.CUBIN) == 0 {
					t.Errorf("compile %s for sm_%d: empty CUBIN", name, arch)
				}
				for _, e := range exprs {
					if l := res.Lowered[e]; !strings.HasPrefix(l, "_Z") {
						t.Errorf("%s: instantiation %q lowered to %q, want a mangled name", name, e, l)
					}
				}
				if strings.Contains(res.Log, "warning") {
					t.Logf("%s sm_%d warnings:\n%s", name, arch, res.Log)
				}
			})
		}
	}
}
