//go:build mpi

package bootstrap

import (
	"runtime"
	"strconv"
	"sync"
	"time"

	"github.com/emer/empi/v2/mpi"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// MPIBuilt reports whether this build includes the MPI bootstrap (the mpi
// build tag).
func MPIBuilt() bool { return true }

// mpiThread is the one OS thread that makes every MPI call of the process:
// MPI initialized without MPI_THREAD_MULTIPLE only promises to work when
// one thread makes all calls, and goroutines move between threads.
var mpiThread struct {
	mu        sync.Mutex
	calls     chan func()
	ownInit   bool  // we called MPI_Init, so FinalizeMPI may finalize
	finalized bool  // MPI cannot be initialized again after MPI_Finalize
	stuck     error // a call that timed out still holds the thread
}

// startMPI initializes MPI once per process, on the MPI thread, unless
// someone else (mpi4py) already did.
func startMPI() error {
	t := &mpiThread
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.finalized {
		return status.Errorf(status.State, "bootstrap: MPI: already finalized in this process; it cannot be initialized again")
	}
	if t.calls != nil {
		return t.stuck
	}
	t.calls = make(chan func())
	go func() {
		runtime.LockOSThread() // never unlocked: this goroutine is the MPI thread
		for f := range t.calls {
			f()
		}
	}()
	return runOnMPIThread(DefaultTimeout, "MPI_Init", func() error {
		mpi.LogErrors = false // errors are returned, not logged
		if mpi.IsOn() {
			return nil
		}
		mpi.Init()
		if !mpi.IsOn() {
			return status.Errorf(status.Bootstrap, "bootstrap: MPI_Init failed")
		}
		t.ownInit = true
		return nil
	})
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

// NewMPI returns a Bootstrap over MPI_COMM_WORLD, initializing MPI on first
// use (or using an MPI that mpi4py or another library initialized). Every
// call is bounded by DefaultTimeout; MPI cannot tell which rank is missing.
// Close does not finalize MPI, since MPI cannot be initialized again in the
// same process; call FinalizeMPI once at exit.
func NewMPI() (Bootstrap, error) {
	if err := startMPI(); err != nil {
		return nil, err
	}
	b := &mpiBootstrap{timeout: DefaultTimeout}
	err := b.run("MPI_Comm_group", func() error {
		comm, err := mpi.NewComm(nil)
		if err != nil {
			return err
		}
		b.comm, b.rank, b.size = comm, comm.Rank(), comm.Size()
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
	return runOnMPIThread(DefaultTimeout, "MPI_Finalize", func() error {
		mpi.Finalize()
		return nil
	})
}

type mpiBootstrap struct {
	rank, size int
	comm       *mpi.Comm
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
	err := runOnMPIThread(b.timeout, what, f)
	if err != nil && status.CodeOf(err) == status.Internal {
		err = status.Errorf(status.Bootstrap, "bootstrap: rank %d: %s: %v", b.rank, what, err)
	}
	return err
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
	err := b.run(b.opName("all-gather", "lengths"), func() error {
		return b.comm.AllGatherI64(lens, []int64{int64(len(data))})
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
		return b.run(b.opName("all-gather", "data"), func() error { return b.comm.AllGatherU8(recv, send) })
	})
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
	b.err = b.run("MPI_Barrier (barrier #"+strconv.Itoa(b.seq)+")", b.comm.Barrier)
	return b.err
}

func (b *mpiBootstrap) usable(op string) error {
	if b.closed {
		return status.Errorf(status.State, "bootstrap: %s after Close", op)
	}
	return b.err
}

// Close marks the bootstrap closed. It leaves MPI initialized; see
// FinalizeMPI.
func (b *mpiBootstrap) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	return nil
}
