package main

/*
#include <pthread.h>

// Set in a forked child: the Go runtime's threads did not follow it there.
volatile int p2p_forked;
static void p2p_mark_forked(void) { p2p_forked = 1; }
__attribute__((constructor)) static void p2p_watch_fork(void) { pthread_atfork(NULL, NULL, p2p_mark_forked); }
*/
import "C"

// inForkedChild reports whether this process is a fork of the one that
// loaded the library. A load of a flag set at fork, not a getpid system
// call: every export asks, and a system call costs a microsecond in a VM.
func inForkedChild() bool { return C.p2p_forked != 0 }
