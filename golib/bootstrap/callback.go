package bootstrap

import (
	"encoding/binary"
	"sync"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// NewCallback returns a Bootstrap that rides on another library's
// collectives, typically torch.distributed's through Python callbacks.
// allGather must be a fixed-size all-gather: every rank passes the same
// len(send), and recv (len(send)*size bytes) receives rank r's bytes at
// offset r*len(send). barrier may be nil; Barrier then all-gathers 8 bytes.
// Timeouts are the callbacks' business. Callback errors are returned as
// status.Bootstrap errors and break the bootstrap.
func NewCallback(rank, size int, allGather func(send, recv []byte) error, barrier func() error) (Bootstrap, error) {
	if size < 1 || rank < 0 || rank >= size {
		return nil, status.Errorf(status.InvalidArgument, "bootstrap: rank %d, world size %d: want 0 <= rank < size", rank, size)
	}
	if allGather == nil {
		return nil, status.Errorf(status.InvalidArgument, "bootstrap: nil all-gather callback")
	}
	return &callbackBootstrap{rank: rank, size: size, allGather: allGather, barrier: barrier}, nil
}

type callbackBootstrap struct {
	rank, size int
	allGather  func(send, recv []byte) error
	barrier    func() error

	mu     sync.Mutex // serializes collectives
	seq    int
	err    error // sticky
	closed bool
}

func (b *callbackBootstrap) Rank() int { return b.rank }
func (b *callbackBootstrap) Size() int { return b.size }

// AllGather makes two fixed-size all-gathers: the lengths, then every
// rank's data padded to the longest (skipped when all are empty).
func (b *callbackBootstrap) AllGather(data []byte) ([][]byte, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.usable("all-gather"); err != nil {
		return nil, err
	}
	b.seq++
	out, err := b.allGatherVar(data)
	if err != nil {
		b.err = err
	}
	return out, err
}

func (b *callbackBootstrap) allGatherVar(data []byte) ([][]byte, error) {
	lens := make([]byte, 8*b.size)
	if err := b.call(binary.LittleEndian.AppendUint64(nil, uint64(len(data))), lens); err != nil {
		return nil, err
	}
	sizes := make([]int, b.size)
	for r := range sizes {
		n := binary.LittleEndian.Uint64(lens[8*r:])
		if n > MaxPayload {
			return nil, status.Errorf(status.Capacity, "bootstrap: all-gather #%d: rank %d sends %d bytes, over the limit of %d",
				b.seq, r, n, MaxPayload)
		}
		sizes[r] = int(n)
	}
	if sizes[b.rank] != len(data) {
		return nil, status.Errorf(status.Bootstrap, "bootstrap: all-gather #%d: callback put length %d in my slot, want %d (not rank-major?)",
			b.seq, sizes[b.rank], len(data))
	}
	return gatherPadded(data, sizes, b.call)
}

func (b *callbackBootstrap) call(send, recv []byte) error {
	if err := b.allGather(send, recv); err != nil {
		return status.Errorf(status.Bootstrap, "bootstrap: rank %d: all-gather callback failed in collective #%d: %v", b.rank, b.seq, err)
	}
	return nil
}

// Barrier calls the barrier callback, or all-gathers nothing without one.
func (b *callbackBootstrap) Barrier() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.usable("barrier"); err != nil {
		return err
	}
	b.seq++
	var err error
	if b.barrier == nil {
		_, err = b.allGatherVar(nil)
	} else if cbErr := b.barrier(); cbErr != nil {
		err = status.Errorf(status.Bootstrap, "bootstrap: rank %d: barrier callback failed in collective #%d: %v", b.rank, b.seq, cbErr)
	}
	b.err = err
	return err
}

func (b *callbackBootstrap) usable(op string) error {
	if b.closed {
		return status.Errorf(status.State, "bootstrap: %s after Close", op)
	}
	return b.err
}

// Close only marks the bootstrap closed; the callbacks' owner keeps its
// process group.
func (b *callbackBootstrap) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	return nil
}
