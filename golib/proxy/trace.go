package proxy

import (
	"bufio"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// A timeline of what the proxies ran, for finding where a call's time goes:
// with P2PCOMM_PROXY_TRACE=prefix the process keeps its last traceCap
// events (a trigger popped, its put and signal handed to the transport, a
// trigger done, a moment a caller marked) and
// writes them to prefix.<pid> whenever a Service closes. Times are wall
// clock nanoseconds, so the files of the processes of one host line up.
// Off (the default), recording an event is one nil check.

const traceCap = 1 << 16

type traceEvent struct {
	ns    int64
	what  byte // 'p' popped, 'u' its put handed to the transport, 's' its signal, 'd' done, 'm' marked
	fifo  uint32
	pos   uint64
	op    Op
	label string
}

var (
	traceTo  = os.Getenv("P2PCOMM_PROXY_TRACE")
	traceBuf []traceEvent
	traceN   atomic.Uint64
	traceMu  sync.Mutex // guards traceBuf's slots and the file
)

func init() {
	if traceTo != "" {
		traceBuf = make([]traceEvent, traceCap)
	}
}

func traceAdd(e traceEvent) {
	if traceBuf == nil {
		return
	}
	e.ns = time.Now().UnixNano()
	traceMu.Lock() // an event holds a string: no reader may see half of one
	traceBuf[(traceN.Add(1)-1)%traceCap] = e
	traceMu.Unlock()
}

// Mark records a moment of the caller's (a launch, say) in the trace.
func Mark(label string) {
	if traceBuf != nil {
		traceAdd(traceEvent{what: 'm', label: label})
	}
}

// traceWrite writes the events kept so far, oldest first.
func traceWrite() error {
	if traceBuf == nil {
		return nil
	}
	traceMu.Lock()
	defer traceMu.Unlock()
	f, err := os.Create(fmt.Sprintf("%s.%d", traceTo, os.Getpid()))
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	n := traceN.Load()
	for i := n - min(n, traceCap); i < n; i++ {
		e := traceBuf[i%traceCap]
		if e.what == 'm' {
			fmt.Fprintf(w, "%d m %s\n", e.ns, e.label)
			continue
		}
		fmt.Fprintf(w, "%d %c fifo=%d pos=%d type=%d channel=%d bytes=%d\n", e.ns, e.what, e.fifo, e.pos, e.op.Type, e.op.Channel, e.op.Size)
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
