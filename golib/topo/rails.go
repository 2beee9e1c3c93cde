package topo

import (
	"os"
	"runtime"
	"strconv"
	"strings"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// A rail is a transport of its own (a UCX worker with its connections, and
// the thread that progresses it) that carries a share of a rank's traffic
// to other nodes: over tcp the thread that moves a transport's bytes is what
// limits it, so several rails move several times as much.

// NetRailsEnv asks for a number of rails.
const NetRailsEnv = "P2PCOMM_NET_RAILS"

// MaxNetRails is the most rails a rank uses, and the default where a rank
// has two cores per rail (the cores it is bound to, else its share of the
// host's).
const MaxNetRails = 8

// NetRails is how many rails this rank asks for: asked (1, 2, 4 or 8), or
// for 0 the default.
func (t *Topology) NetRails(asked int) (int, error) {
	switch {
	case asked == 0:
		cores := coresPerRank(runtime.NumCPU(), onlineCPUs(), t.HostRanks) / 2
		r := MaxNetRails
		for r > 1 && r > cores {
			r /= 2
		}
		return r, nil
	case asked > 0 && asked <= MaxNetRails && MaxNetRails%asked == 0:
		return asked, nil
	}
	return 0, status.Errorf(status.InvalidArgument, "%s=%d: want 1, 2, 4 or 8", NetRailsEnv, asked)
}

// Stripes is how many stripes a rank's UCX transport opens by default for
// staged chunks (ucx.Options.Stripes): one thread each, so up to 4 while
// the rank has two cores per stripe, else 1 (none).
func (t *Topology) Stripes() int {
	cores := coresPerRank(runtime.NumCPU(), onlineCPUs(), t.HostRanks)
	n := 4
	for n > 1 && 2*n > cores {
		n /= 2
	}
	return n
}

// AgreeRails settles every rank on the fewest rails any rank asks for (rail
// k connects rail k of every rank); collective. A bad count on any rank is
// every rank's error.
func (t *Topology) AgreeRails(bs bootstrap.Bootstrap, asked int) (int, error) {
	mine, err := t.NetRails(asked)
	if err = bootstrap.Agree(bs, err); err != nil {
		return 0, err
	}
	all, err := bs.AllGather([]byte{byte(mine)})
	if err != nil {
		return 0, err
	}
	for r, m := range all {
		if len(m) != 1 {
			return 0, status.Errorf(status.Mismatch, "rank %d sent a %d-byte rail count", r, len(m))
		}
		mine = min(mine, int(m[0]))
	}
	return mine, nil
}

// coresPerRank is this rank's share of the host's cores: all it may run on
// where that is fewer than the host has (a launcher bound each rank to its
// own), else an even share among the host's ranks.
func coresPerRank(allowed, online, hostRanks int) int {
	if online > 0 && allowed < online {
		return allowed
	}
	return allowed / max(1, hostRanks)
}

// onlineCPUs counts the host's online CPUs (0 when it cannot tell).
func onlineCPUs() int {
	b, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		return 0
	}
	n := 0
	for _, part := range strings.Split(strings.TrimSpace(string(b)), ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		if err != nil {
			return 0
		}
		z := a
		if isRange {
			if z, err = strconv.Atoi(hi); err != nil || z < a {
				return 0
			}
		}
		n += z - a + 1
	}
	return n
}
