// Host functions launched through LaunchHostFunc: the driver calls
// p2p_host_func with the registered function's id, which it hands to Go.
// (Defined here: a Go file with //export may only declare C functions.)
#include <stdint.h>

extern void p2pRunHostFunc(uintptr_t id);

void p2p_host_func(void* id) { p2pRunHostFunc((uintptr_t)id); }

// cuLaunchHostFunc(stream, fn, userData), called through its pointer f.
int p2p_launch_host_func(void* f, void* stream, uintptr_t id) {
	return ((int (*)(void*, void (*)(void*), void*))f)(stream, p2p_host_func, (void*)id);
}
