// Package bootstraptest gives tests an in-process bootstrap: ranks are
// goroutines of one test, and every collective is bounded like a real one.
package bootstraptest

import (
	"sync"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// memBootstrap is an in-process bootstrap for goroutine "ranks".
type memBootstrap struct {
	rank int
	hub  *memHub
}

type memHub struct {
	mu    sync.Mutex
	cond  *sync.Cond
	size  int
	round int
	got   [][]byte
	n     int
	out   [][]byte
	// timedOut is set once any rank gave up; the hub is then broken.
	timedOut bool
}

// NewMem returns the bootstraps of size goroutine ranks, indexed by rank.
// A collective that waits 10 s for the others fails with status.Timeout
// and breaks the group, so ranks that fall out of step fail a test instead
// of hanging it.
func NewMem(size int) []bootstrap.Bootstrap {
	h := &memHub{size: size, got: make([][]byte, size)}
	h.cond = sync.NewCond(&h.mu)
	bs := make([]bootstrap.Bootstrap, size)
	for r := range bs {
		bs[r] = &memBootstrap{rank: r, hub: h}
	}
	return bs
}

func (b *memBootstrap) Rank() int    { return b.rank }
func (b *memBootstrap) Size() int    { return b.hub.size }
func (b *memBootstrap) Close() error { return nil }
func (b *memBootstrap) Barrier() error {
	_, err := b.AllGather(nil)
	return err
}
func (b *memBootstrap) AllGather(data []byte) ([][]byte, error) {
	h := b.hub
	h.mu.Lock()
	defer h.mu.Unlock()
	round := h.round
	h.got[b.rank] = append([]byte(nil), data...)
	h.n++
	if h.n == h.size {
		h.out, h.got, h.n = h.got, make([][]byte, h.size), 0
		h.round++
		h.cond.Broadcast()
	}
	// Bounded like a real bootstrap: a test whose ranks fall out of step
	// fails instead of hanging the whole run.
	deadline := time.AfterFunc(10*time.Second, func() {
		h.mu.Lock()
		h.timedOut = true
		h.cond.Broadcast()
		h.mu.Unlock()
	})
	defer deadline.Stop()
	for h.round == round && !h.timedOut {
		h.cond.Wait()
	}
	if h.round == round {
		return nil, status.Errorf(status.Timeout, "in-memory bootstrap: rank %d waited 10 s for the others", b.rank)
	}
	return h.out, nil
}
