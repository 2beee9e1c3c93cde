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

func set(key, value string) error {
	k, v := C.CString(key), C.CString(value)
	defer C.free(unsafe.Pointer(k))
	defer C.free(unsafe.Pointer(v))
	if rc, err := C.setenv(k, v, 1); rc != 0 {
		return err
	}
	return nil
}

func unset(key string) error {
	k := C.CString(key)
	defer C.free(unsafe.Pointer(k))
	if rc, err := C.unsetenv(k); rc != 0 {
		return err
	}
	return nil
}
