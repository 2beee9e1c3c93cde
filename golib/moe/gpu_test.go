package moe

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap/bootstraptest"
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// fakeGPU records what the kernel path asks of the GPU backend, in order,
// so that tests can check each call's launches without a device.
type fakeGPU struct {
	rank     int
	sms      int
	exprs    []string // KernelFunction's, by function id - 1
	steps    []string
	params   [][]byte // each launch's parameter bytes, in order
	allocs   int
	host     []byte  // MemHostAlloc's memory
	hostFill []int32 // what the kernels that write into pinned host memory put there
	side     uintptr
	quiet    bool        // record nothing (allocation counts)
	copies   [][3]uint64 // each device copy's destination, source and bytes
}

const fakeStream, fakeSide = 0x5000, 0x6000

func (f *fakeGPU) Alloc(nbytes int64) (uintptr, error) {
	f.allocs++
	return uintptr(f.allocs) << 32, nil
}

func (f *fakeGPU) PeerAddress(ptr uintptr, nbytes int64, rank int) (uintptr, error) {
	return ptr + uintptr(rank)<<40, nil
}

func (f *fakeGPU) StreamBarrier(stream uintptr, call collective.Call) error {
	if !f.quiet {
		f.step("barrier(%s) on %s", call, f.stream(stream))
	}
	return nil
}

func (f *fakeGPU) Check() error { return nil }
func (f *fakeGPU) SMCount() int { return f.sms }
func (f *fakeGPU) WaitInfo() (uintptr, uintptr, uint64) {
	return 0x7000, 0x8000, 60e9
}

func (f *fakeGPU) KernelFunction(file, expr string) (cuda.Function, error) {
	f.exprs = append(f.exprs, file+":"+expr)
	return cuda.Function(len(f.exprs)), nil
}

func (f *fakeGPU) LaunchFunction(fn cuda.Function, grid, block, shared uint32, stream uintptr, params []byte) error {
	if f.quiet {
		return nil
	}
	name := f.exprs[fn-1]
	name = name[strings.Index(name, ":")+1:]
	if i := strings.Index(name, "<"); i > 0 {
		name = name[:i]
	}
	if f.quiet {
		return nil
	}
	if !f.quiet {
		f.step("%s grid %d block %d shared %d on %s", name, grid, block, shared, f.stream(stream))
	}
	f.params = append(f.params, append([]byte(nil), params...))
	// The kernels that write into pinned host memory: what they would find.
	switch name {
	case "moe_dispatch_send":
		f.fillHost(uintptr(decode[dispatchParams](params).CountsHost))
	case "moe_post_status":
		f.fillHost(uintptr(decode[postParams](params).HostStatus))
	}
	return nil
}

// fillHost copies hostFill to host memory at p (0: none).
func (f *fakeGPU) fillHost(p uintptr) {
	if p != 0 && len(f.host) > 0 && p == uintptr(unsafe.Pointer(&f.host[0])) {
		copy(unsafe.Slice((*int32)(unsafe.Pointer(&f.host[0])), len(f.host)/4), f.hostFill)
	}
}

func (f *fakeGPU) stream(s uintptr) string {
	switch s {
	case fakeStream:
		return "main"
	case f.side:
		return "side"
	}
	return fmt.Sprintf("stream %#x", s)
}

func (f *fakeGPU) step(format string, args ...any) {
	if f.quiet {
		return
	}
	f.steps = append(f.steps, fmt.Sprintf(format, args...))
}

