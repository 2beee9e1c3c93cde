package ucx

import (
	"sync/atomic"
	"time"
)

// Background progresses a transport while no call uses it. Over tcp, data
// and acknowledgements move only while a rank progresses, and a rank that
// returned from a call may still owe its peers that (a signal waiting for
// its flush, a tail in UCX's send buffers). So it never stops on its own:
// at once while something moves, then backing off to once a millisecond.
// Between Enter and Leave it sleeps: the call progresses itself.
type Background struct {
	t       *Transport
	busy    atomic.Bool   // a call is running
	idle    chan struct{} // a call ended (capacity 1)
	stop    chan struct{} // closed to end the loop
	stopped chan struct{} // closed when the loop has ended
}

// StartBackground starts progressing t; Stop ends it.
func StartBackground(t *Transport) *Background {
	b := &Background{t: t, idle: make(chan struct{}, 1), stop: make(chan struct{}), stopped: make(chan struct{})}
	go b.loop()
	return b
}

func (b *Background) loop() {
	defer close(b.stopped)
	nap := 20 * time.Microsecond
	timer := time.NewTimer(nap)
	defer timer.Stop()
	for {
		select {
		case <-b.stop:
			return
		case <-b.idle:
			nap = 20 * time.Microsecond
		case <-timer.C:
		}
		if !b.busy.Load() {
			active, err := b.t.Progress()
			switch {
			case err != nil:
				return
			case active:
				nap = 20 * time.Microsecond
			default:
				nap = min(2*nap, time.Millisecond)
			}
		} else {
			nap = 10 * time.Millisecond // idle wakes it when the call ends
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(nap)
	}
}

// Enter and Leave bracket a call that progresses the transport itself.
func (b *Background) Enter() { b.busy.Store(true) }

func (b *Background) Leave() {
	b.busy.Store(false)
	select {
	case b.idle <- struct{}{}:
	default:
	}
}

// Stop ends the loop and waits for it; a nil Background is stopped.
func (b *Background) Stop() {
	if b == nil {
		return
	}
	close(b.stop)
	<-b.stopped
}
