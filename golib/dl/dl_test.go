package dl

import (
	"errors"
	"strings"
	"testing"
)

func TestOpenAndSym(t *testing.T) {
	lib, err := Open("libc.so.6", Now|Local)
	if err != nil {
		t.Fatalf("Open(libc.so.6) = %v, want nil error", err)
	}
	if p, err := lib.Sym("strlen"); err != nil || p == nil {
		t.Errorf("Sym(strlen) = %v, %v; want non-nil pointer, nil error", p, err)
	}
	_, err = lib.Sym("p2pcomm_no_such_symbol")
	var de *Error
	if !errors.As(err, &de) || de.Op != "dlsym" || !strings.Contains(err.Error(), "p2pcomm_no_such_symbol") {
		t.Errorf("Sym(missing) error = %v, want *dl.Error naming the symbol", err)
	}
}

func TestOpenMissingKeepsDlerror(t *testing.T) {
	tests := []struct {
		name string
		path string
	}{
		{"bare name", "libp2pcomm_does_not_exist.so.1"},
		{"full path", "/nonexistent/dir/libfoo.so"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Open(tt.path, Now|Local)
			var de *Error
			if !errors.As(err, &de) {
				t.Fatalf("Open(%q) error = %v, want *dl.Error", tt.path, err)
			}
			// dlerror's text names the file and the reason; keep both.
			if de.Op != "dlopen" || de.Name != tt.path || !strings.Contains(de.Detail, "No such file") {
				t.Errorf("Open(%q) = %+v, want dlopen error with dlerror's 'No such file' text", tt.path, de)
			}
		})
	}
}
