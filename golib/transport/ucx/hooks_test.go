package ucx

import (
	"bytes"
	"fmt"
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/dl"
	"github.com/p2pcomm/p2pcomm/golib/procenv"
)

// libcMemoryCalls are the libc functions UCX's memory hooks patch in place.
var libcMemoryCalls = []string{"mmap", "munmap", "mremap", "madvise", "brk", "sbrk", "shmat", "shmdt"}

// TestLoadingPatchesNoLibcCall: a process that loads UCX keeps libc's
// memory calls as they were and its environment as it was; where the user
// asks for UCX's hooks (HookModeEnv=bistro), or for the registration cache
// they feed, UCX patches them, which also shows that the check sees a
// patch. With the cache asked for, the transport still works.
func TestLoadingPatchesNoLibcCall(t *testing.T) {
	needUCX(t)
	for _, key := range []string{HookModeEnv, "UCX_RCACHE_ENABLE", "UCX_MEMTYPE_CACHE"} {
		t.Setenv(key, "") // restored after the test
		os.Unsetenv(key)
	}
	for _, setting := range []string{"", HookModeEnv + "=bistro", "UCX_RCACHE_ENABLE=y"} {
		name := setting
		if name == "" {
			name = "defaults"
		}
		t.Run(name, func(t *testing.T) {
			var env []string
			if setting != "" {
				env = append(env, setting)
			}
			expectOK(t, runJob(t, "hooks", 1, 30*time.Second, env...))
			if setting == "UCX_RCACHE_ENABLE=y" {
				expectOK(t, runJob(t, "exchange", 2, 40*time.Second, env...))
			}
		})
	}
}

// childHooks loads UCX into a process where nothing has and compares the
// first bytes of libc's memory calls before and after.
func childHooks() int {
	fail := func(format string, args ...any) int {
		fmt.Fprintf(os.Stderr, format+"\n", args...)
		return 1
	}
	libc, err := dl.Open("libc.so.6", dl.Now|dl.Local)
	if err != nil {
		return fail("%v", err)
	}
	snap := func() map[string][]byte {
		code := map[string][]byte{}
		for _, name := range libcMemoryCalls {
			if p, err := libc.Sym(name); err == nil {
				code[name] = bytes.Clone(unsafe.Slice((*byte)(p), 16))
			}
		}
		return code
	}
	mode, asked := procenv.Lookup(HookModeEnv)
	wanted := hooksWanted()
	before := snap()
	if _, err := load(nil); err != nil {
		return fail("load UCX: %v", err)
	}
	var patched []string
	for name, code := range snap() {
		if !bytes.Equal(code, before[name]) {
			patched = append(patched, name)
		}
	}
	if now, set := procenv.Lookup(HookModeEnv); now != mode || set != asked {
		return fail("%s is %q (set %v) after loading, was %q (set %v)", HookModeEnv, now, set, mode, asked)
	}
	if wanted && len(patched) == 0 {
		return fail("hooks asked for (%s=%q): UCX patched none of %v", HookModeEnv, mode, libcMemoryCalls)
	}
	if !wanted && len(patched) > 0 {
		return fail("loading UCX patched libc's %v", patched)
	}
	fmt.Printf("patched %v\nDONE\n", patched)
	return 0
}
