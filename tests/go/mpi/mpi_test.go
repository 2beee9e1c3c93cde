// Package mpi_test checks the MPI bootstrap under a real launcher, with
// Open MPI loaded at run time (P2PCOMM_MPI_LIB, else libmpi.so.40):
//
//	go test -c -o build/mpi.test ./tests/go/mpi
//	mpirun --allow-run-as-root --oversubscribe -np 2 build/mpi.test -test.v
package mpi_test

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
)

func TestMain(m *testing.M) {
	code := m.Run()
	// mpirun counts a process that exits without MPI_Finalize as failed.
	if err := bootstrap.FinalizeMPI(); err != nil {
		fmt.Fprintln(os.Stderr, "FinalizeMPI:", err)
		code = 1
	}
	os.Exit(code)
}

// payload differs in length and content by rank and round; round 0 of
// rank 0 is empty, and round 1 is empty everywhere.
func payload(rank, round int) []byte {
	if round == 1 {
		return nil
	}
	return bytes.Repeat([]byte{byte(rank*16 + round)}, (rank*7+round*3)%20)
}

func TestMPIAllGatherAndBarrier(t *testing.T) {
	if !bootstrap.LaunchedByMPI(os.LookupEnv) {
		t.Skip("not launched by mpirun; run: mpirun --allow-run-as-root --oversubscribe -np 2 build/mpi.test -test.v")
	}
	if !bootstrap.MPIAvailable(os.LookupEnv) {
		t.Fatal("MPIAvailable() = false under mpirun (is Open MPI's libmpi.so.40 on the loader's path, or P2PCOMM_MPI_LIB set?)")
	}
	b, err := bootstrap.NewMPI(os.LookupEnv)
	if err != nil {
		t.Fatalf("NewMPI: %v", err)
	}
	defer b.Close()
	wantSize, _ := strconv.Atoi(os.Getenv("OMPI_COMM_WORLD_SIZE"))
	wantRank, _ := strconv.Atoi(os.Getenv("OMPI_COMM_WORLD_RANK"))
	if wantSize > 0 && (b.Size() != wantSize || b.Rank() != wantRank) {
		t.Fatalf("rank %d of %d, want rank %d of %d (from OMPI_COMM_WORLD_*)", b.Rank(), b.Size(), wantRank, wantSize)
	}
	for round := range 20 {
		got, err := b.AllGather(payload(b.Rank(), round))
		if err != nil {
			t.Fatalf("rank %d: AllGather round %d: %v", b.Rank(), round, err)
		}
		if len(got) != b.Size() {
			t.Fatalf("rank %d: AllGather round %d returned %d items, want %d", b.Rank(), round, len(got), b.Size())
		}
		for r, item := range got {
			if want := payload(r, round); !bytes.Equal(item, want) {
				t.Errorf("rank %d: AllGather round %d item %d = %x, want %x", b.Rank(), round, r, item, want)
			}
		}
		if err := b.Barrier(); err != nil {
			t.Fatalf("rank %d: Barrier after round %d: %v", b.Rank(), round, err)
		}
	}
	t.Logf("rank %d of %d: 20 all-gathers and barriers checked", b.Rank(), b.Size())

	// A second bootstrap in the same process shares the initialized MPI.
	b2, err := bootstrap.NewMPI(os.LookupEnv)
	if err != nil {
		t.Fatalf("second NewMPI: %v", err)
	}
	defer b2.Close()
	got, err := b2.AllGather([]byte(strconv.Itoa(b2.Rank())))
	if err != nil {
		t.Fatalf("second bootstrap AllGather: %v", err)
	}
	for r, item := range got {
		if string(item) != strconv.Itoa(r) {
			t.Errorf("second bootstrap: item %d = %q, want %q", r, item, strconv.Itoa(r))
		}
	}
}
