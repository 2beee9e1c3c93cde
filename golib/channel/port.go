package channel

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
	"github.com/p2pcomm/p2pcomm/golib/proxy"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/symm"
	"github.com/p2pcomm/p2pcomm/golib/transport"
	"github.com/p2pcomm/p2pcomm/golib/transport/cudaipc"
	"github.com/p2pcomm/p2pcomm/golib/transport/ucx"
)

// portState is what every port set shares: one proxy Service over the
// transports this rank's peers need, created at the first port set.
type portState struct {
	svc    *proxy.Service
	ucx    *ucx.Transport
	copier *ucx.CUDACopier // stages device memory for UCX; nil on CPU
	ipc    *cudaipc.Transport
	router *router
}

func (p *portState) close() error {
	var errs []error
	// The proxies stop first: they call into the transports. A proxy that
	// failed already told the calls that met its error; closing after it is
	// no new failure.
	if p.svc != nil {
		failed := p.svc.Err() != nil
		if err := p.svc.Close(); !failed {
			errs = append(errs, err)
		}
	}
	if p.ucx != nil {
		errs = append(errs, p.ucx.Close())
	}
	if p.copier != nil {
		errs = append(errs, p.copier.Close())
	}
	if p.ipc != nil {
		errs = append(errs, p.ipc.Close())
	}
	return errors.Join(errs...)
}

// portPeer is one peer's port channel in a set and where this rank reads
// the peer's signals.
type portPeer struct {
	ch      proxy.PortChannel
	fifo    *proxy.FIFO
	semHost *uint64 // the inbound semaphore as the host reads it; nil: device memory
}

// viaUCX says whether port channels reach rank r over UCX: always on the
// CPU backend, across nodes, and when forced; else the copy engine.
func (c *Channels) viaUCX(r int) bool {
	return !c.onGPU() || c.cfg.ForceUCX || !c.cfg.Topology.SameNode(r)
}

// needs reports which transports this rank's peers need. Every rank of a
// communicator needs UCX or none does: a rank with a peer on another node
// implies the same for every rank.
func (c *Channels) needs() (needUCX, needIPC bool) {
	for r := range c.size {
		if r == c.rank {
			continue
		}
		if c.viaUCX(r) {
			needUCX = true
		} else {
			needIPC = true
		}
	}
	return needUCX, needIPC
}

// ensurePort creates the transports and the Service. Collective the first
// time; a failure leaves nothing behind, so every rank may try again.
func (c *Channels) ensurePort() error {
	if c.port != nil {
		return nil
	}
	bs := c.cfg.Bootstrap
	needUCX, needIPC := c.needs()
	st := &portState{}
	if needUCX {
		if err := bootstrap.Agree(bs, ucx.Available(c.cfg.UCXDirs)); err != nil {
			return fmt.Errorf("port channels to peers on other nodes need UCX: %w", err)
		}
		opts := c.ucxOptions()
		if c.onGPU() {
			// UCX over tcp reaches device memory only through slow bounce
			// buffers: the transport stages it through pinned host memory
			// with this copier (its own stream on this GPU).
			g := c.cfg.GPU
			err := g.Driver.EnsureContext(g.Device)
			if err == nil {
				st.copier, err = ucx.NewCUDACopier(g.Driver)
			}
			if err = bootstrap.Agree(bs, err); err != nil {
				st.close()
				return fmt.Errorf("port channels: UCX staging: %w", err)
			}
			opts.Copier = st.copier
		}
		tr, err := ucx.Open(bs, opts)
		if err != nil {
			st.close()
			return fmt.Errorf("port channels: %w", err)
		}
		st.ucx = tr
	}
	if c.onGPU() {
		var err error
		if needIPC {
			st.ipc, err = c.newIPC()
		}
		if err = bootstrap.Agree(bs, err); err != nil {
			st.close()
			return fmt.Errorf("port channels: copy engine: %w", err)
		}
	}
	st.router = &router{byPeer: make([]transport.Transport, c.size)}
	for r := range c.size {
		switch {
		case r == c.rank:
		case c.viaUCX(r):
			st.router.byPeer[r] = st.ucx
		default:
			st.router.byPeer[r] = st.ipc
		}
	}
	st.router.ucx, st.router.ipc = st.ucx, st.ipc
	opts := proxy.Options{Timeout: c.cfg.Timeout}
	var alloc proxy.Allocator = &proxy.HostAllocator{}
	if g := c.cfg.GPU; g != nil {
		alloc = proxy.CUDAAllocator{Driver: g.Driver}
		opts.Bind = func() error { return g.Driver.EnsureContext(g.Device) }
	}
	svc, err := proxy.New(st.router, alloc, opts)
	if err != nil {
		st.close()
		return err
	}
	st.svc = svc
	c.port = st
	return nil
}

