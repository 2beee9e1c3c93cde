package main

/*
#include <stdint.h>
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"unsafe"

	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/gpucoll"
	"github.com/p2pcomm/p2pcomm/golib/procenv"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// p2p_precompile builds the library's kernels for sm_<arch> into the kernel
// cache (files: comma-separated names in native/kernels, or empty for
// all), with P2PCOMM_NVRTC_OPTIONS as a communicator would, so that a job's
// first calls load them (see gpucoll.Precompile). With progress set it
// says on stderr as each file ends. report receives, as JSON with a
// terminating zero (room for report_cap bytes), the cache folder and each
// file's build.
//
//export p2p_precompile
func p2p_precompile(arch C.int, files *C.char, progress C.int, report *C.char, reportCap C.int64_t) C.int {
	return guard(func() error {
		if report == nil {
			return status.Errorf(status.InvalidArgument, "precompile: null report")
		}
		var names []string
		if files != nil {
			for _, f := range strings.Split(C.GoString(files), ",") {
				if f = strings.TrimSpace(f); f != "" {
					names = append(names, f)
				}
			}
		}
		built, err := gpucoll.Precompile(int(arch), names, strings.Fields(procenv.Get("P2PCOMM_NVRTC_OPTIONS")),
			func(b gpucoll.Built) {
				if progress != 0 {
					from := ""
					if b.Cached {
						from = " (already in the cache)"
					}
					fmt.Fprintf(os.Stderr, "%s for sm_%d: %.1f s%s\n", b.File, int(arch), b.Seconds, from)
				}
			})
		if err != nil {
			return err
		}
		dir, _ := cuda.CacheDir()
		text, err := json.Marshal(struct {
			CacheDir string          `json:"cache_dir"`
			Built    []gpucoll.Built `json:"built"`
		}{dir, built})
		if err == nil && int64(len(text)) >= int64(reportCap) {
			err = status.Errorf(status.Capacity, "precompile: %d bytes of report, room for %d", len(text)+1, reportCap)
		}
		if err != nil {
			return err
		}
		out := unsafe.Slice((*byte)(unsafe.Pointer(report)), len(text)+1)
		copy(out, text)
		out[len(text)] = 0
		return nil
	})
}
