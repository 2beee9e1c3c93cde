package moe

import (
	"errors"
	"fmt"
	"math/rand"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/hostcoll"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
	"github.com/p2pcomm/p2pcomm/golib/transport/ucx/ucxtest"
)

// hostDevice is a StagedDevice whose "device" memory is host memory. Its
// copies wait in a queue until the stream is synchronized or an event is
// recorded after them, so that a path that read a download before waiting
// for it would read stale bytes. It keeps count of what it moved and of
// the pinned memory it holds, so that tests see the staged path's traffic.
type hostDevice struct {
	mu        sync.Mutex
	pinned    map[unsafe.Pointer][]byte
	queued    []func()
	kernels   []string // by handle - 1
	launched  []string // every launch's kernel
	copied    uint64   // bytes of every copy
	capturing bool
	hostFuncs int      // host functions launched
	graph     []func() // the steps recorded while capturing
}

func newHostDevice() *hostDevice { return &hostDevice{pinned: map[unsafe.Pointer][]byte{}} }

func (d *hostDevice) EnsureContext() error { return nil }
func (d *hostDevice) MemcpyAsync(dst, src uintptr, n uint64, _ uintptr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.copied += n
	d.enqueue(func() {
		copy(unsafe.Slice((*byte)(hostPtr(dst)), n), unsafe.Slice((*byte)(hostPtr(src)), n))
	})
	return nil
}

// enqueue queues f in stream order, or records it in the graph while
// capturing. The caller holds d.mu.
func (d *hostDevice) enqueue(f func()) {
	if d.capturing {
		d.graph = append(d.graph, f)
	} else {
		d.queued = append(d.queued, f)
	}
}

// record adds f (the test's own step, as an expert kernel) to the graph.
func (d *hostDevice) record(f func()) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.graph = append(d.graph, f)
}

// queueReplay queues a replay of the graph behind the queued steps, as a
// replay launched on the stream and not yet run.
func (d *hostDevice) queueReplay() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.queued = append(d.queued, d.graph...)
}

// replay runs the graph's steps once, in order.
func (d *hostDevice) replay() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, f := range d.graph {
		f()
	}
}

// run carries out the queued copies, in order.
func (d *hostDevice) run() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, f := range d.queued {
		f()
	}
	d.queued = nil
}

func (d *hostDevice) MemsetD8Async(uintptr, byte, uint64, uintptr) error { return nil }
func (d *hostDevice) StreamSynchronize(uintptr) error                    { d.run(); return nil }
func (d *hostDevice) StreamCreate(uint32) (uintptr, error)               { return 1, nil }
func (d *hostDevice) StreamDestroy(uintptr) error                        { return nil }
func (d *hostDevice) EventCreate(uint32) (cuda.Event, error)             { return 1, nil }
func (d *hostDevice) EventRecord(cuda.Event, uintptr) error              { d.run(); return nil }
func (d *hostDevice) StreamWaitEvent(uintptr, cuda.Event) error          { return nil }
func (d *hostDevice) EventSynchronize(cuda.Event) error                  { return nil }
func (d *hostDevice) EventDestroy(cuda.Event) error                      { return nil }
func (d *hostDevice) StreamCaptureStatus(uintptr) (cuda.CaptureStatus, error) {
	if d.capturing {
		return cuda.CaptureActive, nil
	}
	return cuda.CaptureNone, nil
}

func (d *hostDevice) MemAlloc(n uint64) (uintptr, error) {
	p, err := d.MemHostAlloc(n, 0)
	return uintptr(p), err
}

func (d *hostDevice) MemFree(p uintptr) error { return d.MemFreeHost(hostPtr(p)) }

func (d *hostDevice) MemHostDevicePointer(p unsafe.Pointer) (uintptr, error) { return uintptr(p), nil }
func (d *hostDevice) CtxSynchronize() error                                  { d.run(); return nil }

// LaunchHostFunc queues fn with the copies and kernels, or records it.
func (d *hostDevice) LaunchHostFunc(_ uintptr, fn func()) (func(), error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.hostFuncs++
	var released atomic.Bool // as with the driver: a released function runs nothing
	d.enqueue(func() {
		if !released.Load() {
			fn()
		}
	})
	return func() { released.Store(true) }, nil
}

