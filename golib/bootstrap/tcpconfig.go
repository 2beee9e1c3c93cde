package bootstrap

import (
	"fmt"
	"hash/fnv"
	"strconv"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// TCPConfig says how a rank finds the others over TCP. Rank 0 listens on
// Addr:Port; every other rank dials it.
type TCPConfig struct {
	Rank, Size int
	Addr       string // rank 0's host name or IP
	Port       int    // rank 0's port; NewTCP adds a per-process offset
	// Token identifies the job; rank 0 refuses peers with another token, so
	// a stale process of an earlier job cannot join.
	Token uint64
	// Timeout bounds the rendezvous and every later collective; zero means
	// DefaultTimeout.
	Timeout time.Duration
}

func (c TCPConfig) timeout() time.Duration {
	if c.Timeout <= 0 {
		return DefaultTimeout
	}
	return c.Timeout
}

func (c TCPConfig) validate() error {
	if c.Size < 1 {
		return status.Errorf(status.InvalidArgument, "bootstrap: world size %d, want >= 1", c.Size)
	}
	if c.Rank < 0 || c.Rank >= c.Size {
		return status.Errorf(status.InvalidArgument, "bootstrap: rank %d out of range [0, %d)", c.Rank, c.Size)
	}
	if c.Port < 1 || c.Port > 65535 {
		return status.Errorf(status.InvalidArgument, "bootstrap: port %d out of range [1, 65535]", c.Port)
	}
	if c.Size > 1 && c.Addr == "" {
		return status.Errorf(status.InvalidArgument, "bootstrap: empty rank 0 address")
	}
	return nil
}

// TCPConfigFromEnv builds a TCPConfig from the variables torchrun sets, each
// overridable by a P2PCOMM_ variant:
//
//	rank        P2PCOMM_RANK, else RANK (required)
//	world size  P2PCOMM_WORLD_SIZE, else WORLD_SIZE (required)
//	address     P2PCOMM_MASTER_ADDR, else MASTER_ADDR, else 127.0.0.1
//	port        P2PCOMM_MASTER_PORT, else MASTER_PORT+1 (torchrun's own
//	            TCPStore already listens on MASTER_PORT)
//	timeout     P2PCOMM_TIMEOUT_MS, else DefaultTimeout
//	token       P2PCOMM_JOB_TOKEN (a number is used as is, other text is
//	            hashed), else FNV-64a of TORCHELASTIC_RUN_ID, address, port
//	            and world size
//
// lookup is usually os.LookupEnv. Errors are status.Bootstrap when a
// required variable is missing and status.InvalidArgument when one is
// malformed; both name the variable.
func TCPConfigFromEnv(lookup func(string) (string, bool)) (TCPConfig, error) {
	var c TCPConfig
	var err error
	if c.Rank, err = envInt(lookup, "P2PCOMM_RANK", "RANK"); err != nil {
		return c, err
	}
	if c.Size, err = envInt(lookup, "P2PCOMM_WORLD_SIZE", "WORLD_SIZE"); err != nil {
		return c, err
	}
	if c.Size < 1 {
		return c, status.Errorf(status.InvalidArgument, "bootstrap: %s=%d, want >= 1", envName(lookup, "P2PCOMM_WORLD_SIZE", "WORLD_SIZE"), c.Size)
	}
	if c.Rank < 0 || c.Rank >= c.Size {
		return c, status.Errorf(status.InvalidArgument, "bootstrap: %s=%d out of range [0, %d) for world size %d",
			envName(lookup, "P2PCOMM_RANK", "RANK"), c.Rank, c.Size, c.Size)
	}
	c.Addr = "127.0.0.1"
	if v, ok := firstEnv(lookup, "P2PCOMM_MASTER_ADDR", "MASTER_ADDR"); ok && v != "" {
		c.Addr = v
	}
	if c.Port, err = envPort(lookup); err != nil {
		return c, err
	}
	c.Timeout = DefaultTimeout
	if v, ok := lookup("P2PCOMM_TIMEOUT_MS"); ok {
		ms, err := strconv.ParseInt(v, 10, 64)
		if err != nil || ms <= 0 || ms > int64(24*time.Hour/time.Millisecond) {
			return c, status.Errorf(status.InvalidArgument, "bootstrap: P2PCOMM_TIMEOUT_MS=%q, want milliseconds in [1, 86400000]", v)
		}
		c.Timeout = time.Duration(ms) * time.Millisecond
	}
	c.Token = envToken(lookup, c)
	return c, nil
}

func firstEnv(lookup func(string) (string, bool), names ...string) (string, bool) {
	for _, n := range names {
		if v, ok := lookup(n); ok {
			return v, true
		}
	}
	return "", false
}

// envName returns the first of names that is set, for error messages.
func envName(lookup func(string) (string, bool), names ...string) string {
	for _, n := range names {
		if _, ok := lookup(n); ok {
			return n
		}
	}
	return names[len(names)-1]
}

func envInt(lookup func(string) (string, bool), names ...string) (int, error) {
	v, ok := firstEnv(lookup, names...)
	if !ok {
		return 0, status.Errorf(status.Bootstrap, "bootstrap: neither %s nor %s is set (launch with torchrun or set them)", names[0], names[1])
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return 0, status.Errorf(status.InvalidArgument, "bootstrap: %s=%q is not an integer", envName(lookup, names...), v)
	}
	return n, nil
}

func envPort(lookup func(string) (string, bool)) (int, error) {
	if v, ok := lookup("P2PCOMM_MASTER_PORT"); ok {
		p, err := strconv.Atoi(v)
		if err != nil || p < 1 || p > 65535 {
			return 0, status.Errorf(status.InvalidArgument, "bootstrap: P2PCOMM_MASTER_PORT=%q, want a port in [1, 65535]", v)
		}
		return p, nil
	}
	v, ok := lookup("MASTER_PORT")
	if !ok {
		return 0, status.Errorf(status.Bootstrap, "bootstrap: neither P2PCOMM_MASTER_PORT nor MASTER_PORT is set")
	}
	p, err := strconv.Atoi(v)
	if err != nil || p < 1 || p > 65534 {
		return 0, status.Errorf(status.InvalidArgument,
			"bootstrap: MASTER_PORT=%q, want a port in [1, 65534] (p2pcomm uses MASTER_PORT+1; or set P2PCOMM_MASTER_PORT)", v)
	}
	return p + 1, nil
}

func envToken(lookup func(string) (string, bool), c TCPConfig) uint64 {
	if t, ok := explicitToken(lookup); ok {
		return t
	}
	runID, _ := lookup("TORCHELASTIC_RUN_ID")
	return hashToken(fmt.Sprintf("%s\x00%s\x00%d\x00%d", runID, c.Addr, c.Port, c.Size))
}

// JobToken names this job for resources shared on the host: P2PCOMM_JOB_TOKEN
// when set (a number as is, other text hashed), else a hash of torchrun's
// run id and rendezvous address; the same on every rank of a job.
func JobToken(lookup func(string) (string, bool)) uint64 {
	if t, ok := explicitToken(lookup); ok {
		return t
	}
	runID, _ := lookup("TORCHELASTIC_RUN_ID")
	addr, _ := lookup("MASTER_ADDR")
	port, _ := lookup("MASTER_PORT")
	return hashToken(runID + "\x00" + addr + "\x00" + port)
}

func explicitToken(lookup func(string) (string, bool)) (uint64, bool) {
	v, ok := lookup("P2PCOMM_JOB_TOKEN")
	if !ok || v == "" {
		return 0, false
	}
	if n, err := strconv.ParseUint(v, 0, 64); err == nil {
		return n, true
	}
	return hashToken(v), true
}

func hashToken(s string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(s))
	return h.Sum64()
}
