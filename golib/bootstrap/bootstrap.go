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
