package proxy

import (
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/native/kernels"
)

func headerText(t *testing.T, name string) string {
	t.Helper()
	src, err := kernels.Source(name)
	if err != nil {
		t.Fatal(err)
	}
	return src
}

// constant returns the value of "constexpr <type> name = <int>" in src.
func constant(t *testing.T, src, name string) int {
	t.Helper()
	m := regexp.MustCompile(`constexpr \w+ ` + name + ` = (\d+)(?:u|ull)?;`).FindStringSubmatch(src)
	if m == nil {
		t.Fatalf("channel.cuh: no integer constexpr %s", name)
	}
	v, _ := strconv.Atoi(m[1])
	return v
}

// TestConstantsMatchHeader checks Go's constants against channel.cuh.
func TestConstantsMatchHeader(t *testing.T) {
	src := headerText(t, "channel.cuh")
	common := headerText(t, "p2p_common.cuh")
	numPhases, _ := strconv.Atoi(regexp.MustCompile(`kNumPhases = (\d+)`).FindStringSubmatch(common)[1])
	phase := func(name string) int {
		m := regexp.MustCompile(`constexpr int ` + name + ` = kNumPhases \+ (\d+);`).FindStringSubmatch(src)
		if m == nil {
			t.Fatalf("channel.cuh: no phase %s", name)
		}
		v, _ := strconv.Atoi(m[1])
		return numPhases + v
	}
	tests := []struct {
		name      string
		got, want int
	}{
		{"kTriggerPut", TriggerPut, constant(t, src, "kTriggerPut")},
		{"kTriggerSignal", TriggerSignal, constant(t, src, "kTriggerSignal")},
		{"kTriggerFlush", TriggerFlush, constant(t, src, "kTriggerFlush")},
		{"kTriggerSizeBits", sizeBits, constant(t, src, "kTriggerSizeBits")},
		{"kTriggerOffsetBits", offsetBits, constant(t, src, "kTriggerOffsetBits")},
		{"kTriggerMemoryBits", memoryBits, constant(t, src, "kTriggerMemoryBits")},
		{"kTriggerTypeBits", typeBits, constant(t, src, "kTriggerTypeBits")},
		{"kTriggerChannelBits", channelBits, constant(t, src, "kTriggerChannelBits")},
		{"kTriggerLapBit", lapBit, constant(t, src, "kTriggerLapBit")},
		{"kTriggerFstLapBit", fstLapBit, constant(t, src, "kTriggerFstLapBit")},
		{"kInlineBytes", InlineBytes, constant(t, src, "kInlineBytes")},
		{"kErrProxy", ErrCodeProxy, constant(t, src, "kErrProxy")},
		{"kPhaseChannelWait", PhaseChannelWait, phase("kPhaseChannelWait")},
		{"kPhaseFifoPush", PhaseFifoPush, phase("kPhaseFifoPush")},
		{"kPhaseFifoFlush", PhaseFifoFlush, phase("kPhaseFifoFlush")},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s: Go has %d, channel.cuh has %d", tt.name, tt.got, tt.want)
		}
	}
	if !strings.Contains(src, "constexpr u32 kInlineMemory = kMaxMemories - 1;") || InlineMemory != MaxMemories-1 {
		t.Errorf("kInlineMemory: Go has %d, channel.cuh does not say kMaxMemories - 1", InlineMemory)
	}
}

// row is one line of a layout table in channel.cuh's comments.
type row struct {
	offset, size uintptr
	field        string
}

// table parses the "offset size field" comment block right above
// "struct [alignas(N)] name {" or "struct name;".
func table(t *testing.T, src, name string) (rows []row, total uintptr) {
	t.Helper()
	at := regexp.MustCompile(`\nstruct (alignas\(\d+\) )?` + name + `( \{|;)`).FindStringIndex(src)
	if at == nil {
		t.Fatalf("channel.cuh: no struct %s", name)
	}
	lines := strings.Split(src[:at[0]], "\n")
	start := len(lines) - 1
	for start > 0 && strings.HasPrefix(lines[start-1], "//") {
		start--
	}
	rowRe := regexp.MustCompile(`^//\s+(\d+)\s+(\d+)\s+(\w+)`)
	totalRe := regexp.MustCompile(`^//\s+total\s+(\d+)`)
	for _, l := range lines[start:] {
		if m := rowRe.FindStringSubmatch(l); m != nil {
			o, _ := strconv.Atoi(m[1])
			s, _ := strconv.Atoi(m[2])
			rows = append(rows, row{uintptr(o), uintptr(s), m[3]})
		} else if m := totalRe.FindStringSubmatch(l); m != nil {
			v, _ := strconv.Atoi(m[1])
			total = uintptr(v)
		}
	}
	if len(rows) == 0 || total == 0 {
		t.Fatalf("channel.cuh: no layout table above struct %s", name)
	}
	return rows, total
}

// goName turns a C field name into the Go field's, e.g. tail_cache -> TailCache.
func goName(c string) string {
	c = strings.TrimSuffix(c, "[]")
	var b strings.Builder
	for _, part := range strings.Split(c, "_") {
		if part != "" {
			b.WriteString(strings.ToUpper(part[:1]) + part[1:])
		}
	}
	return b.String()
}

