package channel

import (
	"fmt"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/proxy"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/symm"
)

// memState hands out memory channels' semaphores from symmetric pools:
// every rank takes the same slice of the same pool for the same set, so a
// word's address on the peer is known without an exchange. Slices are
// never reused, so each starts at zero (Alloc zeroes pools before any rank
// returns from it).
type memState struct {
	pool *symm.Buffer
	used uint64
}

// MemoryChannels builds a set of memory channels over [ptr, ptr+nbytes) of
// this rank's symmetric or registered device memory: entry r of the result
// is the channel to rank r, zero for this rank and for ranks of other nodes
// (their memory is out of reach). Collective over every rank. GPU backend
// only: on the CPU backend the error is status.Unsupported.
func (c *Channels) MemoryChannels(ptr uintptr, nbytes uint64) (uint64, []proxy.MemoryChannel, error) {
	if err := c.usable(); err != nil {
		return 0, nil, err
	}
	var local error
	var buf *symm.Buffer
	if !c.onGPU() {
		local = status.Errorf(status.Unsupported, "memory channels need the GPU backend (peer memory over CUDA IPC); use port channels")
	} else if local = c.registered(ptr, nbytes); local == nil {
		buf, _ = c.cfg.GPU.Space.Lookup(ptr, nbytes)
	}
	if err := c.agreeOnRange("memory channels", local, nbytes); err != nil {
		return 0, nil, err
	}
	sems, off, err := c.semaphores(uint64(16 * c.size))
	if err != nil {
		return 0, nil, fmt.Errorf("memory channels: %w", err)
	}
	g := c.cfg.GPU
	timeoutNs := uint64(c.cfg.Timeout.Nanoseconds())
	out := make([]proxy.MemoryChannel, c.size)
	base := ptr - buf.Local
	for r := range c.size {
		if r == c.rank || !c.cfg.Topology.SameNode(r) {
			continue
		}
		if buf.Peers[r] == 0 || sems.Peers[r] == 0 {
			err = status.Errorf(status.Internal, "memory channels: rank %d of this node is not mapped", r)
			break
		}
		// Word s of a rank's slice counts the signals from rank s; words
		// size+s hold how many of them that rank has waited for.
		out[r] = proxy.MemoryChannel{
			Remote: buf.Peers[r] + base, Local: ptr, Packets: ptr,
			RemoteSem: sems.Peers[r] + off + uintptr(8*c.rank), Sem: sems.Local + off + uintptr(8*r),
			Expected: sems.Local + off + uintptr(8*(c.size+r)), Err: g.ErrWord, TimeoutNs: timeoutNs,
			Rank: int32(c.rank), Peer: int32(r),
		}
	}
	if err = bootstrap.Agree(c.cfg.Bootstrap, err); err != nil {
		return 0, nil, err
	}
	s := c.add(&set{kind: Memory, ptr: ptr, nbytes: nbytes})
	return s.id, out, nil
}

// semaphores returns a fresh slice of n bytes of a symmetric pool and its
// offset. Collective: a new pool is allocated on every rank at once.
func (c *Channels) semaphores(n uint64) (*symm.Buffer, uintptr, error) {
	m := &c.mem
	if m.pool == nil || m.used+n > m.pool.Size {
		err := c.cfg.GPU.Driver.EnsureContext(c.cfg.GPU.Device)
		if err = bootstrap.Agree(c.cfg.Bootstrap, err); err != nil {
			return nil, 0, err
		}
		pool, err := c.cfg.GPU.Space.Alloc(max(n, symm.Granularity))
		if err != nil {
			return nil, 0, fmt.Errorf("allocate semaphores: %w", err)
		}
		m.pool, m.used = pool, 0
	}
	off := m.used
	m.used += (n + 127) &^ 127 // each set's words on lines of their own
	return m.pool, uintptr(off), nil
}
