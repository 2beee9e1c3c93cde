package ucx

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport"
)

// childInvalid makes every kind of bad call, checks each error's code and
// text, then proves the transport still works.
func childInvalid(tr *Transport, bs bootstrap.Bootstrap, timeout time.Duration) error {
	j := newJob(tr, bs, timeout)
	if err := j.connect(); err != nil {
		return err
	}
	peer := 1 - j.rank
	dstKeys, err := bs.AllGather(j.lsrc.Key())
	if err != nil {
		return err
	}
	remoteSrc, err := tr.Remote(peer, dstKeys[peer])
	if err != nil {
		return err
	}
	unaligned := func() error { return tr.Signal(j.rword[peer], 4, 1) }
	tests := []struct {
		name string
		call func() error
		code status.Code
		text string
	}{
		{"put past the remote's end", func() error {
			return tr.Put(remoteSrc, slotSize-10, j.lsrc, 0, 11)
		}, status.InvalidArgument, fmt.Sprintf("past the end of its %d-byte range", slotSize)},
		{"put past the source's end", func() error {
			return tr.Put(j.rdst[peer], 0, j.lsrc, slotSize, 1)
		}, status.InvalidArgument, "past the end of the local"},
		{"offset overflowing", func() error {
			return tr.Put(j.rdst[peer], ^uint64(0), j.lsrc, 0, 2)
		}, status.InvalidArgument, "past the end"},
		{"remote of oneself", func() error {
			_, err := tr.Remote(j.rank, dstKeys[j.rank])
			return err
		}, status.InvalidArgument, "cannot address its own memory"},
		{"key of another rank", func() error {
			_, err := tr.Remote(peer, dstKeys[j.rank])
			return err
		}, status.Mismatch, fmt.Sprintf("belongs to rank %d", j.rank)},
		{"garbage key", func() error {
			_, err := tr.Remote(peer, []byte("not a key at all, not at all, no"))
			return err
		}, status.InvalidArgument, "not a UCX key"},
		{"rank out of range", func() error { return tr.Flush(7) }, status.InvalidArgument, "rank 7 out of range"},
		{"unaligned signal", unaligned, status.InvalidArgument, "not an aligned word"},
		{"empty registration", func() error {
			_, err := tr.Register(0, 0, transport.HostMemory)
			return err
		}, status.InvalidArgument, "empty range"},
	}
	for _, tt := range tests {
		err := tt.call()
		if status.CodeOf(err) != tt.code || err == nil || !strings.Contains(err.Error(), tt.text) {
			return fmt.Errorf("%s: error %v (code %v), want code %v with %q", tt.name, err, status.CodeOf(err), tt.code, tt.text)
		}
	}
	if err := remoteSrc.Close(); err != nil {
		return err
	}
	if err := remoteSrc.Close(); err != nil {
		return fmt.Errorf("second Close of a remote: %v", err)
	}
	if err := tr.Put(remoteSrc, 0, j.lsrc, 0, 1); status.CodeOf(err) != status.State {
		return fmt.Errorf("put to a closed remote: %v, want code %v", err, status.State)
	}
	return j.exchangeConnected(2)
}

// exchangeConnected is exchange for a job already connected.
func (j *job) exchangeConnected(rounds int) error {
	connect := j.connect
	j.connect = func() error { return nil }
	defer func() { j.connect = connect }()
	return j.exchange(rounds)
}

// listeningPorts returns this process's listening TCP ports: the sockets
// of /proc/self/fd matched with listening entries of /proc/self/net/tcp*.
func listeningPorts() map[int]bool {
	inodes := map[string]bool{}
	fds, _ := filepath.Glob("/proc/self/fd/*")
	for _, fd := range fds {
		if l, err := os.Readlink(fd); err == nil && strings.HasPrefix(l, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]")] = true
		}
	}
	ports := map[int]bool{}
	for _, table := range []string{"/proc/self/net/tcp", "/proc/self/net/tcp6"} {
		f, err := os.Open(table)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		sc.Scan() // header
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			// local_address is HEX_IP:HEX_PORT, st 0A is LISTEN, inode is field 9.
			if len(fields) < 10 || fields[3] != "0A" || !inodes[fields[9]] {
				continue
			}
			if i := strings.LastIndexByte(fields[1], ':'); i >= 0 {
				if p, err := strconv.ParseUint(fields[1][i+1:], 16, 16); err == nil {
					ports[int(p)] = true
				}
			}
		}
		f.Close()
	}
	return ports
}

