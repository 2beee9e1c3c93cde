package transport

import (
	"bytes"
	"math/rand"
	"testing"
)

// TestKeysRoundTrip: keys of random lengths (empty ones too) come back as
// they went, after any prefix; a message cut anywhere short of its last
// key's end is refused.
func TestKeysRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewSource(3))
	for range 200 {
		keys := make([][]byte, 1+rng.Intn(4))
		for i := range keys {
			keys[i] = make([]byte, rng.Intn(40))
			rng.Read(keys[i])
		}
		prefix := []byte{1, 2, 3}
		msg := AppendKeys(append([]byte{}, prefix...), keys...)
		got, ok := SplitKeys(msg[len(prefix):], len(keys))
		if !ok {
			t.Fatalf("keys %v not split back", keys)
		}
		for i := range keys {
			if !bytes.Equal(got[i], keys[i]) {
				t.Fatalf("key %d: got %x, want %x", i, got[i], keys[i])
			}
		}
		body := msg[len(prefix):]
		for cut := range len(body) {
			if _, ok := SplitKeys(body[:cut], len(keys)); ok {
				t.Fatalf("a message cut to %d of %d bytes was split", cut, len(body))
			}
		}
	}
}