// PortChannels builds a set of port channels over [ptr, ptr+nbytes) of
// this rank's registered memory (device memory on the GPU backend, host
// memory on the CPU backend): entry r of the result is the channel to rank
// r, zero for this rank. Puts read this rank's range and write the same
// range of the peer's. Collective: every rank passes its own range of the
// same size. The first call opens the transports (UCX collectively).
func (c *Channels) PortChannels(ptr uintptr, nbytes uint64) (uint64, []proxy.PortChannel, error) {
	if err := c.usable(); err != nil {
		return 0, nil, err
	}
	local := c.registered(ptr, nbytes)
	if local == nil && nbytes-1 > proxy.MaxOffset {
		local = status.Errorf(status.InvalidArgument,
			"port channels over %d bytes: trigger offsets address at most %d bytes", nbytes, uint64(proxy.MaxOffset)+1)
	}
	if err := c.agreeOnRange("port channels", local, nbytes); err != nil {
		return 0, nil, err
	}
	if err := c.ensurePort(); err != nil {
		return 0, nil, err
	}
	id, lanes, err := c.addPort(ptr, nbytes, false, 1)
	if err != nil {
		return 0, nil, err
	}
	return id, lanes[0], nil
}

// HostPortChannels builds channels over buf, pinned host memory mapped into
// the device, on the GPU backend: lanes sets of channels that share one
// FIFO (one proxy thread) and each have semaphores of their own, so that
// each block of a kernel can count its own signals. Entry [k][r] is lane
// k's channel to rank r when r is on another node (UCX), zero otherwise. The proxy then
// moves the set's bytes with UCX alone, without a CUDA call: a kernel that
// waits for its own puts' peers (a collective across nodes) cannot be
// stalled by a proxy that waits for the device, which a synchronous copy, a
// module load or a cudaFree elsewhere in the process holds until running
// kernels end. Collective, like PortChannels; buf is this rank's own, of
// the same size on every rank.
func (c *Channels) HostPortChannels(buf *symm.HostBuffer, lanes int) (uint64, [][]proxy.PortChannel, error) {
	if err := c.usable(); err != nil {
		return 0, nil, err
	}
	var local error
	switch {
	case !c.onGPU():
		local = status.Errorf(status.Unsupported, "host port channels are for GPU communicators (CPU port channels are host memory already)")
	case buf == nil || buf.Host == nil || buf.Size == 0:
		local = status.Errorf(status.InvalidArgument, "host port channels over an empty buffer")
	case lanes < 1 || lanes > maxLanes:
		local = status.Errorf(status.InvalidArgument, "host port channels: %d lanes, want 1..%d", lanes, maxLanes)
	case buf.Size-1 > proxy.MaxOffset:
		local = status.Errorf(status.InvalidArgument,
			"port channels over %d bytes: trigger offsets address at most %d bytes", buf.Size, uint64(proxy.MaxOffset)+1)
	}
	var size uint64
	if buf != nil {
		size = buf.Size
	}
	if err := c.agreeOnRange("host port channels", local, size); err != nil {
		return 0, nil, err
	}
	if err := c.ensurePort(); err != nil {
		return 0, nil, err
	}
	return c.addPort(uintptr(buf.Host), buf.Size, true, lanes)
}

