package kernels_test

import (
	"fmt"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/cuda/cudatest"
	"github.com/p2pcomm/p2pcomm/native/kernels"
)

// TestMain points the NVRTC search at the local Python's nvidia wheels when
// nothing else says where NVRTC is, as the Python package does at run time.
func TestMain(m *testing.M) {
	cudatest.UsePythonWheels()
	os.Exit(m.Run())
}

// TestEveryKernelCompiles compiles each .cu file for sm_80 and sm_90 with
// the instantiations it declares and the library's options (kernels.go's
// compile in golib/gpucoll), and checks that each one lowers; in files that
// say "p2pcomm:no-spills", that no kernel spills registers or uses a stack
// frame. Builds go through the kernel cache (CacheDir), whose key covers the
// source, headers, options, arch and NVRTC version, so an unchanged kernel
// is checked once. Each logs its time, so a long run shows progress (-v).
func TestEveryKernelCompiles(t *testing.T) {
	names := kernels.Kernels()
	if len(names) == 0 {
		t.Skip("no .cu files in native/kernels yet")
	}
	n, err := cuda.LoadNVRTC()
	if err != nil {
		t.Skipf("NVRTC not found (set %s or %s); searched %v: %v",
			cuda.EnvNVRTC, cuda.EnvNVIDIAPaths, cuda.NVRTCCandidates(), err)
	}
	major, minor := n.Version()
	t.Logf("NVRTC %d.%d from %s", major, minor, n.Path())
	headers := kernels.Headers()
	m := regexp.MustCompile(`constexpr int kThreads = (\d+);`).FindStringSubmatch(headers["p2p_common.cuh"])
	if m == nil {
		t.Fatal("kThreads not found in p2p_common.cuh")
	}
	threads, _ := strconv.Atoi(m[1])
	// Builds take up to a minute each on a small machine: say every 20 s
	// which are still running, so that a long stretch is never silent.
	var running sync.Map
	start := time.Now()
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) }) // after the parallel subtests
	go func() {
		for tick := time.NewTicker(20 * time.Second); ; {
			select {
			case <-stop:
				tick.Stop()
				return
			case <-tick.C:
				var now []string
				running.Range(func(k, _ any) bool { now = append(now, k.(string)); return true })
				sort.Strings(now)
				fmt.Printf("    still compiling at %.0f s: %s\n", time.Since(start).Seconds(), strings.Join(now, ", "))
			}
		}
	}()
	for _, name := range names {
		src, err := kernels.Source(name)
		if err != nil {
			t.Fatal(err)
		}
		exprs := kernels.Instantiations(src)
		noSpills := strings.Contains(src, "p2pcomm:no-spills")
		for _, arch := range []int{80, 90} {
			t.Run(name+"/sm_"+strconv.Itoa(arch), func(t *testing.T) {
				t.Parallel() // NVRTC compiles are independent: use every core
				key := name + "/sm_" + strconv.Itoa(arch)
				running.Store(key, true)
				defer running.Delete(key)
				start := time.Now()
				res, err := n.CompileCached(cuda.CompileRequest{Name: name, Source: src, Headers: headers, Arch: arch,
					Options: []string{"-std=c++17", "-default-device", "--ptxas-options=-v"}, NameExpressions: exprs})
				if err != nil {
					t.Fatalf("compile %s for sm_%d: %v", name, arch, err)
				}
				from := ""
				if res.Cached {
					from = " (kernel cache)"
				}
				t.Logf("compiled %s for sm_%d in %.1f s%s", name, arch, time.Since(start).Seconds(), from)
				if len(res.CUBIN) == 0 {
					t.Errorf("compile %s for sm_%d: empty CUBIN", name, arch)
				}
				for _, e := range exprs {
					if l := res.Lowered[e]; !strings.HasPrefix(l, "_Z") {
						t.Errorf("%s: instantiation %q lowered to %q, want a mangled name", name, e, l)
					}
				}
				for _, line := range strings.Split(res.Log, "\n") {
					if strings.Contains(line, "warning") {
						t.Logf("%s sm_%d: %s", name, arch, line)
					}
				}
				if !noSpills {
					return
				}
				report := ptxasReport(res.Log, res.Lowered)
				for _, e := range exprs {
					if _, ok := report[e]; !ok {
						t.Errorf("%s sm_%d: ptxas -v said nothing of %s", name, arch, e)
					}
				}
				for e, r := range report {
					if r.spillStores != 0 || r.spillLoads != 0 || r.stack != 0 {
						t.Errorf("%s sm_%d: %s spills (registers %d, spill stores %d B, loads %d B, stack %d B)",
							name, arch, e, r.registers, r.spillStores, r.spillLoads, r.stack)
					}
					if r.registers > 65536/threads {
						t.Errorf("%s sm_%d: %s uses %d registers, more than %d threads per block can have",
							name, arch, e, r.registers, threads)
					}
				}
			})
		}
	}
}

type ptxasUse struct{ registers, spillStores, spillLoads, stack int }

var (
	ptxasEntry = regexp.MustCompile(`Compiling entry function '(\w+)'`)
	ptxasSpill = regexp.MustCompile(`(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads`)
	ptxasRegs  = regexp.MustCompile(`Used (\d+) registers`)
)

// ptxasReport reads ptxas -v's log into each instantiation's use. Spills and
// stack frames add up over the kernel and the functions it calls, which
// ptxas lists under the kernel's entry.
func ptxasReport(log string, lowered map[string]string) map[string]ptxasUse {
	byName := map[string]string{}
	for e, l := range lowered {
		byName[l] = e
	}
	out := map[string]ptxasUse{}
	current := ""
	for _, line := range strings.Split(log, "\n") {
		if m := ptxasEntry.FindStringSubmatch(line); m != nil {
			current = byName[m[1]]
			continue
		}
		if current == "" {
			continue
		}
		r := out[current]
		if m := ptxasSpill.FindStringSubmatch(line); m != nil {
			stack, _ := strconv.Atoi(m[1])
			stores, _ := strconv.Atoi(m[2])
			loads, _ := strconv.Atoi(m[3])
			r.stack, r.spillStores, r.spillLoads = r.stack+stack, r.spillStores+stores, r.spillLoads+loads
		}
		if m := ptxasRegs.FindStringSubmatch(line); m != nil {
			r.registers, _ = strconv.Atoi(m[1])
		}
		out[current] = r
	}
	return out
}
