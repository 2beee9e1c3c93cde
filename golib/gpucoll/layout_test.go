package gpucoll

import (
	"testing"
	"unsafe"
)

// The kernels static_assert the same numbers (p2p_common.cuh).
func TestLayoutsMatchTheKernels(t *testing.T) {
	var p allReduceParams
	var e errorWord
	tests := []struct {
		name      string
		got, want uintptr
	}{
		{"sizeof(AllReduceParams)", unsafe.Sizeof(p), 264},
		{"graph_slot", unsafe.Offsetof(p.GraphSlot), 256},
		{"peer_scratch", unsafe.Offsetof(p.PeerScratch), 64},
		{"peer_signal", unsafe.Offsetof(p.PeerSignal), 128},
		{"local_src", unsafe.Offsetof(p.LocalSrc), 192},
		{"out", unsafe.Offsetof(p.Out), 200},
		{"err", unsafe.Offsetof(p.Err), 208},
		{"count", unsafe.Offsetof(p.Count), 216},
		{"timeout_ns", unsafe.Offsetof(p.TimeoutNs), 224},
		{"rank", unsafe.Offsetof(p.Rank), 232},
		{"world", unsafe.Offsetof(p.World), 236},
		{"op", unsafe.Offsetof(p.Op), 240},
		{"signature", unsafe.Offsetof(p.Signature), 244},
		{"half_bytes", unsafe.Offsetof(p.HalfBytes), 248},
		{"flags", unsafe.Offsetof(p.Flags), 252},
		{"sizeof(ErrorWord)", unsafe.Sizeof(e), 40},
		{"ErrorWord.peer", unsafe.Offsetof(e.Peer), 8},
		{"ErrorWord.expected", unsafe.Offsetof(e.Expected), 24},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s = %d, want %d", tt.name, tt.got, tt.want)
		}
	}
}
