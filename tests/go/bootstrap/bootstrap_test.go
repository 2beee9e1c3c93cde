// Package bootstrap_test runs the TCP bootstrap across real processes: the
// test binary re-executes itself as every rank of a job, configured only by
// the environment torchrun would set.
package bootstrap_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// childRoleEnv marks a child process and says what it does.
const childRoleEnv = "P2PCOMM_TEST_CHILD_ROLE"

const (
	roleGather = "gather" // two bootstraps, rounds of all-gather, print digests
	roleLeave  = "leave"  // one round, then rank leaverEnv exits, the others must fail
	leaverEnv  = "P2PCOMM_TEST_LEAVER"
	rounds     = 10
	numComms   = 2 // bootstraps per process, to exercise the port offset
)

func TestMain(m *testing.M) {
	if role := os.Getenv(childRoleEnv); role != "" {
		os.Exit(child(role))
	}
	os.Exit(m.Run())
}

// payload is what rank sends in round of bootstrap comm.
func payload(comm, rank, round int) []byte {
	rng := rand.New(rand.NewPCG(uint64(comm)<<32|uint64(rank), uint64(round)))
	p := make([]byte, rng.IntN(500))
	for i := range p {
		p[i] = byte(rng.Uint32())
	}
	return p
}

// digest hashes every rank's payload of every round of comm, as the
// all-gathers should deliver them.
func digest(comm, size int) string {
	h := sha256.New()
	for round := range rounds {
		for r := range size {
			fmt.Fprintf(h, "%d:", r)
			h.Write(payload(comm, r, round))
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

func child(role string) int {
	cfg, err := bootstrap.TCPConfigFromEnv(os.LookupEnv)
	if err != nil {
		fmt.Fprintln(os.Stderr, "config:", err)
		return 1
	}
	switch role {
	case roleGather:
		return childGather(cfg)
	case roleLeave:
		return childLeave(cfg)
	}
	fmt.Fprintln(os.Stderr, "unknown role", role)
	return 1
}

func childGather(cfg bootstrap.TCPConfig) int {
	for comm := range numComms {
		b, err := bootstrap.NewTCP(cfg)
		if err != nil {
			fmt.Fprintf(os.Stderr, "NewTCP #%d: %v\n", comm, err)
			return 1
		}
		h := sha256.New()
		for round := range rounds {
			got, err := b.AllGather(payload(comm, cfg.Rank, round))
			if err != nil {
				fmt.Fprintf(os.Stderr, "bootstrap %d round %d: %v\n", comm, round, err)
				return 1
			}
			for r, item := range got {
				fmt.Fprintf(h, "%d:", r)
				h.Write(item)
			}
		}
		if err := b.Barrier(); err != nil {
			fmt.Fprintf(os.Stderr, "bootstrap %d barrier: %v\n", comm, err)
			return 1
		}
		fmt.Printf("RESULT %d %s\n", comm, hex.EncodeToString(h.Sum(nil)))
		// Not closed until the end: both bootstraps are live at once.
		defer b.Close()
	}
	return 0
}

func childLeave(cfg bootstrap.TCPConfig) int {
	leaver, _ := strconv.Atoi(os.Getenv(leaverEnv))
	b, err := bootstrap.NewTCP(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "NewTCP:", err)
		return 1
	}
	if _, err := b.AllGather(payload(0, cfg.Rank, 0)); err != nil {
		fmt.Fprintln(os.Stderr, "round 0:", err)
		return 1
	}
	if cfg.Rank == leaver {
		os.Exit(0) // no Close: the kernel drops the connection, as in a crash
	}
	start := time.Now()
	_, err = b.AllGather(payload(0, cfg.Rank, 1))
	if err == nil {
		fmt.Fprintln(os.Stderr, "round 1 succeeded without the leaver")
		return 2
	}
	fmt.Printf("ERROR code=%d after=%dms %v\n", status.CodeOf(err), time.Since(start).Milliseconds(), err)
	return 0
}

// freePorts returns the first of n consecutive loopback ports that were
// all free a moment ago.
func freePorts(t *testing.T, n int) int {
	t.Helper()
	for range 50 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("listen: %v", err)
		}
		first := ln.Addr().(*net.TCPAddr).Port
		ls := []net.Listener{ln}
		for p := first + 1; p < first+n; p++ {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
			if err != nil {
				break
			}
			ls = append(ls, l)
		}
		for _, l := range ls {
			l.Close()
		}
		if len(ls) == n {
			return first
		}
	}
	t.Fatalf("no %d consecutive free ports", n)
	return 0
}

type childResult struct {
	stdout, stderr string
	err            error
}

// runJob starts size children with torchrun's variables and waits for all.
func runJob(t *testing.T, role string, size int, extraEnv ...string) []childResult {
	t.Helper()
	port := freePorts(t, numComms)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	results := make([]childResult, size)
	var wg sync.WaitGroup
	for rank := range size {
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(),
			childRoleEnv+"="+role,
			"RANK="+strconv.Itoa(rank), "LOCAL_RANK="+strconv.Itoa(rank), "WORLD_SIZE="+strconv.Itoa(size),
			"MASTER_ADDR=127.0.0.1", "MASTER_PORT="+strconv.Itoa(port-1), // p2pcomm uses MASTER_PORT+1
			"TORCHELASTIC_RUN_ID="+t.Name(),
			"P2PCOMM_TIMEOUT_MS=5000",
		)
		cmd.Env = append(cmd.Env, extraEnv...)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Start(); err != nil {
			t.Fatalf("start rank %d: %v", rank, err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := cmd.Wait()
			results[rank] = childResult{stdout.String(), stderr.String(), err}
		}()
	}
	wg.Wait()
	return results
}

func TestCrossProcessAllGather(t *testing.T) {
	for _, size := range []int{1, 2, 4} {
		t.Run(fmt.Sprintf("size%d", size), func(t *testing.T) {
			results := runJob(t, roleGather, size)
			for rank, res := range results {
				if res.err != nil {
					t.Errorf("rank %d: %v\nstderr: %s", rank, res.err, res.stderr)
					continue
				}
				for comm := range numComms {
					want := fmt.Sprintf("RESULT %d %s", comm, digest(comm, size))
					if !strings.Contains(res.stdout, want) {
						t.Errorf("rank %d bootstrap %d: output %q, want a line %q", rank, comm, res.stdout, want)
					}
				}
			}
		})
	}
}

func TestCrossProcessPeerExits(t *testing.T) {
	const size, leaver = 3, 2
	start := time.Now()
	results := runJob(t, roleLeave, size, leaverEnv+"="+strconv.Itoa(leaver))
	if took := time.Since(start); took > 4*time.Second {
		t.Errorf("job took %v, want the survivors to fail well within the 5s timeout", took)
	}
	for rank, res := range results {
		if res.err != nil {
			t.Errorf("rank %d: %v\nstderr: %s", rank, res.err, res.stderr)
			continue
		}
		if rank == leaver {
			continue
		}
		want := fmt.Sprintf("rank %d closed the connection during all-gather #2", leaver)
		code := fmt.Sprintf("ERROR code=%d ", status.Bootstrap)
		if !strings.Contains(res.stdout, code) || !strings.Contains(res.stdout, want) {
			t.Errorf("rank %d: output %q, want %q and %q", rank, res.stdout, code, want)
		}
	}
}
