package kernels

import (
	"errors"
	"io/fs"
	"reflect"
	"strings"
	"testing"
)

func TestInstantiations(t *testing.T) {
	tests := []struct {
		name string
		src  string
		want []string
	}{
		{"none", "__global__ void k() {}\n", nil},
		{"several in order", "// p2pcomm:instantiate a<float, 2>\nx\n  // p2pcomm:instantiate b<__nv_bfloat16, 8>  \r\n",
			[]string{"a<float, 2>", "b<__nv_bfloat16, 8>"}},
		{"needs the exact prefix", "//p2pcomm:instantiate a<int>\n// p2pcomm: instantiate b\n// p2pcomm:instantiate \n", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Instantiations(tt.src); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Instantiations(%q) = %q, want %q", tt.src, got, tt.want)
			}
		})
	}
}

func TestSourcesOnlyCUDA(t *testing.T) {
	for name := range Sources() {
		if !strings.HasSuffix(name, ".cu") && !strings.HasSuffix(name, ".cuh") {
			t.Errorf("Sources() holds %q, want only .cu and .cuh files", name)
		}
	}
	for name, text := range Headers() {
		if !strings.HasSuffix(name, ".cuh") {
			t.Errorf("Headers() holds %q, want only .cuh", name)
		}
		if got, err := Source(name); err != nil || got != text {
			t.Errorf("Source(%q) = %d bytes, %v; want the %d bytes Headers() gave", name, len(got), err, len(text))
		}
	}
	for _, name := range []string{"kernels.go", "missing.cu"} {
		if _, err := Source(name); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("Source(%q) error = %v, want fs.ErrNotExist", name, err)
		}
	}
}