// maxLanes bounds the channel sets over one FIFO (each lane's semaphores
// are a word per rank).
const maxLanes = 64

// addPort builds lanes port channel sets over this rank's range (host
// memory mapped into the device when host, else the backend's memory) and
// adds them as one set; the host calls (Put, Wait, ...) use lane 0.
func (c *Channels) addPort(ptr uintptr, nbytes uint64, host bool, lanes int) (uint64, [][]proxy.PortChannel, error) {
	s, err := c.buildPort(ptr, nbytes, host, lanes)
	if err = bootstrap.Agree(c.cfg.Bootstrap, err); err != nil {
		return 0, nil, fmt.Errorf("port channels: %w", err)
	}
	c.add(s)
	out := make([][]proxy.PortChannel, lanes)
	for k := range out {
		out[k] = make([]proxy.PortChannel, c.size)
		for r := range c.size {
			if k == 0 {
				out[k][r] = s.port[r].ch
			} else {
				out[k][r] = s.lanes[k-1][r]
			}
		}
	}
	return s.id, out, nil
}

// portLocal is what one rank registers for a set: its data range and the
// words its peers' signals land in, with each transport it uses.
type portLocal struct {
	data    multiLocal
	ucxSem  transport.Local // host words peers signal over UCX
	ipcSem  transport.Local // device words peers signal over the copy engine
	semHost unsafe.Pointer  // UCX semaphores as the host reads them
	semUCX  uintptr         // their device-side address (== host address on CPU)
	semIPC  uintptr         // device semaphores (GPU)
	expect  uintptr         // expected counts, where the waiting side keeps them
}

// keys encodes the keys peers need: ok, then UCX data, UCX semaphores,
// copy-engine data, copy-engine semaphores, each length-prefixed.
func (l *portLocal) keys(ok bool) []byte {
	if !ok {
		return []byte{0}
	}
	var keys [][]byte
	for _, loc := range []transport.Local{l.data.ucx, l.ucxSem, l.data.ipc, l.ipcSem} {
		var k []byte
		if loc != nil {
			k = loc.Key()
		}
		keys = append(keys, k)
	}
	return transport.AppendKeys([]byte{1}, keys...)
}

// decodeKeys splits a peer's keys; ok is false when the peer failed.
func decodeKeys(r int, b []byte) (keys [4][]byte, ok bool, err error) {
	if len(b) == 0 || b[0] == 0 {
		return keys, false, nil
	}
	split, ok := transport.SplitKeys(b[1:], len(keys))
	if !ok {
		return keys, false, status.Errorf(status.Bootstrap, "rank %d sent truncated channel keys", r)
	}
	copy(keys[:], split)
	return keys, true, nil
}