func (d *hostDevice) LaunchHostFuncOnce(stream uintptr, fn func()) error {
	if d.capturing {
		return fmt.Errorf("a host function run once, launched while capturing")
	}
	_, err := d.LaunchHostFunc(stream, fn)
	return err
}

// KernelFunction hands out moe_staged.cu's kernels, which LaunchFunction
// runs on the host (in stream order, like the copies).
func (d *hostDevice) KernelFunction(file, expr string) (cuda.Function, error) {
	if file != stagedFile {
		return 0, fmt.Errorf("no kernels of %s here", file)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.kernels = append(d.kernels, expr)
	return cuda.Function(len(d.kernels)), nil
}

func (d *hostDevice) LaunchFunction(fn cuda.Function, _, _, _ uint32, _ uintptr, params []byte) error {
	var sp stagedParams
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&sp)), unsafe.Sizeof(sp)), params)
	d.mu.Lock()
	defer d.mu.Unlock()
	expr := d.kernels[fn-1]
	d.launched = append(d.launched, expr)
	d.enqueue(func() { runStagedKernel(expr, sp) })
	return nil
}

// runStagedKernel does on the host what moe_staged.cu's kernel expr does.
func runStagedKernel(expr string, sp stagedParams) {
	rb := int64(sp.RowPacks) * 16
	if sp.ItemsAt != 0 {
		sp.Items = min(max(*(*int64)(hostPtr(uintptr(sp.ItemsAt))), 0), sp.Items)
	}
	if expr == "moe_staged_expand" {
		for r := range sp.Items {
			from := r // no index: row r
			if sp.Index != 0 {
				from = int64(unsafe.Slice((*int32)(hostPtr(uintptr(sp.Index))), sp.Items)[r])
			}
			copy(unsafe.Slice((*byte)(hostPtr(uintptr(sp.Dst+uint64(r*rb)))), rb),
				unsafe.Slice((*byte)(hostPtr(uintptr(sp.Src+uint64(from*rb)))), rb))
		}
		return
	}
	index := unsafe.Slice((*int32)(hostPtr(uintptr(sp.Index))), max(sp.Items*int64(max(sp.TopK, 1)), 1))
	var dt, tr reduce.DType
	for d := range cTypes {
		for _, t := range []reduce.DType{reduce.Float32, d} {
			if _, e := stagedExprs(d, t); e == expr {
				dt, tr = d, t
			}
		}
	}
	K, H := int64(sp.TopK), rb/int64(dt.Size())
	weights := unsafe.Slice((*float32)(hostPtr(uintptr(sp.Weights))), sp.Items*K)
	acc, tmp := make([]float32, H), make([]float32, H)
	cb := H * int64(tr.Size())
	for i := range sp.Items {
		clear(acc)
		for k := range K {
			row := int64(index[i*K+k])
			if row < 0 {
				continue
			}
			widen(tmp, unsafe.Slice((*byte)(hostPtr(uintptr(sp.Src+uint64(row*rb)))), rb), dt)
			for e, v := range tmp {
				acc[e] += float32(weights[i*K+k] * v)
			}
		}
		narrow(unsafe.Slice((*byte)(hostPtr(uintptr(sp.Dst+uint64(i*cb)))), cb), acc, tr)
	}
}

func (d *hostDevice) MemHostAlloc(n uint64, _ uint32) (unsafe.Pointer, error) {
	b, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, err
	}
	p := unsafe.Pointer(&b[0])
	d.mu.Lock()
	d.pinned[p] = b
	d.mu.Unlock()
	return p, nil
}

func (d *hostDevice) MemFreeHost(p unsafe.Pointer) error {
	d.run() // as the driver's free, after the work queued before it
	d.mu.Lock()
	b, ok := d.pinned[p]
	delete(d.pinned, p)
	d.mu.Unlock()
	if !ok {
		return fmt.Errorf("free of %p, which is not pinned", p)
	}
	return unix.Munmap(b)
}

// onStagedNodes is a runner of staged EPs over simulated nodes of
// localSize ranks, each rank's EP on its own hostDevice (devs[rank]).
func onStagedNodes(localSize int, devs *[]*hostDevice) runner {
	return onStagedNodesOf(localSize, 0, devs)
}

