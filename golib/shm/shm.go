// Package shm maps POSIX shared-memory segments (files in /dev/shm) that the
// ranks of one job on one host share.
package shm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// Dir is where segments live; a variable so tests can use a temp dir.
var Dir = "/dev/shm"

// Prefix starts every segment name; CleanStale relies on it.
const Prefix = "p2pcomm."

// Name builds a segment name that embeds the owner's pid, so that a later
// job can tell a dead job's leftovers from a live one's.
func Name(job uint64, pid int, rest string) string {
	return fmt.Sprintf("%s%016x.%d.%s", Prefix, job, pid, rest)
}

// Segment is a mapped shared-memory file.
type Segment struct {
	Name string
	Data []byte
}

// Create makes a new segment of size bytes, reserving the memory up front:
// touching an unreserved page of a full tmpfs would kill the process with
// SIGBUS, so running out of room must fail here, as an error.
func Create(name string, size int) (*Segment, error) {
	path := filepath.Join(Dir, name)
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("create shared memory %s: %w", path, err)
	}
	defer unix.Close(fd)
	if err := unix.Fallocate(fd, 0, 0, int64(size)); err != nil {
		unix.Unlink(path)
		if errors.Is(err, unix.ENOSPC) {
			return nil, status.Errorf(status.Capacity,
				"cannot reserve %d bytes in %s: not enough room there; free space or lower P2PCOMM_STAGING_BYTES", size, Dir)
		}
		return nil, fmt.Errorf("reserve %d bytes for %s: %w", size, path, err)
	}
	seg, err := mapFd(fd, name, size)
	if err != nil {
		unix.Unlink(path)
	}
	return seg, err
}

// Open maps an existing segment created by a peer.
func Open(name string, size int) (*Segment, error) {
	path := filepath.Join(Dir, name)
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open shared memory %s: %w", path, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	if st.Size < int64(size) {
		return nil, status.Errorf(status.Mismatch, "shared memory %s has %d bytes, want %d", path, st.Size, size)
	}
	return mapFd(fd, name, size)
}

func mapFd(fd int, name string, size int) (*Segment, error) {
	data, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("map %s (%d bytes): %w", name, size, err)
	}
	return &Segment{Name: name, Data: data}, nil
}

// Unlink removes the name; mappings stay valid until unmapped. Peers unlink
// as soon as everyone has mapped, so nothing is left behind if a process dies.
func Unlink(name string) error {
	err := unix.Unlink(filepath.Join(Dir, name))
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	return err
}

// Close unmaps the segment. Idempotent.
func (s *Segment) Close() error {
	if s == nil || s.Data == nil {
		return nil
	}
	err := unix.Munmap(s.Data)
	s.Data = nil
	return err
}

// CleanStale removes segments whose owner process no longer exists and
// returns how many it removed.
func CleanStale() int {
	entries, err := os.ReadDir(Dir)
	if err != nil {
		return 0
	}
	removed := 0
	for _, e := range entries {
		pid, ok := ownerPid(e.Name())
		if !ok || Alive(pid) {
			continue
		}
		if os.Remove(filepath.Join(Dir, e.Name())) == nil {
			removed++
		}
	}
	return removed
}

func ownerPid(name string) (int, bool) {
	if !strings.HasPrefix(name, Prefix) {
		return 0, false
	}
	parts := strings.SplitN(strings.TrimPrefix(name, Prefix), ".", 3)
	if len(parts) < 3 {
		return 0, false
	}
	pid, err := strconv.Atoi(parts[1])
	return pid, err == nil && pid > 0
}

// Alive reports whether process pid exists (a zombie counts as dead).
func Alive(pid int) bool {
	err := syscall.Kill(pid, 0)
	if err != nil && !errors.Is(err, syscall.EPERM) {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return !errors.Is(err, os.ErrNotExist)
	}
	// Field 3 is the state; a zombie ('Z') has exited.
	if i := strings.LastIndexByte(string(b), ')'); i >= 0 && i+2 < len(b) {
		return b[i+2] != 'Z'
	}
	return true
}
