package bootstrap

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// freePort returns a loopback port that was free a moment ago.
func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func testConfig(port, rank, size int, timeout time.Duration) TCPConfig {
	return TCPConfig{Rank: rank, Size: size, Addr: "127.0.0.1", Port: port, Token: 0x5eed, Timeout: timeout}
}

// startRanks runs newTCP for every config at once and returns the results
// by index. Bootstraps are closed at the end of the test.
func startRanks(t *testing.T, cfgs []TCPConfig) ([]*tcpBootstrap, []error) {
	t.Helper()
	bs := make([]*tcpBootstrap, len(cfgs))
	errs := make([]error, len(cfgs))
	var wg sync.WaitGroup
	for i, c := range cfgs {
		wg.Add(1)
		go func() { defer wg.Done(); bs[i], errs[i] = newTCP(c) }()
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, b := range bs {
			if b != nil {
				b.Close()
			}
		}
	})
	return bs, errs
}

func startJob(t *testing.T, size int, timeout time.Duration) []*tcpBootstrap {
	t.Helper()
	port := freePort(t)
	cfgs := make([]TCPConfig, size)
	for r := range cfgs {
		cfgs[r] = testConfig(port, r, size, timeout)
	}
	bs, errs := startRanks(t, cfgs)
	for r, err := range errs {
		if err != nil {
			t.Fatalf("newTCP(rank %d of %d): %v", r, size, err)
		}
	}
	return bs
}

// payload is what rank sends in round: random bytes of a random length
// (empty included) that every rank can recompute.
func payload(rank, round int) []byte {
	rng := rand.New(rand.NewPCG(uint64(rank), uint64(round)))
	p := make([]byte, rng.IntN(300))
	for i := range p {
		p[i] = byte(rng.Uint32())
	}
	return p
}

// eachRank runs f for every rank concurrently and reports its errors.
func eachRank(t *testing.T, bs []*tcpBootstrap, f func(b *tcpBootstrap) error) []error {
	t.Helper()
	errs := make([]error, len(bs))
	var wg sync.WaitGroup
	for r, b := range bs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[r] = f(b) }()
	}
	wg.Wait()
	return errs
}

func checkGather(b Bootstrap, round int) error {
	got, err := b.AllGather(payload(b.Rank(), round))
	if err != nil {
		return err
	}
	if len(got) != b.Size() {
		return fmt.Errorf("rank %d round %d: AllGather returned %d items, want %d", b.Rank(), round, len(got), b.Size())
	}
	for r := range got {
		if want := payload(r, round); !bytes.Equal(got[r], want) {
			return fmt.Errorf("rank %d round %d: AllGather item %d = %d bytes %x..., want %d bytes",
				b.Rank(), round, r, len(got[r]), got[r][:min(len(got[r]), 8)], len(want))
		}
	}
	return nil
}