// onStagedNodesWithin is onStagedNodes of one rank per node with waits
// bounded by timeout.
func onStagedNodesWithin(timeout time.Duration, devs *[]*hostDevice) runner {
	return onStagedNodesOf(1, timeout, devs)
}

func onStagedNodesOf(localSize int, timeout time.Duration, devs *[]*hostDevice) runner {
	return func(t *testing.T, world int, cfg func(rank int) Config, f func(rank int, ep *EP) error) []error {
		t.Helper()
		*devs = make([]*hostDevice, world)
		for r := range world {
			(*devs)[r] = newHostDevice()
		}
		return ranksWith(t, world, localSize, timeout, func(r int, g Group, c *hostcoll.Comm, cfg Config) (*EP, error) {
			return NewStaged(g, c, (*devs)[r], cfg)
		}, cfg, f)
	}
}

// onTwoNodeLayouts runs f as a subtest for 2 nodes of 1 rank and of 2.
func onTwoNodeLayouts(t *testing.T, f func(t *testing.T, world, local int)) {
	t.Helper()
	for _, l := range []struct{ world, local int }{{2, 1}, {4, 2}} {
		t.Run(fmt.Sprintf("%dx%d", l.world/l.local, l.local), func(t *testing.T) { f(t, l.world, l.local) })
	}
}

// GPU tensors across nodes go through pinned host memory and give the
// host path's bits: 2 nodes of 1 and of 2, eager and capturable, both
// transits; the kernels lay out the rows and make the partials where they
// take the configuration (not float64), the host otherwise; every pinned
// and device byte is given back when the EPs close.
func TestStagedAcrossNodesMatchesTheDocumentedOrderAndRounding(t *testing.T) {
	ucxtest.Need(t)
	onTwoNodeLayouts(t, func(t *testing.T, world, local int) {
		W := world
		for _, c := range []roundsCase{
			{W, 2 * W, 3, 24, 9, reduce.BFloat16, reduce.BFloat16, 0.2},
			{W, 2 * W, 8, 16, 6, reduce.Float32, reduce.Float32, 0.1},
			{W, 2 * W, 4, 1024, 40, reduce.BFloat16, reduce.Float32, 0.1}, // split among workers
			{W, 2 * W, 3, 8, 5, reduce.Float64, reduce.Float32, 0.1},
		} {
			var devs []*hostDevice
			checkRounds(t, onStagedNodes(local, &devs), []roundsCase{c})
			for r, d := range devs {
				if d.copied == 0 {
					t.Errorf("%s: rank %d: nothing went between device and host", c.dt, r)
				}
				if kernels := len(d.launched) > 0; kernels != (c.dt != reduce.Float64) {
					t.Errorf("%s: rank %d launched %v", c.dt, r, d.launched)
				}
				// Capturable calls the kernels take run in stream order; the others
				// wait for the host on the caller's thread.
				if ordered := d.hostFuncs > 0; ordered != (c.dt != reduce.Float64) {
					t.Errorf("%s: rank %d launched %d host functions", c.dt, r, d.hostFuncs)
				}
				if len(d.pinned) != 0 {
					t.Errorf("%s: rank %d: %d pinned or device buffers left after close", c.dt, r, len(d.pinned))
				}
			}
		}
	})
}

// Rejected calls fail on every rank and move nothing; every rank is usable
// after.
func TestStagedRejectedCallsMoveNothing(t *testing.T) {
	ucxtest.Need(t)
	var devs []*hostDevice
	checkRejected(t, onStagedNodes(1, &devs))
}

