package ucx

import (
	"strings"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// TestMissingLibraryIsUnsupported runs without UCX: a P2PCOMM_UCX_LIB that
// names no file must give status.Unsupported saying how to get UCX and
// where it looked.
func TestMissingLibraryIsUnsupported(t *testing.T) {
	const path = "/nonexistent/p2pcomm/libucp.so.0"
	lookup := func(name string) (string, bool) {
		if name == LibraryEnv {
			return path, true
		}
		return "", false
	}
	_, err := openLibrary(lookup, []string{"/also/not/here"}, nil)
	if status.CodeOf(err) != status.Unsupported {
		t.Fatalf("openLibrary(%s=%s) error = %v (code %v), want code %v", LibraryEnv, path, err, status.CodeOf(err), status.Unsupported)
	}
	for _, want := range []string{"pip install libucx-cu13", LibraryEnv, path, "No such file"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("openLibrary error %q does not mention %q", err, want)
		}
	}
}
