package collective

import "time"

// BlameWait is how long a rank whose wait across nodes timed out listens
// for whom the rank it waited for blames: a quarter of the timeout, at most
// 2 s. That rank started its own wait (and times out) later by however much
// it entered the call later; on a busy host that skew reached a few hundred
// milliseconds, and a shorter window then blamed the waiting neighbour. The
// all-reduce (hostcoll) and the MoE (moe) across nodes both listen this long.
func BlameWait(timeout time.Duration) time.Duration { return min(timeout/4, 2*time.Second) }
