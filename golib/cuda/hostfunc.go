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
	fns  map[uintptr]hostFunc
}

type hostFunc struct {
	fn   func()
	once bool // forgotten as it runs
}

// LaunchHostFunc orders fn on stream: the driver runs it once the work
// before it on stream has completed, and the work after it waits for it to
// return; a graph that captured it runs it at each replay. fn must make no
// CUDA call (the driver forbids it) and should not panic (a panic is
// recovered and dropped). fn stays registered until release; a launch or
// replay that reaches it afterwards runs nothing.
func (d *Driver) LaunchHostFunc(stream uintptr, fn func()) (release func(), err error) {
	return d.launchHostFunc(stream, hostFunc{fn: fn})
}

// LaunchHostFuncOnce orders fn on stream as LaunchHostFunc does, for a
// stream that is not capturing: fn runs once and is forgotten as it runs.
func (d *Driver) LaunchHostFuncOnce(stream uintptr, fn func()) error {
	_, err := d.launchHostFunc(stream, hostFunc{fn: fn, once: true})
	return err
}

func (d *Driver) launchHostFunc(stream uintptr, f hostFunc) (release func(), err error) {
	if d.fn.launchHostFunc == nil {
		return nil, fmt.Errorf("cuLaunchHostFunc: %w", ErrNotSupported)
	}
	hostFuncs.mu.Lock()
	if hostFuncs.fns == nil {
		hostFuncs.fns = map[uintptr]hostFunc{}
	}
	hostFuncs.next++
	id := hostFuncs.next
	hostFuncs.fns[id] = f
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
	f := hostFuncs.fns[uintptr(id)]
	if f.once {
		delete(hostFuncs.fns, uintptr(id))
	}
	hostFuncs.mu.Unlock()
	if f.fn == nil {
		return
	}
	defer func() { recover() }() // nothing may unwind into the driver's thread
	f.fn()
}
