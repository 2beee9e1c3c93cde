//go:build cgo

package procenv

// #include <stdlib.h>
import "C"

import "unsafe"

func lookup(key string) (string, bool) {
	k := C.CString(key)
	defer C.free(unsafe.Pointer(k))
	v := C.getenv(k)
	if v == nil {
		return "", false
	}
	return C.GoString(v), true
}
