// Package trace keeps a timeline of what the proxies and transports did,
// for finding where a call's time goes: with P2PCOMM_PROXY_TRACE=prefix the
// process keeps its last Cap events (a trigger popped, its put and signal
// handed to the transport, a trigger done, a moment a caller marked) and
// Write puts them in prefix.<pid>. Times are wall clock nanoseconds, so the
// files of the processes of one host line up (tools/proxy_timeline.py).
// Off (the default), recording an event is one nil check.
package trace

import (
	"bufio"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/procenv"
)

// Cap is how many events are kept, the newest.
const Cap = 1 << 16

// Event is one moment: What is 'p' popped, 'u' its put handed to the
// transport, 's' its signal, 'd' done (with the trigger's FIFO, position,
// type bits, channel and bytes), or 'm' marked (with Label).
type Event struct {
	ns            int64
	What          byte
	FIFO          uint32
	Pos           uint64
	Type, Channel uint32
	Size          uint64
	Label         string
}

var (
	to    = procenv.Get("P2PCOMM_PROXY_TRACE")
	buf   []Event
	count atomic.Uint64
	mu    sync.Mutex // guards buf's slots and the file
)

func init() {
	if to != "" {
		buf = make([]Event, Cap)
	}
}

// On reports whether events are kept.
func On() bool { return buf != nil }

// Add records e now.
func Add(e Event) {
	if buf == nil {
		return
	}
	e.ns = time.Now().UnixNano()
	mu.Lock() // an event holds a string: no reader may see half of one
	buf[(count.Add(1)-1)%Cap] = e
	mu.Unlock()
}

// Mark records a moment of the caller's (a launch, say).
func Mark(label string) {
	if buf != nil {
		Add(Event{What: 'm', Label: label})
	}
}

// Write writes the events kept so far, oldest first.
func Write() error {
	if buf == nil {
		return nil
	}
	mu.Lock()
	defer mu.Unlock()
	f, err := os.Create(fmt.Sprintf("%s.%d", to, os.Getpid()))
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	n := count.Load()
	for i := n - min(n, Cap); i < n; i++ {
		e := buf[i%Cap]
		if e.What == 'm' {
			fmt.Fprintf(w, "%d m %s\n", e.ns, e.Label)
			continue
		}
		fmt.Fprintf(w, "%d %c fifo=%d pos=%d type=%d channel=%d bytes=%d\n", e.ns, e.What, e.FIFO, e.Pos, e.Type, e.Channel, e.Size)
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
