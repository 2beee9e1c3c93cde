package cuda

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestMain points the NVRTC search at the local Python's nvidia wheels when
// nothing else says where NVRTC is, as the Python package does at run time.
func TestMain(m *testing.M) {
	if os.Getenv(EnvNVRTC) == "" && os.Getenv(EnvNVIDIAPaths) == "" {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		out, err := exec.CommandContext(ctx, "python3", "-c",
			"import nvidia; print(':'.join(nvidia.__path__))").Output()
		cancel()
		if err == nil {
			os.Setenv(EnvNVIDIAPaths, strings.TrimSpace(string(out)))
		}
	}
	os.Exit(m.Run())
}
