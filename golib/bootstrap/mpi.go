package bootstrap

/*
#include "mpi_trampolines.h"
*/
import "C"

import (
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/dl"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// MPILibEnv names the variable that gives the full path of Open MPI's
// libmpi.so; without it the dynamic loader's search finds libmpi.so.40, then
// libmpi.so.
const MPILibEnv = "P2PCOMM_MPI_LIB"

// mpiThreadFunneled is MPI_THREAD_FUNNELED, the same value in every MPI:
// the process has many threads, and the one that initialized MPI makes
// every call.
const mpiThreadFunneled = 1

// mpiInstallHint says how to get a library the bootstrap can load.
const mpiInstallHint = "install Open MPI (e.g. apt-get install openmpi-bin libopenmpi3) or set " +
	MPILibEnv + " to the full path of its libmpi.so"

// symbols is what the loader needs from an opened library; *dl.Library
// satisfies it, and tests substitute fakes.
type symbols interface {
	Sym(name string) (unsafe.Pointer, error)
}

// mpiLib is a loaded Open MPI: one pointer per entry point, and the
// addresses of the predefined handles (Open MPI's handles are the addresses
// of exported globals, e.g. MPI_COMM_WORLD is &ompi_mpi_comm_world).
type mpiLib struct {
	path string

	initialized, finalized, initThread, finalize   unsafe.Pointer
	commDup, commSetErrhandler, commRank, commSize unsafe.Pointer
	allgather, barrier, errorString                unsafe.Pointer
	commWorld, byteType, int64Type, errorsReturn   unsafe.Pointer
}

type mpiEntry struct {
	name string
	slot *unsafe.Pointer
}

func (m *mpiLib) functions() []mpiEntry {
	return []mpiEntry{
		{"MPI_Initialized", &m.initialized},
		{"MPI_Finalized", &m.finalized},
		{"MPI_Init_thread", &m.initThread},
		{"MPI_Finalize", &m.finalize},
		{"MPI_Comm_dup", &m.commDup},
		{"MPI_Comm_set_errhandler", &m.commSetErrhandler},
		{"MPI_Comm_rank", &m.commRank},
		{"MPI_Comm_size", &m.commSize},
		{"MPI_Allgather", &m.allgather},
		{"MPI_Barrier", &m.barrier},
		{"MPI_Error_string", &m.errorString},
	}
}

func (m *mpiLib) handles() []mpiEntry {
	return []mpiEntry{
		{"ompi_mpi_comm_world", &m.commWorld},
		{"ompi_mpi_byte", &m.byteType},
		{"ompi_mpi_int64_t", &m.int64Type},
		{"ompi_mpi_errors_return", &m.errorsReturn},
	}
}

// resolveMPI fills the entry-point table from lib, opened from path. A
// library with the MPI functions but without Open MPI's handle symbols uses
// another ABI (MPICH and its derivatives: integer handles).
func resolveMPI(lib symbols, path string) (*mpiLib, error) {
	m := &mpiLib{path: path}
	var missing []string
	for _, e := range m.functions() {
		p, err := lib.Sym(e.name)
		if err != nil {
			missing = append(missing, e.name)
		}
		*e.slot = p
	}
	if len(missing) > 0 {
		return nil, status.Errorf(status.Unsupported, "bootstrap: MPI: %s is not an MPI library (missing %s); %s",
			path, strings.Join(missing, ", "), mpiInstallHint)
	}
	for _, e := range m.handles() {
		p, err := lib.Sym(e.name)
		if err != nil {
			return nil, status.Errorf(status.Unsupported,
				"bootstrap: MPI: %s is not Open MPI (no %s): MPICH-ABI libraries are not supported; set %s to Open MPI's libmpi.so",
				path, e.name, MPILibEnv)
		}
		*e.slot = p
	}
	return m, nil
}

// mpiLoad holds the one MPI of the process once a load succeeds; failures
// are not kept, so a later call may find a library installed or named since.
var mpiLoad struct {
	mu  sync.Mutex
	lib *mpiLib
}

// loadMPI opens Open MPI: MPILibEnv's path if set (lookup is usually
// os.LookupEnv or a communicator config's), else libmpi.so.40, else
// libmpi.so. Once one is loaded, every later call returns it: a process
// has one MPI. The error is a status.Unsupported saying how to get one.
func loadMPI(lookup func(string) (string, bool)) (*mpiLib, error) {
	mpiLoad.mu.Lock()
	defer mpiLoad.mu.Unlock()
	if mpiLoad.lib != nil {
		return mpiLoad.lib, nil
	}
	candidates := []string{"libmpi.so.40", "libmpi.so"}
	if v, ok := lookup(MPILibEnv); ok && v != "" {
		candidates = []string{v}
	}
	var tried []string
	for _, path := range candidates {
		// RTLD_GLOBAL: Open MPI's components, dlopened by libmpi itself,
		// need libmpi's symbols.
		lib, err := dl.Open(path, dl.Now|dl.Global)
		if err != nil {
			tried = append(tried, err.Error())
			continue
		}
		m, err := resolveMPI(lib, path)
		if err != nil {
			return nil, err
		}
		mpiLoad.lib = m
		return m, nil
	}
	return nil, status.Errorf(status.Unsupported, "bootstrap: MPI: cannot load Open MPI (%s); %s",
		strings.Join(tried, "; "), mpiInstallHint)
}

// MPIAvailable reports whether the MPI bootstrap can load Open MPI, as
// loadMPI would with lookup.
func MPIAvailable(lookup func(string) (string, bool)) bool {
	_, err := loadMPI(lookup)
	return err == nil
}

// errorText is MPI_Error_string's text for code; call it on the MPI thread.
func (m *mpiLib) errorText(code C.int) string {
	buf := make([]byte, 1024) // MPI_MAX_ERROR_STRING is 256 in Open MPI
	n := C.int(0)
	if C.p2p_mpi_error_string(m.errorString, code, (*C.char)(unsafe.Pointer(&buf[0])), &n) != 0 || n <= 0 || int(n) > len(buf) {
		return "MPI error " + strconv.Itoa(int(code))
	}
	return strings.TrimRight(string(buf[:n]), "\x00") + " (MPI error " + strconv.Itoa(int(code)) + ")"
}

// check turns an MPI return code into nil or a status.Bootstrap error.
func (m *mpiLib) check(call string, code C.int) error {
	if code == 0 { // MPI_SUCCESS
		return nil
	}
	return status.Errorf(status.Bootstrap, "bootstrap: MPI: %s: %s", call, m.errorText(code))
}

// mpiThread is the one OS thread that makes every MPI call of the process:
// MPI initialized without MPI_THREAD_MULTIPLE only promises to work when
// one thread makes all calls, and goroutines move between threads.
var mpiThread struct {
	mu        sync.Mutex
	lib       *mpiLib
	calls     chan func()
	ownInit   bool  // we called MPI_Init_thread, so FinalizeMPI may finalize
	finalized bool  // MPI cannot be initialized again after MPI_Finalize
	stuck     error // a call that timed out still holds the thread
	initErr   error // MPI did not start; no MPI call may follow
}

// startMPI initializes MPI once per process, on the MPI thread, unless
// someone else (mpi4py) already did.
func startMPI(lib *mpiLib) error {
	t := &mpiThread
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.finalized {
		return status.Errorf(status.State, "bootstrap: MPI: already finalized in this process; it cannot be initialized again")
	}
	if t.calls != nil {
		if t.stuck != nil {
			return t.stuck
		}
		return t.initErr
	}
	t.lib = lib
	t.calls = make(chan func())
	go func() {
		runtime.LockOSThread() // never unlocked: this goroutine is the MPI thread
		for f := range t.calls {
			f()
		}
	}()
	own := false // read only once the call has returned, never after a timeout
	t.initErr = runOnMPIThread(DefaultTimeout, "MPI_Init_thread", func() error {
		var on, off C.int
		if err := lib.check("MPI_Initialized", C.p2p_mpi_p(lib.initialized, unsafe.Pointer(&on))); err != nil {
			return err
		}
		if err := lib.check("MPI_Finalized", C.p2p_mpi_p(lib.finalized, unsafe.Pointer(&off))); err != nil {
			return err
		}
		switch {
		case off != 0:
			return status.Errorf(status.State, "bootstrap: MPI: finalized by another library in this process; it cannot be initialized again")
		case on != 0:
			return nil
		}
		var provided C.int
		if err := lib.check("MPI_Init_thread", C.p2p_mpi_init_thread(lib.initThread, mpiThreadFunneled, &provided)); err != nil {
			return err
		}
		own = true
		return nil
	})
	t.ownInit = t.initErr == nil && own
	return t.initErr
}

// runOnMPIThread runs f on the MPI thread and waits at most timeout. MPI
// calls cannot be interrupted, so a call that times out keeps the thread and
// every later MPI call of the process fails with the same error.
func runOnMPIThread(timeout time.Duration, what string, f func() error) error {
	t := &mpiThread
	if t.stuck != nil {
		return t.stuck
	}
	done := make(chan error, 1)
	t.calls <- func() { done <- f() }
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case err := <-done:
		return err
	case <-timer.C:
		t.stuck = status.Errorf(status.Timeout,
			"bootstrap: MPI: %s did not finish within %v (a rank exited or never called it; MPI cannot say which)", what, timeout)
		return t.stuck
	}
}

