package bootstrap

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// tcpInstances counts NewTCP calls in this process; see NewTCP.
var tcpInstances atomic.Int64

// NewTCP joins the job described by cfg: a star through rank 0, which
// listens on cfg.Addr:port while every other rank dials it (retrying until
// the timeout, since rank 0 may start last). It blocks until all cfg.Size
// ranks have arrived and rank 0 has checked that they agree on the wire
// version, job token and world size; a disagreement fails every rank it
// reaches with a status.Bootstrap error saying what differed.
//
// port is cfg.Port+k, where k is the number of NewTCP calls this process
// made before this one. So a job that creates several TCP bootstraps gets a
// fresh port for each, provided every rank creates them in the same order.
// Go sets SO_REUSEADDR on listeners, so a port left in TIME_WAIT by an
// earlier job can be reused at once.
//
// Size 1 opens no sockets.
func NewTCP(cfg TCPConfig) (Bootstrap, error) {
	k := int(tcpInstances.Add(1) - 1)
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if cfg.Port+k > 65535 {
		return nil, status.Errorf(status.InvalidArgument,
			"bootstrap: TCP bootstrap #%d of this process would use port %d+%d, beyond 65535", k, cfg.Port, k)
	}
	cfg.Port += k
	return newTCP(cfg)
}

// tcpBootstrap is a TCP star: rank 0 holds one connection per peer, every
// other rank holds one connection to rank 0.
type tcpBootstrap struct {
	rank, size int
	token      uint64
	timeout    time.Duration
	peers      []net.Conn // rank 0 only: peers[r] for r >= 1
	root       net.Conn   // ranks >= 1 only

	mu  sync.Mutex // serializes collectives
	seq uint32
	err error // sticky: once set, every later collective returns it

	closed    atomic.Bool
	closeOnce sync.Once
}

// replyGrace is how much longer a peer waits for rank 0 than rank 0 waits
// for the slowest peer, so that rank 0's report naming the slow rank
// arrives before the peer gives up and blames rank 0.
func replyGrace(timeout time.Duration) time.Duration { return timeout/4 + 100*time.Millisecond }

// errWriteGrace bounds the best-effort error notes sent while failing.
const errWriteGrace = time.Second

func newTCP(cfg TCPConfig) (*tcpBootstrap, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	b := &tcpBootstrap{rank: cfg.Rank, size: cfg.Size, token: cfg.Token, timeout: cfg.timeout()}
	if b.size == 1 {
		return b, nil
	}
	deadline := time.Now().Add(b.timeout)
	var err error
	if b.rank == 0 {
		err = b.acceptPeers(cfg, deadline)
	} else {
		err = b.joinRoot(cfg, deadline)
	}
	if err != nil {
		return nil, err
	}
	return b, nil
}

// listenAddr binds loopback only when rank 0's address is loopback (then
// every peer is local); otherwise it binds every interface, since the name
// peers dial may resolve to any of this host's addresses.
func listenAddr(cfg TCPConfig) string {
	port := strconv.Itoa(cfg.Port)
	if cfg.Addr == "localhost" {
		return net.JoinHostPort("127.0.0.1", port)
	}
	if ip := net.ParseIP(cfg.Addr); ip != nil && ip.IsLoopback() {
		return net.JoinHostPort(cfg.Addr, port)
	}
	return net.JoinHostPort("", port)
}

type helloResult struct {
	conn net.Conn
	msg  Message
	err  error
}

// acceptPeers is rank 0's side of the rendezvous.
func (b *tcpBootstrap) acceptPeers(cfg TCPConfig, deadline time.Time) error {
	addr := listenAddr(cfg)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return status.Errorf(status.Bootstrap,
			"bootstrap: rank 0 cannot listen on %s: %v (port taken by another job or rank 0? set P2PCOMM_MASTER_PORT)", addr, err)
	}
	hellos := make(chan helloResult)
	done := make(chan struct{})
	var pendingMu sync.Mutex
	pending := map[net.Conn]bool{}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return // ln closed below
			}
			pendingMu.Lock()
			pending[c] = true
			pendingMu.Unlock()
			go func() {
				c.SetReadDeadline(deadline)
				m, err := Decode(c, 0)
				select {
				case hellos <- helloResult{c, m, err}:
				case <-done:
					c.Close()
				}
			}()
		}
	}()

	b.peers = make([]net.Conn, b.size)
	var rejected []string
	fail := func() error {
		timer := time.NewTimer(time.Until(deadline))
		defer timer.Stop()
		for arrived := 1; arrived < b.size; {
			select {
			case h := <-hellos:
				pendingMu.Lock()
				delete(pending, h.conn)
				pendingMu.Unlock()
				if h.err != nil {
					// Not a p2pcomm peer, or one that never spoke: ignore it
					// but mention it if the rendezvous times out.
					rejected = append(rejected, fmt.Sprintf("%s: %v", h.conn.RemoteAddr(), h.err))
					h.conn.Close()
					continue
				}
				if err := b.admit(h); err != nil {
					sendError(h.conn, b.errorNote(0), err)
					h.conn.Close()
					return err
				}
				arrived++
			case <-timer.C:
				return b.missingError(rejected)
			}
		}
		return nil
	}()
	close(done)
	ln.Close()
	pendingMu.Lock()
	for c := range pending {
		c.Close()
	}
	pendingMu.Unlock()

	if fail == nil {
		for r := 1; r < b.size; r++ {
			c := b.peers[r]
			c.SetWriteDeadline(deadline)
			if err := Encode(c, b.note(MsgHelloAck, 0, nil)); err != nil {
				fail = status.Errorf(status.Bootstrap, "bootstrap: rendezvous: cannot reach rank %d: %v", r, err)
				break
			}
		}
	}
	if fail != nil {
		b.failRoot(fail)
		b.Close()
		return fail
	}
	return nil
}

