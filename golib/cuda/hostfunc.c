// The one C function the driver calls for every host function launched
// through LaunchHostFunc: it hands the registered function's id to Go.
#include <stdint.h>

extern void p2pRunHostFunc(uintptr_t id);

void p2p_host_func(void* id) { p2pRunHostFunc((uintptr_t)id); }
