package cuda

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/cuda/internal/fakecu"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

func fakeDriver(t *testing.T, missing ...string) (*Driver, error) {
	t.Helper()
	fakecu.SetMissing(missing...)
	fakecu.SetInitResult(0)
	t.Cleanup(func() { fakecu.SetMissing(); fakecu.SetInitResult(0) })
	return newDriver(fakecu.Library{})
}

func TestNewDriverResolvesTable(t *testing.T) {
	d, err := fakeDriver(t)
	if err != nil {
		t.Fatalf("newDriver(fake) = %v, want nil error", err)
	}
	if got := d.Version(); got != 13000 {
		t.Errorf("Version() = %d, want 13000", got)
	}
	// Entries are pinned to the CUDA 12.0 ABI (those introduced later to their
	// own version) with legacy-stream semantics.
	if v, f := fakecu.LastProcQuery(); v != 12000 || f != getProcLegacyStream {
		t.Errorf("last cuGetProcAddress(version, flags) = (%d, %d), want (12000, %d)", v, f, getProcLegacyStream)
	}
	n, err := d.DeviceCount()
	if err != nil || n != 2 {
		t.Errorf("DeviceCount() = %d, %v; want 2, nil", n, err)
	}
	u, err := d.DeviceUUID(1)
	if err != nil || u[0] != 16 || u[15] != 31 {
		t.Errorf("DeviceUUID(1) = %v, %v; want bytes 16..31", u, err)
	}
	bus, err := d.DevicePCIBusID(1)
	if err != nil || bus != "0000:43:00.0" {
		t.Errorf("DevicePCIBusID(1) = %q, %v; want 0000:43:00.0", bus, err)
	}
}

func TestNewDriverFailures(t *testing.T) {
	tests := []struct {
		name     string
		missing  []string
		initCode int
		wantIs   error
		wantText string
	}{
		{"required entry missing", []string{"cuIpcOpenMemHandle"}, 0, ErrNoDriver, "cuIpcOpenMemHandle: not found"},
		{"cuInit fails", nil, 100, nil, "cuInit: CUDA_ERROR_FAKE (100)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fakecu.SetMissing(tt.missing...)
			fakecu.SetInitResult(tt.initCode)
			defer func() { fakecu.SetMissing(); fakecu.SetInitResult(0) }()
			_, err := newDriver(fakecu.Library{})
			if err == nil || !strings.Contains(err.Error(), tt.wantText) {
				t.Fatalf("newDriver() = %v, want error containing %q", err, tt.wantText)
			}
			if tt.wantIs != nil && !errors.Is(err, tt.wantIs) {
				t.Errorf("errors.Is(%v, %v) = false", err, tt.wantIs)
			}
			if tt.initCode != 0 && status.CodeOf(err) != status.CUDA {
				t.Errorf("status.CodeOf(%v) = %v, want CUDA", err, status.CodeOf(err))
			}
		})
	}
}

func TestOptionalEntryMissing(t *testing.T) {
	d, err := fakeDriver(t, "cuEventCreate", "cuStreamGetCaptureInfo")
	if err != nil {
		t.Fatalf("newDriver with optional entries missing = %v, want nil error", err)
	}
	if _, err := d.EventCreate(EventDefault); !errors.Is(err, ErrNotSupported) {
		t.Errorf("EventCreate() error = %v, want ErrNotSupported", err)
	}
	if _, _, err := d.StreamCaptureInfo(0); !errors.Is(err, ErrNotSupported) {
		t.Errorf("StreamCaptureInfo() error = %v, want ErrNotSupported", err)
	}
	// Present in the fake as a stub answering CUDA_ERROR_NOT_SUPPORTED.
	err = d.EventDestroy(1)
	var ce *Error
	if !errors.As(err, &ce) || ce.Code != 801 || ce.Call != "cuEventDestroy" || !errors.Is(err, ErrNotSupported) {
		t.Errorf("EventDestroy() error = %#v, want *Error{801, cuEventDestroy} matching ErrNotSupported", err)
	}
}

func TestMemoryThroughFake(t *testing.T) {
	d, err := fakeDriver(t)
	if err != nil {
		t.Fatal(err)
	}
	p, err := d.MemAlloc(64)
	if err != nil {
		t.Fatalf("MemAlloc(64) = %v", err)
	}
	defer d.MemFree(p)
	if err := d.MemsetD8Async(p, 0xAB, 64, 0); err != nil {
		t.Fatalf("MemsetD8Async = %v", err)
	}
	got := make([]byte, 64)
	if err := d.MemcpyDtoH(got, p); err != nil {
		t.Fatalf("MemcpyDtoH = %v", err)
	}
	if want := bytes.Repeat([]byte{0xAB}, 64); !bytes.Equal(got, want) {
		t.Errorf("MemcpyDtoH after memset 0xAB = %x, want %x", got, want)
	}
	var h IPCHandle
	h[0], h[63] = 5, 7
	base, err := d.IPCOpenMemHandle(h)
	if err != nil || base != 0x10000+12 {
		t.Errorf("IPCOpenMemHandle = %#x, %v; want %#x (64-byte handle passed by value)", base, err, 0x10000+12)
	}
	if f := fakecu.LastIPCFlags(); f != IPCLazyEnablePeerAccess {
		t.Errorf("cuIpcOpenMemHandle flags = %d, want %d", f, IPCLazyEnablePeerAccess)
	}
}

