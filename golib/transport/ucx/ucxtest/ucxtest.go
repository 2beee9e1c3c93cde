// Package ucxtest holds what tests of packages above the UCX transport
// share.
package ucxtest

import (
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/transport/ucx"
)

// Need skips t where no UCX loads, saying how to get one.
func Need(t testing.TB) {
	t.Helper()
	if err := ucx.Available(nil); err != nil {
		t.Skipf("UCX is not installed (pip install libucx-cu13==1.22.0, or set %s): %v", ucx.LibraryEnv, err)
	}
}
