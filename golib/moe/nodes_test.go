package moe

import (
	"errors"
	"fmt"
	"math/rand"
	"sync"
	"testing"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport/ucx/ucxtest"
)

// onNodes is a runner over simulated nodes of localSize consecutive ranks.
func onNodes(localSize int) runner {
	return func(t *testing.T, world int, cfg func(rank int) Config, f func(rank int, ep *EP) error) []error {
		t.Helper()
		return ranksOn(t, world, localSize, 0, cfg, f)
	}
}

// Across nodes, every row lands in the documented order and every combine
// has the single-node bits: 2 nodes of 1, 2 of 2, 3 of 1, 3 of 2, and
// uneven nodes (2 + 1, 3 + 2).
func TestCPUAcrossNodesMatchesTheDocumentedOrderAndRounding(t *testing.T) {
	ucxtest.Need(t)
	layouts := []struct {
		name         string
		world, local int
	}{{"2x1", 2, 1}, {"2x2", 4, 2}, {"3x1", 3, 1}, {"3x2", 6, 2}, {"2+1", 3, 2}, {"3+2", 5, 3}}
	for _, l := range layouts {
		t.Run(l.name, func(t *testing.T) {
			W := l.world
			cases := []roundsCase{
				{W, 2 * W, 3, 24, 9, reduce.BFloat16, reduce.BFloat16, 0.2},
				{W, 2 * W, 8, 16, 6, reduce.Float32, reduce.Float32, 0.1},
				{W, W, 1, 8, 7, reduce.Float16, reduce.Float32, 0},
			}
			checkRounds(t, onNodes(l.local), cases)
		})
	}
}

// Over rails, puts of more than a stripe's worth per peer travel in
// stripes: rows and combines keep the documented order and bits, in 2
// nodes of 1 over 4 rails and 2 nodes of 2 over 2.
func TestCPUAcrossNodesOverRails(t *testing.T) {
	ucxtest.Need(t)
	for _, c := range []struct {
		local, rails int
		rounds       roundsCase // rows of 8 and 4 KiB: several hundred KiB per peer and call
	}{
		{1, 4, roundsCase{2, 4, 2, 4096, 80, reduce.BFloat16, reduce.Float32, 0}},
		{2, 2, roundsCase{4, 8, 3, 2048, 96, reduce.BFloat16, reduce.BFloat16, 0.1}},
	} {
		t.Run(fmt.Sprintf("local%d_rails%d", c.local, c.rails), func(t *testing.T) {
			defer func(old int) { testRails = old }(testRails)
			testRails = c.rails
			checkRounds(t, onNodes(c.local), []roundsCase{c.rounds})
		})
	}
}

// Rejected calls across nodes fail on every rank and move nothing; every
// rank is usable after.
func TestCPURejectedCallsAcrossNodesMoveNothing(t *testing.T) {
	ucxtest.Need(t)
	for _, local := range []int{1, 2} {
		t.Run(fmt.Sprintf("local%d", local), func(t *testing.T) { checkRejected(t, onNodes(local)) })
	}
}

