package proxy

import "github.com/p2pcomm/p2pcomm/golib/trace"

// traceOp records what happened to the trigger at pos of f (see package
// trace: 'p' popped, 'u' its put handed to the transport, 's' its signal,
// 'd' done).
func traceOp(what byte, f *FIFO, pos uint64, op Op) {
	if trace.On() {
		trace.Add(trace.Event{What: what, FIFO: f.id, Pos: pos, Type: op.Type, Channel: op.Channel, Size: op.Size})
	}
}
