package bootstrap

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

func TestAgreeSpreadsTheFirstFailure(t *testing.T) {
	bs := startJob(t, 3, 5*time.Second)
	own := status.Errorf(status.Unsupported, "no CUDA driver here")
	errs := eachRank(t, bs, func(b *tcpBootstrap) error {
		var local error
		if b.Rank() == 1 {
			local = own
		}
		return Agree(b, local)
	})
	if !errors.Is(errs[1], own) {
		t.Errorf("rank 1 got %v, want its own error", errs[1])
	}
	for _, r := range []int{0, 2} {
		if errs[r] == nil || !strings.Contains(errs[r].Error(), "rank 1 failed: no CUDA driver here") ||
			status.CodeOf(errs[r]) != status.Unsupported {
			t.Errorf("rank %d got %v, want rank 1's failure with its code", r, errs[r])
		}
	}
	// Everyone succeeding agrees on nil, and the bootstrap stays usable.
	for r, err := range eachRank(t, bs, func(b *tcpBootstrap) error { return Agree(b, nil) }) {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

func TestAgreeNamesAFailureWithoutText(t *testing.T) {
	bs := startJob(t, 2, 5*time.Second)
	errs := eachRank(t, bs, func(b *tcpBootstrap) error {
		var local error
		if b.Rank() == 0 {
			local = status.Errorf(status.InvalidArgument, " ")
		}
		return Agree(b, local)
	})
	want := "rank 0 failed (" + status.InvalidArgument.String() + ") and gave no reason"
	if errs[1] == nil || !strings.Contains(errs[1].Error(), want) || status.CodeOf(errs[1]) != status.InvalidArgument {
		t.Errorf("rank 1 got %v, want %q with rank 0's code", errs[1], want)
	}
}
