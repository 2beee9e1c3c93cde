package ucx

/*
#cgo LDFLAGS: -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include "calls.h"

// p2p_ucx_file names the file that holds symbol f: the loader's answer to
// a bare soname.
static const char* p2p_ucx_file(void* f) {
	Dl_info info;
	if (dladdr(f, &info) == 0 || info.dli_fname == NULL) return "";
	return info.dli_fname;
}
*/
import "C"

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/dl"
	"github.com/p2pcomm/p2pcomm/golib/procenv"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// LibraryEnv names the full path of libucp.so.0 to use instead of searching.
const LibraryEnv = "P2PCOMM_UCX_LIB"

// libraryName is the soname searched for.
const libraryName = "libucp.so.0"

// minMajor.minMinor is the oldest UCP with every entry point and parameter
// field used here (the *_nbx calls and mem_map's memory type).
const minMajor, minMinor = 1, 12

// memhMinor is the first UCP 1.x that reads a request's memh.
const memhMinor = 14

// library is a loaded UCP: the entry points, the file they came from and
// its version.
type library struct {
	path                  string
	version               string // ucp_get_version_string
	major, minor, release int
	fn                    funcs
}

// funcs holds one pointer per UCP entry point; all are required but
// epQuery, whose endpoint transports came with UCP 1.14.
type funcs struct {
	getVersion, getVersionString, statusString                     unsafe.Pointer
	configRead, configModify, configRelease, init, cleanup         unsafe.Pointer
	workerCreate, workerDestroy, workerQuery, workerReleaseAddress unsafe.Pointer
	workerProgress, workerFence                                    unsafe.Pointer
	epCreate, epCloseNbx, epFlushNbx                               unsafe.Pointer
	memMap, memUnmap, rkeyPack, rkeyBufferRelease, rkeyUnpack      unsafe.Pointer
	rkeyDestroy, putNbx                                            unsafe.Pointer
	requestCheckStatus, requestCancel, requestFree                 unsafe.Pointer
	contextQuery, epQuery                                          unsafe.Pointer
	workerSetAMRecvHandler, amSendNbx                              unsafe.Pointer
}

func (f *funcs) table() []struct {
	name string
	slot *unsafe.Pointer
} {
	return []struct {
		name string
		slot *unsafe.Pointer
	}{
		{"ucp_get_version", &f.getVersion},
		{"ucp_get_version_string", &f.getVersionString},
		{"ucs_status_string", &f.statusString}, // libucs, reached through libucp's dependencies
		{"ucp_config_read", &f.configRead},
		{"ucp_config_modify", &f.configModify},
		{"ucp_config_release", &f.configRelease},
		{"ucp_init_version", &f.init},
		{"ucp_cleanup", &f.cleanup},
		{"ucp_worker_create", &f.workerCreate},
		{"ucp_worker_destroy", &f.workerDestroy},
		{"ucp_worker_query", &f.workerQuery},
		{"ucp_worker_release_address", &f.workerReleaseAddress},
		{"ucp_worker_progress", &f.workerProgress},
		{"ucp_worker_fence", &f.workerFence},
		{"ucp_ep_create", &f.epCreate},
		{"ucp_ep_close_nbx", &f.epCloseNbx},
		{"ucp_ep_flush_nbx", &f.epFlushNbx},
		{"ucp_mem_map", &f.memMap},
		{"ucp_mem_unmap", &f.memUnmap},
		{"ucp_rkey_pack", &f.rkeyPack},
		{"ucp_rkey_buffer_release", &f.rkeyBufferRelease},
		{"ucp_ep_rkey_unpack", &f.rkeyUnpack},
		{"ucp_rkey_destroy", &f.rkeyDestroy},
		{"ucp_put_nbx", &f.putNbx},
		{"ucp_request_check_status", &f.requestCheckStatus},
		{"ucp_request_cancel", &f.requestCancel},
		{"ucp_request_free", &f.requestFree},
		{"ucp_context_query", &f.contextQuery},
		{"ucp_ep_query", &f.epQuery},
		{"ucp_worker_set_am_recv_handler", &f.workerSetAMRecvHandler},
		{"ucp_am_send_nbx", &f.amSendNbx},
	}
}