// admit checks one hello and records the peer; the error is meant for both
// rank 0 and the peer.
func (b *tcpBootstrap) admit(h helloResult) error {
	m := h.msg
	switch {
	case m.Type != MsgHello:
		return status.Errorf(status.Bootstrap, "bootstrap: %s sent %s before hello", h.conn.RemoteAddr(), m.Type)
	case int64(m.Size) != int64(b.size):
		// Checked before the token: the default token hashes the world
		// size, so this is the more useful message.
		return status.Errorf(status.Bootstrap, "bootstrap: world size mismatch: rank %d says %d, rank 0 says %d",
			m.Rank, m.Size, b.size)
	case m.Token != b.token:
		return status.Errorf(status.Bootstrap,
			"bootstrap: job token mismatch: rank %d has %#x, rank 0 has %#x (set the same P2PCOMM_JOB_TOKEN, or check TORCHELASTIC_RUN_ID, MASTER_ADDR, MASTER_PORT)",
			m.Rank, m.Token, b.token)
	case m.Rank == 0 || int64(m.Rank) >= int64(b.size):
		return status.Errorf(status.Bootstrap, "bootstrap: rank %d out of range [1, %d) for a peer of rank 0 (from %s)",
			m.Rank, b.size, h.conn.RemoteAddr())
	case b.peers[m.Rank] != nil:
		return status.Errorf(status.Bootstrap, "bootstrap: duplicate rank %d: from %s and from %s",
			m.Rank, b.peers[m.Rank].RemoteAddr(), h.conn.RemoteAddr())
	}
	b.peers[m.Rank] = h.conn
	return nil
}

func (b *tcpBootstrap) missingError(rejected []string) error {
	var missing []int
	for r := 1; r < b.size; r++ {
		if b.peers[r] == nil {
			missing = append(missing, r)
		}
	}
	who := fmt.Sprintf("ranks %v", missing)
	if len(missing) == 1 {
		who = fmt.Sprintf("rank %d", missing[0])
	}
	msg := fmt.Sprintf("bootstrap: %s never arrived within %v", who, b.timeout)
	if len(rejected) > 0 {
		msg += fmt.Sprintf(" (ignored %d connections: %v)", len(rejected), rejected)
	}
	return status.Errorf(status.Timeout, "%s", msg)
}

// joinRoot is the rendezvous of a rank other than 0.
func (b *tcpBootstrap) joinRoot(cfg TCPConfig, deadline time.Time) error {
	addr := net.JoinHostPort(cfg.Addr, strconv.Itoa(cfg.Port))
	c, err := dialRetry(addr, deadline)
	if err != nil {
		return status.Errorf(status.Timeout, "bootstrap: rank %d cannot reach rank 0 at %s within %v: %v",
			b.rank, addr, b.timeout, err)
	}
	b.root = c
	fail := func(err error) error {
		b.Close()
		return err
	}
	c.SetWriteDeadline(deadline)
	if err := Encode(c, b.note(MsgHello, 0, nil)); err != nil {
		return fail(status.Errorf(status.Bootstrap, "bootstrap: rank %d: sending hello to rank 0 at %s: %v", b.rank, addr, err))
	}
	c.SetReadDeadline(deadline.Add(replyGrace(b.timeout)))
	m, err := Decode(c, MaxPayload)
	if err != nil {
		return fail(b.readError(0, "rendezvous", err))
	}
	switch {
	case m.Type == MsgError:
		code, why := decodeError(m.Payload)
		return fail(status.Errorf(code, "bootstrap: rank %d: rendezvous failed at rank 0: %s", b.rank, why))
	case m.Type != MsgHelloAck || m.Token != b.token || int64(m.Size) != int64(b.size):
		return fail(status.Errorf(status.Bootstrap,
			"bootstrap: rank 0 answered the hello of rank %d with %s (token %#x, world size %d), want hello-ack (token %#x, world size %d)",
			b.rank, m.Type, m.Token, m.Size, b.token, b.size))
	}
	return nil
}