func (f *fakeGPU) EnsureContext() error { return nil }
func (f *fakeGPU) MemcpyAsync(dst, src uintptr, n uint64, stream uintptr) error {
	if !f.quiet {
		f.step("copy %d bytes on %s", n, f.stream(stream))
		f.copies = append(f.copies, [3]uint64{uint64(dst), uint64(src), n})
	}
	return nil
}
func (f *fakeGPU) MemsetD8Async(p uintptr, v byte, n uint64, stream uintptr) error { return nil }
func (f *fakeGPU) StreamSynchronize(stream uintptr) error {
	if stream != 0 {
		if !f.quiet {
			f.step("wait for %s", f.stream(stream))
		}
	}
	return nil
}
func (f *fakeGPU) StreamCreate(flags uint32) (uintptr, error) {
	f.side = fakeSide
	return fakeSide, nil
}
func (f *fakeGPU) StreamDestroy(uintptr) error { return nil }
func (f *fakeGPU) EventCreate(uint32) (cuda.Event, error) {
	return cuda.Event(0x100 + len(f.steps)), nil
}
func (f *fakeGPU) EventRecord(ev cuda.Event, stream uintptr) error {
	if !f.quiet {
		f.step("record on %s", f.stream(stream))
	}
	return nil
}
func (f *fakeGPU) StreamWaitEvent(stream uintptr, ev cuda.Event) error {
	if !f.quiet {
		f.step("%s waits", f.stream(stream))
	}
	return nil
}
func (f *fakeGPU) EventSynchronize(cuda.Event) error { f.step("wait for event"); return nil }
func (f *fakeGPU) EventDestroy(cuda.Event) error     { return nil }
func (f *fakeGPU) MemHostAlloc(n uint64, flags uint32) (unsafe.Pointer, error) {
	f.host = make([]byte, n)
	return unsafe.Pointer(&f.host[0]), nil
}
func (f *fakeGPU) MemFreeHost(unsafe.Pointer) error { return nil }

