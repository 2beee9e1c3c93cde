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
// asks for UCX's hooks (HookModeEnv=bistro), UCX patches them, which shows
// that the check sees a patch.
func TestLoadingPatchesNoLibcCall(t *testing.T) {
	needUCX(t)
	for _, mode := range []string{"", "bistro"} {
		t.Run("mode="+mode, func(t *testing.T) {
			var env []string
			if mode != "" {
				env = append(env, HookModeEnv+"="+mode)
			}
			expectOK(t, runJob(t, "hooks", 1, 30*time.Second, env...))
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
	if mode == "bistro" && len(patched) == 0 {
		return fail("%s=bistro: UCX patched none of %v", HookModeEnv, libcMemoryCalls)
	}
	if mode != "bistro" && len(patched) > 0 {
		return fail("loading UCX patched libc's %v", patched)
	}
	fmt.Printf("patched %v\nDONE\n", patched)
	return 0
}
