package moe

import (
	"fmt"
	"os"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/cuda/cudatest"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/native/kernels"
)

// TestMain points the NVRTC search at the local Python's nvidia wheels
// (TestLayoutsCompile), as the Python package does at run time.
func TestMain(m *testing.M) {
	cudatest.UsePythonWheels()
	os.Exit(m.Run())
}

func source(t *testing.T, name string) string {
	t.Helper()
	src, err := kernels.Source(name)
	if err != nil {
		t.Fatal(err)
	}
	return src
}

// mirrors are the Go structs the kernels take, by their CUDA names.
var mirrors = map[string]any{
	"MoeSync": syncParams{}, "MoeDispatchParams": dispatchParams{}, "MoeExpandParams": expandParams{},
	"MoeCombineParams": combineParams{}, "MoePostParams": postParams{}, "MoeStagedParams": stagedParams{},
}

type field struct{ offset, size int }

// tables reads the layout table in the comment above each struct of src:
// {struct: ({field: where}, total size)}.
func tables(src string) map[string]struct {
	fields map[string]field
	total  int
} {
	out := map[string]struct {
		fields map[string]field
		total  int
	}{}
	row := regexp.MustCompile(`(?m)^//\s+(\d+)\s+(\d+)\s+(\w+)`)
	total := regexp.MustCompile(`(?m)^//\s+total\s+(\d+)`)
	for _, m := range regexp.MustCompile(`((?://[^\n]*\n)+)struct (\w+) \{`).FindAllStringSubmatch(src, -1) {
		tot := total.FindStringSubmatch(m[1])
		rows := row.FindAllStringSubmatch(m[1], -1)
		if tot == nil || rows == nil {
			continue
		}
		fs := map[string]field{}
		for _, r := range rows {
			off, _ := strconv.Atoi(r[1])
			size, _ := strconv.Atoi(r[2])
			fs[r[3]] = field{off, size}
		}
		n, _ := strconv.Atoi(tot[1])
		out[m[2]] = struct {
			fields map[string]field
			total  int
		}{fs, n}
	}
	return out
}

// goLayout is each tagged field's offset and size in a Go mirror, in order.
func goLayout(v any) (names []string, fields map[string]field, size int) {
	t := reflect.TypeOf(v)
	fields = map[string]field{}
	for i := range t.NumField() {
		f := t.Field(i)
		name := f.Tag.Get("c")
		names = append(names, name)
		fields[name] = field{int(f.Offset), int(f.Type.Size())}
	}
	return names, fields, int(t.Size())
}

// TestMirrorsMatchTheTables: every Go mirror has the fields, offsets, sizes
// and total of its struct's table in moe_common.cuh, the C struct declares
// the fields in that order, and its size static_assert says the same.
func TestMirrorsMatchTheTables(t *testing.T) {
	src := source(t, "moe_common.cuh")
	tabs := tables(src)
	var names []string
	for n := range tabs {
		names = append(names, n)
	}
	sort.Strings(names)
	if want := []string{"MoeCombineParams", "MoeDispatchParams", "MoeExpandParams", "MoePostParams", "MoeStagedParams",
		"MoeSync"}; !reflect.DeepEqual(names, want) {
		t.Fatalf("tables of %v, want %v", names, want)
	}
	for name, tab := range tabs {
		t.Run(name, func(t *testing.T) {
			order, fields, size := goLayout(mirrors[name])
			if size != tab.total {
				t.Errorf("unsafe.Sizeof = %d, the table says %d", size, tab.total)
			}
			if !reflect.DeepEqual(fields, tab.fields) {
				t.Errorf("Go fields %v, the table %v", fields, tab.fields)
			}
			m := regexp.MustCompile(`static_assert\(sizeof\(` + name + `\) == (\d+)`).FindStringSubmatch(src)
			if m == nil || m[1] != strconv.Itoa(size) {
				t.Errorf("static_assert(sizeof(%s)) = %v, Go %d", name, m, size)
			}
			body := regexp.MustCompile(`(?s)struct ` + name + ` \{(.*?)\};`).FindStringSubmatch(src)
			if body == nil {
				t.Fatalf("no declaration of %s", name)
			}
			var declared []string
			for _, d := range regexp.MustCompile(`(\w+)(?:\[kMaxRanks\])?;`).FindAllStringSubmatch(body[1], -1) {
				declared = append(declared, d[1])
			}
			if !reflect.DeepEqual(declared, order) {
				t.Errorf("declared %v, Go order %v", declared, order)
			}
		})
	}
}