// childStray connects to every port UCX listens on and sends garbage, in
// several ways, then checks that transfers still verify.
func childStray(tr *Transport, bs bootstrap.Bootstrap, timeout time.Duration, before map[int]bool) error {
	var ports []int
	for p := range listeningPorts() {
		if !before[p] {
			ports = append(ports, p)
		}
	}
	fmt.Println("UCX listens on", ports)
	rng := rand.New(rand.NewPCG(uint64(bs.Rank()), 7))
	var conns []net.Conn
	for _, p := range ports {
		for kind := range 3 {
			c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", p), time.Second)
			if err != nil {
				continue
			}
			switch kind {
			case 0: // garbage, then hang up
				junk := make([]byte, 4096)
				for i := range junk {
					junk[i] = byte(rng.Uint32())
				}
				c.Write(junk)
				c.Close()
			case 1: // connect and vanish
				c.Close()
			case 2: // a plausible-looking small header, kept open
				c.Write([]byte{0xff, 0xff, 0xff, 0xff, 0, 0, 0, 1, 2, 3})
				conns = append(conns, c)
			}
		}
	}
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	// Let UCX's progress meet the strays before the traffic starts.
	deadline := time.Now().Add(200 * time.Millisecond)
	for time.Now().Before(deadline) {
		tr.Progress()
	}
	return newJob(tr, bs, timeout).exchange(3)
}

// childKill: the victim dies by SIGKILL while the others stream puts to it;
// each survivor's operation toward it must fail naming it, within the
// timeout, and the survivors must still exchange data among themselves.
func childKill(tr *Transport, bs bootstrap.Bootstrap, timeout time.Duration, victim int, mem transport.Memory) error {
	j := newJob(tr, bs, timeout)
	j.mem = mem
	if err := j.connect(); err != nil {
		return err
	}
	if err := tr.progressWhile(bs.Barrier); err != nil {
		return err
	}
	if j.rank == victim {
		deadline := time.Now().Add(100 * time.Millisecond)
		for time.Now().Before(deadline) {
			tr.Progress()
		}
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	start := time.Now()
	var err error
	for err == nil && time.Since(start) < 3*timeout {
		for k := 0; k < 8 && err == nil; k++ {
			err = tr.Put(j.rdst[victim], uint64(j.rank*slotSize), j.lsrc, 0, slotSize)
		}
		if err == nil {
			err = tr.Flush(victim)
		}
	}
	took := time.Since(start)
	if err == nil {
		return fmt.Errorf("puts to the killed rank %d kept succeeding for %v", victim, took)
	}
	if status.CodeOf(err) != status.Timeout || !strings.Contains(err.Error(), fmt.Sprintf("rank %d", victim)) {
		return fmt.Errorf("error %v (code %v), want code %v naming rank %d", err, status.CodeOf(err), status.Timeout, victim)
	}
	if took > timeout+2*time.Second {
		return fmt.Errorf("failure took %v, want within the %v timeout", took, timeout)
	}
	fmt.Printf("rank %d saw after %v: %v\n", j.rank, took.Round(time.Millisecond), err)
	if tr.Stripes() > 0 && tr.stage.peers[victim].striped == 0 {
		return fmt.Errorf("no chunk to the killed rank %d went through the stripes", victim)
	}
	// Every later call toward the victim fails at once with the same error.
	if err2 := tr.Flush(victim); status.CodeOf(err2) != status.Timeout {
		return fmt.Errorf("flush after the failure: %v, want code %v", err2, status.Timeout)
	}
	// Survivors still reach each other: one put, one signal each way. One
	// that saw the failure at once (its endpoint reset) waits for one that
	// saw it only at the timeout.
	j.timeout = 2*timeout + 2*time.Second
	var survivors []int
	for p := range j.size {
		if p != victim {
			survivors = append(survivors, p)
		}
	}
	for _, p := range survivors {
		if p == j.rank {
			continue
		}
		fillSource(j.src, j.rank, 99)
		if err := tr.Put(j.rdst[p], uint64(j.rank*slotSize), j.lsrc, 0, slotSize); err != nil {
			return err
		}
		if err := tr.Signal(j.rword[p], signalWord(j.rank), 1); err != nil {
			return err
		}
		if err := tr.Flush(p); err != nil {
			return err
		}
		if err := j.await(signalWord(p), 1, fmt.Sprintf("survivor rank %d", p)); err != nil {
			return err
		}
		want := make([]byte, slotSize)
		fillSource(want, p, 99)
		if string(j.dst[p*slotSize:(p+1)*slotSize]) != string(want) {
			return fmt.Errorf("data from survivor rank %d differs", p)
		}
		// Hold on until the other survivor has read ours too.
		if err := tr.Signal(j.rword[p], ackWord(j.rank), 1); err != nil {
			return err
		}
		if err := tr.Flush(p); err != nil {
			return err
		}
		if err := j.await(ackWord(p), 1, fmt.Sprintf("survivor rank %d's ack", p)); err != nil {
			return err
		}
		// And until its flush of that ack is through: a survivor that
		// closed as soon as it held the other's ack would reset the
		// connection under that flush. This last signal (on the signal
		// word, which the peer has done waiting for) is not flushed; the
		// close below flushes it where the peer is still there.
		if err := tr.Signal(j.rword[p], signalWord(j.rank), 1); err != nil {
			return err
		}
		if err := j.await(signalWord(p), 2, fmt.Sprintf("survivor rank %d's last signal", p)); err != nil {
			return err
		}
	}
	return tr.CloseAfterFlush(survivors, timeout)
}
