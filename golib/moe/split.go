package moe

import (
	"runtime"
	"sync"
)

// splitMinBytes is the least work (bytes touched) worth a goroutine: below
// it, starting and joining one costs more than the work saves.
const splitMinBytes = 256 << 10

// maxSplit bounds the goroutines of one call: memory bandwidth, not cores,
// bounds these loops past a handful.
const maxSplit = 16

// workers is how many goroutines n items of itemBytes each are split
// among.
func workers(n int, itemBytes int64) int {
	w := min(runtime.GOMAXPROCS(0), maxSplit, n)
	if total := int64(n) * itemBytes; total/splitMinBytes < int64(w) {
		w = int(total / splitMinBytes)
	}
	return max(w, 1)
}

// split runs f over [0, n) cut into contiguous ranges, one per worker
// (numbered from 0, so that each may keep its own scratch), and waits.
// Each item's result depends on that item alone, so the cut changes no bit.
func split(n, workers int, f func(worker, lo, hi int)) {
	if workers <= 1 || n <= 1 {
		f(0, 0, n)
		return
	}
	var wg sync.WaitGroup
	panics := make([]any, workers)
	for w := range workers {
		lo, hi := n*w/workers, n*(w+1)/workers
		if lo == hi {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			// A panic goes back to the caller's goroutine, where the C
			// boundary's recover turns it into an error; here it would end
			// the process.
			defer func() { panics[w] = recover() }()
			f(w, lo, hi)
		}()
	}
	wg.Wait()
	for _, p := range panics {
		if p != nil {
			panic(p)
		}
	}
}
