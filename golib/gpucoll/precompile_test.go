package gpucoll

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/cuda/cudatest"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// Precompile puts a file into the kernel cache under the key a
// communicator's first call looks up (the next build of it is a hit), and
// refuses a file or arch that does not exist.
func TestPrecompileFillsTheKernelCache(t *testing.T) {
	cudatest.UsePythonWheels()
	if _, err := cuda.LoadNVRTC(); err != nil {
		t.Skipf("NVRTC not found: %v", err)
	}
	dir := t.TempDir()
	t.Setenv(cuda.EnvCacheDir, dir)
	var heard []Built
	built, err := Precompile(90, []string{"copy.cu"}, nil, func(b Built) { heard = append(heard, b) })
	if err != nil {
		t.Fatal(err)
	}
	if len(built) != 1 || built[0].File != "copy.cu" || built[0].Cached || len(heard) != 1 {
		t.Fatalf("first build: %+v (heard %+v), want copy.cu built", built, heard)
	}
	if entries, _ := filepath.Glob(filepath.Join(dir, "*.cubin")); len(entries) != 1 {
		t.Fatalf("cache holds %v, want one entry", entries)
	}
	// What a communicator's kernel cache compiles for sm_90 is now a hit.
	req, err := (&kernelCache{arch: 90}).request("copy.cu")
	if err != nil {
		t.Fatal(err)
	}
	nv, _ := cuda.LoadNVRTC()
	res, err := nv.CompileCached(req)
	if err != nil || !res.Cached {
		t.Fatalf("the runtime's build of copy.cu after precompile: cached %v, err %v", res.Cached, err)
	}
	for _, bad := range []struct {
		arch  int
		files []string
	}{{90, []string{"nope.cu"}}, {7, nil}} {
		if _, err := Precompile(bad.arch, bad.files, nil, nil); status.CodeOf(err) != status.InvalidArgument {
			t.Errorf("Precompile(%d, %v) = %v, want InvalidArgument", bad.arch, bad.files, err)
		}
	}
	if _, err := os.Stat(dir); err != nil {
		t.Fatal(err)
	}
}