// TestLayoutsMatchHeader checks every shared struct's size and each named
// field's offset and size against the tables in channel.cuh, and that the
// header's static_asserts pin the same sizes.
func TestLayoutsMatchHeader(t *testing.T) {
	src := headerText(t, "channel.cuh")
	structs := []struct {
		c    string
		goT  reflect.Type
		size uintptr
	}{
		{"FifoDeviceWords", reflect.TypeOf(deviceWords{}), unsafe.Sizeof(deviceWords{})},
		{"FifoHostWords", reflect.TypeOf(hostWords{}), unsafe.Sizeof(hostWords{})},
		{"FifoHandle", reflect.TypeOf(FifoHandle{}), unsafe.Sizeof(FifoHandle{})},
		{"PortChannel", reflect.TypeOf(PortChannel{}), unsafe.Sizeof(PortChannel{})},
		{"MemoryChannel", reflect.TypeOf(MemoryChannel{}), unsafe.Sizeof(MemoryChannel{})},
	}
	alias := map[string]string{"Fifo": "FIFO", "Id": "ID"}
	for _, s := range structs {
		t.Run(s.c, func(t *testing.T) {
			rows, total := table(t, src, s.c)
			if s.size != total {
				t.Errorf("unsafe.Sizeof = %d, channel.cuh's table says %d", s.size, total)
			}
			if !regexp.MustCompile(`sizeof\(` + s.c + `\) == ` + strconv.Itoa(int(total)) + `\b`).MatchString(src) {
				t.Errorf("channel.cuh has no static_assert(sizeof(%s) == %d)", s.c, total)
			}
			var sum uintptr
			for _, r := range rows {
				sum += r.size
				if strings.HasPrefix(r.field, "pad") {
					continue
				}
				name := goName(r.field)
				if a, ok := alias[name]; ok {
					name = a
				}
				f, ok := s.goT.FieldByName(name)
				if !ok {
					t.Errorf("field %s (Go %s) missing in %s", r.field, name, s.goT)
					continue
				}
				if f.Offset != r.offset || f.Type.Size() != r.size {
					t.Errorf("%s: Go offset %d size %d, channel.cuh offset %d size %d",
						r.field, f.Offset, f.Type.Size(), r.offset, r.size)
				}
			}
			if sum != total {
				t.Errorf("table rows add up to %d bytes, total says %d", sum, total)
			}
		})
	}
	if got := unsafe.Sizeof(Trigger{}); got != 16 {
		t.Errorf("unsafe.Sizeof(Trigger{}) = %d, want 16", got)
	}
}

// TestTriggerBitsMatchHeader checks Encode against the bit table of
// channel.cuh's Trigger comment: each field, set to all ones, fills exactly
// the bits the table names in the word it names.
func TestTriggerBitsMatchHeader(t *testing.T) {
	src := headerText(t, "channel.cuh")
	re := regexp.MustCompile(`(?m)^//\s+(fst|snd)?\s*bits\s+(\d+)\.\.(\d+)\s+(\w+)`)
	setters := map[string]func(*Op){
		"size":       func(o *Op) { o.Size = MaxSize },
		"src_offset": func(o *Op) { o.SrcOffset = MaxOffset },
		"dst_offset": func(o *Op) { o.DstOffset = MaxOffset },
		"src_memory": func(o *Op) { o.SrcMemory = MaxMemories - 1 },
		"dst_memory": func(o *Op) { o.DstMemory = MaxMemories - 1 },
		"channel":    func(o *Op) { o.Channel = MaxChannels - 1 },
	}
	word, seen := "", 0
	for _, m := range re.FindAllStringSubmatch(src, -1) {
		if m[1] != "" {
			word = m[1]
		}
		lo, _ := strconv.Atoi(m[2])
		hi, _ := strconv.Atoi(m[3])
		want := (^uint64(0) >> (63 - hi)) >> lo << lo
		set, ok := setters[m[4]]
		if !ok {
			continue
		}
		seen++
		op := Op{Type: TriggerPut}
		set(&op)
		tr, err := op.Encode()
		if err != nil {
			t.Fatalf("Encode(%+v): %v", op, err)
		}
		got := tr.Fst
		base, _ := Op{Type: TriggerPut}.Encode()
		if word == "snd" {
			got = tr.Snd &^ base.Snd
		}
		if got != want {
			t.Errorf("%s: Encode sets %s bits %#x, channel.cuh says %#x", m[4], word, got, want)
		}
	}
	if seen != len(setters) {
		t.Errorf("found %d of %d trigger fields in channel.cuh's table", seen, len(setters))
	}
	typ := regexp.MustCompile(`bits (\d+)\.\.(\d+)\s+type`).FindStringSubmatch(src)
	if typ == nil || typ[1] != "48" || typ[2] != "50" {
		t.Errorf("channel.cuh: type bits %v, Go encodes 48..50", typ)
	}
}
