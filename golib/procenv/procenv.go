// Package procenv reads the process environment as it is now.
//
// Go's os package copies the environment once, from the block the kernel
// gave the process at its start. A library loaded into a running host sees
// that copy, not what the host set since: Python's os.environ["X"] = ... (or
// a forked worker given its own variables) reaches libc's environ but not
// os.Getenv. The library reads its settings here instead, as every C library
// it loads (UCX, CUDA) does.
package procenv

// Lookup returns the variable's value and whether it is set.
func Lookup(key string) (string, bool) { return lookup(key) }

// Get returns the variable's value, "" when it is not set.
func Get(key string) string {
	v, _ := lookup(key)
	return v
}
