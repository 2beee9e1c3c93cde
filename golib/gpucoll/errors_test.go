package gpucoll

import (
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/native/kernels"
)

func TestDescribeNamesTheCallThatTimedOut(t *testing.T) {
	cases := []struct {
		w    errorWord
		want string
	}{
		{errorWord{Code: errTimeout, Peer: 2, Phase: 1, Block: 3, Step: 4, Expected: 9, Seen: 8},
			"rank 2 never arrived at the middle barrier of an all-reduce (block 3, step 4, waited for flag 9, saw 8)"},
		{errorWord{Code: errTimeout, Peer: 1, Phase: phaseMoeStart, Step: 0, Expected: 5, Seen: 4},
			"rank 1 never arrived at the start barrier of an MoE dispatch (block 0, waited for flag 5, saw 4)"},
		{errorWord{Code: errTimeout, Peer: 3, Phase: phaseMoeMid, Block: 7, Step: 1, Expected: 2, Seen: 1},
			"rank 3 never arrived at the middle barrier of an MoE combine (block 7, waited for flag 2, saw 1)"},
		{errorWord{Code: errTimeout, Peer: 1, Phase: 0, Block: 0, Step: -1, Expected: 6, Seen: 5},
			"rank 1 never arrived at the start barrier of an all-reduce (block 0, waited for flag 6, saw 5)"},
		{errorWord{Code: errTimeout, Peer: 1, Phase: 0, Block: 0, Step: -1 - int32(collective.CallMoeDispatch), Expected: 6, Seen: 5},
			"rank 1 never arrived at the start barrier of an MoE dispatch (block 0, waited for flag 6, saw 5)"},
		{errorWord{Code: errTimeout, Peer: 2, Phase: 0, Block: 0, Step: -1 - int32(collective.CallMoeCombine), Expected: 6, Seen: 5},
			"rank 2 never arrived at the start barrier of an MoE combine (block 0, waited for flag 6, saw 5)"},
		{errorWord{Code: errTimeout, Peer: 2, Phase: 0, Block: 0, Step: -1 - int32(collective.CallStreamBarrier), Expected: 6, Seen: 5},
			"rank 2 never arrived at the start barrier of a stream barrier (block 0, waited for flag 6, saw 5)"},
	}
	for _, c := range cases {
		got := describe(c.w).Error()
		if !strings.Contains(got, c.want) {
			t.Errorf("describe(%+v) = %q, want it to contain %q", c.w, got, c.want)
		}
	}
}

// The phase numbers describe() tells apart are the kernels' (p2p_common.cuh
// kNumPhases, moe.cu's kPhaseMoe* = kNumPhases + n).
func TestPhaseNumbersMatchTheKernels(t *testing.T) {
	src := kernels.Sources()
	all := src["p2p_common.cuh"] + src["moe.cu"]
	m := regexp.MustCompile(`kNumPhases = (\d+)`).FindStringSubmatch(all)
	if m == nil {
		t.Fatal("kNumPhases not found in p2p_common.cuh")
	}
	base, _ := strconv.Atoi(m[1])
	for name, want := range map[string]int{"kPhaseMoeStart": phaseMoeStart, "kPhaseMoeMid": phaseMoeMid} {
		m := regexp.MustCompile(`constexpr int ` + name + ` = kNumPhases \+ (\d+);`).FindStringSubmatch(all)
		if m == nil {
			t.Errorf("%s not found in the kernels", name)
			continue
		}
		if n, _ := strconv.Atoi(m[1]); base+n != want {
			t.Errorf("%s = %d in the kernels, %d here", name, base+n, want)
		}
	}
}

// The calls a barrier serves are the kernels' kCall* (step = -1 - call).
func TestCallNumbersMatchTheKernels(t *testing.T) {
	src := kernels.Sources()["p2p_common.cuh"]
	for name, want := range map[string]collective.Call{"kCallAllReduce": collective.CallAllReduce,
		"kCallStreamBarrier": collective.CallStreamBarrier, "kCallMoeDispatch": collective.CallMoeDispatch,
		"kCallMoeCombine": collective.CallMoeCombine} {
		m := regexp.MustCompile(`constexpr int ` + name + ` = (\d+);`).FindStringSubmatch(src)
		if m == nil {
			t.Errorf("%s not found in p2p_common.cuh", name)
			continue
		}
		if n, _ := strconv.Atoi(m[1]); collective.Call(n) != want {
			t.Errorf("%s = %d in the kernels, %d here", name, n, want)
		}
	}
	m := regexp.MustCompile(`constexpr unsigned kCallShift = (\d+);`).FindStringSubmatch(src)
	if m == nil || m[1] != strconv.Itoa(callShift) {
		t.Errorf("kCallShift in p2p_common.cuh: %v, want %d", m, callShift)
	}
}
