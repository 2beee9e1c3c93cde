//go:build !cgo

package procenv

import "os"

// Without cgo the process is a Go program, whose os package keeps the
// environment itself.
func lookup(key string) (string, bool) { return os.LookupEnv(key) }