func TestErrorNameFromDriver(t *testing.T) {
	d, err := fakeDriver(t)
	if err != nil {
		t.Fatal(err)
	}
	_, err = d.MemAlloc(1 << 62) // the fake's malloc fails with CUDA_ERROR_OUT_OF_MEMORY
	if got, want := err.Error(), "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (2)"; got != want {
		t.Errorf("MemAlloc(huge) error = %q, want %q", got, want)
	}
}

// kernelArgs mirrors a device struct `struct Args { void* p; int n; float x; }`.
type kernelArgs struct {
	P uint64
	N int32
	X float32
}

func TestLaunchPassesStructByValue(t *testing.T) {
	d, err := fakeDriver(t)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	want := kernelArgs{P: 0xdeadbeef00, N: -3, X: 1.5}
	_ = binary.Write(&buf, binary.LittleEndian, want)
	fn := Function(fakecu.NewFunction(buf.Len()))
	if err := d.Launch(fn, 132, 512, 4096, 0x77, buf.Bytes()); err != nil {
		t.Fatalf("Launch = %v", err)
	}
	l := fakecu.LastLaunch()
	if l.Grid != [3]uint32{132, 1, 1} || l.Block != [3]uint32{512, 1, 1} || l.Shared != 4096 || l.Stream != 0x77 {
		t.Errorf("launch shape = grid %v block %v shared %d stream %#x; want [132 1 1] [512 1 1] 4096 0x77",
			l.Grid, l.Block, l.Shared, l.Stream)
	}
	var got kernelArgs
	_ = binary.Read(bytes.NewReader(l.Params), binary.LittleEndian, &got)
	if got != want {
		t.Errorf("kernel saw args %+v, want %+v", got, want)
	}
	if err := d.Launch(fn, 1, 1, 0, 0, nil); status.CodeOf(err) != status.InvalidArgument {
		t.Errorf("Launch(nil args) = %v, want InvalidArgument", err)
	}
}

func TestLaunchParams(t *testing.T) {
	d, err := fakeDriver(t)
	if err != nil {
		t.Fatal(err)
	}
	fn := Function(fakecu.NewFunction(8, 4, 2))
	cfg := LaunchConfig{Grid: [3]uint32{2, 3}, Block: [3]uint32{32, 4, 1}, SharedBytes: 16}
	if err := d.LaunchParams(fn, cfg, []byte{1, 2, 3, 4, 5, 6, 7, 8}, []byte{9, 10, 11, 12}, []byte{13, 14}); err != nil {
		t.Fatalf("LaunchParams = %v", err)
	}
	l := fakecu.LastLaunch()
	if want := []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14}; !bytes.Equal(l.Params, want) {
		t.Errorf("kernel saw params %v, want %v", l.Params, want)
	}
	if l.Grid != [3]uint32{2, 3, 1} || l.Block != [3]uint32{32, 4, 1} {
		t.Errorf("grid %v block %v, want [2 3 1] [32 4 1] (zero dims count as 1)", l.Grid, l.Block)
	}
	many := make([][]byte, MaxParams+1)
	if err := d.LaunchParams(fn, cfg, many...); status.CodeOf(err) != status.InvalidArgument {
		t.Errorf("LaunchParams(%d params) = %v, want InvalidArgument", len(many), err)
	}
}

// BenchmarkLaunch measures the Go-side cost of one launch (the fake driver
// does a memcpy of the arguments, as the real one does).
func BenchmarkLaunch(b *testing.B) {
	fakecu.SetMissing()
	d, err := newDriver(fakecu.Library{})
	if err != nil {
		b.Fatal(err)
	}
	args := make([]byte, 256)
	fn := Function(fakecu.NewFunction(len(args)))
	b.ReportAllocs()
	for b.Loop() {
		if err := d.Launch(fn, 1, 1, 0, 0, args); err != nil {
			b.Fatal(err)
		}
	}
}

func TestLoadWithoutDriver(t *testing.T) {
	d, err := Load()
	if err == nil {
		t.Skipf("a CUDA driver is installed here (version %d); the no-driver path is not testable", d.Version())
	}
	if !errors.Is(err, ErrNoDriver) && status.CodeOf(err) != status.CUDA {
		t.Fatalf("Load() error = %v, want ErrNoDriver or a CUDA error", err)
	}
	if errors.Is(err, ErrNoDriver) {
		if !strings.Contains(err.Error(), "libcuda.so.1") || status.CodeOf(err) != status.Unsupported {
			t.Errorf("Load() error = %q (code %v), want dlerror text naming libcuda.so.1, Unsupported", err, status.CodeOf(err))
		}
	}
	if _, err2 := Load(); err2 != err {
		t.Errorf("second Load() = %v, want the same error %v", err2, err)
	}
}
