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

func TestDefaultHoldsOnlyWhileFnRunsAndKeepsWhatIsSet(t *testing.T) {
	key := "P2PCOMM_PROCENV_TEST_" + strconv.FormatUint(rand.Uint64(), 36)
	var seen string
	if err := Default(key, "default", func() { seen = Get(key) }); err != nil || seen != "default" {
		t.Fatalf("inside Default: %q, %v; want \"default\"", seen, err)
	}
	if v, ok := Lookup(key); ok {
		t.Fatalf("after Default: %s=%q is still set", key, v)
	}
	t.Setenv(key, "mine")
	if err := Default(key, "default", func() { seen = Get(key) }); err != nil || seen != "mine" {
		t.Fatalf("inside Default with the variable set: %q, %v; want \"mine\"", seen, err)
	}
	if v := Get(key); v != "mine" {
		t.Fatalf("after Default with the variable set: %q, want \"mine\"", v)
	}
}