var (
	loadMu sync.Mutex
	loaded *library // the first library loaded stays for the life of the process
)

// load returns the process's UCP, opening it on first success. A failure is
// not remembered, so a later call with more directories may succeed.
func load(dirs []string) (*library, error) {
	loadMu.Lock()
	defer loadMu.Unlock()
	if loaded != nil {
		return loaded, nil
	}
	lib, err := openLibrary(procenv.Lookup, dirs, pythonLibDir, hasRDMA())
	if err != nil {
		return nil, err
	}
	loaded = lib
	return lib, nil
}

// HookModeEnv is read by UCX's memory hooks (UCM) as the library loads. By
// default they patch libc's mmap, munmap, brk and their kin in place, for
// the registration and memory-type caches that this transport turns off
// (defaults); that patching costs about 0.4 s of CPU per process. Loading
// sets it to none, and restores the environment after, unless the user set
// it or set either cache (UCP refuses a registration cache without hooks).
const HookModeEnv = "UCX_MEM_MMAP_HOOK_MODE"

// hooksWanted reports whether the user's UCX settings leave the memory
// hooks to UCX.
func hooksWanted() bool {
	for _, key := range []string{HookModeEnv, "UCX_RCACHE_ENABLE", "UCX_MEMTYPE_CACHE"} {
		if _, set := procenv.Lookup(key); set {
			return true
		}
	}
	return false
}

// DirsEnv names folders (colon-separated) searched for libucp.so.0 like
// the libucx wheel's; the Python package sets it to its wheel's folder.
const DirsEnv = "P2PCOMM_UCX_DIRS"

// rdmaDevicesDir lists the host's RDMA devices where it has any.
const rdmaDevicesDir = "/sys/class/infiniband"

// hasRDMA reports whether the host has an RDMA device.
func hasRDMA() bool {
	entries, err := os.ReadDir(rdmaDevicesDir)
	return err == nil && len(entries) > 0
}

// openLibrary finds libucp.so.0: the path in P2PCOMM_UCX_LIB alone when it
// is set, else the candidates in searchOrder's order. The error is
// status.Unsupported and lists every place tried with dlerror's text.
func openLibrary(lookup func(string) (string, bool), dirs []string, pyDir func() (string, error), rdma bool) (*library, error) {
	var tried []string
	hooks := hooksWanted()
	try := func(path string) *library {
		var h *dl.Library
		var err error
		open := func() { h, err = dl.Open(path, dl.Now|dl.Local) }
		if hooks {
			open()
		} else if serr := procenv.Default(HookModeEnv, "none", open); serr != nil {
			err = fmt.Errorf("set %s for loading %s: %w", HookModeEnv, path, serr)
		}
		if err != nil {
			tried = append(tried, err.Error())
			return nil
		}
		lib, err := resolve(h)
		if err != nil {
			tried = append(tried, path+": "+err.Error())
			return nil
		}
		return lib
	}
	if p, ok := lookup(LibraryEnv); ok && p != "" {
		if lib := try(p); lib != nil {
			return lib, nil
		}
		return nil, notFound(tried, LibraryEnv+"="+p)
	}
	for _, c := range searchOrder(withEnvDirs(lookup, dirs), pyDir, rdma) {
		if path, err := c(); err != nil {
			tried = append(tried, err.Error())
		} else if lib := try(path); lib != nil {
			return lib, nil
		}
	}
	return nil, notFound(tried, "")
}

// withEnvDirs is dirs, then DirsEnv's folders.
func withEnvDirs(lookup func(string) (string, bool), dirs []string) []string {
	if v, ok := lookup(DirsEnv); ok {
		return append(dirs[:len(dirs):len(dirs)], filepath.SplitList(v)...)
	}
	return dirs
}

// candidate gives a path to try, or why its place gives none.
type candidate func() (string, error)