// fakeRanks builds an EP of cfg on world fake GPUs and runs f on each.
func fakeRanks(t *testing.T, world int, cfg Config, f func(rank int, ep *EP, g *fakeGPU) error) {
	t.Helper()
	bs := bootstraptest.NewMem(world)
	errs := make([]error, world)
	var wg sync.WaitGroup
	for r := range world {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g := &fakeGPU{rank: r, sms: 132}
			ep, err := NewGPU(bs[r], g, cfg)
			if err != nil {
				errs[r] = err
				return
			}
			g.steps, g.params = nil, nil
			errs[r] = f(r, ep, g)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

func decode[T any](b []byte) T { return *(*T)(unsafe.Pointer(&b[0])) }

func want(got, want []string) error {
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		return fmt.Errorf("steps:\n  %s\nwant:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
	return nil
}

var bf16Config = Config{NumExperts: 16, Hidden: 7168, MaxTokens: 4096, TopK: 8, DType: reduce.BFloat16,
	CombineDType: reduce.BFloat16}

func TestGPUEagerDispatchSteps(t *testing.T) {
	const blocks = 24
	tests := []struct {
		name  string
		T     int
		x     uintptr
		steps []string
	}{
		{"small batch: copied by the send kernel, no count kernel", 128, 0x9000, []string{
			"moe_post_status grid 1 block 512 shared 0 on main",
			"moe_dispatch_send grid 24 block 512 shared 4160 on main",
			"wait for main",
			"moe_dispatch_expand grid 24 block 512 shared 96 on main",
		}},
		{"x off 16-byte alignment: copy on the caller's stream", 256, 0x9002, []string{
			"moe_post_status grid 1 block 512 shared 0 on main",
			"copy 3670016 bytes on main",
			"moe_dispatch_send grid 24 block 512 shared 8256 on main",
			"wait for main",
			"moe_dispatch_expand grid 24 block 512 shared 96 on main",
		}},
		{"large batch: copied by the send kernel, count kernel", 4096, 0x9000, []string{
			"moe_post_status grid 1 block 512 shared 0 on main",
			"moe_dispatch_count grid 24 block 512 shared 72 on main",
			"moe_dispatch_send grid 24 block 512 shared 64 on main",
			"wait for main",
			"moe_dispatch_expand grid 24 block 512 shared 96 on main",
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fakeRanks(t, 2, bf16Config, func(r int, ep *EP, g *fakeGPU) error {
				// checks [W] then hdr [W, L+1]: rows of local experts 3 and 4 from each source.
				g.hostFill = []int32{0, 0, 7, 0, 0, 3, 0, 0, 0, 0, 1, 0}
				for call := range 2 {
					g.steps, g.params = nil, nil
					rows, err := ep.Dispatch(&DispatchArgs{X: tt.x, TopkIdx: 0xa000, TopkWeights: 0xb000, NumTokens: tt.T,
						IdxBytes: 8, Stream: fakeStream})
					if err != nil {
						return err
					}
					if rows != 4 {
						return fmt.Errorf("rows %d, want 4 (from hdr)", rows)
					}
					if err := ep.Expand(Rows{X: 0xc000, Info: 0xd000, Counts: 0xe000, Rows: rows}, fakeStream); err != nil {
						return err
					}
					if err := want(g.steps, tt.steps); err != nil {
						return err
					}
					post := decode[postParams](g.params[0])
					if post.Code != 0 || post.TopkIdx != 0xa000 || int(post.NumIDs) != tt.T*8 || post.IdxBytes != 8 ||
						post.IDCode != checkInvalidArg || post.PeerStatus[1]-post.PeerStatus[0] != 1<<40 ||
						post.Tag != int32(call+1) || post.Kind != kindDispatch || post.HostStatus != 0 ||
						post.Signal != 0x7000 || post.Err != 0x8000 || post.TimeoutNs != 60e9 {
						return fmt.Errorf("post %+v", post)
					}
					send := decode[dispatchParams](g.params[len(g.params)-2])
					stage := [2]uint64{}
					if tt.x == 0x9000 {
						stage = [2]uint64{0x9000, uint64(ep.gpu.xs)}
					}
					if [2]uint64{send.StageSrc, send.StageDst} != stage || send.CountsHost != uint64(uintptr(unsafe.Pointer(&g.host[0]))) {
						return fmt.Errorf("send stages %#x into %#x, counts into %#x", send.StageSrc, send.StageDst, send.CountsHost)
					}
					// Alternate calls post into alternate status rows.
					if wantStatus := uint64(ep.gpu.checks) + uint64(call*2*4); send.Status != wantStatus ||
						post.PeerStatus[r]-uint64(r)<<40 != wantStatus {
						return fmt.Errorf("call %d: status row %#x, peer table %#x, want %#x", call, send.Status, post.PeerStatus, wantStatus)
					}
					if send.Sync.Mode != syncArrive|blocks<<syncGridShift || send.Sync.Kind != kindDispatch || int(send.NumTokens) != tt.T ||
						send.Counted != b2i(tt.T == 4096) || send.IDsShared != b2i(tt.T <= 256) {
						return fmt.Errorf("send %+v", send)
					}
					ex := decode[expandParams](g.params[len(g.params)-1])
					if ex.RowCap != 4 || ex.OutInfo != 0xd000 || ex.Sync.Mode != blocks<<syncGridShift {
						return fmt.Errorf("expand %+v", ex)
					}
				}
				return nil
			})
		})
	}
}

// capturableStagedSteps is a capturable dispatch of x staged on the side
// stream (bf16Config's grid), with copies between the gate and the flags.
func capturableStagedSteps(copies ...string) []string {
	steps := []string{"record on main", "side waits", "moe_dispatch_send grid 24 block 512 shared 576 on main",
		"moe_stage_gate grid 1 block 32 shared 0 on side"}
	steps = append(steps, copies...)
	return append(steps, "moe_stage_done grid 1 block 32 shared 0 on side", "record on side", "main waits",
		"moe_dispatch_expand grid 24 block 512 shared 96 on main")
}

func TestGPUCapturableDispatchSteps(t *testing.T) {
	fakeRanks(t, 2, bf16Config, func(r int, ep *EP, g *fakeGPU) error {
		out := Rows{X: 0xc000, Info: 0xd000, Counts: 0xe000, Rows: ep.maxRecvRows}
		// x staged: its copy on the side stream, between the gate and the staged flags.
		if _, err := ep.Dispatch(&DispatchArgs{X: 0x9000, TopkIdx: 0xa000, TopkWeights: 0xb000, NumTokens: 16, IdxBytes: 4,
			Capturable: true, Stream: fakeStream, Out: out}); err != nil {
			return err
		}
		if err := want(g.steps, capturableStagedSteps("copy 229376 bytes on side")); err != nil {
			return err
		}
		send := decode[dispatchParams](g.params[0])
		if send.Sync.Mode != syncStart|syncArrive|syncStageGo|24<<syncGridShift || send.Status != 0 {
			return fmt.Errorf("staged send: mode %#x status %#x", send.Sync.Mode, send.Status)
		}
		if ex := decode[expandParams](g.params[3]); ex.Sync.Mode != syncWait|syncStaged|24<<syncGridShift || ex.RowCap != ep.maxRecvRows {
			return fmt.Errorf("expand mode %#x rows %d", ex.Sync.Mode, ex.RowCap)
		}
		// x built in the staging buffer: nothing to copy, the send kernel posts the staged flags.
		g.steps, g.params = nil, nil
		if _, err := ep.Dispatch(&DispatchArgs{X: ep.Info().Staging, TopkIdx: 0xa000, TopkWeights: 0xb000, NumTokens: 16,
			IdxBytes: 4, Capturable: true, Stream: fakeStream, Out: out}); err != nil {
			return err
		}
		if err := want(g.steps, []string{
			"moe_dispatch_send grid 24 block 512 shared 576 on main",
			"moe_dispatch_expand grid 24 block 512 shared 96 on main",
		}); err != nil {
			return err
		}
		if send := decode[dispatchParams](g.params[0]); send.Sync.Mode != syncStart|syncArrive|syncPostStaged|24<<syncGridShift {
			return fmt.Errorf("unstaged send: mode %#x", send.Sync.Mode)
		}
		if _, err := ep.Dispatch(&DispatchArgs{NumTokens: 1, IdxBytes: 4, Capturable: true, Out: Rows{Rows: 5}}); err == nil {
			return fmt.Errorf("a capturable dispatch took room for 5 rows")
		}
		return nil
	})
}

// fp8Placement is one way to pass an fp8 dispatch's T rows (7168 float8
// each) and their scales (56 float32): at 0x9000 and 0x9800, or built in
// xs (the rows at its start, the scales at xsScales); copies are what
// golib/moe then copies into xs, {dst, src, bytes}.
type fp8Placement struct {
	x, scales uintptr
	copies    [][3]uint64
}

func fp8Placements(ep *EP, T int) []fp8Placement {
	xs := ep.Info().Staging
	scalesAt := xs + 4096*7168
	rows := [3]uint64{uint64(xs), 0x9000, uint64(T) * 7168}
	scales := [3]uint64{uint64(scalesAt), 0x9800, uint64(T) * 56 * 4}
	return []fp8Placement{
		{0x9000, 0x9800, [][3]uint64{rows, scales}},
		{xs, 0x9800, [][3]uint64{scales}},
		{0x9000, scalesAt, [][3]uint64{rows}},
		{xs, scalesAt, nil},
	}
}

// fp8 dispatch stages the float8 rows and their scales apart in xs, each
// unless it was built there, and tells the expand kernel where each part
// sits and goes.
func TestGPUFP8DispatchSteps(t *testing.T) {
	c := bf16Config
	c.DispatchFP8 = true
	fakeRanks(t, 2, c, func(r int, ep *EP, g *fakeGPU) error {
		out := Rows{X: 0xc000, Scales: 0xc800, Info: 0xd000, Counts: 0xe000, Rows: ep.maxRecvRows}
		for _, tc := range fp8Placements(ep, 16) {
			g.steps, g.params, g.copies = nil, nil, nil
			if _, err := ep.Dispatch(&DispatchArgs{X: tc.x, Scales: tc.scales, TopkIdx: 0xa000, TopkWeights: 0xb000,
				NumTokens: 16, IdxBytes: 4, Capturable: true, Stream: fakeStream, Out: out}); err != nil {
				return err
			}
			steps := []string{"moe_dispatch_send grid 24 block 512 shared 576 on main",
				"moe_dispatch_expand grid 24 block 512 shared 96 on main"}
			if tc.copies != nil {
				var copies []string
				for _, c := range tc.copies {
					copies = append(copies, fmt.Sprintf("copy %d bytes on side", c[2]))
				}
				steps = capturableStagedSteps(copies...)
			}
			if err := want(g.steps, steps); err != nil {
				return err
			}
			ex := decode[expandParams](g.params[len(g.params)-1])
			if ex.OutX != 0xc000 || ex.OutScales != 0xc800 || ex.RowBytes != 7168 || ex.ScaleBytes != 224 ||
				ex.XsScales != 4096*7168 {
				return fmt.Errorf("expand %+v", ex)
			}
			if !reflect.DeepEqual(g.copies, tc.copies) {
				return fmt.Errorf("x %#x scales %#x: copies %#x, want %#x", tc.x, tc.scales, g.copies, tc.copies)
			}
			if send := decode[dispatchParams](g.params[0]); tc.copies == nil && send.Sync.Mode&syncPostStaged == 0 {
				return fmt.Errorf("rows and scales in place: send mode %#x does not post the staged flags", send.Sync.Mode)
			}
		}
		// Without scales, or without room for the received ones: refused.
		if _, err := ep.Dispatch(&DispatchArgs{X: 0x9000, TopkIdx: 0xa000, TopkWeights: 0xb000, NumTokens: 16, IdxBytes: 4,
			Capturable: true, Stream: fakeStream, Out: out}); status.CodeOf(err) != status.InvalidArgument {
			return fmt.Errorf("dispatch without scales: %v", err)
		}
		out.Scales = 0
		if _, err := ep.Dispatch(&DispatchArgs{X: 0x9000, Scales: 0x9800, TopkIdx: 0xa000, TopkWeights: 0xb000, NumTokens: 16,
			IdxBytes: 4, Capturable: true, Stream: fakeStream, Out: out}); status.CodeOf(err) != status.InvalidArgument {
			return fmt.Errorf("dispatch without room for scales: %v", err)
		}
		return nil
	})
}

// A rank that rejects its arguments still takes part: the status kernel
// (the start barrier) and the send kernel (whose blocks count calls and run
// the middle barrier), with no tokens, and no copy; the call returns no
// rows and every rank's checks.
func TestGPURejectedDispatchSteps(t *testing.T) {
	fakeRanks(t, 2, bf16Config, func(r int, ep *EP, g *fakeGPU) error {
		g.hostFill = []int32{0, 2, 0, 0}
		check := int32(0)
		if r == 1 {
			check = 2
		}
		rows, err := ep.Dispatch(&DispatchArgs{X: 0x9000, TopkIdx: 0xa000, TopkWeights: 0xb000, NumTokens: 64, IdxBytes: 8,
			Check: check, Stream: fakeStream})
		if err != nil {
			return err
		}
		if rows != 0 || ep.Checks()[1] != 2 {
			return fmt.Errorf("rows %d checks %v", rows, ep.Checks())
		}
		if ep.Expand(Rows{}, fakeStream) == nil {
			return fmt.Errorf("expand after a rejected dispatch")
		}
		steps := []string{
			"moe_post_status grid 1 block 512 shared 0 on main",
			"moe_dispatch_send grid 24 block 512 shared 2112 on main",
			"wait for main",
		}
		if r == 1 {
			steps = []string{"moe_post_status grid 1 block 512 shared 0 on main",
				"moe_dispatch_send grid 24 block 512 shared 64 on main", "wait for main"}
			post := decode[postParams](g.params[0])
			send := decode[dispatchParams](g.params[1])
			if post.Code != 2 || post.TopkIdx != 0 || send.NumTokens != 0 || send.TopkIdx != 0 || send.IDsShared != 0 {
				return fmt.Errorf("post %+v send %+v", post, send)
			}
		}
		return want(g.steps, steps)
	})
}

func TestGPUCombineSteps(t *testing.T) {
	tests := []struct {
		name       string
		world      int
		cfg        func(*Config)
		T          int
		capturable bool
		steps      []string
		reduceExpr string
	}{
		{"eager, small batch", 2, nil, 128, false, []string{
			"moe_post_status grid 1 block 512 shared 0 on main",
			"record on main",
			"moe_combine_send grid 24 block 512 shared 0 on main",
			"moe_combine_reduce grid 24 block 512 shared 0 on main",
			"wait for event",
		}, "moe_combine_reduce<bf16, bf16, 2>"},
		{"capturable, large batch of a world of 2: self-local", 2, nil, 4096, true, []string{
			"moe_combine_send grid 24 block 512 shared 0 on main",
			"moe_combine_reduce_self grid 24 block 512 shared 0 on main",
		}, ""},
		{"float32 partials: never self-local", 2, func(c *Config) { c.CombineDType = reduce.Float32 }, 4096, true, []string{
			"moe_combine_send grid 24 block 512 shared 0 on main",
			"moe_combine_reduce grid 24 block 512 shared 0 on main",
		}, "moe_combine_reduce<bf16, float, 2>"},
		{"self-local forced", 2, func(c *Config) { c.Tuning.SelfLocal = "always" }, 3, true, []string{
			"moe_combine_send grid 24 block 512 shared 0 on main",
			"moe_combine_reduce_self grid 6 block 512 shared 0 on main",
		}, ""},
		{"self-local off", 2, func(c *Config) { c.Tuning.SelfLocal = "never" }, 4096, true, []string{
			"moe_combine_send grid 24 block 512 shared 0 on main",
			"moe_combine_reduce grid 24 block 512 shared 0 on main",
		}, ""},
		{"four ranks: one group", 4, nil, 4096, true, []string{
			"moe_combine_send grid 24 block 512 shared 0 on main",
			"moe_combine_reduce grid 24 block 512 shared 0 on main",
		}, "moe_combine_reduce<bf16, bf16, 4>"},
		{"eight ranks: groups of four", 8, nil, 1, true, []string{
			"moe_combine_send grid 24 block 512 shared 0 on main",
			"moe_combine_reduce grid 2 block 512 shared 0 on main",
		}, "moe_combine_reduce<bf16, bf16, 0>"},
		{"no tokens: no reduce", 2, nil, 0, true, []string{
			"moe_combine_send grid 24 block 512 shared 0 on main",
		}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := bf16Config
			cfg.NumExperts = 2 * tt.world
			if tt.cfg != nil {
				tt.cfg(&cfg)
			}
			fakeRanks(t, tt.world, cfg, func(r int, ep *EP, g *fakeGPU) error {
				err := ep.Combine(&CombineArgs{ExpertOut: 0x9000, ExpertRows: 77, Y: 0xa000, NumTokens: tt.T,
					Capturable: tt.capturable, Stream: fakeStream})
				if err != nil {
					return err
				}
				if err := want(g.steps, tt.steps); err != nil {
					return err
				}
				i := 0
				if !tt.capturable {
					i = 1
					post := decode[postParams](g.params[0])
					if post.Kind != kindCombine || post.HostStatus != uint64(uintptr(unsafe.Pointer(&g.host[0]))) || post.Tag != 1 {
						return fmt.Errorf("post %+v", post)
					}
				}
				send := decode[combineParams](g.params[i])
				mode := int32(syncArrive | 24<<syncGridShift)
				if tt.capturable {
					mode |= syncStart
				}
				if send.Sync.Mode != mode || send.Sync.Kind != kindCombine || send.RowCap != 77 || int(send.NumTokens) != tt.T ||
					(send.SelfLocal == 1) != strings.Contains(strings.Join(tt.steps, " "), "reduce_self") {
					return fmt.Errorf("send %+v", send)
				}
				if len(g.params) > i+1 {
					if red := decode[combineParams](g.params[i+1]); red.Sync.Mode != syncWait|24<<syncGridShift {
						return fmt.Errorf("reduce mode %#x", red.Sync.Mode)
					}
				}
				if tt.reduceExpr != "" && !strings.Contains(strings.Join(g.exprs, " "), combineFile+":"+tt.reduceExpr) {
					return fmt.Errorf("kernels %v, want %s", g.exprs, tt.reduceExpr)
				}
				return nil
			})
		})
	}
}

// What a configuration the kernels cannot take says, on every rank.
func TestGPUConfigurationsTheKernelsRefuse(t *testing.T) {
	for _, tt := range []struct {
		name string
		cfg  func(*Config)
		want string
	}{
		{"float64", func(c *Config) { c.DType, c.CombineDType = reduce.Float64, reduce.Float64 }, "dtype float64"},
		{"row of 14 bytes", func(c *Config) { c.Hidden = 7 }, "not a multiple of 16"},
		{"topk 33", func(c *Config) { c.TopK = 33; c.NumExperts = 64 }, "topk=33"},
		{"4098 experts", func(c *Config) { c.NumExperts = 4098 }, "num_experts=4098"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := bf16Config
			tt.cfg(&cfg)
			bs := bootstraptest.NewMem(2)
			var wg sync.WaitGroup
			errs := make([]error, 2)
			for r := range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					_, errs[r] = NewGPU(bs[r], &fakeGPU{sms: 132}, cfg)
				}()
			}
			wg.Wait()
			for r, err := range errs {
				if err == nil || !strings.Contains(err.Error(), tt.want) {
					t.Errorf("rank %d: %v, want %q", r, err, tt.want)
				}
			}
		})
	}
}

