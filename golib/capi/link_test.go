package main

import (
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// allowedNeeded are the libraries every Linux machine has; CUDA, NVRTC, UCX
// and MPI are opened at run time, so a wheel loads wherever glibc does.
var allowedNeeded = []string{"libc.so.", "libpthread.so.", "libdl.so.", "libm.so.", "ld-linux"}

// The c-shared library links nothing beyond libc and its companions, even
// on a machine where Open MPI or CUDA is installed at build time.
func TestLibraryNeedsOnlyLibc(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the whole library")
	}
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("no go command to build the library: %v", err)
	}
	lib := filepath.Join(t.TempDir(), "libp2pcomm.so")
	cmd := exec.Command(goTool, "build", "-buildmode=c-shared", "-trimpath", "-o", lib, ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build -buildmode=c-shared: %v\n%s", err, out)
	}
	f, err := elf.Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	needed, err := f.ImportedLibraries()
	if err != nil {
		t.Fatal(err)
	}
	if len(needed) == 0 {
		t.Fatal("the library needs no library at all; want at least libc.so.6")
	}
	for _, name := range needed {
		ok := false
		for _, prefix := range allowedNeeded {
			ok = ok || strings.HasPrefix(name, prefix)
		}
		if !ok {
			t.Errorf("the library needs %s; allowed: %v", name, allowedNeeded)
		}
	}
	syms, err := f.ImportedSymbols()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range syms {
		n := s.Name
		native := len(n) > 2 && strings.HasPrefix(n, "cu") && n[2] >= 'A' && n[2] <= 'Z' // cuInit, cuMemAlloc...
		for _, prefix := range []string{"MPI_", "ompi_", "nvrtc", "ucp_", "ucs_", "uct_"} {
			native = native || strings.HasPrefix(n, prefix)
		}
		if native {
			t.Errorf("the library imports %s (from %q); it must be looked up at run time", n, s.Library)
		}
	}
	t.Logf("needs %v", needed)
}
