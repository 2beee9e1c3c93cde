package gpucoll

import (
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/status"
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

func TestDescribeChannelWaits(t *testing.T) {
	cases := []struct {
		name string
		w    errorWord
		code status.Code
		want string
	}{
		{"channel wait", errorWord{Code: errTimeout, Rank: 0, Peer: 3, Phase: phaseChannelWait, Block: 2, Step: -1, Expected: 5, Seen: 4},
			status.Timeout, "rank 0's channel wait for a signal from peer 3 timed out (block 2, waited for count 5, saw 4)"},
		{"push", errorWord{Code: errTimeout, Rank: 1, Peer: 2, Phase: phaseFifoPush, Step: 4, Expected: 9, Seen: 7},
			status.Timeout, "rank 1's push into FIFO 4 toward peer 2 found no free slot"},
		{"flush", errorWord{Code: errTimeout, Rank: 1, Peer: 0, Phase: phaseFifoFlush, Step: 1, Expected: 12, Seen: 10},
			status.Timeout, "rank 1's flush of FIFO 1 toward peer 0 timed out (block 0, waited for the proxy to complete 12 triggers, it had 10)"},
		{"proxy failed under a channel wait", errorWord{Code: errProxy, Rank: 2, Peer: 0, Phase: phaseChannelWait, Block: 1, Step: 3, Expected: 7, Seen: 6},
			status.Internal, "the proxy of rank 2 failed (FIFO 3) while a channel wait for a signal from peer 0 was pending (block 1, waited for count 7, saw 6)"},
		{"proxy failed a push", errorWord{Code: errProxy, Rank: 1, Peer: 2, Phase: phaseFifoPush, Step: 3},
			status.Internal, "the proxy failed a trigger of FIFO 3 toward peer 2, seen by a push on rank 1"},
		{"proxy failed a flush", errorWord{Code: errProxy, Rank: 0, Peer: 1, Phase: phaseFifoFlush, Step: 0},
			status.Internal, "the proxy failed a trigger of FIFO 0 toward peer 1, seen by a flush on rank 0"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := describe(c.w)
			if status.CodeOf(err) != c.code || !strings.Contains(err.Error(), c.want) {
				t.Errorf("describe(%+v) = %v (%v), want %v containing %q", c.w, err, status.CodeOf(err), c.code, c.want)
			}
		})
	}
}

// The channel phases and the proxy's code are channel.cuh's (kNumPhases + n).
func TestChannelNumbersMatchTheKernels(t *testing.T) {
	src := kernels.Sources()
	all := src["p2p_common.cuh"] + src["channel.cuh"]
	base, _ := strconv.Atoi(regexp.MustCompile(`kNumPhases = (\d+)`).FindStringSubmatch(all)[1])
	for name, want := range map[string]int{"kPhaseChannelWait": phaseChannelWait, "kPhaseFifoPush": phaseFifoPush,
		"kPhaseFifoFlush": phaseFifoFlush} {
		m := regexp.MustCompile(`constexpr int ` + name + ` = kNumPhases \+ (\d+);`).FindStringSubmatch(all)
		if m == nil {
			t.Errorf("%s not found in channel.cuh", name)
			continue
		}
		if n, _ := strconv.Atoi(m[1]); base+n != want {
			t.Errorf("%s = %d in the kernels, %d here", name, base+n, want)
		}
	}
	m := regexp.MustCompile(`constexpr u32 kErrProxy = (\d+);`).FindStringSubmatch(all)
	if m == nil || m[1] != strconv.Itoa(errProxy) {
		t.Errorf("kErrProxy in channel.cuh: %v, want %d", m, errProxy)
	}
}