// The thresholds that pick between paths giving the same bits can be moved
// (the tests of the Python package reach every path that way).
func TestGPUTuningOverrides(t *testing.T) {
	none, huge := int64(-1), int64(1)<<40
	cfg := bf16Config
	cfg.Tuning = Tuning{EagerKernelStageBytes: &none, CountKernelMinPairs: &none}
	fakeRanks(t, 2, cfg, func(r int, ep *EP, g *fakeGPU) error {
		if _, err := ep.Dispatch(&DispatchArgs{X: 0x9000, TopkIdx: 0xa000, TopkWeights: 0xb000, NumTokens: 1, IdxBytes: 8,
			Stream: fakeStream}); err != nil {
			return err
		}
		got := strings.Join(g.steps, "\n")
		if !strings.Contains(got, "moe_dispatch_count grid") || !strings.Contains(got, "copy 14336 bytes on main") {
			return fmt.Errorf("one token with both thresholds below it: %s", got)
		}
		return nil
	})
	cfg.Tuning = Tuning{EagerKernelStageBytes: &huge, CountKernelMinPairs: &huge}
	fakeRanks(t, 2, cfg, func(r int, ep *EP, g *fakeGPU) error {
		if _, err := ep.Dispatch(&DispatchArgs{X: 0x9000, TopkIdx: 0xa000, TopkWeights: 0xb000, NumTokens: 4096, IdxBytes: 8,
			Stream: fakeStream}); err != nil {
			return err
		}
		got := strings.Join(g.steps, "\n")
		if strings.Contains(got, "moe_dispatch_count grid") || strings.Contains(got, "copy") {
			return fmt.Errorf("4096 tokens with both thresholds out of reach: %s", got)
		}
		return nil
	})
}

