package gpucoll

import (
	"regexp"
	"strconv"
	"testing"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/native/kernels"
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

// hierParams against HierParams in allreduce_hier.cu, and the constants
// the host shares with that kernel, read from its source.
func TestHierLayoutMatchesTheKernel(t *testing.T) {
	src, err := kernels.Source(hierFile)
	if err != nil {
		t.Fatal(err)
	}
	constant := func(name string) int {
		m := regexp.MustCompile(`constexpr \w+ ` + name + ` = (\d+);`).FindStringSubmatch(src)
		if m == nil {
			t.Fatalf("%s: no integer constexpr %s", hierFile, name)
		}
		v, _ := strconv.Atoi(m[1])
		return v
	}
	phase := func(name string) int {
		m := regexp.MustCompile(`constexpr int ` + name + ` = kPhaseFifoFlush \+ (\d+);`).FindStringSubmatch(src)
		if m == nil {
			t.Fatalf("%s: no phase %s", hierFile, name)
		}
		v, _ := strconv.Atoi(m[1])
		return phaseFifoFlush + v
	}
	size := regexp.MustCompile(`static_assert\(sizeof\(HierParams\) == (\d+)`).FindStringSubmatch(src)
	if size == nil {
		t.Fatalf("%s: no size assertion of HierParams", hierFile)
	}
	want, _ := strconv.Atoi(size[1])
	var p hierParams
	tests := []struct {
		name      string
		got, want uintptr
	}{
		{"sizeof(HierParams)", unsafe.Sizeof(p), uintptr(want)},
		{"peer_hier", unsafe.Offsetof(p.PeerHier), 64},
		{"local_src", unsafe.Offsetof(p.LocalSrc), 192},
		{"chans", unsafe.Offsetof(p.Chans), 216},
		{"net", unsafe.Offsetof(p.Net), 224},
		{"count", unsafe.Offsetof(p.Count), 232},
		{"slot_bytes", unsafe.Offsetof(p.SlotBytes), 264},
		{"local_rank", unsafe.Offsetof(p.LocalRank), 272},
		{"signature", unsafe.Offsetof(p.Signature), 300},
		{"call_signature", unsafe.Offsetof(p.CallSignature), 308},
		{"global_of", unsafe.Offsetof(p.GlobalOf), 312},
		{"group_of", unsafe.Offsetof(p.GroupOf), 344},
		{"kHierBlocks", hierBlocks, uintptr(constant("kHierBlocks"))},
		{"kHierRing", hierRing, uintptr(constant("kHierRing"))},
		{"kHierExchangeSlotBytes", hierExchangeSlotBytes, uintptr(constant("kHierExchangeSlotBytes"))},
		{"kPhaseHierHeader", phaseHierHeader, uintptr(phase("kPhaseHierHeader"))},
		{"kPhaseHierVerdict", phaseHierVerdict, uintptr(phase("kPhaseHierVerdict"))},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s = %d, want %d", tt.name, tt.got, tt.want)
		}
	}
}

// The Lamport buffers' size and sentinel are lamport.cuh's.
func TestLamportConstantsMatchTheKernels(t *testing.T) {
	src := kernels.Sources()["lamport.cuh"]
	half := regexp.MustCompile(`constexpr i64 kLamportHalf = (\d+)ll << (\d+);`).FindStringSubmatch(src)
	if half == nil {
		t.Fatal("kLamportHalf not found in lamport.cuh")
	}
	n, _ := strconv.ParseInt(half[1], 10, 64)
	shift, _ := strconv.Atoi(half[2])
	if n<<shift != lamportHalfBytes {
		t.Errorf("lamportHalfBytes = %d, lamport.cuh's kLamportHalf %d << %d", lamportHalfBytes, n, shift)
	}
	free := regexp.MustCompile(`constexpr u32 kLamportFree = 0x([0-9a-fA-F]+)u;`).FindStringSubmatch(src)
	if free == nil {
		t.Fatal("kLamportFree not found in lamport.cuh")
	}
	if v, _ := strconv.ParseUint(free[1], 16, 32); v != lamportFree {
		t.Errorf("lamportFree = %#x, lamport.cuh's kLamportFree %#x", lamportFree, v)
	}
}