// NewMPI returns a Bootstrap over a duplicate of MPI_COMM_WORLD that
// returns errors instead of aborting, loading Open MPI (see MPILibEnv;
// lookup is usually os.LookupEnv) and initializing it on first use, or using
// an MPI that mpi4py or another library initialized. Every call is bounded
// by DefaultTimeout; MPI cannot tell which rank is missing. Close does not
// finalize MPI, since MPI cannot be initialized again in the same process;
// call FinalizeMPI once at exit. Without a loadable Open MPI the error is a
// status.Unsupported saying how to get one.
func NewMPI(lookup func(string) (string, bool)) (Bootstrap, error) {
	lib, err := loadMPI(lookup)
	if err != nil {
		return nil, err
	}
	if err := startMPI(lib); err != nil {
		return nil, err
	}
	b := &mpiBootstrap{lib: lib, timeout: DefaultTimeout}
	err = b.run("MPI_Comm_dup", func() error {
		var comm unsafe.Pointer
		if err := lib.check("MPI_Comm_dup", C.p2p_mpi_p_p(lib.commDup, lib.commWorld, unsafe.Pointer(&comm))); err != nil {
			return err
		}
		if err := lib.check("MPI_Comm_set_errhandler", C.p2p_mpi_p_p(lib.commSetErrhandler, comm, lib.errorsReturn)); err != nil {
			return err
		}
		var rank, size C.int
		if err := lib.check("MPI_Comm_rank", C.p2p_mpi_p_p(lib.commRank, comm, unsafe.Pointer(&rank))); err != nil {
			return err
		}
		if err := lib.check("MPI_Comm_size", C.p2p_mpi_p_p(lib.commSize, comm, unsafe.Pointer(&size))); err != nil {
			return err
		}
		b.comm, b.rank, b.size = comm, int(rank), int(size)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return b, nil
}

// FinalizeMPI calls MPI_Finalize if NewMPI initialized MPI and nothing has
// finalized it yet. Call it once, at process exit, after closing every MPI
// bootstrap: Open MPI's mpirun reports a process that exits without it as
// failed. A later NewMPI returns a status.State error.
func FinalizeMPI() error {
	t := &mpiThread
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.calls == nil || !t.ownInit || t.finalized {
		return nil
	}
	t.finalized = true
	lib := t.lib
	return runOnMPIThread(DefaultTimeout, "MPI_Finalize", func() error {
		return lib.check("MPI_Finalize", C.p2p_mpi_v(lib.finalize))
	})
}

type mpiBootstrap struct {
	rank, size int
	lib        *mpiLib
	comm       unsafe.Pointer // MPI_Comm, a duplicate of MPI_COMM_WORLD with MPI_ERRORS_RETURN
	timeout    time.Duration

	mu     sync.Mutex // serializes collectives
	seq    int
	err    error // sticky
	closed bool
}

func (b *mpiBootstrap) Rank() int { return b.rank }
func (b *mpiBootstrap) Size() int { return b.size }

func (b *mpiBootstrap) run(what string, f func() error) error {
	mpiThread.mu.Lock()
	defer mpiThread.mu.Unlock()
	if mpiThread.finalized {
		return status.Errorf(status.State, "bootstrap: MPI: %s after FinalizeMPI", what)
	}
	return runOnMPIThread(b.timeout, what, f)
}

// check is mpiLib.check naming this rank; call it on the MPI thread.
func (b *mpiBootstrap) check(call string, code C.int) error {
	if code == 0 {
		return nil
	}
	return status.Errorf(status.Bootstrap, "bootstrap: rank %d: MPI: %s: %s", b.rank, call, b.lib.errorText(code))
}

// AllGather all-gathers the lengths, then every rank's data padded to the
// longest (skipped when all are empty).
func (b *mpiBootstrap) AllGather(data []byte) ([][]byte, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.usable("all-gather"); err != nil {
		return nil, err
	}
	b.seq++
	out, err := b.allGatherVar(data)
	b.err = err
	return out, err
}

func (b *mpiBootstrap) allGatherVar(data []byte) ([][]byte, error) {
	if len(data) > MaxPayload {
		return nil, status.Errorf(status.Capacity, "bootstrap: all-gather of %d bytes exceeds the limit of %d", len(data), MaxPayload)
	}
	lens := make([]int64, b.size)
	mine := []int64{int64(len(data))}
	what := b.opName("all-gather", "lengths")
	err := b.run(what, func() error {
		return b.allgather(what, unsafe.Pointer(&mine[0]), unsafe.Pointer(&lens[0]), 1, b.lib.int64Type)
	})
	if err != nil {
		return nil, err
	}
	sizes := make([]int, b.size)
	for r, n := range lens {
		if n < 0 || n > MaxPayload {
			return nil, status.Errorf(status.Bootstrap, "bootstrap: all-gather #%d: rank %d sends %d bytes", b.seq, r, n)
		}
		sizes[r] = int(n)
	}
	return gatherPadded(data, sizes, func(send, recv []byte) error {
		what := b.opName("all-gather", "data")
		return b.run(what, func() error {
			return b.allgather(what, unsafe.Pointer(&send[0]), unsafe.Pointer(&recv[0]), len(send), b.lib.byteType)
		})
	})
}

// allgather is MPI_Allgather of count elements of dtype per rank; call it
// on the MPI thread. The buffers hold no Go pointers, and a call that times
// out keeps them alive on the MPI thread's stack.
func (b *mpiBootstrap) allgather(what string, send, recv unsafe.Pointer, count int, dtype unsafe.Pointer) error {
	return b.check(what, C.p2p_mpi_allgather(b.lib.allgather, send, C.int(count), dtype, recv, C.int(count), dtype, b.comm))
}

func (b *mpiBootstrap) opName(kind, part string) string {
	return "MPI_Allgather (" + kind + " #" + strconv.Itoa(b.seq) + ", " + part + ")"
}

// Barrier is MPI_Barrier.
func (b *mpiBootstrap) Barrier() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.usable("barrier"); err != nil {
		return err
	}
	b.seq++
	what := "MPI_Barrier (barrier #" + strconv.Itoa(b.seq) + ")"
	b.err = b.run(what, func() error { return b.check(what, C.p2p_mpi_p(b.lib.barrier, b.comm)) })
	return b.err
}

func (b *mpiBootstrap) usable(op string) error {
	if b.closed {
		return status.Errorf(status.State, "bootstrap: %s after Close", op)
	}
	return b.err
}

// Close marks the bootstrap closed. It leaves MPI initialized and keeps its
// communicator (MPI_Comm_free is collective, and Close does not wait for
// peers; MPI_Finalize frees it); see FinalizeMPI.
func (b *mpiBootstrap) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	return nil
}
