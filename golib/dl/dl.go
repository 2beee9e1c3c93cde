// Package dl opens shared libraries at run time and looks up their symbols,
// keeping dlerror's text in every error.
//
// Libraries are never closed: the CUDA driver and NVRTC keep threads, atexit
// handlers and function pointers that Go code may still hold, and unloading
// them under a live process is a classic source of crashes at exit. A process
// opens each library once, so nothing leaks that matters.
package dl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>

// dl_open and dl_sym clear the previous error first and copy dlerror's text,
// so that the message belongs to this call even under concurrent use (glibc
// keeps dlerror state per thread, and a cgo call stays on one thread).
static void* dl_open(const char* path, int flags, const char** err) {
	dlerror();
	void* h = dlopen(path, flags);
	if (h == NULL) *err = dlerror();
	return h;
}

static void* dl_sym(void* h, const char* name, const char** err) {
	dlerror();
	void* p = dlsym(h, name);
	const char* e = dlerror();
	if (e != NULL) *err = e;
	return p;
}
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// Flags for Open, the values of <dlfcn.h>.
const (
	Now    = int(C.RTLD_NOW)    // resolve every symbol at load time
	Lazy   = int(C.RTLD_LAZY)   // resolve functions on first call
	Local  = int(C.RTLD_LOCAL)  // symbols do not satisfy later libraries
	Global = int(C.RTLD_GLOBAL) // symbols satisfy later libraries (and dlopen by soname)
)

// Library is an opened shared library. The zero value is not usable.
type Library struct {
	path   string
	handle unsafe.Pointer
}

// Error is a failed dlopen or dlsym with dlerror's text.
type Error struct {
	Op     string // "dlopen" or "dlsym"
	Name   string // the path or symbol
	Detail string // dlerror's text
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s %s: %s", e.Op, e.Name, e.Detail)
}

// Open loads the library at path (a file path, or a bare name searched by the
// dynamic loader) with flags such as Now|Local.
func Open(path string, flags int) (*Library, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var cerr *C.char
	h := C.dl_open(cpath, C.int(flags), &cerr)
	if h == nil {
		return nil, &Error{Op: "dlopen", Name: path, Detail: errText(cerr)}
	}
	return &Library{path: path, handle: h}, nil
}

// Path returns the name the library was opened with.
func (l *Library) Path() string { return l.path }

// Sym returns the address of the named symbol. A symbol whose value is NULL
// is reported as an error: none of the symbols this project needs may be NULL.
func (l *Library) Sym(name string) (unsafe.Pointer, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var cerr *C.char
	p := C.dl_sym(l.handle, cname, &cerr)
	if cerr != nil || p == nil {
		return nil, &Error{Op: "dlsym", Name: name, Detail: errText(cerr) + " (in " + l.path + ")"}
	}
	return p, nil
}

func errText(e *C.char) string {
	if e == nil {
		return "unknown error"
	}
	return C.GoString(e)
}
