package proxy

import (
	_ "embed"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/cuda/cudatest"
	"github.com/p2pcomm/p2pcomm/native/kernels"
)

// channelTestSource holds the test kernels; embedded so that a test binary
// carried to a GPU machine has them.
//
//go:embed testdata/channel_test.cu
var channelTestSource string

// TestMain points the NVRTC search at the local Python's nvidia wheels when
// nothing else says where NVRTC is, as the Python package does at run time.
func TestMain(m *testing.M) {
	cudatest.UsePythonWheels()
	os.Exit(m.Run())
}

func compileChannelTest(n *cuda.NVRTC, arch int) (cuda.CompileResult, error) {
	return n.CompileCached(cuda.CompileRequest{Name: "channel_test.cu", Source: channelTestSource,
		Headers: kernels.Headers(), Arch: arch, Options: []string{"-std=c++17", "-default-device"},
		NameExpressions: kernels.Instantiations(channelTestSource)})
}

// TestChannelHeaderCompiles compiles a kernel calling every channel method
// for sm_80 and sm_90.
func TestChannelHeaderCompiles(t *testing.T) {
	n, err := cuda.LoadNVRTC()
	if err != nil {
		t.Skipf("NVRTC not found (set %s or %s): %v", cuda.EnvNVRTC, cuda.EnvNVIDIAPaths, err)
	}
	exprs := kernels.Instantiations(channelTestSource)
	for _, arch := range []int{80, 90} {
		t.Run("sm_"+strconv.Itoa(arch), func(t *testing.T) {
			res, err := compileChannelTest(n, arch)
			if err != nil {
				t.Fatalf("compile channel_test.cu for sm_%d: %v", arch, err)
			}
			for _, e := range exprs {
				if l := res.Lowered[e]; !strings.HasPrefix(l, "_Z") {
					t.Errorf("instantiation %q lowered to %q, want a mangled name", e, l)
				}
			}
			if strings.Contains(res.Log, "warning") {
				t.Errorf("sm_%d warnings:\n%s", arch, res.Log)
			}
		})
	}
}
