// Package procenv reads the process environment as it is now.
//
// Go's os package copies the environment once, from the block the kernel
// gave the process at its start. A library loaded into a running host sees
// that copy, not what the host set since: Python's os.environ["X"] = ... (or
// a forked worker given its own variables) reaches libc's environ but not
// os.Getenv. The library reads its settings here instead, as every C library
// it loads (UCX, CUDA) does. Default sets one for a moment, for a C library
// that reads it only while it loads.
package procenv

// Lookup returns the variable's value and whether it is set.
func Lookup(key string) (string, bool) { return lookup(key) }

// Get returns the variable's value, "" when it is not set.
func Get(key string) string {
	v, _ := lookup(key)
	return v
}

// Default sets the variable to value for the duration of fn unless it is
// set already, then restores what was there: for a setting a C library
// reads from the environment only while it loads.
func Default(key, value string, fn func()) error {
	if _, set := lookup(key); set {
		fn()
		return nil
	}
	if err := set(key, value); err != nil {
		return err
	}
	defer unset(key)
	fn()
	return nil
}
