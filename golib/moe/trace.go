package moe

import "time"

// Launch is one step of a call as the kernel path took it: a kernel
// (Name, its geometry, the stream it ran on), the copy of x into the
// staging buffer (Name "stage"), or an eager call's one wait for the GPU
// (Name "host sync", with how long the host waited). Tests read them to see
// which path a call took, and tools/moe_host_cost.py how long the host
// waited; nothing else depends on them.
type Launch struct {
	Name   string `json:"name"`
	Grid   uint32 `json:"grid"`
	Block  uint32 `json:"block"`
	Shared uint32 `json:"shared"` // dynamic shared memory, bytes
	Side   bool   `json:"side"`   // on the side stream (else the caller's)
	WaitNs int64  `json:"wait_ns,omitempty"`
}

// traceLen bounds the steps kept between two reads: a few calls' worth.
const traceLen = 64

// trace keeps the latest steps in a ring, without allocating.
type trace struct {
	n   int
	buf [traceLen]Launch
}

func (t *trace) add(name string, grid, block, shared uint32, side bool) {
	t.buf[t.n%traceLen] = Launch{Name: name, Grid: grid, Block: block, Shared: shared, Side: side}
	t.n++
}

// waited records a host sync that took d.
func (t *trace) waited(d time.Duration) {
	t.buf[t.n%traceLen] = Launch{Name: "host sync", WaitNs: d.Nanoseconds()}
	t.n++
}

// take returns the steps since the previous take (the latest traceLen of
// them) and forgets them.
func (t *trace) take() []Launch {
	n := min(t.n, traceLen)
	out := make([]Launch, 0, n)
	for i := t.n - n; i < t.n; i++ {
		out = append(out, t.buf[i%traceLen])
	}
	t.n = 0
	return out
}
