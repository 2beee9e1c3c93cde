package bootstrap

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// fakeLib answers Sym for the names it holds, each with its own non-nil
// address; the functions are never called.
type fakeLib map[string]bool

func (f fakeLib) Sym(name string) (unsafe.Pointer, error) {
	if !f[name] {
		return nil, errors.New("dlsym " + name + ": undefined symbol")
	}
	return unsafe.Pointer(new(byte)), nil
}

// openMPINames is every symbol resolveMPI takes from Open MPI.
func openMPINames() fakeLib {
	names := fakeLib{}
	m := &mpiLib{}
	for _, e := range append(m.functions(), m.handles()...) {
		names[e.name] = true
	}
	return names
}

func TestResolveMPIFillsEveryEntry(t *testing.T) {
	m, err := resolveMPI(openMPINames(), "/opt/ompi/lib/libmpi.so.40")
	if err != nil {
		t.Fatalf("resolveMPI: %v", err)
	}
	for _, e := range append(m.functions(), m.handles()...) {
		if *e.slot == nil {
			t.Errorf("%s not resolved", e.name)
		}
	}
}

// An MPICH-ABI library has the MPI functions but integer handles, so no
// ompi_mpi_* globals: it is refused by name, never called with pointers.
func TestResolveMPIRefusesMPICH(t *testing.T) {
	lib := openMPINames()
	for _, e := range (&mpiLib{}).handles() {
		delete(lib, e.name)
	}
	_, err := resolveMPI(lib, "/usr/lib/x86_64-linux-gnu/libmpich.so.12")
	if status.CodeOf(err) != status.Unsupported {
		t.Fatalf("resolveMPI of an MPICH-ABI library: %v (code %v), want Unsupported", err, status.CodeOf(err))
	}
	for _, want := range []string{"libmpich.so.12", "ompi_mpi_comm_world", "MPICH", MPILibEnv} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

func TestResolveMPIRefusesANonMPILibrary(t *testing.T) {
	lib := openMPINames()
	delete(lib, "MPI_Allgather")
	delete(lib, "MPI_Error_string")
	_, err := resolveMPI(lib, "libfoo.so")
	if status.CodeOf(err) != status.Unsupported {
		t.Fatalf("resolveMPI without MPI_Allgather: %v (code %v), want Unsupported", err, status.CodeOf(err))
	}
	for _, want := range []string{"libfoo.so", "MPI_Allgather, MPI_Error_string"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

// P2PCOMM_MPI_LIB naming a missing file is the only library tried: NewMPI
// fails with Unsupported naming the path, and nothing is initialized. It
// runs before the test that loads Open MPI, which then stays loaded.
func TestNewMPIWithMissingLibraryIsUnsupported(t *testing.T) {
	path := filepath.Join(t.TempDir(), "no", "libmpi.so.40")
	env := func(k string) (string, bool) {
		if k == MPILibEnv {
			return path, true
		}
		return "", false
	}
	if MPIAvailable(env) {
		t.Fatalf("MPIAvailable with %s=%s = true", MPILibEnv, path)
	}
	b, err := NewMPI(env)
	if err == nil {
		b.Close()
		t.Fatalf("NewMPI with %s=%s succeeded", MPILibEnv, path)
	}
	if status.CodeOf(err) != status.Unsupported {
		t.Fatalf("NewMPI: %v (code %v), want Unsupported", err, status.CodeOf(err))
	}
	for _, want := range []string{path, "No such file", MPILibEnv, "apt-get install"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "libmpi.so.40;") || strings.Contains(err.Error(), "dlopen libmpi.so:") {
		t.Errorf("error %q: the default names were tried though %s is set", err, MPILibEnv)
	}
	if err := FinalizeMPI(); err != nil {
		t.Errorf("FinalizeMPI after a failed NewMPI: %v", err)
	}
}

// Under mpirun (make test-mpi runs this package's MPI tests there), an MPI
// call that fails returns MPI_Error_string's text instead of aborting the
// job: the bootstrap's communicator has MPI_ERRORS_RETURN. Only this test
// initializes MPI in this package, so it finalizes it too.
func TestMPIErrorIsReturnedWithItsText(t *testing.T) {
	if !LaunchedByMPI(os.LookupEnv) {
		t.Skip("not launched by mpirun")
	}
	bs, err := NewMPI(os.LookupEnv)
	if err != nil {
		t.Fatalf("NewMPI: %v", err)
	}
	defer func() {
		bs.Close()
		if err := FinalizeMPI(); err != nil {
			t.Errorf("FinalizeMPI: %v", err)
		}
	}()
	b := bs.(*mpiBootstrap)
	var send, recv [8]byte
	err = b.run("bad count", func() error {
		return b.allgather("MPI_Allgather (count -1)", unsafe.Pointer(&send[0]), unsafe.Pointer(&recv[0]), -1, b.lib.byteType)
	})
	if status.CodeOf(err) != status.Bootstrap {
		t.Fatalf("MPI_Allgather with count -1: %v (code %v), want a Bootstrap error", err, status.CodeOf(err))
	}
	want := fmt.Sprintf("bootstrap: rank %d: MPI: MPI_Allgather (count -1): ", b.Rank())
	if !strings.HasPrefix(err.Error(), want) || !strings.Contains(err.Error(), "(MPI error ") ||
		strings.Contains(err.Error(), ": MPI error ") {
		t.Fatalf("error %q: want %q, MPI_Error_string's text, then the code", err, want)
	}
	t.Log(err)
	// The failed call left MPI usable: the bootstrap still gathers.
	got, err := b.AllGather([]byte{byte(b.Rank())})
	if err != nil {
		t.Fatalf("AllGather after the failed call: %v", err)
	}
	for r, item := range got {
		if len(item) != 1 || item[0] != byte(r) {
			t.Errorf("AllGather item %d = %v, want [%d]", r, item, r)
		}
	}
}