// dialRetry dials addr until it answers or the deadline passes, backing off
// from 10 ms to 1 s between attempts.
func dialRetry(addr string, deadline time.Time) (net.Conn, error) {
	backoff := 10 * time.Millisecond
	for {
		d := net.Dialer{Deadline: deadline, KeepAlive: 15 * time.Second}
		c, err := d.Dial("tcp", addr)
		if err == nil {
			return c, nil
		}
		left := time.Until(deadline)
		if left <= 0 {
			return nil, err
		}
		time.Sleep(min(backoff, left))
		backoff = min(2*backoff, time.Second)
	}
}

func (b *tcpBootstrap) Rank() int { return b.rank }
func (b *tcpBootstrap) Size() int { return b.size }

// AllGather sends data to rank 0, which answers every rank with every
// rank's data. It blocks until rank 0 has heard from every rank, at most
// the timeout. An error names the rank that failed and breaks the
// bootstrap: later calls return the same error.
func (b *tcpBootstrap) AllGather(data []byte) ([][]byte, error) {
	return b.collective("all-gather", data)
}

// Barrier is an all-gather of nothing.
func (b *tcpBootstrap) Barrier() error {
	_, err := b.collective("barrier", nil)
	return err
}

func (b *tcpBootstrap) collective(kind string, data []byte) ([][]byte, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed.Load() {
		return nil, status.Errorf(status.State, "bootstrap: %s after Close", kind)
	}
	if b.err != nil {
		return nil, b.err
	}
	if len(data) > MaxPayload {
		return nil, status.Errorf(status.Capacity, "bootstrap: %s of %d bytes exceeds the limit of %d", kind, len(data), MaxPayload)
	}
	b.seq++
	op := fmt.Sprintf("%s #%d", kind, b.seq)
	if b.size == 1 {
		return [][]byte{append([]byte{}, data...)}, nil
	}
	var out [][]byte
	var err error
	if b.rank == 0 {
		out, err = b.rootGather(op, data)
		if err != nil {
			b.failRoot(err)
		}
	} else {
		out, err = b.peerGather(op, data)
		if err != nil {
			b.root.Close() // rank 0 sees us leave and names us
		}
	}
	if err != nil {
		b.err = err
	}
	return out, err
}

type gatherResult struct {
	rank int
	msg  Message
	err  error
}

func (b *tcpBootstrap) rootGather(op string, data []byte) ([][]byte, error) {
	deadline := time.Now().Add(b.timeout)
	results := make(chan gatherResult, b.size-1)
	// Read every peer at once so the first one to fail is reported at once,
	// not after the ranks before it.
	for r := 1; r < b.size; r++ {
		c := b.peers[r]
		go func() {
			c.SetReadDeadline(deadline)
			m, err := Decode(c, MaxPayload)
			results <- gatherResult{r, m, err}
		}()
	}
	items := make([][]byte, b.size)
	items[0] = append([]byte{}, data...)
	for range b.size - 1 {
		g := <-results
		if g.err != nil {
			return nil, b.readError(g.rank, op, g.err)
		}
		if err := b.checkGather(g, op); err != nil {
			return nil, err
		}
		items[g.rank] = g.msg.Payload
	}
	payload := encodeList(items)
	if len(payload) > MaxPayload {
		return nil, status.Errorf(status.Capacity, "bootstrap: %s: result of %d bytes exceeds the limit of %d",
			op, len(payload), MaxPayload)
	}
	for r := 1; r < b.size; r++ {
		c := b.peers[r]
		c.SetWriteDeadline(deadline)
		if err := Encode(c, b.note(MsgGatherResult, b.seq, payload)); err != nil {
			return nil, b.writeError(r, op, err)
		}
	}
	return items, nil
}

func (b *tcpBootstrap) checkGather(g gatherResult, op string) error {
	m := g.msg
	if m.Type == MsgError {
		code, why := decodeError(m.Payload)
		return status.Errorf(code, "bootstrap: rank %d failed during %s: %s", g.rank, op, why)
	}
	if m.Type != MsgGather || int64(m.Rank) != int64(g.rank) || m.Token != b.token || int64(m.Size) != int64(b.size) {
		return status.Errorf(status.Bootstrap, "bootstrap: rank %d sent %s (rank %d, token %#x, world size %d) during %s",
			g.rank, m.Type, m.Rank, m.Token, m.Size, op)
	}
	if m.Seq != b.seq {
		return status.Errorf(status.Bootstrap, "bootstrap: rank %d is at collective #%d while rank 0 is at %s (ranks called in different orders?)",
			g.rank, m.Seq, op)
	}
	return nil
}

