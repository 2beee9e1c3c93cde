package symm

import "unsafe"

// unsafeBytes views n bytes of C memory at p.
func unsafeBytes(p unsafe.Pointer, n uint64) []byte { return unsafe.Slice((*byte)(p), n) }