func TestTCPAllGather(t *testing.T) {
	const rounds = 50
	for size := 1; size <= 5; size++ {
		t.Run(fmt.Sprintf("size%d", size), func(t *testing.T) {
			bs := startJob(t, size, 5*time.Second)
			errs := eachRank(t, bs, func(b *tcpBootstrap) error {
				for round := range rounds {
					if err := checkGather(b, round); err != nil {
						return err
					}
					if round%10 == 0 {
						if err := b.Barrier(); err != nil {
							return fmt.Errorf("rank %d: Barrier after round %d: %w", b.Rank(), round, err)
						}
					}
				}
				return nil
			})
			for r, err := range errs {
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
		})
	}
}

func TestTCPAllGatherDoesNotAlias(t *testing.T) {
	bs := startJob(t, 2, 5*time.Second)
	data := []byte("abc")
	var got0 [][]byte
	eachRank(t, bs, func(b *tcpBootstrap) error {
		out, err := b.AllGather(data)
		if b.rank == 0 {
			got0 = out
		}
		return err
	})
	data[0] = 'X'
	if string(got0[0]) != "abc" {
		t.Errorf("rank 0's own item changed with its input: %q, want %q", got0[0], "abc")
	}
}

func TestTCPBarrierWaitsForAll(t *testing.T) {
	bs := startJob(t, 3, 5*time.Second)
	const delay = 200 * time.Millisecond
	elapsed := make([]time.Duration, len(bs))
	errs := eachRank(t, bs, func(b *tcpBootstrap) error {
		start := time.Now()
		if b.rank == 2 {
			time.Sleep(delay)
		}
		err := b.Barrier()
		elapsed[b.rank] = time.Since(start)
		return err
	})
	for r := range bs {
		if errs[r] != nil || elapsed[r] < delay {
			t.Errorf("rank %d: Barrier = %v after %v, want nil after >= %v", r, errs[r], elapsed[r], delay)
		}
	}
}

func TestTCPRendezvousRejects(t *testing.T) {
	const timeout = 3 * time.Second
	tests := []struct {
		name   string
		mutate func(cfgs []TCPConfig) []TCPConfig
		want   string // in rank 0's error and in every rejected rank's error
	}{
		{"bad token", func(c []TCPConfig) []TCPConfig { c[1].Token++; return c },
			"job token mismatch: rank 1 has 0x5eee, rank 0 has 0x5eed"},
		{"size mismatch", func(c []TCPConfig) []TCPConfig { c[1].Size = 3; return c },
			"world size mismatch: rank 1 says 3, rank 0 says 2"},
		{"duplicate rank", func(c []TCPConfig) []TCPConfig {
			// Rank 1 twice in a job of 3 with no rank 2, so rank 0 is still
			// waiting when the second rank 1 arrives.
			for i := range c {
				c[i].Size = 3
			}
			return append(c, c[1])
		}, "duplicate rank 1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			port := freePort(t)
			cfgs := tt.mutate([]TCPConfig{testConfig(port, 0, 2, timeout), testConfig(port, 1, 2, timeout)})
			start := time.Now()
			_, errs := startRanks(t, cfgs)
			if took := time.Since(start); took > timeout/2 {
				t.Errorf("rendezvous took %v to fail, want well under the %v timeout", took, timeout)
			}
			for i, err := range errs {
				if status.CodeOf(err) != status.Bootstrap || !strings.Contains(errString(err), tt.want) {
					t.Errorf("config %d (rank %d): newTCP = %v (code %v), want a %v error containing %q",
						i, cfgs[i].Rank, err, status.CodeOf(err), status.Bootstrap, tt.want)
				}
			}
		})
	}
}