// A capturable dispatch, the experts and a capturable combine recorded in
// a CUDA graph give, at each replay, the rows and bits of the inputs the
// buffers hold then: new routing, new rows, uneven T (one rank none) and -1
// ids; 2 nodes of 1 and of 2. Nothing runs while recording.
func TestStagedGraphReplaysWithNewRouting(t *testing.T) {
	ucxtest.Need(t)
	onTwoNodeLayouts(t, func(t *testing.T, world, local int) {
		W, E, K, H, Tm := world, 2*world, 3, 24, 9
		dt, tr := reduce.BFloat16, reduce.Float32
		sizes := make([]int, W)
		for q := range sizes {
			sizes[q] = []int{Tm, 0, 1 + (5*q)%Tm}[min(q, 2)]
		}
		rounds := make([][]tokens, 3)
		for i := range rounds {
			for q := range W {
				rounds[i] = append(rounds[i], makeTokens(rand.New(rand.NewSource(int64(300+10*i+q))), sizes[q], H, E, K, dt, 0.2))
			}
		}
		cfg := func(int) Config {
			return Config{NumExperts: E, Hidden: H, MaxTokens: Tm, TopK: K, DType: dt, CombineDType: tr, Capturable: true}
		}
		var devs []*hostDevice
		lastY, lastRes := make([][]byte, W), make([]result, W)
		errs := onStagedNodes(local, &devs)(t, W, cfg, func(r int, ep *EP) error {
			d, T := devs[r], sizes[r]
			in := makeTokens(rand.New(rand.NewSource(1)), T, H, E, K, dt, 0) // the graph's input buffers
			y := make([]byte, T*H*dt.Size())
			// A capturable round outside the capture first, as a warm-up would.
			warm, err := dispatch(ep, in, T, true, 0)
			if err == nil {
				err = ep.Combine(&CombineArgs{ExpertOut: addr(expertOut(warm, H, dt)), ExpertRows: warm.rows, Y: addr(y),
					NumTokens: T, Capturable: true})
			}
			if err == nil {
				err = settled(ep)
			}
			if err != nil {
				return fmt.Errorf("warm-up: %w", err)
			}
			d.capturing = true
			res, err := dispatch(ep, in, T, true, 0)
			var out []byte
			if err == nil {
				out = make([]byte, len(res.x))
				d.record(func() { copy(out, expertOut(res, H, dt)) })
				err = ep.Combine(&CombineArgs{ExpertOut: addr(out), ExpertRows: res.rows, Y: addr(y), NumTokens: T, Capturable: true})
			}
			d.capturing = false
			if err != nil {
				return fmt.Errorf("recording: %w", err)
			}
			if len(d.queued) != 0 {
				return fmt.Errorf("%d steps ran outside the graph", len(d.queued))
			}
			// An eager round between recording and replays, its rows laid out by
			// the host (an output the kernels cannot address): the buffers the
			// graph holds stay where it recorded them.
			held := func() []uintptr {
				st := ep.staged
				return []uintptr{st.rows.p, st.index.p, st.info.p, st.in.p, st.counts.p, st.k.rows.p, st.k.index.p, st.items.dp}
			}
			before := held()
			if err := eagerMisalignedRound(ep, in, T, H, dt); err != nil {
				return fmt.Errorf("eager round: %w", err)
			}
			if after := held(); !slices.Equal(before, after) {
				return fmt.Errorf("a buffer the graph holds moved after the capture: %#x -> %#x", before, after)
			}
			for i, all := range rounds {
				copy(in.x, all[r].x)
				copy(in.idx, all[r].idx)
				copy(in.w, all[r].w)
				for j := range res.x {
					res.x[j] = 0xff // rows a replay does not write show up
				}
				d.replay()
				if err := ep.staged.failure(); err != nil {
					return fmt.Errorf("replay %d: %w", i, err)
				}
				if err := checkDispatch(res, all, r, W, E, K, H, dt); err != nil {
					return fmt.Errorf("replay %d: %w", i, err)
				}
				if want := emulate(all[r], r, W, E, K, H, dt, tr); string(y) != string(want) {
					return fmt.Errorf("replay %d: combine differs from the emulation", i)
				}
			}
			// A replay still queued as the EP closes runs first, its peers' with it.
			copy(in.x, rounds[0][r].x)
			copy(in.idx, rounds[0][r].idx)
			copy(in.w, rounds[0][r].w)
			clear(y)
			d.queueReplay()
			lastY[r], lastRes[r] = y, res
			return nil
		})
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		for r := range W {
			if err := checkDispatch(lastRes[r], rounds[0], r, W, E, K, H, dt); err != nil {
				t.Errorf("the replay queued as the EP closed: %v", err)
			}
			if string(lastY[r]) != string(emulate(rounds[0][r], r, W, E, K, H, dt, tr)) {
				t.Errorf("rank %d: the replay queued as the EP closed: combine differs from the emulation", r)
			}
		}
	})
}