// searchOrder lists where libucp.so.0 is looked for: the given folders and
// python3's libucx wheel (the UCX project's build: tcp and CUDA
// transports), and the dynamic loader's path (a system UCX). Where the
// host has an RDMA device the system's comes first, as the one built with
// verbs. Elsewhere UCX runs over tcp and the wheel comes first: a system
// UCX may lack CUDA support or be old (Debian 12's 1.13 has neither weak
// fences nor endpoint lane queries, and runs the CPU all-reduce across
// nodes about 2.5x slower at 64 MiB: docs/BENCHMARKS.md). pyDir runs only when its
// candidate is tried.
func searchOrder(dirs []string, pyDir func() (string, error), rdma bool) []candidate {
	var wheels []candidate
	seen := map[string]bool{}
	for _, d := range dirs {
		if d != "" && !seen[filepath.Clean(d)] {
			seen[filepath.Clean(d)] = true
			wheels = append(wheels, func() (string, error) { return filepath.Join(d, libraryName), nil })
		}
	}
	if pyDir != nil {
		wheels = append(wheels, func() (string, error) {
			d, err := pyDir()
			if err != nil {
				return "", fmt.Errorf("python3's libucx: %w", err)
			}
			if seen[filepath.Clean(d)] {
				return "", fmt.Errorf("python3's libucx: %s, tried above", d)
			}
			return filepath.Join(d, libraryName), nil
		})
	}
	system := func() (string, error) { return libraryName, nil }
	if rdma {
		return append([]candidate{system}, wheels...)
	}
	return append(wheels, system)
}

func notFound(tried []string, only string) error {
	where := "the dynamic loader's path, the given directories (and " + DirsEnv + "'s) and python3's libucx wheel"
	if only != "" {
		where = only
	}
	return status.Errorf(status.Unsupported,
		"UCX transport: no usable %s in %s (install it with `pip install libucx-cu13`, or set %s to its full path); tried: %s",
		libraryName, where, LibraryEnv, strings.Join(tried, "; "))
}

// pythonLibDir asks python3 where the libucx wheel lives without importing
// it (find_spec loads no UCX), once per process: a search that failed may
// run again.
var pythonLibDir = sync.OnceValues(askPython)

func askPython() (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "python3", "-c",
		"import importlib.util,os;s=importlib.util.find_spec('libucx');print(os.path.dirname(s.origin) if s and s.origin else '')").Output()
	if err != nil {
		return "", err
	}
	d := strings.TrimSpace(string(out))
	if d == "" {
		return "", fmt.Errorf("no libucx module")
	}
	return filepath.Join(d, "lib"), nil
}

// resolve looks up every entry point and checks the version.
func resolve(h *dl.Library) (*library, error) {
	lib := &library{path: h.Path()}
	for _, e := range lib.fn.table() {
		p, err := h.Sym(e.name)
		if err != nil && e.slot != &lib.fn.epQuery {
			return nil, err
		}
		*e.slot = p
	}
	var major, minor, release C.uint
	C.p2p_ucx_get_version(lib.fn.getVersion, &major, &minor, &release)
	lib.major, lib.minor, lib.release = int(major), int(minor), int(release)
	lib.version = C.GoString(C.p2p_ucx_version_string(lib.fn.getVersionString))
	if file := C.GoString(C.p2p_ucx_file(lib.fn.init)); file != "" {
		lib.path = file
	}
	if lib.major != minMajor || lib.minor < minMinor {
		return nil, fmt.Errorf("UCX %s is too old, want %d.%d or newer", lib.version, minMajor, minMinor)
	}
	return lib, nil
}

// statusText is ucs_status_string of s, e.g. "Connection reset by remote peer".
func (l *library) statusText(s C.int) string {
	return C.GoString(C.p2p_ucx_status_string(l.fn.statusString, s))
}

// String says which library and version were loaded.
func (l *library) String() string { return fmt.Sprintf("UCX %s (%s)", l.version, l.path) }
