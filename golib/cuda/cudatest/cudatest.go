// Package cudatest helps tests of packages that compile kernels find NVRTC
// where the Python package would: in the local Python's nvidia wheels.
package cudatest

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
)

// UsePythonWheels sets cuda.EnvNVIDIAPaths to the nvidia wheel dirs of
// python3 (what the Python package passes at run time), unless the
// environment already says where NVRTC is. Call it from TestMain.
func UsePythonWheels() {
	if os.Getenv(cuda.EnvNVRTC) != "" || os.Getenv(cuda.EnvNVIDIAPaths) != "" {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "python3", "-c", "import nvidia; print(':'.join(nvidia.__path__))").Output()
	if err == nil {
		os.Setenv(cuda.EnvNVIDIAPaths, strings.TrimSpace(string(out)))
	}
}
