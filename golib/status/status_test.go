package status

import (
	"errors"
	"fmt"
	"testing"
)

func TestCodeOfFindsWrappedCode(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want Code
	}{
		{"nil", nil, OK},
		{"plain", errors.New("x"), Internal},
		{"direct", Errorf(Timeout, "rank 1 never arrived"), Timeout},
		{"wrapped", fmt.Errorf("all-reduce: %w", Errorf(Mismatch, "sizes differ")), Mismatch},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := CodeOf(tt.err); got != tt.want {
				t.Errorf("CodeOf(%v) = %v, want %v", tt.err, got, tt.want)
			}
		})
	}
}
