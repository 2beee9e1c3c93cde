package cuda

import (
	"errors"
	"fmt"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

func TestErrorText(t *testing.T) {
	tests := []struct {
		name string
		err  *Error
		want string
		code status.Code
	}{
		{"named by driver", &Error{Code: 2, Name: "CUDA_ERROR_OUT_OF_MEMORY", Call: "cuMemAlloc"}, "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (2)", status.CUDA},
		{"name from table without driver", &Error{Code: 700, Call: "cuStreamSynchronize"}, "cuStreamSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS (700)", status.CUDA},
		{"unknown code prints number", &Error{Code: 12345, Call: "cuInit"}, "cuInit: CUresult 12345", status.CUDA},
		{"not supported", &Error{Code: 801, Call: "cuX"}, "cuX: CUDA_ERROR_NOT_SUPPORTED (801)", status.Unsupported},
		{"peer access unsupported", &Error{Code: 217, Call: "cuIpcOpenMemHandle"}, "cuIpcOpenMemHandle: CUDA_ERROR_PEER_ACCESS_UNSUPPORTED (217)", status.PeerUnavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.err.Error(); got != tt.want {
				t.Errorf("Error() = %q, want %q", got, tt.want)
			}
			wrapped := fmt.Errorf("open IPC handle of rank 3: %w", tt.err)
			if got := status.CodeOf(wrapped); got != tt.code {
				t.Errorf("status.CodeOf(wrapped) = %v, want %v", got, tt.code)
			}
		})
	}
}

func TestErrorNameWithoutDriver(t *testing.T) {
	var d *Driver
	if got := d.ErrorName(1); got != "CUDA_ERROR_INVALID_VALUE" {
		t.Errorf("(*Driver)(nil).ErrorName(1) = %q, want CUDA_ERROR_INVALID_VALUE", got)
	}
}

func TestLoadErrorUnwraps(t *testing.T) {
	err := fmt.Errorf("gpu backend: %w", &LoadError{Lib: "NVRTC", Tried: []string{"a: no", "b: no"}, kind: ErrNoNVRTC})
	if !errors.Is(err, ErrNoNVRTC) || errors.Is(err, ErrNoDriver) {
		t.Errorf("errors.Is(%v, ErrNoNVRTC/ErrNoDriver) wrong", err)
	}
	if got := status.CodeOf(err); got != status.Unsupported {
		t.Errorf("status.CodeOf = %v, want Unsupported", got)
	}
	if got, want := err.Error(), "gpu backend: load NVRTC: a: no; b: no"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
}
