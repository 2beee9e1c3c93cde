// Package collective defines what a communicator asks of a backend: the
// all-reduce request, the algorithms, and the Backend interface that the CPU
// (hostcoll) and GPU (gpucoll) backends implement.
package collective

import (
	"fmt"

	"github.com/p2pcomm/p2pcomm/golib/reduce"
)

// Algorithm selects how an all-reduce moves data. The numbers are part of
// the C ABI.
type Algorithm int32

const (
	Auto Algorithm = 0
	// OneShot: every rank reads every peer's whole input and reduces it.
	OneShot Algorithm = 1
	// TwoShot: reduce-scatter (rank r reduces slice r), then all-gather.
	TwoShot Algorithm = 2
	// Ring: reduce-scatter and all-gather passed around the ring of ranks.
	Ring Algorithm = 3
	// RecursiveDoubling: log2(world) pairwise exchange steps.
	RecursiveDoubling Algorithm = 4
	// OneShotLL: one-shot with the flags inside the data (low latency): each
	// rank pushes its input into every peer, no barrier. Small messages.
	OneShotLL Algorithm = 5
	// TwoShotLL: two-shot with the flags inside the data. Medium messages.
	TwoShotLL Algorithm = 6
	// OneShotPush: each rank pushes its input into every peer, then one flag
	// per block after a fence; no barrier round trip, no staging copy.
	OneShotPush Algorithm = 7
	// TwoShotPush: two-shot pushing slices and results, flagged per block.
	TwoShotPush Algorithm = 8
	// OneShotLL128: one-shot on 128-byte lines of 120 data bytes and a flag
	// (NCCL's LL128): LL's single trip at 7% overhead instead of 100%.
	OneShotLL128 Algorithm = 9
	// OneShotLamport: one-shot on plain data, arrival told by the data itself
	// (a sentinel every free word holds): floating-point sums only.
	OneShotLamport Algorithm = 10
	// TwoShotLamport: two-shot on the same plain data (reduce-scatter, then
	// all-gather, no barrier): floating-point sums only.
	TwoShotLamport Algorithm = 11
	numAlgorithms            = 12
)

var algoNames = [numAlgorithms]string{"auto", "oneshot", "twoshot", "ring", "recursive_doubling",
	"oneshot_ll", "twoshot_ll", "oneshot_push", "twoshot_push", "oneshot_ll128",
	"oneshot_lamport", "twoshot_lamport"}

// Valid reports whether a is a known algorithm.
func (a Algorithm) Valid() bool { return a >= 0 && a < numAlgorithms }

func (a Algorithm) String() string {
	if !a.Valid() {
		return fmt.Sprintf("algorithm(%d)", int32(a))
	}
	return algoNames[a]
}

// AlgorithmNames lists every algorithm's name, in ABI order.
func AlgorithmNames() []string { return append([]string(nil), algoNames[:]...) }

// ParseAlgorithm maps a name ("oneshot", "ring", ...) to its Algorithm.
func ParseAlgorithm(name string) (Algorithm, bool) {
	for i, n := range algoNames {
		if n == name {
			return Algorithm(i), true
		}
	}
	return 0, false
}

// AllReduce is one all-reduce call. Src and Dst are addresses in the
// backend's memory space (host for CPU, device for GPU); Src == Dst means in
// place. Stream is a CUDA stream (0 = legacy default) and ignored on CPU.
type AllReduce struct {
	Src, Dst uintptr
	Count    int64 // elements
	DType    reduce.DType
	Op       reduce.Op
	Algo     Algorithm
	Stream   uintptr
	// Reject, when set, is this rank's own validation failure: the backend
	// still takes part in the collective, so every peer learns of it and
	// fails too instead of waiting, and then returns Reject here.
	Reject error
}

// Bytes is the payload size of the call.
func (a AllReduce) Bytes() int64 { return a.Count * int64(a.DType.Size()) }

// Backend runs collectives for one communicator. Calls are collective where
// noted; a backend is used from one goroutine at a time (the communicator
// serializes calls).
type Backend interface {
	// Alloc collectively allocates nbytes of symmetric memory on every rank
	// and returns the local address.
	Alloc(nbytes int64) (uintptr, error)
	// Free collectively releases memory returned by Alloc.
	Free(ptr uintptr) error
	// Register collectively makes [ptr, ptr+nbytes) usable in place.
	Register(ptr uintptr, nbytes int64) error
	// Deregister collectively undoes Register.
	Deregister(ptr uintptr) error
	// AllReduce runs one collective all-reduce.
	AllReduce(req AllReduce) error
	// Check returns an error recorded asynchronously (e.g. by a device
	// kernel that timed out), or nil.
	Check() error
	// Close releases every resource. Not collective; idempotent.
	Close() error
}

// PeerMemory is implemented by backends whose symmetric memory peers can
// address directly (both backends do).
type PeerMemory interface {
	// PeerAddress returns where this process sees rank's copy of the
	// symmetric (or registered) range [ptr, ptr+nbytes).
	PeerAddress(ptr uintptr, nbytes int64, rank int) (uintptr, error)
	// StreamBarrier orders a barrier among all ranks on stream, on behalf
	// of call (named when a peer never arrives): work
	// enqueued after it runs once every rank's work before it has run.
	// The CPU backend waits on the host.
	StreamBarrier(stream uintptr, call Call) error
}

// GraphBuffers is implemented by backends whose kernels can read inputs
// captured into CUDA graphs in place once they are registered (GPU).
type GraphBuffers interface {
	// RegisterGraphBuffers collectively registers the inputs that calls
	// captured since the last time had to stage, and returns their number.
	RegisterGraphBuffers() (int, error)
}

// Call is the operation a stream barrier serves, so that a peer that never
// arrives is reported against it. The numbers are part of the C ABI and of
// the kernels (p2p_common.cuh kCall*).
type Call int32

const (
	CallAllReduce     Call = 0
	CallStreamBarrier Call = 1
	CallMoeDispatch   Call = 2
	CallMoeCombine    Call = 3
	numCalls               = 4
)

var callNames = [numCalls]string{"an all-reduce", "a stream barrier", "an MoE dispatch", "an MoE combine"}

// Valid reports whether c is a known call.
func (c Call) Valid() bool { return c >= 0 && c < numCalls }

func (c Call) String() string {
	if !c.Valid() {
		return fmt.Sprintf("call(%d)", int32(c))
	}
	return callNames[c]
}
