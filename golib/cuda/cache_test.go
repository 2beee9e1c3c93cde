package cuda

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// countingCompiler is a fake NVRTC that returns a CUBIN derived from the
// request and counts compiles.
type countingCompiler struct {
	mu    sync.Mutex
	calls int
	fail  error
}

func (c *countingCompiler) Version() (int, int) { return 13, 0 }

func (c *countingCompiler) Compile(req CompileRequest) (CompileResult, error) {
	c.mu.Lock()
	c.calls++
	c.mu.Unlock()
	if c.fail != nil {
		return CompileResult{}, c.fail
	}
	lowered := map[string]string{}
	for _, e := range req.NameExpressions {
		lowered[e] = "_Z" + e
	}
	return CompileResult{CUBIN: []byte("\x7fELF" + req.Source), Lowered: lowered, Log: "warn"}, nil
}

func (c *countingCompiler) count() int { c.mu.Lock(); defer c.mu.Unlock(); return c.calls }

func TestCompileCachedHitsAndMisses(t *testing.T) {
	dir := t.TempDir()
	c := &countingCompiler{}
	headers := func(h, i string) map[string]string {
		return map[string]string{"h.cuh": "#include \"i.cuh\"\n" + h, "i.cuh": i, "unused.cuh": "u"}
	}
	base := CompileRequest{Name: "a.cu", Source: "#include \"h.cuh\"\nsrc", Headers: headers("1", "x"), Arch: 90,
		Options: []string{"-O3"}, NameExpressions: []string{"k<float>"}}
	first, err := compileCached(c, dir, base)
	if err != nil || first.Cached || c.count() != 1 {
		t.Fatalf("first compileCached = cached %v, %v, calls %d; want a fresh compile", first.Cached, err, c.count())
	}
	again, err := compileCached(c, dir, base)
	if err != nil || !again.Cached || c.count() != 1 || !bytes.Equal(again.CUBIN, first.CUBIN) ||
		again.Lowered["k<float>"] != "_Zk<float>" || again.Log != "warn" {
		t.Fatalf("second compileCached = %+v, %v, calls %d; want the cached entry", again, err, c.count())
	}
	changes := []struct {
		name   string
		modify func(r *CompileRequest)
	}{
		{"source", func(r *CompileRequest) { r.Source = "src2" }},
		{"header text", func(r *CompileRequest) { r.Headers = headers("2", "x") }},
		{"text of a header the header includes", func(r *CompileRequest) { r.Headers = headers("1", "y") }},
		{"header name", func(r *CompileRequest) { r.Headers = map[string]string{"g.cuh": "1", "i.cuh": "x"} }},
		{"arch", func(r *CompileRequest) { r.Arch = 80 }},
		{"options", func(r *CompileRequest) { r.Options = []string{"-O2"} }},
		{"name expressions", func(r *CompileRequest) { r.NameExpressions = []string{"k<half>"} }},
		{"option moved into expressions", func(r *CompileRequest) { r.Options, r.NameExpressions = nil, []string{"-O3", "k<float>"} }},
	}
	for _, ch := range changes {
		t.Run(ch.name, func(t *testing.T) {
			req := base
			ch.modify(&req)
			before := c.count()
			res, err := compileCached(c, dir, req)
			if err != nil || res.Cached || c.count() != before+1 {
				t.Errorf("compileCached after changing %s = cached %v, %v; want a recompile", ch.name, res.Cached, err)
			}
		})
	}
}

// TestCompileCachedIgnoresHeadersNotIncluded: an edit to a header the
// source never includes keeps its entry.
func TestCompileCachedIgnoresHeadersNotIncluded(t *testing.T) {
	dir := t.TempDir()
	c := &countingCompiler{}
	req := CompileRequest{Name: "a.cu", Source: "  # include <h.cuh>\nsrc", Arch: 90,
		Headers: map[string]string{"h.cuh": "1", "other.cuh": "1"}}
	if _, err := compileCached(c, dir, req); err != nil {
		t.Fatal(err)
	}
	req.Headers = map[string]string{"h.cuh": "1", "other.cuh": "2", "new.cuh": "3"}
	if res, err := compileCached(c, dir, req); err != nil || !res.Cached || c.count() != 1 {
		t.Errorf("compileCached after editing headers the source does not include = cached %v, %v, %d compiles; want the entry",
			res.Cached, err, c.count())
	}
}

func TestCompileCachedCorruptEntry(t *testing.T) {
	dir := t.TempDir()
	c := &countingCompiler{}
	req := CompileRequest{Name: "a.cu", Source: "src", Arch: 90}
	if _, err := compileCached(c, dir, req); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, cacheKey(req, 13, 0)+".cubin")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("cache entry %s not written: %v", path, err)
	}
	corruptions := []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"truncated", data[:len(data)-2]},
		{"flipped CUBIN byte", append(append([]byte{}, data[:len(data)-1]...), data[len(data)-1]^1)},
		{"garbage", []byte("not a cache entry at all")},
	}
	for _, cc := range corruptions {
		t.Run(cc.name, func(t *testing.T) {
			if err := os.WriteFile(path, cc.data, 0o644); err != nil {
				t.Fatal(err)
			}
			before := c.count()
			res, err := compileCached(c, dir, req)
			if err != nil || res.Cached || c.count() != before+1 || string(res.CUBIN) != "\x7fELFsrc" {
				t.Errorf("compileCached over %s entry = %q cached %v, %v; want a recompile", cc.name, res.CUBIN, res.Cached, err)
			}
			if again, _ := compileCached(c, dir, req); !again.Cached {
				t.Errorf("entry not rewritten after recompiling over a %s one", cc.name)
			}
		})
	}
}

func TestCompileCachedConcurrentWriters(t *testing.T) {
	dir := t.TempDir()
	c := &countingCompiler{}
	req := CompileRequest{Name: "a.cu", Source: "shared", Arch: 90}
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := compileCached(c, dir, req)
			if err == nil && string(res.CUBIN) != "\x7fELFshared" {
				err = errors.New("wrong CUBIN " + string(res.CUBIN))
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("concurrent compileCached: %v", err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 || filepath.Ext(entries[0].Name()) != ".cubin" {
		t.Errorf("cache dir holds %v, want exactly one entry and no temp files", entries)
	}
}

func TestCompileCachedErrorNotCached(t *testing.T) {
	dir := t.TempDir()
	c := &countingCompiler{fail: errors.New("boom")}
	req := CompileRequest{Name: "a.cu", Source: "s", Arch: 90}
	if _, err := compileCached(c, dir, req); err == nil || err.Error() != "boom" {
		t.Fatalf("compileCached with failing compiler = %v, want boom", err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("failed compile left %d cache entries, want 0", len(entries))
	}
}

func TestCacheDir(t *testing.T) {
	tests := []struct {
		name, env, xdg, home, want string
	}{
		{"explicit", "/x/cache", "/xdg", "/home/u", "/x/cache"},
		{"xdg", "", "/xdg", "/home/u", "/xdg/p2pcomm"},
		{"home", "", "", "/home/u", "/home/u/.cache/p2pcomm"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv(EnvCacheDir, tt.env)
			t.Setenv("XDG_CACHE_HOME", tt.xdg)
			t.Setenv("HOME", tt.home)
			if got, err := CacheDir(); err != nil || got != tt.want {
				t.Errorf("CacheDir() = %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}