// buildPort registers the set's memory, exchanges keys and fills every
// peer's channel. The all-gather runs whatever failed before it, so that
// no peer waits for this rank.
func (c *Channels) buildPort(ptr uintptr, nbytes uint64, host bool, lanes int) (*set, error) {
	st := c.port
	l, err := c.registerPort(ptr, nbytes, host, lanes)
	all, gerr := c.cfg.Bootstrap.AllGather(l.keys(err == nil))
	if err != nil {
		return nil, err
	}
	if gerr != nil {
		return nil, fmt.Errorf("exchange channel keys: %w", gerr)
	}
	s := &set{kind: Port, ptr: ptr, nbytes: nbytes, port: make([]portPeer, c.size)}
	for range lanes - 1 {
		s.lanes = append(s.lanes, make([]proxy.PortChannel, c.size))
	}
	fifo, err := st.svc.NewFIFO()
	if err != nil {
		return nil, err
	}
	src, err := st.svc.AddLocal(&l.data)
	if err != nil {
		return nil, err
	}
	var errWord uintptr
	if c.onGPU() {
		errWord = c.cfg.GPU.ErrWord
	}
	for r := range c.size {
		if r == c.rank || (host && !c.viaUCX(r)) {
			continue
		}
		keys, ok, err := decodeKeys(r, all[r])
		if err != nil || !ok {
			return nil, err // a failed peer reports its own error through Agree
		}
		var tr transport.Transport
		dataKey, semKey, sem, semHost := keys[0], keys[1], l.semUCX, (*uint64)(l.semHost)
		if c.viaUCX(r) {
			if st.ucx != nil {
				tr = st.ucx
			}
		} else {
			dataKey, semKey, sem, semHost = keys[2], keys[3], l.semIPC, nil
			if st.ipc != nil {
				tr = st.ipc
			}
		}
		if tr == nil || len(dataKey) == 0 || len(semKey) == 0 {
			return nil, status.Errorf(status.Mismatch, "rank %d registered no memory for the transport that connects it to rank %d", r, c.rank)
		}
		dst, err := tr.Remote(r, dataKey)
		if err != nil {
			return nil, fmt.Errorf("data range of rank %d: %w", r, err)
		}
		remoteSem, err := tr.Remote(r, semKey)
		if err != nil {
			return nil, fmt.Errorf("semaphores of rank %d: %w", r, err)
		}
		dstID, err := st.svc.AddRemote(dst)
		if err != nil {
			return nil, err
		}
		// Each sender owns one word of the receiver's semaphores (per
		// lane): the transports' signals need a single writer per word.
		for k := range lanes {
			word := uint64(8 * (k*c.size + c.rank))
			chID, err := st.svc.AddChannel(r, remoteSem, word)
			if err != nil {
				return nil, err
			}
			mine := uintptr(8 * (k*c.size + r))
			ch := proxy.PortChannel{
				FIFO: fifo.Handle(), Sem: sem + mine, Expected: l.expect + mine, Err: errWord,
				TimeoutNs: uint64(c.cfg.Timeout.Nanoseconds()), Channel: chID, DstMemory: dstID, SrcMemory: src,
				Rank: int32(c.rank), Peer: int32(r),
			}
			if _, ok := tr.(transport.InlinePutter); ok && c.onGPU() && !host {
				ch.InlineMax, ch.SrcBase = min(c.cfg.InlineBytes, proxy.InlineBytes), ptr
			}
			if k > 0 {
				s.lanes[k-1][r] = ch
				continue
			}
			if semHost != nil {
				semHost = (*uint64)(unsafe.Add(unsafe.Pointer(semHost), mine))
			}
			s.port[r] = portPeer{fifo: fifo, semHost: semHost, ch: ch}
		}
	}
	return s, nil
}

