package bootstraptest

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Rank is how one process of a Job ended and what it printed.
type Rank struct {
	Rank           int
	Stdout, Stderr string
	Err            error
}

// RunJob runs size copies of the test binary, running no test, as the ranks
// of one job over the TCP bootstrap on a free loopback port. Each gets the
// bootstrap's environment, role in roleEnv (its TestMain dispatches on it),
// and env; RunJob waits for all of them and kills them after limit.
func RunJob(t testing.TB, roleEnv, role string, size int, limit time.Duration, env ...string) []Rank {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	out := make([]Rank, size)
	var wg sync.WaitGroup
	for rank := range size {
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), roleEnv+"="+role,
			"P2PCOMM_RANK="+strconv.Itoa(rank), "P2PCOMM_WORLD_SIZE="+strconv.Itoa(size),
			"P2PCOMM_MASTER_ADDR=127.0.0.1", "P2PCOMM_MASTER_PORT="+strconv.Itoa(port),
			"P2PCOMM_JOB_TOKEN="+strings.ReplaceAll(t.Name(), "/", "."))
		cmd.Env = append(cmd.Env, env...)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Start(); err != nil {
			t.Fatalf("start rank %d: %v", rank, err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := cmd.Wait()
			out[rank] = Rank{rank, stdout.String(), stderr.String(), err}
		}()
	}
	wg.Wait()
	return out
}

// ExpectDone fails t for every rank, but those in skip, that did not exit
// cleanly after printing DONE.
func ExpectDone(t testing.TB, ranks []Rank, skip ...int) {
	t.Helper()
	for _, r := range ranks {
		if len(skip) > 0 && r.Rank == skip[0] {
			continue
		}
		if r.Err != nil || !strings.Contains(r.Stdout, "DONE") {
			t.Errorf("rank %d: %v\nstdout: %s\nstderr: %s", r.Rank, r.Err, r.Stdout, r.Stderr)
		} else {
			t.Logf("rank %d: %s%s", r.Rank, r.Stdout, r.Stderr)
		}
	}
}
