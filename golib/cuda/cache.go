package cuda

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"

	"github.com/p2pcomm/p2pcomm/golib/procenv"
)

// EnvCacheDir overrides where compiled kernels are cached.
const EnvCacheDir = "P2PCOMM_CACHE_DIR"

// CacheDir returns the kernel cache directory: $P2PCOMM_CACHE_DIR, else
// $XDG_CACHE_HOME/p2pcomm, else ~/.cache/p2pcomm.
func CacheDir() (string, error) {
	if d := procenv.Get(EnvCacheDir); d != "" {
		return d, nil
	}
	if d := procenv.Get("XDG_CACHE_HOME"); d != "" {
		return filepath.Join(d, "p2pcomm"), nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", fmt.Errorf("kernel cache dir: %w", err)
	}
	return filepath.Join(home, ".cache", "p2pcomm"), nil
}

// cacheKey hashes everything that changes the CUBIN. Fields are length-
// prefixed so that no two different requests share a byte stream.
func cacheKey(req CompileRequest, major, minor int) string {
	h := sha256.New()
	put := func(s string) {
		var n [8]byte
		binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	put("p2pcomm-cubin-v1")
	put(fmt.Sprintf("nvrtc %d.%d arch %d", major, minor, req.Arch))
	put(req.Name)
	put(req.Source)
	names := req.headerNames()
	put(fmt.Sprint(len(names)))
	for _, n := range names {
		put(n)
		put(req.Headers[n])
	}
	for _, list := range [][]string{req.Options, req.NameExpressions} {
		put(fmt.Sprint(len(list)))
		for _, s := range list {
			put(s)
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

var includeLine = regexp.MustCompile(`(?m)^[ \t]*#[ \t]*include[ \t]*["<]([^">]+)[">]`)

// withIncludedHeaders keeps only the headers the source includes, directly
// or through other headers: an edit to a header a kernel never includes
// leaves that kernel's cache entry valid.
func (r CompileRequest) withIncludedHeaders() CompileRequest {
	if len(r.Headers) == 0 {
		return r
	}
	used := map[string]string{}
	queue := []string{r.Source}
	for len(queue) > 0 {
		text := queue[0]
		queue = queue[1:]
		for _, m := range includeLine.FindAllStringSubmatch(text, -1) {
			name := m[1]
			if _, ok := r.Headers[name]; !ok {
				name = filepath.Base(name)
			}
			if h, ok := r.Headers[name]; ok {
				if _, seen := used[name]; !seen {
					used[name] = h
					queue = append(queue, h)
				}
			}
		}
	}
	r.Headers = used
	return r
}

// A cache entry is: magic, 4-byte header length, JSON header, CUBIN. The
// header records the CUBIN's hash, so a torn or corrupted file is detected
// and recompiled rather than handed to the driver.
var cacheMagic = []byte("P2PCOMM-CUBIN-1\n")

type cacheHeader struct {
	Key     string            `json:"key"`
	Size    int               `json:"size"`
	SHA256  string            `json:"sha256"`
	Lowered map[string]string `json:"lowered"`
	Log     string            `json:"log,omitempty"`
}

func encodeEntry(key string, res CompileResult) ([]byte, error) {
	sum := sha256.Sum256(res.CUBIN)
	hdr, err := json.Marshal(cacheHeader{Key: key, Size: len(res.CUBIN), SHA256: hex.EncodeToString(sum[:]),
		Lowered: res.Lowered, Log: res.Log})
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	b.Write(cacheMagic)
	_ = binary.Write(&b, binary.LittleEndian, uint32(len(hdr)))
	b.Write(hdr)
	b.Write(res.CUBIN)
	return b.Bytes(), nil
}

var errCorrupt = errors.New("corrupt kernel cache entry")

func decodeEntry(key string, data []byte) (CompileResult, error) {
	if !bytes.HasPrefix(data, cacheMagic) || len(data) < len(cacheMagic)+4 {
		return CompileResult{}, errCorrupt
	}
	data = data[len(cacheMagic):]
	n := binary.LittleEndian.Uint32(data)
	data = data[4:]
	if uint64(n) > uint64(len(data)) {
		return CompileResult{}, errCorrupt
	}
	var hdr cacheHeader
	if err := json.Unmarshal(data[:n], &hdr); err != nil {
		return CompileResult{}, errCorrupt
	}
	cubin := data[n:]
	sum := sha256.Sum256(cubin)
	if hdr.Key != key || hdr.Size != len(cubin) || hdr.SHA256 != hex.EncodeToString(sum[:]) {
		return CompileResult{}, errCorrupt
	}
	if hdr.Lowered == nil {
		hdr.Lowered = map[string]string{}
	}
	return CompileResult{CUBIN: cubin, Lowered: hdr.Lowered, Log: hdr.Log, Cached: true}, nil
}

// compiler is what the cache wraps; *NVRTC satisfies it.
type compiler interface {
	Version() (major, minor int)
	Compile(req CompileRequest) (CompileResult, error)
}

// CompileCached is Compile behind the disk cache in CacheDir(). Entries are
// keyed by the hash of source, headers, arch, NVRTC version, options and
// name expressions. Writes go to a temp file renamed into place, so ranks
// compiling the same module at once never see a partial entry. Unreadable or
// corrupt entries are recompiled; a cache that cannot be written is skipped.
func (n *NVRTC) CompileCached(req CompileRequest) (CompileResult, error) {
	dir, err := CacheDir()
	if err != nil {
		return n.Compile(req)
	}
	return compileCached(n, dir, req)
}

func compileCached(c compiler, dir string, req CompileRequest) (CompileResult, error) {
	req = req.withIncludedHeaders()
	major, minor := c.Version()
	key := cacheKey(req, major, minor)
	path := filepath.Join(dir, key+".cubin")
	if data, err := os.ReadFile(path); err == nil {
		if res, err := decodeEntry(key, data); err == nil {
			return res, nil
		}
	}
	res, err := c.Compile(req)
	if err != nil {
		return res, err
	}
	_ = writeAtomic(dir, path, key, res) // the cache is an optimization only
	return res, nil
}

func writeAtomic(dir, path, key string, res CompileResult) error {
	data, err := encodeEntry(key, res)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, ".tmp-*.cubin")
	if err != nil {
		return err
	}
	_, werr := f.Write(data)
	cerr := f.Close()
	if werr != nil || cerr != nil {
		os.Remove(f.Name())
		return errors.Join(werr, cerr)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		os.Remove(f.Name())
		return err
	}
	return nil
}