// registerPort registers the set's data range with each transport this rank
// uses (UCX only for a host range on GPUs) and allocates its semaphores,
// zeroed, registered likewise.
func (c *Channels) registerPort(ptr uintptr, nbytes uint64, host bool, lanes int) (*portLocal, error) {
	st := c.port
	l := &portLocal{}
	words := uint64(8 * c.size * lanes) // bytes of semaphores
	kind := transport.HostMemory
	if c.onGPU() && !host {
		kind = transport.DeviceMemory
	}
	var err error
	if st.ucx != nil {
		if l.data.ucx, err = st.ucx.Register(ptr, nbytes, kind); err != nil {
			return l, fmt.Errorf("register the range with UCX: %w", err)
		}
	}
	if st.ipc != nil && !host {
		if l.data.ipc, err = st.ipc.Register(ptr, nbytes, kind); err != nil {
			return l, fmt.Errorf("register the range with the copy engine: %w", err)
		}
	}
	if !c.onGPU() {
		// Host words: semaphores, then expected counts.
		host, err := c.hostWords(2 * words)
		if err != nil {
			return l, err
		}
		l.semHost, l.semUCX, l.expect = host, uintptr(host), uintptr(host)+uintptr(words)
		l.ucxSem, err = st.ucx.Register(l.semUCX, words, transport.HostMemory)
		return l, err
	}
	g := c.cfg.GPU
	dev, err := c.deviceWords(2 * words)
	if err != nil {
		return l, err
	}
	// Device words: copy-engine semaphores (a spin on them stays in L2),
	// then expected counts.
	l.semIPC, l.expect = dev, dev+uintptr(words)
	if st.ipc != nil {
		if l.ipcSem, err = st.ipc.Register(l.semIPC, words, transport.DeviceMemory); err != nil {
			return l, fmt.Errorf("register semaphores with the copy engine: %w", err)
		}
	}
	if st.ucx != nil {
		// UCX signals land in host memory: pinned and mapped, so kernels
		// wait on its device address.
		hm, err := g.Space.HostMapped(words)
		if err != nil {
			return l, err
		}
		l.semHost, l.semUCX = hm.Host, hm.Device
		if l.ucxSem, err = st.ucx.Register(uintptr(hm.Host), words, transport.HostMemory); err != nil {
			return l, fmt.Errorf("register semaphores with UCX: %w", err)
		}
	}
	return l, nil
}

// hostWords maps n zeroed bytes outside the Go heap, unmapped at Close.
func (c *Channels) hostWords(n uint64) (unsafe.Pointer, error) {
	b, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, status.Errorf(status.Capacity, "map %d bytes of semaphores: %v", n, err)
	}
	c.freed = append(c.freed, func() error { return unix.Munmap(b) })
	return unsafe.Pointer(&b[0]), nil
}

// deviceWords allocates n zeroed bytes of device memory, freed at Close.
func (c *Channels) deviceWords(n uint64) (uintptr, error) {
	g := c.cfg.GPU
	if err := g.Driver.EnsureContext(g.Device); err != nil {
		return 0, err
	}
	p, err := g.Driver.MemAlloc(n)
	if err != nil {
		return 0, fmt.Errorf("allocate %d bytes of semaphores: %w", n, err)
	}
	c.freed = append(c.freed, func() error {
		if err := g.Driver.EnsureContext(g.Device); err != nil {
			return err
		}
		return g.Driver.MemFree(p)
	})
	if err := g.Driver.MemsetD8Async(p, 0, n, 0); err != nil {
		return 0, err
	}
	return p, g.Driver.StreamSynchronize(0)
}

// peer returns a port set's channel to rank peer.
func (c *Channels) peer(id uint64, peer int, op string) (*portPeer, error) {
	s, err := c.lookup(id, Port)
	if err != nil {
		return nil, err
	}
	if peer < 0 || peer >= c.size || peer == c.rank {
		return nil, status.Errorf(status.InvalidArgument, "port %s from rank %d to rank %d: not a peer (world of %d)", op, c.rank, peer, c.size)
	}
	if s.port[peer].fifo == nil {
		return nil, status.Errorf(status.InvalidArgument, "port %s from rank %d to rank %d: this set has no channel to it (host port sets reach only ranks on other nodes)", op, c.rank, peer)
	}
	return &s.port[peer], nil
}

// Put queues a copy of bytes from srcOff of this rank's range to dstOff of
// peer's, through the same FIFO kernels push to. It returns once queued;
// Flush completes it.
func (c *Channels) Put(id uint64, peer int, dstOff, srcOff, bytes uint64) error {
	p, err := c.peer(id, peer, "put")
	if err != nil {
		return err
	}
	n := c.sets[id-1].nbytes
	if dstOff > n || bytes > n-dstOff || srcOff > n || bytes > n-srcOff {
		return status.Errorf(status.InvalidArgument, "port put of %d bytes to rank %d from offset %d to offset %d: past the end of the %d-byte range",
			bytes, peer, srcOff, dstOff, n)
	}
	return c.push(p, peer, "put", proxy.Op{Type: proxy.TriggerPut, DstOffset: dstOff, SrcOffset: srcOff, Size: bytes})
}