// A host function that panics fails its call like any other failure: a
// panic in a replay's dispatch leaves counts of no row, one in its combine
// leaves y NaN, and the next call raises it.
func TestStagedPanickingHostFunction(t *testing.T) {
	ucxtest.Need(t)
	defer func() { hostStepHook = nil }()
	const W, E, K, H, Tm = 2, 4, 2, 16, 4
	dt := reduce.BFloat16
	for _, step := range []string{"dispatch", "combine"} {
		t.Run(step, func(t *testing.T) {
			cfg := func(int) Config {
				return Config{NumExperts: E, Hidden: H, MaxTokens: Tm, TopK: K, DType: dt, CombineDType: reduce.Float32,
					Capturable: true}
			}
			// Only replays run host functions, and only rank 0's panics.
			hostStepHook = func(rank int, s string) {
				if rank == 0 && s == step {
					panic("injected")
				}
			}
			var devs []*hostDevice
			errs := onStagedNodes(1, &devs)(t, W, cfg, func(r int, ep *EP) error {
				tk := makeTokens(rand.New(rand.NewSource(int64(r))), Tm, H, E, K, dt, 0)
				d, y := devs[r], make([]byte, Tm*H*dt.Size())
				d.capturing = true
				res, err := dispatch(ep, tk, Tm, true, 0)
				if err == nil {
					err = ep.Combine(&CombineArgs{ExpertOut: addr(expertOut(res, H, dt)), ExpertRows: res.rows, Y: addr(y),
						NumTokens: Tm, Capturable: true})
				}
				d.capturing = false
				if err != nil {
					return fmt.Errorf("recording: %w", err)
				}
				for i := range res.counts {
					res.counts[i] = -1
				}
				d.replay() // rank 1's host functions fail too: rank 0 stops answering
				if r == 0 {
					if err := ep.staged.failure(); !contains(err, "panicked: injected") {
						return fmt.Errorf("recorded failure %v, want the panic", err)
					}
					for i, c := range res.counts {
						if step == "dispatch" && c != 0 {
							return fmt.Errorf("counts[%d] = %d after a failed dispatch, want 0", i, c)
						}
					}
					for i, b := range y {
						if b != 0xff {
							return fmt.Errorf("y byte %d = %#x after a failed call, want NaN", i, b)
						}
					}
				}
				return nil
			})
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// eagerMisalignedRound is, outside a capture, a capturable dispatch of tk
// into rows 8 bytes off 16-byte alignment (the host lays out every
// possible row), then an eager dispatch and combine of such rows.
func eagerMisalignedRound(ep *EP, tk tokens, T, H int, dt reduce.DType) error {
	rb := H * dt.Size()
	R := ep.maxRecvRows
	off := make([]byte, R*int64(rb)+8)
	if _, err := ep.Dispatch(&DispatchArgs{X: addr(tk.x), TopkIdx: addr(tk.idx), TopkWeights: addr(tk.w), NumTokens: T,
		IdxBytes: 8, Capturable: true, Out: Rows{X: addr(off) + 8, Info: addr(make([]int32, 4*R)),
			Counts: addr(make([]int32, ep.numLocal+1)), Rows: R}}); err != nil {
		return fmt.Errorf("capturable: %w", err)
	}
	rows, err := ep.Dispatch(&DispatchArgs{X: addr(tk.x), TopkIdx: addr(tk.idx), TopkWeights: addr(tk.w), NumTokens: T, IdxBytes: 8})
	if err != nil {
		return err
	}
	x := make([]byte, rows*int64(rb)+8)
	res := result{x: x[8:], info: make([]int32, 4*rows), counts: make([]int32, ep.numLocal+1), rows: rows}
	if err := ep.Expand(Rows{X: addr(res.x), Info: addr(res.info), Counts: addr(res.counts), Rows: rows}, 0); err != nil {
		return err
	}
	out := expertOut(res, H, dt)
	shifted := make([]byte, len(out)+8)
	copy(shifted[8:], out)
	y := make([]byte, T*rb)
	return ep.Combine(&CombineArgs{ExpertOut: addr(shifted) + 8, ExpertRows: rows, Y: addr(y), NumTokens: T})
}

// Capturable calls run in stream order outside a capture too: queued, their
// host functions not yet run, an eager call after them waits for them, and
// both give their bits; a call still queued as the EP closes completes
// first, and every buffer goes back.
func TestStagedEagerCallAfterCallsInStreamOrder(t *testing.T) {
	ucxtest.Need(t)
	onTwoNodeLayouts(t, func(t *testing.T, world, local int) {
		W, E, K, H, Tm := world, 2*world, 3, 32, 6
		dt, tr := reduce.BFloat16, reduce.Float32
		sizes := make([]int, W)
		rounds := make([][]tokens, 2)
		for q := range W {
			sizes[q] = []int{Tm, 4, 0, 5}[q%4]
			for i := range rounds {
				rounds[i] = append(rounds[i], makeTokens(rand.New(rand.NewSource(int64(500+10*i+q))), sizes[q], H, E, K, dt, 0.2))
			}
		}
		cfg := func(int) Config {
			return Config{NumExperts: E, Hidden: H, MaxTokens: Tm, TopK: K, DType: dt, CombineDType: tr, Capturable: true}
		}
		kept := make([]result, W) // the outputs of calls queued as the EPs close
		var devs []*hostDevice
		errs := onStagedNodes(local, &devs)(t, W, cfg, func(r int, ep *EP) error {
			d, T, R := devs[r], sizes[r], ep.maxRecvRows
			rb := int64(H * dt.Size())
			queue := func(tk tokens) (result, error) {
				res := result{x: make([]byte, R*rb), info: make([]int32, 4*R), counts: make([]int32, ep.numLocal+1), rows: R}
				_, err := ep.Dispatch(&DispatchArgs{X: addr(tk.x), TopkIdx: addr(tk.idx), TopkWeights: addr(tk.w),
					NumTokens: T, IdxBytes: 8, Capturable: true,
					Out: Rows{X: addr(res.x), Info: addr(res.info), Counts: addr(res.counts), Rows: R}})
				return res, err
			}
			a := rounds[0][r]
			resA, err := queue(a)
			if err != nil {
				return fmt.Errorf("capturable dispatch: %w", err)
			}
			outA, yA := make([]byte, len(resA.x)), make([]byte, int64(T)*rb)
			d.mu.Lock()
			d.enqueue(func() { copy(outA, expertOut(resA, H, dt)) }) // the expert step, in stream order
			d.mu.Unlock()
			if err := ep.Combine(&CombineArgs{ExpertOut: addr(outA), ExpertRows: R, Y: addr(yA), NumTokens: T,
				Capturable: true}); err != nil {
				return fmt.Errorf("capturable combine: %w", err)
			}
			if d.hostFuncs == 0 || len(d.queued) == 0 {
				return fmt.Errorf("the capturable calls ran at once (%d host functions, %d steps queued)", d.hostFuncs, len(d.queued))
			}
			b := rounds[1][r]
			resB, err := dispatch(ep, b, T, false, 0)
			if err != nil {
				return fmt.Errorf("eager dispatch: %w", err)
			}
			if err := checkDispatch(resA, rounds[0], r, W, E, K, H, dt); err != nil {
				return fmt.Errorf("capturable dispatch: %w", err)
			}
			if string(yA) != string(emulate(a, r, W, E, K, H, dt, tr)) {
				return fmt.Errorf("the capturable combine differs from the emulation")
			}
			if err := checkDispatch(resB, rounds[1], r, W, E, K, H, dt); err != nil {
				return fmt.Errorf("eager dispatch: %w", err)
			}
			yB := make([]byte, int64(T)*rb)
			if err := ep.Combine(&CombineArgs{ExpertOut: addr(expertOut(resB, H, dt)), ExpertRows: resB.rows, Y: addr(yB),
				NumTokens: T}); err != nil {
				return fmt.Errorf("eager combine: %w", err)
			}
			if string(yB) != string(emulate(b, r, W, E, K, H, dt, tr)) {
				return fmt.Errorf("the eager combine differs from the emulation")
			}
			var err2 error
			if kept[r], err2 = queue(b); err2 != nil { // left queued as the EP closes
				return fmt.Errorf("last capturable dispatch: %w", err2)
			}
			return nil
		})
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		for r, d := range devs {
			if err := checkDispatch(kept[r], rounds[1], r, W, E, K, H, dt); err != nil {
				t.Errorf("the call queued as the EP closed: %v", err)
			}
			if len(d.queued) != 0 || len(d.pinned) != 0 {
				t.Errorf("rank %d: %d steps queued, %d pinned or device buffers left after close", r, len(d.queued), len(d.pinned))
			}
		}
	})
}

// Calls a CUDA graph cannot hold are refused on the rank that records
// them, before any exchange, and the EP goes on: an eager call, a
// capturable call of rows the kernels do not take (float64), and the first
// capturable call of an EP built eager (it makes the buffers).
func TestStagedRefusesWhatAGraphCannotHold(t *testing.T) {
	ucxtest.Need(t)
	const W, E, K, H, Tm = 2, 4, 2, 8, 4
	for _, c := range []struct {
		name       string
		dt         reduce.DType
		capturable bool // the call's mode (the EP is built eager)
		want       string
	}{
		{"eager", reduce.Float32, false, "CUDA graph"},
		{"float64", reduce.Float64, true, "CUDA graph"},
		{"first_capturable", reduce.Float32, true, "first capturable call"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var devs []*hostDevice
			errs := onStagedNodes(1, &devs)(t, W, sameConfig(E, H, Tm, K, c.dt), func(r int, ep *EP) error {
				tk := makeTokens(rand.New(rand.NewSource(int64(r))), Tm, H, E, K, c.dt, 0)
				devs[r].capturing = true
				_, err := dispatch(ep, tk, Tm, c.capturable, 0)
				devs[r].capturing = false
				if status.CodeOf(err) != status.Unsupported || !contains(err, c.want) {
					return fmt.Errorf("dispatch while capturing = %v, want Unsupported saying %q", err, c.want)
				}
				if len(devs[r].graph) != 0 {
					return fmt.Errorf("%d steps recorded before the refusal", len(devs[r].graph))
				}
				if _, err := dispatch(ep, tk, Tm, false, 0); err != nil {
					return fmt.Errorf("dispatch after the refusal: %w", err)
				}
				if c.name == "first_capturable" {
					// Made outside a capture once, the buffers let the next capture through.
					if _, err := dispatch(ep, tk, Tm, true, 0); err != nil {
						return fmt.Errorf("a capturable dispatch outside the capture: %w", err)
					}
					devs[r].capturing = true
					_, err := dispatch(ep, tk, Tm, true, 0)
					devs[r].capturing = false
					if err != nil {
						return fmt.Errorf("capture after a capturable call: %w", err)
					}
					if devs[r].hostFuncs == 0 {
						return fmt.Errorf("the capture recorded no host function")
					}
				}
				return nil
			})
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A rank that never comes to a replayed call: on the others its host
// function fails (the rank's endpoint closed, or the timeout), the result
// says no row arrived, and the next call raises the failure naming the
// rank.
func TestStagedReplayNamesAnAbsentRank(t *testing.T) {
	ucxtest.Need(t)
	const W, E, K, H, Tm = 2, 4, 2, 8, 4
	cfg := func(int) Config {
		return Config{NumExperts: E, Hidden: H, MaxTokens: Tm, TopK: K, DType: reduce.Float32, CombineDType: reduce.Float32,
			Capturable: true}
	}
	const absent = 1
	var devs []*hostDevice
	errs := onStagedNodesWithin(1500*time.Millisecond, &devs)(t, W, cfg, func(r int, ep *EP) error {
		tk := makeTokens(rand.New(rand.NewSource(int64(r))), Tm, H, E, K, reduce.Float32, 0)
		if _, err := dispatch(ep, tk, Tm, true, 0); err != nil {
			return fmt.Errorf("first dispatch: %w", err)
		}
		if r == absent {
			return nil
		}
		d, counts, rows := devs[r], []int32{-1, -1, -1}, ep.maxRecvRows
		a := &DispatchArgs{X: addr(tk.x), TopkIdx: addr(tk.idx), TopkWeights: addr(tk.w), NumTokens: Tm, IdxBytes: 8,
			Capturable: true, Out: Rows{X: addr(make([]byte, rows*H*4)), Info: addr(make([]int32, 4*rows)),
				Counts: addr(counts), Rows: rows}}
		d.capturing = true
		_, err := ep.Dispatch(a)
		d.capturing = false
		if err != nil {
			return fmt.Errorf("recording: %w", err)
		}
		d.replay()
		if counts[0] != 0 || counts[1] != 0 || counts[2] != 0 {
			return fmt.Errorf("counts %v without rank %d, want none", counts, absent)
		}
		if ep.staged.failure() == nil {
			return fmt.Errorf("the replay's failure was not recorded")
		}
		_, err = dispatch(ep, tk, Tm, true, 0)
		want := fmt.Sprintf("rank %d", absent)
		if status.CodeOf(err) != status.Timeout || !contains(err, want) {
			return fmt.Errorf("the call after = %v, want a timeout naming %q", err, want)
		}
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

// Rows the kernels cannot address 16 bytes at a time (a tensor view at an
// odd offset) take the host's layout and partials instead, with the same
// results: no staged kernel runs for them.
func TestStagedMisalignedRowsTakeTheHostPath(t *testing.T) {
	ucxtest.Need(t)
	const W, E, K, H, Tm = 2, 4, 2, 16, 6
	dt := reduce.BFloat16
	cfg := sameConfig(E, H, Tm, K, dt)
	all := make([]tokens, W)
	for q := range W {
		all[q] = makeTokens(rand.New(rand.NewSource(int64(7+q))), Tm, H, E, K, dt, 0)
	}
	rb := H * dt.Size()
	var devs []*hostDevice
	errs := onStagedNodes(1, &devs)(t, W, cfg, func(r int, ep *EP) error {
		a := &DispatchArgs{X: addr(all[r].x), TopkIdx: addr(all[r].idx), TopkWeights: addr(all[r].w), NumTokens: Tm, IdxBytes: 8}
		rows, err := ep.Dispatch(a)
		if err != nil {
			return err
		}
		// Room for the rows at an offset of 8 bytes: not 16-byte aligned.
		x := make([]byte, rows*int64(rb)+8)
		res := result{x: x[8:], info: make([]int32, 4*rows), counts: make([]int32, E/W+1), rows: rows}
		launched := len(devs[r].launched)
		if err := ep.Expand(Rows{X: addr(res.x), Info: addr(res.info), Counts: addr(res.counts), Rows: rows}, 0); err != nil {
			return err
		}
		if err := checkDispatch(res, all, r, W, E, K, H, dt); err != nil {
			return err
		}
		out := expertOut(res, H, dt)
		shifted := make([]byte, len(out)+8)
		copy(shifted[8:], out)
		y := make([]byte, Tm*rb)
		if err := ep.Combine(&CombineArgs{ExpertOut: addr(shifted) + 8, ExpertRows: rows, Y: addr(y), NumTokens: Tm}); err != nil {
			return err
		}
		if want := emulate(all[r], r, W, E, K, H, dt, reduce.Float32); string(y) != string(want) {
			return fmt.Errorf("rank %d: combine of misaligned rows differs from the emulation", r)
		}
		if got := devs[r].launched[launched:]; len(got) != 0 {
			return fmt.Errorf("rank %d: kernels ran on misaligned rows: %v", r, got)
		}
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

// A fixed buffer, whose address a CUDA graph may hold, refuses to grow
// instead of moving; others grow.
func TestFixedBufferNeverMoves(t *testing.T) {
	d := newHostDevice()
	b := growBuf{mapped: true, fixed: true}
	if err := b.reserve(d, 4096, 4096, "test"); err != nil {
		t.Fatal(err)
	}
	p, dp := b.p, b.dp
	if err := b.reserve(d, 8192, 8192, "test"); status.CodeOf(err) != status.Internal {
		t.Errorf("growing a fixed buffer = %v, want an internal error", err)
	}
	if b.p != p || b.dp != dp || dp == 0 {
		t.Errorf("the fixed buffer moved: %#x/%#x -> %#x/%#x", p, dp, b.p, b.dp)
	}
	u := growBuf{}
	if err := u.reserve(d, 4096, 8192, "test"); err != nil {
		t.Fatal(err)
	}
	if err := u.reserve(d, 8192, 8192, "test"); err != nil || u.cap < 8192 {
		t.Errorf("a buffer not fixed did not grow: %v, %d bytes", err, u.cap)
	}
	b.free(d)
	u.free(d)
}