// A rank that never comes to a call is named by every other rank, on its
// node and on the others, within the timeout; the EP stays broken.
func TestCPUAbsentRankAcrossNodesIsNamed(t *testing.T) {
	ucxtest.Need(t)
	const W, E, K, H, Tm = 4, 4, 2, 8, 4
	for _, c := range []struct{ absent, rails int }{{1, 1}, {2, 1}, {1, 2}, {2, 2}} {
		absent := c.absent
		t.Run(fmt.Sprintf("rank%d_rails%d", absent, c.rails), func(t *testing.T) {
			defer func(old int) { testRails = old }(testRails)
			testRails = c.rails
			cfg := sameConfig(E, H, Tm, K, reduce.Float32)
			// Long enough for UCX's wire-up under the same timeout on a busy 2-core machine (as hostcoll's
			// across-nodes failure tests).
			timeout := 1500 * time.Millisecond
			begin := time.Now()
			// Survivors keep their eps open until every survivor has its error:
			// one that closed first would fail the others' endpoints to it,
			// and they could blame it (this tests the absent rank's naming).
			var survivors sync.WaitGroup
			survivors.Add(W - 1)
			errs := ranksOn(t, W, 2, timeout, cfg, func(r int, ep *EP) error {
				if r != absent {
					defer survivors.Wait()
					defer survivors.Done()
				}
				tk := makeTokens(rand.New(rand.NewSource(int64(r))), Tm, H, E, K, reduce.Float32, 0)
				if _, err := dispatch(ep, tk, Tm, false, 0); err != nil {
					return fmt.Errorf("first dispatch: %w", err)
				}
				if r == absent {
					return nil
				}
				_, err := dispatch(ep, tk, Tm, true, 0)
				want := fmt.Sprintf("rank %d (node %d)", absent, absent/2)
				if err == nil || status.CodeOf(err) != status.Timeout || !contains(err, want) || !contains(err, "MoE dispatch") {
					return fmt.Errorf("dispatch without rank %d = %v, want a timeout naming %q", absent, err, want)
				}
				if _, again := dispatch(ep, tk, Tm, false, 0); again == nil {
					return fmt.Errorf("a dispatch after the failure went through")
				}
				return nil
			})
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
			if took := time.Since(begin); took > 20*timeout {
				t.Errorf("the failure took %v to be seen, timeout %v", took, timeout)
			}
		})
	}
}

// A blame word carries its culprit, the rank that saw it, how and whether it
// is settled, for every rank number an EP allows.
func TestBlameWordRoundTrips(t *testing.T) {
	for _, c := range []struct{ culprit, seer, how int }{{0, 1, blameLate}, {maxRanks - 1, 0, blameGone}, {3, maxRanks - 1, blameLate}} {
		for _, final := range []bool{false, true} {
			b := makeBlame(c.culprit, c.seer, c.how, final)
			if blameCulprit(b) != c.culprit || blameSeer(b) != c.seer || blameHow(b) != c.how || (b&blameFinal != 0) != final {
				t.Errorf("makeBlame(%d, %d, %d, %v) = %#x reads back %d, %d, %d, %v", c.culprit, c.seer, c.how, final, b,
					blameCulprit(b), blameSeer(b), blameHow(b), b&blameFinal != 0)
			}
		}
	}
}

// TestStripes: a put's stripes cover every byte once, in order, on rails
// that exist, each a whole number of pages but the last; a put below
// railStripeMin stays whole on rail 0. Sizes include odd ones whose share
// per rail is a whole number of pages.
func TestStripes(t *testing.T) {
	rng := rand.New(rand.NewSource(5))
	for _, extra := range []int{0, 1, 3, 7} {
		n := &netPeers{rails: make([]*rail, extra)}
		parts := uint64(extra + 1)
		sizes := []uint64{0, 1, railStripeMin - 1, railStripeMin, railStripeMin + 1, 294916, 262145,
			parts * 4096 * 64, parts*4096*64 + 3, 64 << 20}
		for range 200 {
			sizes = append(sizes, railStripeMin+uint64(rng.Int63n(64<<20)))
		}
		for _, size := range sizes {
			next, last := uint64(0), -1
			err := n.stripes(size, func(k int, at, part uint64) error {
				switch {
				case k < 0 || k > extra || k <= last:
					return fmt.Errorf("stripe on rail %d after rail %d", k, last)
				case at != next:
					return fmt.Errorf("stripe at %d, want %d", at, next)
				case size >= railStripeMin && extra > 0 && at+part < size && part%4096 != 0:
					return fmt.Errorf("stripe of %d bytes before the last", part)
				}
				next, last = at+part, k
				return nil
			})
			if err == nil && next != size {
				err = fmt.Errorf("stripes end at %d", next)
			}
			if err == nil && (size < railStripeMin || extra == 0) && last != 0 {
				err = fmt.Errorf("a put below the stripe size on rail %d", last)
			}
			if err != nil {
				t.Fatalf("%d further rails, %d bytes: %v", extra, size, err)
			}
		}
	}
}
