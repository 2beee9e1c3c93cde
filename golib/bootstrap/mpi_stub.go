//go:build !mpi

package bootstrap

import "github.com/p2pcomm/p2pcomm/golib/status"

// MPIBuilt reports whether this build includes the MPI bootstrap (the mpi
// build tag).
func MPIBuilt() bool { return false }

// NewMPI returns status.Unsupported: this build has no MPI.
func NewMPI() (Bootstrap, error) {
	return nil, status.Errorf(status.Unsupported, "bootstrap: MPI: built without the mpi tag (rebuild with -tags mpi)")
}

// FinalizeMPI does nothing: this build has no MPI.
func FinalizeMPI() error { return nil }