// TestTCPRootRejectsBadHello speaks the wire protocol directly to send
// hellos that NewTCP would refuse to send.
func TestTCPRootRejectsBadHello(t *testing.T) {
	tests := []struct {
		name  string
		hello Message
		want  string
	}{
		{"rank out of range", Message{Type: MsgHello, Token: 0x5eed, Rank: 7, Size: 2}, "rank 7 out of range [1, 2)"},
		{"second rank 0", Message{Type: MsgHello, Token: 0x5eed, Rank: 0, Size: 2}, "rank 0 out of range [1, 2)"},
		{"gather before hello", Message{Type: MsgGather, Token: 0x5eed, Rank: 1, Size: 2}, "sent gather before hello"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			port := freePort(t)
			rootErr := make(chan error, 1)
			go func() {
				b, err := newTCP(testConfig(port, 0, 2, 3*time.Second))
				if b != nil {
					b.Close()
				}
				rootErr <- err
			}()
			c, err := dialRetry(fmt.Sprintf("127.0.0.1:%d", port), time.Now().Add(2*time.Second))
			if err != nil {
				t.Fatalf("dial rank 0: %v", err)
			}
			defer c.Close()
			if err := Encode(c, tt.hello); err != nil {
				t.Fatalf("send hello: %v", err)
			}
			c.SetReadDeadline(time.Now().Add(2 * time.Second))
			reply, err := Decode(c, MaxPayload)
			if err != nil || reply.Type != MsgError {
				t.Fatalf("reply = %+v, %v; want an error message", reply, err)
			}
			if code, why := decodeError(reply.Payload); code != status.Bootstrap || !strings.Contains(why, tt.want) {
				t.Errorf("reply says %v %q, want %v containing %q", code, why, status.Bootstrap, tt.want)
			}
			if err := <-rootErr; !strings.Contains(errString(err), tt.want) {
				t.Errorf("rank 0: newTCP = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}

func TestTCPRootIgnoresGarbageConnection(t *testing.T) {
	port := freePort(t)
	cfgs := []TCPConfig{testConfig(port, 0, 2, 3*time.Second), testConfig(port, 1, 2, 3*time.Second)}
	root := make(chan *tcpBootstrap, 1)
	go func() {
		b, err := newTCP(cfgs[0])
		if err != nil {
			t.Errorf("rank 0: newTCP = %v, want nil", err)
		}
		root <- b
	}()
	stray, err := dialRetry(fmt.Sprintf("127.0.0.1:%d", port), time.Now().Add(2*time.Second))
	if err != nil {
		t.Fatalf("dial rank 0: %v", err)
	}
	stray.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	stray.SetReadDeadline(time.Now().Add(2 * time.Second))
	if n, err := stray.Read(make([]byte, 1)); err == nil {
		t.Errorf("rank 0 answered a stray HTTP request with %d bytes, want it to hang up", n)
	}
	stray.Close()

	b1, err := newTCP(cfgs[1])
	if err != nil {
		t.Fatalf("rank 1 after a stray connection: newTCP = %v, want nil", err)
	}
	defer b1.Close()
	b0 := <-root
	if b0 == nil {
		return
	}
	defer b0.Close()
	errs := eachRank(t, []*tcpBootstrap{b0, b1}, func(b *tcpBootstrap) error { return checkGather(b, 0) })
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

func TestTCPPeerLeavesMidCollective(t *testing.T) {
	const timeout = 5 * time.Second
	tests := []struct {
		name     string
		leaver   int
		leave    func(b *tcpBootstrap) // instead of the third round
		wantCode status.Code
		want     string
		maxTime  time.Duration
	}{
		{"peer closes", 2, func(b *tcpBootstrap) { b.Close() }, status.Bootstrap,
			"rank 2 closed the connection during all-gather #3", timeout / 2},
		{"root closes", 0, func(b *tcpBootstrap) { b.Close() }, status.Bootstrap,
			"rank 0 closed the connection during all-gather #3", timeout / 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bs := startJob(t, 4, timeout)
			start := make([]time.Time, len(bs))
			took := make([]time.Duration, len(bs))
			errs := eachRank(t, bs, func(b *tcpBootstrap) error {
				for round := range 2 {
					if err := checkGather(b, round); err != nil {
						return fmt.Errorf("round %d before anyone left: %w", round, err)
					}
				}
				start[b.rank] = time.Now()
				if b.rank == tt.leaver {
					tt.leave(b)
					return nil
				}
				err := checkGather(b, 2)
				took[b.rank] = time.Since(start[b.rank])
				return err
			})
			for r, err := range errs {
				if r == tt.leaver {
					continue
				}
				if status.CodeOf(err) != tt.wantCode || !strings.Contains(errString(err), tt.want) || took[r] > tt.maxTime {
					t.Errorf("rank %d: AllGather = %v (code %v) after %v; want a %v error containing %q within %v",
						r, err, status.CodeOf(err), took[r], tt.wantCode, tt.want, tt.maxTime)
				}
				// The bootstrap is broken: the same error again, at once.
				if again := bs[r].Barrier(); again != err {
					t.Errorf("rank %d: Barrier after failure = %v, want the same error %v", r, again, err)
				}
			}
		})
	}
}

func TestTCPPeerNeverArrives(t *testing.T) {
	const timeout = 300 * time.Millisecond
	bs := startJob(t, 4, timeout)
	errs := eachRank(t, bs, func(b *tcpBootstrap) error {
		if b.rank == 3 {
			return nil // alive but never calls
		}
		return checkGather(b, 0)
	})
	for r := range 3 {
		want := "rank 3 never arrived at all-gather #1 within 300ms"
		if status.CodeOf(errs[r]) != status.Timeout || !strings.Contains(errString(errs[r]), want) {
			t.Errorf("rank %d: AllGather = %v (code %v), want a %v error containing %q",
				r, errs[r], status.CodeOf(errs[r]), status.Timeout, want)
		}
	}
}

func TestTCPRendezvousTimeouts(t *testing.T) {
	const timeout = 300 * time.Millisecond
	tests := []struct {
		name string
		cfg  TCPConfig
		want string
	}{
		{"root absent", TCPConfig{Rank: 1, Size: 2}, "rank 1 cannot reach rank 0 at 127.0.0.1:"},
		{"peers absent", TCPConfig{Rank: 0, Size: 3}, "ranks [1 2] never arrived within 300ms"},
		{"one peer absent", TCPConfig{Rank: 0, Size: 2}, "rank 1 never arrived within 300ms"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := testConfig(freePort(t), tt.cfg.Rank, tt.cfg.Size, timeout)
			start := time.Now()
			b, err := newTCP(cfg)
			took := time.Since(start)
			if b != nil {
				b.Close()
			}
			if status.CodeOf(err) != status.Timeout || !strings.Contains(errString(err), tt.want) {
				t.Errorf("newTCP = %v (code %v), want a %v error containing %q", err, status.CodeOf(err), status.Timeout, tt.want)
			}
			if took < timeout-50*time.Millisecond || took > timeout+time.Second {
				t.Errorf("newTCP gave up after %v, want about %v", took, timeout)
			}
		})
	}
}

func TestTCPClosed(t *testing.T) {
	bs := startJob(t, 1, time.Second)
	bs[0].Close()
	if _, err := bs[0].AllGather([]byte("x")); status.CodeOf(err) != status.State {
		t.Errorf("AllGather after Close = %v, want a %v error", err, status.State)
	}
	if err := bs[0].Close(); err != nil {
		t.Errorf("second Close = %v, want nil", err)
	}
}

func TestNewTCPValidates(t *testing.T) {
	tests := []struct {
		name string
		cfg  TCPConfig
		want string
	}{
		{"size zero", TCPConfig{Rank: 0, Size: 0, Port: 1000}, "world size 0"},
		{"rank negative", TCPConfig{Rank: -1, Size: 2, Port: 1000, Addr: "x"}, "rank -1 out of range [0, 2)"},
		{"rank too big", TCPConfig{Rank: 2, Size: 2, Port: 1000, Addr: "x"}, "rank 2 out of range [0, 2)"},
		{"port zero", TCPConfig{Rank: 0, Size: 2, Port: 0, Addr: "x"}, "port 0 out of range"},
		{"no address", TCPConfig{Rank: 1, Size: 2, Port: 1000}, "empty rank 0 address"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := NewTCP(tt.cfg)
			if status.CodeOf(err) != status.InvalidArgument || !strings.Contains(errString(err), tt.want) {
				t.Errorf("NewTCP(%+v) = %v, want an %v error containing %q", tt.cfg, err, status.InvalidArgument, tt.want)
			}
		})
	}
}

func TestNewTCPOffsetsPort(t *testing.T) {
	// Each call adds the number of earlier calls to the port; size 1 needs
	// no socket, so the port only shows when it runs past 65535.
	k := int(tcpInstances.Load())
	cfg := TCPConfig{Rank: 0, Size: 1, Port: 65535 - k}
	b, err := NewTCP(cfg)
	if err != nil {
		t.Fatalf("NewTCP #%d with port %d: %v, want port 65535", k, cfg.Port, err)
	}
	b.Close()
	_, err = NewTCP(cfg)
	want := fmt.Sprintf("would use port %d+%d", cfg.Port, k+1)
	if status.CodeOf(err) != status.InvalidArgument || !strings.Contains(errString(err), want) {
		t.Errorf("NewTCP #%d = %v, want an %v error containing %q", k+1, err, status.InvalidArgument, want)
	}
}

func TestListenAddr(t *testing.T) {
	tests := []struct{ addr, want string }{
		{"127.0.0.1", "127.0.0.1:99"},
		{"localhost", "127.0.0.1:99"},
		{"::1", "[::1]:99"},
		{"10.1.2.3", ":99"},
		{"node-017", ":99"},
	}
	for _, tt := range tests {
		if got := listenAddr(TCPConfig{Addr: tt.addr, Port: 99}); got != tt.want {
			t.Errorf("listenAddr(%q) = %q, want %q", tt.addr, got, tt.want)
		}
	}
}
