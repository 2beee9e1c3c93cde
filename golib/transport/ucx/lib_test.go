package ucx

import (
	"errors"
	"slices"
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
	_, err := openLibrary(lookup, []string{"/also/not/here"}, nil, false)
	if status.CodeOf(err) != status.Unsupported {
		t.Fatalf("openLibrary(%s=%s) error = %v (code %v), want code %v", LibraryEnv, path, err, status.CodeOf(err), status.Unsupported)
	}
	for _, want := range []string{"pip install libucx-cu13", LibraryEnv, path, "No such file"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("openLibrary error %q does not mention %q", err, want)
		}
	}
}

// TestSearchOrder: without an RDMA device the given folders and python3's
// wheel come before the dynamic loader's path, with one the system's UCX
// comes first; python3 is asked only when its turn comes, and its failure
// is a reason in the list.
func TestSearchOrder(t *testing.T) {
	for _, rdma := range []bool{false, true} {
		asked := 0
		pyDir := func() (string, error) {
			asked++
			if rdma {
				return "", errors.New("no libucx module")
			}
			return "/py/libucx/lib", nil
		}
		cands := searchOrder([]string{"/a", "", "/b"}, pyDir, rdma)
		if asked != 0 {
			t.Fatalf("rdma=%v: python3 asked %d times before its candidate was tried", rdma, asked)
		}
		var got []string
		for _, c := range cands {
			p, err := c()
			if err != nil {
				p = "error: " + err.Error()
			}
			got = append(got, p)
		}
		want := []string{"/a/libucp.so.0", "/b/libucp.so.0", "/py/libucx/lib/libucp.so.0", "libucp.so.0"}
		if rdma {
			want = []string{"libucp.so.0", "/a/libucp.so.0", "/b/libucp.so.0", "error: python3's libucx: no libucx module"}
		}
		if !slices.Equal(got, want) || asked != 1 {
			t.Errorf("rdma=%v: order %q (python3 asked %d times), want %q once", rdma, got, asked, want)
		}
	}
}

// TestDirsEnvSearched: P2PCOMM_UCX_DIRS's folders are searched after the
// given ones.
func TestDirsEnvSearched(t *testing.T) {
	lookup := func(name string) (string, bool) {
		if name == DirsEnv {
			return "/env/one:/env/two", true
		}
		return "", false
	}
	got := withEnvDirs(lookup, []string{"/given"})
	if want := []string{"/given", "/env/one", "/env/two"}; !slices.Equal(got, want) {
		t.Errorf("folders %q, want %q", got, want)
	}
	none := func(string) (string, bool) { return "", false }
	if got := withEnvDirs(none, []string{"/given"}); !slices.Equal(got, []string{"/given"}) {
		t.Errorf("folders without %s: %q, want the given one", DirsEnv, got)
	}
}

// TestSearchOrderTriesAFolderOnce: a folder given twice, or given and also
// python3's, is tried once.
func TestSearchOrderTriesAFolderOnce(t *testing.T) {
	pyDir := func() (string, error) { return "/py/libucx/lib", nil }
	var got []string
	for _, c := range searchOrder([]string{"/a", "/a/", "/py/libucx/lib"}, pyDir, false) {
		if p, err := c(); err == nil {
			got = append(got, p)
		}
	}
	if want := []string{"/a/libucp.so.0", "/py/libucx/lib/libucp.so.0", "libucp.so.0"}; !slices.Equal(got, want) {
		t.Errorf("paths tried %q, want %q", got, want)
	}
}
