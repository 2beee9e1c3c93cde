// Package kernels embeds the CUDA sources in this directory, which NVRTC
// compiles at run time: *.cu files are kernels, *.cuh files are headers they
// include by bare name (#include "common.cuh").
package kernels

import (
	"embed"
	"fmt"
	"io/fs"
	"sort"
	"strings"
)

// go:embed fails the build when a pattern matches nothing: this directory
// must always hold at least one .cu and one .cuh file.
//
//go:embed *.cu *.cuh
var files embed.FS

// InstantiatePrefix starts a comment line in a .cu file that names one
// template instantiation to compile and lower, e.g.
//
//	// p2pcomm:instantiate allreduce_oneshot<__nv_bfloat16, 4>
const InstantiatePrefix = "// p2pcomm:instantiate "

func isSource(name string) bool {
	return strings.HasSuffix(name, ".cu") || strings.HasSuffix(name, ".cuh")
}

func read(filter func(string) bool) map[string]string {
	out := map[string]string{}
	entries, _ := fs.ReadDir(files, ".")
	for _, e := range entries {
		if e.IsDir() || !filter(e.Name()) {
			continue
		}
		data, err := files.ReadFile(e.Name())
		if err == nil {
			out[e.Name()] = string(data)
		}
	}
	return out
}

// Sources returns every .cu and .cuh file, by file name.
func Sources() map[string]string { return read(isSource) }

// Headers returns the .cuh files, by file name: the Headers of an NVRTC
// compile request.
func Headers() map[string]string {
	return read(func(n string) bool { return strings.HasSuffix(n, ".cuh") })
}

// Kernels returns the names of the .cu files, sorted.
func Kernels() []string {
	var names []string
	for n := range read(func(n string) bool { return strings.HasSuffix(n, ".cu") }) {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Source returns the text of one .cu or .cuh file; the error wraps
// fs.ErrNotExist for an unknown name.
func Source(name string) (string, error) {
	if !isSource(name) {
		return "", fmt.Errorf("kernel source %q: %w", name, fs.ErrNotExist)
	}
	data, err := files.ReadFile(name)
	if err != nil {
		return "", fmt.Errorf("kernel source %q: %w", name, fs.ErrNotExist)
	}
	return string(data), nil
}

// Instantiations returns the name expressions declared in src by lines of
// the form "// p2pcomm:instantiate <name expression>", in file order.
// Leading whitespace before "//" is allowed; the expression is trimmed.
func Instantiations(src string) []string {
	var out []string
	for _, line := range strings.Split(src, "\n") {
		line = strings.TrimSpace(line)
		if rest, ok := strings.CutPrefix(line, InstantiatePrefix); ok {
			if e := strings.TrimSpace(rest); e != "" {
				out = append(out, e)
			}
		}
	}
	return out
}
