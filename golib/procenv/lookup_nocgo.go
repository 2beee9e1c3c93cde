//go:build !cgo

package procenv

import "os"

// Without cgo the process is a Go program, whose os package keeps the
// environment itself.
func lookup(key string) (string, bool) { return os.LookupEnv(key) }

func set(key, value string) error { return os.Setenv(key, value) }

func unset(key string) error { return os.Unsetenv(key) }