// An eager fp8 dispatch copies its rows and their scales on the caller's
// stream (the send kernel copies rows of the ep's dtype only), and never on
// the side stream: only a capturable call's staged flags cover such a copy;
// nothing that was built in the buffer.
func TestGPUEagerFP8DispatchCopiesInLine(t *testing.T) {
	c := bf16Config
	c.DispatchFP8 = true
	fakeRanks(t, 2, c, func(r int, ep *EP, g *fakeGPU) error {
		g.hostFill = []int32{0, 0}
		for _, T := range []int{16, 4096} {
			g.steps, g.params = nil, nil
			if _, err := ep.Dispatch(&DispatchArgs{X: 0x9000, Scales: 0x9800, TopkIdx: 0xa000, TopkWeights: 0xb000,
				NumTokens: T, IdxBytes: 4, Stream: fakeStream}); err != nil {
				return err
			}
			copies := fmt.Sprintf("copy %d bytes on main\ncopy %d bytes on main", T*7168, T*56*4)
			if got := strings.Join(g.steps, "\n"); !strings.Contains(got, copies) || strings.Contains(got, "side") {
				return fmt.Errorf("%d tokens: %s", T, got)
			}
			if send := decode[dispatchParams](g.params[len(g.params)-1]); send.StageSrc != 0 {
				return fmt.Errorf("%d tokens: the send kernel stages %#x", T, send.StageSrc)
			}
		}
		// Rows or scales built in the buffer are not copied; what is copied
		// runs between the start barrier (moe_post_status) and the send kernel.
		for _, tc := range fp8Placements(ep, 256) {
			g.steps, g.params, g.copies = nil, nil, nil
			if _, err := ep.Dispatch(&DispatchArgs{X: tc.x, Scales: tc.scales, TopkIdx: 0xa000, TopkWeights: 0xb000,
				NumTokens: 256, IdxBytes: 8, Stream: fakeStream}); err != nil {
				return err
			}
			if !reflect.DeepEqual(g.copies, tc.copies) {
				return fmt.Errorf("x %#x scales %#x: copies %#x, want %#x", tc.x, tc.scales, g.copies, tc.copies)
			}
			// The copies run on main between the start barrier and the send kernel.
			send := -1
			for i, step := range g.steps {
				if strings.HasPrefix(step, "moe_dispatch_send") {
					send = i
				}
			}
			if len(g.steps) == 0 || !strings.HasPrefix(g.steps[0], "moe_post_status") || send != 1+len(tc.copies) {
				return fmt.Errorf("x %#x scales %#x: steps %q", tc.x, tc.scales, g.steps)
			}
			for _, step := range g.steps[1:send] {
				if !strings.HasPrefix(step, "copy ") || !strings.HasSuffix(step, " on main") {
					return fmt.Errorf("x %#x scales %#x: steps %q", tc.x, tc.scales, g.steps)
				}
			}
		}
		return nil
	})
}