func (b *tcpBootstrap) peerGather(op string, data []byte) ([][]byte, error) {
	deadline := time.Now().Add(b.timeout)
	c := b.root
	c.SetWriteDeadline(deadline)
	if err := Encode(c, b.note(MsgGather, b.seq, data)); err != nil {
		return nil, b.writeError(0, op, err)
	}
	c.SetReadDeadline(deadline.Add(replyGrace(b.timeout)))
	m, err := Decode(c, MaxPayload)
	if err != nil {
		return nil, b.readError(0, op, err)
	}
	switch {
	case m.Type == MsgError:
		code, why := decodeError(m.Payload)
		return nil, status.Errorf(code, "bootstrap: rank %d: %s failed at rank 0: %s", b.rank, op, why)
	case m.Type != MsgGatherResult || m.Seq != b.seq:
		return nil, status.Errorf(status.Bootstrap, "bootstrap: rank 0 answered %s with %s #%d", op, m.Type, m.Seq)
	}
	items, err := decodeList(m.Payload, b.size)
	if err != nil {
		return nil, fmt.Errorf("bootstrap: rank 0 answered %s with a bad list: %w", op, err)
	}
	return items, nil
}

// readError turns a failed read from peer into an error that names it.
func (b *tcpBootstrap) readError(peer int, op string, err error) error {
	switch {
	case b.closed.Load() || errors.Is(err, net.ErrClosed):
		return status.Errorf(status.State, "bootstrap: closed during %s", op)
	case errors.Is(err, os.ErrDeadlineExceeded):
		if b.rank == 0 {
			return status.Errorf(status.Timeout, "bootstrap: rank %d never arrived at %s within %v", peer, op, b.timeout)
		}
		return status.Errorf(status.Timeout, "bootstrap: rank %d: rank 0 did not answer %s within %v",
			b.rank, op, b.timeout+replyGrace(b.timeout))
	case errors.Is(err, errBadMessage):
		return fmt.Errorf("bootstrap: rank %d sent a bad message during %s: %w", peer, op, err)
	default:
		return status.Errorf(status.Bootstrap, "bootstrap: rank %d closed the connection during %s (%v)", peer, op, err)
	}
}

func (b *tcpBootstrap) writeError(peer int, op string, err error) error {
	switch {
	case b.closed.Load() || errors.Is(err, net.ErrClosed):
		return status.Errorf(status.State, "bootstrap: closed during %s", op)
	case errors.Is(err, os.ErrDeadlineExceeded):
		return status.Errorf(status.Timeout, "bootstrap: rank %d did not take %s within %v", peer, op, b.timeout)
	default:
		return status.Errorf(status.Bootstrap, "bootstrap: rank %d closed the connection during %s (%v)", peer, op, err)
	}
}

// failRoot tells every connected peer why rank 0 failed, so that they fail
// with the same reason instead of timing out. It half-closes rather than
// closes: a full close with unread input would reset the connection and
// could discard the note before the peer reads it.
func (b *tcpBootstrap) failRoot(err error) {
	for _, c := range b.peers {
		if c == nil {
			continue
		}
		sendError(c, b.errorNote(b.seq), err)
		if tc, ok := c.(*net.TCPConn); ok {
			tc.CloseWrite()
		}
	}
}

func (b *tcpBootstrap) note(t MsgType, seq uint32, payload []byte) Message {
	return Message{Type: t, Token: b.token, Rank: uint32(b.rank), Size: uint32(b.size), Seq: seq, Payload: payload}
}

func (b *tcpBootstrap) errorNote(seq uint32) Message { return b.note(MsgError, seq, nil) }

// sendError is best effort: the peer may already be gone.
func sendError(c net.Conn, m Message, err error) {
	m.Payload = encodeError(err)
	c.SetWriteDeadline(time.Now().Add(errWriteGrace))
	Encode(c, m)
}

// Close closes every connection, which also interrupts a collective
// blocked in another goroutine. It does not wait for peers.
func (b *tcpBootstrap) Close() error {
	b.closeOnce.Do(func() {
		b.closed.Store(true)
		for _, c := range b.peers {
			if c != nil {
				c.Close()
			}
		}
		if b.root != nil {
			b.root.Close()
		}
	})
	return nil
}