// Signal queues one signal to peer, after this rank's earlier puts to it.
func (c *Channels) Signal(id uint64, peer int) error {
	p, err := c.peer(id, peer, "signal")
	if err != nil {
		return err
	}
	return c.push(p, peer, "signal", proxy.Op{Type: proxy.TriggerSignal})
}

func (c *Channels) push(p *portPeer, peer int, what string, op proxy.Op) error {
	op.Channel, op.DstMemory, op.SrcMemory = p.ch.Channel, p.ch.DstMemory, p.ch.SrcMemory
	if _, err := p.fifo.Push(op); err != nil {
		return fmt.Errorf("port %s from rank %d to rank %d: %w", what, c.rank, peer, err)
	}
	return nil
}

// Flush waits until every put and signal queued to peer so far has landed
// there, up to the timeout.
func (c *Channels) Flush(id uint64, peer int) error {
	p, err := c.peer(id, peer, "flush")
	if err != nil {
		return err
	}
	if err := p.fifo.Flush(p.ch.Channel); err != nil {
		return fmt.Errorf("port flush from rank %d to rank %d: %w", c.rank, peer, err)
	}
	return nil
}

// Wait blocks until peer has signalled this rank count times in all
// through the set, up to the timeout (status.Timeout naming the peer), or
// until the proxy failed.
func (c *Channels) Wait(id uint64, peer int, count uint64) error {
	p, err := c.peer(id, peer, "wait")
	if err != nil {
		return err
	}
	deadline := time.Now().Add(c.cfg.Timeout)
	var seen uint64
	for spin := 0; ; spin++ {
		if seen, err = c.loadSem(p); err != nil {
			return err
		}
		if seen >= count {
			return nil
		}
		if spin&63 == 63 {
			if err := c.port.svc.Err(); err != nil {
				return fmt.Errorf("port wait on rank %d for rank %d: the proxy failed: %w", c.rank, peer, err)
			}
			if time.Now().After(deadline) {
				return status.Errorf(status.Timeout,
					"port wait on rank %d for rank %d: %d signals arrived, want %d, after %v (P2PCOMM_TIMEOUT_MS)",
					c.rank, peer, seen, count, c.cfg.Timeout)
			}
			proxy.Nap()
		}
	}
}

// loadSem reads peer's signal count as the host sees it.
func (c *Channels) loadSem(p *portPeer) (uint64, error) {
	if p.semHost != nil {
		return atomic.LoadUint64(p.semHost), nil
	}
	g := c.cfg.GPU
	if err := g.Driver.EnsureContext(g.Device); err != nil {
		return 0, err
	}
	var b [8]byte
	if err := g.Driver.MemcpyDtoH(b[:], p.ch.Sem); err != nil {
		return 0, fmt.Errorf("read the semaphore of rank %d: %w", p.ch.Peer, err)
	}
	return binary.LittleEndian.Uint64(b[:]), nil
}

// multiLocal is one range registered with each transport in use; the
// router hands a put the registration of the transport it travels on.
type multiLocal struct {
	ucx, ipc transport.Local
}

func (m *multiLocal) part(t transport.Transport) transport.Local {
	if _, ok := t.(*ucx.Transport); ok {
		return m.ucx
	}
	return m.ipc
}

// Key is not exchanged: each transport's own key is (portLocal.keys).
func (m *multiLocal) Key() []byte { return nil }

// Size is the range's bytes.
func (m *multiLocal) Size() uint64 {
	if m.ucx != nil {
		return m.ucx.Size()
	}
	return m.ipc.Size()
}

// Close does nothing: the transports release registrations at their Close.
func (m *multiLocal) Close() error { return nil }

