package procenv

import (
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
)

func TestLookupSeesTheVariablesOfNow(t *testing.T) {
	key := "P2PCOMM_PROCENV_TEST_" + strconv.FormatUint(rand.Uint64(), 36)
	if _, ok := Lookup(key); ok {
		t.Fatalf("%s is set before the test sets it", key)
	}
	for _, want := range []string{"a value", "", "=x=y", "ünïcode"} {
		t.Setenv(key, want)
		if got, ok := Lookup(key); !ok || got != want {
			t.Fatalf("Lookup(%s) = %q, %v; want %q, true", key, got, ok, want)
		}
		if got := Get(key); got != want {
			t.Fatalf("Get(%s) = %q; want %q", key, got, want)
		}
	}
	os.Unsetenv(key)
	if got, ok := Lookup(key); ok || got != "" {
		t.Fatalf("Lookup(%s) after unset = %q, %v; want \"\", false", key, got, ok)
	}
}
