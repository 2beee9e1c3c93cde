package cuda

/*
#include <stdint.h>

int p2p_launch_host_func(void* f, void* stream, uintptr_t id);
*/
import "C"

import (
	"fmt"
	"sync"
)

// Host functions: Go functions the driver runs on its own thread once a
// stream reaches them (cuLaunchHostFunc), and at every replay of a CUDA
// graph that captured them. The driver holds an id, never a Go pointer.
var hostFuncs struct {
	mu   sync.Mutex
	next uintptr
	fns  map[uintptr]func()
}

// LaunchHostFunc orders fn on stream: the driver runs it once the work
// before it on stream has completed, and the work after it waits for it to
// return; a graph that captured it runs it at each replay. fn must make no
// CUDA call (the driver forbids it) and should not panic (a panic is
// recovered and dropped). fn stays registered until release; a launch or
// replay that reaches it afterwards runs nothing.
func (d *Driver) LaunchHostFunc(stream uintptr, fn func()) (release func(), err error) {
	if d.fn.launchHostFunc == nil {
		return nil, fmt.Errorf("cuLaunchHostFunc: %w", ErrNotSupported)
	}
	hostFuncs.mu.Lock()
	if hostFuncs.fns == nil {
		hostFuncs.fns = map[uintptr]func(){}
	}
	hostFuncs.next++
	id := hostFuncs.next
	hostFuncs.fns[id] = fn
	hostFuncs.mu.Unlock()
	release = func() {
		hostFuncs.mu.Lock()
		delete(hostFuncs.fns, id)
		hostFuncs.mu.Unlock()
	}
	if err := d.check("cuLaunchHostFunc", C.p2p_launch_host_func(d.fn.launchHostFunc, ptr(stream), C.uintptr_t(id))); err != nil {
		release()
		return nil, err
	}
	return release, nil
}

//export p2pRunHostFunc
func p2pRunHostFunc(id C.uintptr_t) {
	hostFuncs.mu.Lock()
	fn := hostFuncs.fns[uintptr(id)]
	hostFuncs.mu.Unlock()
	if fn == nil {
		return
	}
	defer func() { recover() }() // nothing may unwind into the driver's thread
	fn()
}