// router is the one transport a proxy Service runs on: it sends each call
// on the transport of the peer it goes to.
type router struct {
	byPeer []transport.Transport
	ucx    *ucx.Transport
	ipc    *cudaipc.Transport
}

func (r *router) Name() string {
	switch {
	case r.ucx != nil && r.ipc != nil:
		return "ucx+cudaipc"
	case r.ucx != nil:
		return "ucx"
	}
	return "cudaipc"
}

func (r *router) to(peer int) (transport.Transport, error) {
	if peer < 0 || peer >= len(r.byPeer) || r.byPeer[peer] == nil {
		return nil, status.Errorf(status.InvalidArgument, "no transport to rank %d", peer)
	}
	return r.byPeer[peer], nil
}

// Register is not used: ranges are registered with each transport.
func (r *router) Register(uintptr, uint64, transport.Memory) (transport.Local, error) {
	return nil, status.Errorf(status.Internal, "register through the router")
}

// Remote is not used: remotes come from each transport.
func (r *router) Remote(int, []byte) (transport.Remote, error) {
	return nil, status.Errorf(status.Internal, "remote through the router")
}

// source is the transport of dst's peer and src's registration with it.
func (r *router) source(dst transport.Remote, src transport.Local) (transport.Transport, transport.Local, error) {
	t, err := r.to(dst.Peer())
	if err != nil {
		return nil, nil, err
	}
	m, ok := src.(*multiLocal)
	if !ok {
		return nil, nil, status.Errorf(status.InvalidArgument, "put from a range the router did not register")
	}
	return t, m.part(t), nil
}

func (r *router) Put(dst transport.Remote, dstOff uint64, src transport.Local, srcOff, size uint64) error {
	t, l, err := r.source(dst, src)
	if err != nil {
		return err
	}
	return t.Put(dst, dstOff, l, srcOff, size)
}

// PutInline sends a kernel's inline put on its peer's transport, which
// takes them wherever a channel's InlineMax allowed them (UCX).
func (r *router) PutInline(dst transport.Remote, dstOff uint64, data []byte) error {
	t, err := r.to(dst.Peer())
	if err != nil {
		return err
	}
	ip, ok := t.(transport.InlinePutter)
	if !ok {
		return status.Errorf(status.InvalidArgument, "an inline put to rank %d, whose transport (%s) does not take them", dst.Peer(), t.Name())
	}
	return ip.PutInline(dst, dstOff, data)
}

// The proxy finds inline puts through the router: it must offer them.
var _ transport.InlinePutter = (*router)(nil)

// PutWithSignal sends a put and its signal on their peer's transport, as
// one call where that transport takes them so.
func (r *router) PutWithSignal(dst transport.Remote, dstOff uint64, src transport.Local, srcOff, size uint64,
	sem transport.Remote, semOff, value uint64) error {
	t, l, err := r.source(dst, src)
	if err != nil {
		return err
	}
	if ps, ok := t.(transport.PutSignaler); ok && sem.Peer() == dst.Peer() {
		return ps.PutWithSignal(dst, dstOff, l, srcOff, size, sem, semOff, value)
	}
	if err := t.Put(dst, dstOff, l, srcOff, size); err != nil {
		return err
	}
	return r.Signal(sem, semOff, value)
}

var _ transport.PutSignaler = (*router)(nil)

func (r *router) Signal(dst transport.Remote, dstOff uint64, value uint64) error {
	t, err := r.to(dst.Peer())
	if err != nil {
		return err
	}
	return t.Signal(dst, dstOff, value)
}

func (r *router) Flush(peer int) error {
	t, err := r.to(peer)
	if err != nil {
		return err
	}
	return t.Flush(peer)
}

// Progress advances UCX, whose targets move data only while they progress;
// the copy engine needs none.
func (r *router) Progress() (bool, error) {
	if r.ucx != nil {
		return r.ucx.Progress()
	}
	return false, nil
}

// Close does nothing: portState closes the transports after the proxies.
func (r *router) Close() error { return nil }
