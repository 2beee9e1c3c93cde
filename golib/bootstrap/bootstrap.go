// Package bootstrap exchanges small messages between the ranks of a job
// before any shared memory exists: who is who, and the handles to map.
package bootstrap

import "time"

// Bootstrap is a rendezvous among Size() processes. Calls are collective:
// every rank must make the same sequence of calls. Every call is bounded by
// the bootstrap's timeout and returns an error naming the peer that failed.
type Bootstrap interface {
	Rank() int
	Size() int
	// AllGather sends data (any length, may differ per rank) and returns
	// every rank's data indexed by rank. The result does not alias data.
	AllGather(data []byte) ([][]byte, error)
	// Barrier returns once every rank has entered it.
	Barrier() error
	// Close releases connections. It does not wait for peers.
	Close() error
}

// DefaultTimeout bounds every bootstrap wait unless configured otherwise.
const DefaultTimeout = 120 * time.Second

// gatherPadded all-gathers data of per-rank lengths sizes (already
// exchanged) through gather, an all-gather of equal-sized buffers: each
// rank pads its data to the longest, and the result cuts the padding off
// (capacity too, so no rank's slice reaches into the next). Nothing is
// gathered when every length is 0.
func gatherPadded(data []byte, sizes []int, gather func(send, recv []byte) error) ([][]byte, error) {
	longest := 0
	for _, n := range sizes {
		longest = max(longest, n)
	}
	out := make([][]byte, len(sizes))
	if longest == 0 {
		for r := range out {
			out[r] = []byte{}
		}
		return out, nil
	}
	send := make([]byte, longest)
	copy(send, data)
	recv := make([]byte, longest*len(sizes))
	if err := gather(send, recv); err != nil {
		return nil, err
	}
	for r, n := range sizes {
		out[r] = recv[r*longest : r*longest+n : r*longest+n]
	}
	return out, nil
}