// constants the Go side shares with the CUDA side, by CUDA name.
var constants = map[string]int{
	"kSyncStart": syncStart, "kSyncArrive": syncArrive, "kSyncWait": syncWait, "kSyncStageGo": syncStageGo,
	"kSyncStaged": syncStaged, "kSyncPostStaged": syncPostStaged, "kSyncGridShift": syncGridShift,
	"kMoeKinds": syncKinds, "kMoeDispatch": kindDispatch, "kMoeSyncBlocks": maxSyncBlocks, "kMoeMaxTopK": maxTopK,
	"kMoeFlagWords": syncFlagWords, "kMaxRanks": maxRanks, "kThreads": threads, "kCombWide": combWide,
	"sizeof(MoeSyncState)": syncStateBytes, "kStatusTagShift": statusTagShift, "kStatusTagMax": statusTagMax,
}

// TestLayoutsCompile compiles static_asserts of every mirror's size, every
// field's size and every shared constant against the kernels' own headers
// (NVRTC, when it can be found): the compiler's numbers, not the comments'.
// The tables then pin the offsets (no padding: the field sizes add up).
func TestLayoutsCompile(t *testing.T) {
	nv, err := cuda.LoadNVRTC()
	if err != nil {
		t.Skipf("NVRTC not found (set %s or %s): %v", cuda.EnvNVRTC, cuda.EnvNVIDIAPaths, err)
	}
	var b strings.Builder
	b.WriteString("#include \"moe_dispatch.cu\"\n#include \"moe_combine.cu\"\n")
	for name, v := range mirrors {
		order, fields, size := goLayout(v)
		fmt.Fprintf(&b, "static_assert(sizeof(%s) == %d, \"sizeof(%s)\");\n", name, size, name)
		sum := 0
		for _, f := range order {
			fmt.Fprintf(&b, "static_assert(sizeof(%s::%s) == %d, \"%s.%s\");\n", name, f, fields[f].size, name, f)
			sum += fields[f].size
		}
		if sum != size {
			t.Errorf("%s: the fields add up to %d bytes, the struct is %d: padding would move offsets", name, sum, size)
		}
	}
	for name, v := range constants {
		fmt.Fprintf(&b, "static_assert(%s == %d, \"%s\");\n", name, v, name)
	}
	b.WriteString("// p2pcomm:instantiate moe_layout_probe\n__global__ void moe_layout_probe() {}\n")
	headers := kernels.Headers()
	headers["moe_dispatch.cu"] = source(t, "moe_dispatch.cu")
	headers["moe_combine.cu"] = source(t, "moe_combine.cu")
	if _, err := nv.Compile(cuda.CompileRequest{Name: "moe_layout.cu", Source: b.String(), Headers: headers, Arch: 90,
		Options: []string{"-std=c++17", "-default-device"}, NameExpressions: []string{"moe_layout_probe"}}); err != nil {
		t.Fatalf("the kernels disagree with golib/moe:\n%v", err)
	}
}

// TestKernelExpressionsAreInstantiated: the name expressions an EP launches,
// over every dtype, transit and world, are exactly those the files declare,
// each in the file kernel.file names.
func TestKernelExpressionsAreInstantiated(t *testing.T) {
	declared := map[string]string{}
	for _, file := range []string{dispatchFile, combineFile, stagedFile} {
		for _, e := range kernels.Instantiations(source(t, file)) {
			if _, dup := declared[e]; dup {
				t.Errorf("%s declared twice", e)
			}
			declared[e] = file
		}
	}
	used := map[string]string{}
	for dt := range cTypes {
		for _, tr := range []reduce.DType{reduce.Float32, dt} {
			for world := 2; world <= maxRanks; world++ {
				for k := kernel(0); k < numKernels; k++ {
					if k.needed(world) {
						used[k.expr(dt, tr, world)] = k.file()
					}
				}
			}
		}
	}
	for dt := range cTypes {
		for _, tr := range []reduce.DType{reduce.Float32, dt} {
			expand, partials := stagedExprs(dt, tr)
			used[expand], used[partials] = stagedFile, stagedFile
		}
	}
	if !reflect.DeepEqual(used, declared) {
		t.Errorf("launched %v\ndeclared %v", used, declared)
	}
}