// Eager calls, the host-bound ones, allocate nothing on the way to the
// device: parameter blocks are filled in place and kernels resolved once.
func TestGPUCallsDoNotAllocate(t *testing.T) {
	fakeRanks(t, 1, Config{NumExperts: 8, Hidden: 64, MaxTokens: 128, TopK: 8, DType: reduce.BFloat16,
		CombineDType: reduce.Float32}, func(r int, ep *EP, g *fakeGPU) error {
		g.quiet = true
		g.hostFill = []int32{0, 0, 3, 1, 2}
		dispatch := &DispatchArgs{X: 0x9000, TopkIdx: 0xa000, TopkWeights: 0xb000, NumTokens: 128, IdxBytes: 8, Stream: fakeStream}
		combine := &CombineArgs{ExpertOut: 0x9000, ExpertRows: 3, Y: 0xa000, NumTokens: 128, Stream: fakeStream}
		var err error
		allocs := testing.AllocsPerRun(50, func() {
			var rows int64
			if rows, err = ep.Dispatch(dispatch); err == nil {
				if err = ep.Expand(Rows{X: 0xc000, Info: 0xd000, Counts: 0xe000, Rows: rows}, fakeStream); err == nil {
					err = ep.Combine(combine)
				}
			}
		})
		if err != nil {
			return err
		}
		if allocs != 0 {
			return fmt.Errorf("%v allocations per eager dispatch and combine", allocs)
		}
		return nil
	})
}
