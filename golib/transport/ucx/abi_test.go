package ucx

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// abiFields lists, per struct of ucp_abi.h, the real UCP type and every
// field declared; nested fields are checked through their first member.
var abiFields = []struct {
	mine, real string
	fields     []string
}{
	{"p2p_ucp_params", "ucp_params_t", []string{"field_mask", "features", "request_size", "request_init",
		"request_cleanup", "tag_sender_mask", "mt_workers_shared", "estimated_num_eps", "estimated_num_ppn", "name"}},
	{"p2p_ucp_worker_params", "ucp_worker_params_t", []string{"field_mask", "thread_mode", "cpu_mask", "events",
		"user_data", "event_fd", "flags", "name"}},
	{"p2p_ucp_worker_attr", "ucp_worker_attr_t", []string{"field_mask", "thread_mode", "address_flags", "address", "address_length"}},
	{"p2p_ucp_ep_params", "ucp_ep_params_t", []string{"field_mask", "address", "err_mode", "err_handler.cb",
		"err_handler.arg", "user_data", "flags", "sockaddr.addr", "sockaddr.addrlen", "conn_request", "name"}},
	{"p2p_ucp_mem_map_params", "ucp_mem_map_params_t", []string{"field_mask", "address", "length", "flags", "prot", "memory_type"}},
	{"p2p_ucp_request_param", "ucp_request_param_t", []string{"op_attr_mask", "flags", "request", "cb", "datatype",
		"user_data", "reply_buffer", "memory_type", "recv_info", "memh"}},
	{"p2p_ucp_am_handler_param", "ucp_am_handler_param_t", []string{"field_mask", "id", "flags", "cb", "arg"}},
	{"p2p_ucp_am_recv_param", "ucp_am_recv_param_t", []string{"recv_attr"}},
	{"p2p_ucp_context_attr", "ucp_context_attr_t", []string{"field_mask", "request_size", "thread_mode", "memory_types"}},
	{"p2p_ucp_transport_entry", "ucp_transport_entry_t", []string{"transport_name", "device_name"}},
	{"p2p_ucp_transports", "ucp_transports_t", []string{"entries", "num_entries", "entry_size"}},
	{"p2p_ucp_ep_attr", "ucp_ep_attr_t", []string{"field_mask", "name", "local_sockaddr", "remote_sockaddr", "transports"}},
}

// abiConstants are the values ucp_abi.h copies, by real name.
var abiConstants = []string{
	"UCP_PARAM_FIELD_FEATURES", "UCP_PARAM_FIELD_MT_WORKERS_SHARED", "UCP_PARAM_FIELD_ESTIMATED_NUM_EPS", "UCP_PARAM_FIELD_NAME", "UCP_FEATURE_RMA",
	"UCP_FEATURE_AM", "UCP_AM_HANDLER_PARAM_FIELD_ID", "UCP_AM_HANDLER_PARAM_FIELD_CB", "UCP_AM_HANDLER_PARAM_FIELD_ARG",
	"UCP_AM_SEND_FLAG_EAGER", "UCP_AM_RECV_ATTR_FLAG_RNDV",
	"UCP_WORKER_PARAM_FIELD_THREAD_MODE", "UCP_WORKER_ATTR_FIELD_ADDRESS", "UCS_THREAD_MODE_SERIALIZED",
	"UCP_EP_PARAM_FIELD_REMOTE_ADDRESS", "UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE", "UCP_EP_PARAM_FIELD_ERR_HANDLER",
	"UCP_ERR_HANDLING_MODE_NONE", "UCP_ERR_HANDLING_MODE_PEER", "UCP_EP_CLOSE_FLAG_FORCE",
	"UCP_MEM_MAP_PARAM_FIELD_ADDRESS", "UCP_MEM_MAP_PARAM_FIELD_LENGTH", "UCP_MEM_MAP_PARAM_FIELD_PROT",
	"UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE", "UCP_MEM_MAP_PROT_LOCAL_READ", "UCP_MEM_MAP_PROT_LOCAL_WRITE",
	"UCP_MEM_MAP_PROT_REMOTE_READ", "UCP_MEM_MAP_PROT_REMOTE_WRITE", "UCS_MEMORY_TYPE_HOST", "UCS_MEMORY_TYPE_CUDA",
	"UCP_OP_ATTR_FIELD_FLAGS", "UCP_OP_ATTR_FIELD_MEMORY_TYPE", "UCP_OP_ATTR_FIELD_MEMH",
	"UCP_ATTR_FIELD_MEMORY_TYPES", "UCP_EP_ATTR_FIELD_TRANSPORTS",
	"UCS_OK", "UCS_INPROGRESS", "UCS_ERR_LAST",
}

// ucxInclude finds a folder holding ucp/api/ucp.h: UCX_INCLUDE, then the
// libucx wheel's include folder.
func ucxInclude() (string, string) {
	if d := os.Getenv("UCX_INCLUDE"); d != "" {
		return d, ""
	}
	lib, err := pythonLibDir()
	if err != nil {
		return "", "no libucx wheel: " + err.Error()
	}
	d := filepath.Join(filepath.Dir(lib), "include")
	if _, err := os.Stat(filepath.Join(d, "ucp", "api", "ucp.h")); err != nil {
		return "", err.Error()
	}
	return d, ""
}

// TestABIMatchesHeader compiles ucp_abi.h beside the real ucp.h and checks
// every declared field's offset and size and every copied constant.
func TestABIMatchesHeader(t *testing.T) {
	inc, why := ucxInclude()
	if inc == "" {
		t.Skipf("no UCX headers (pip install libucx-cu13, or set UCX_INCLUDE): %s", why)
	}
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("no C compiler %q: %v", cc, err)
	}
	here, _ := os.Getwd()
	var src strings.Builder
	src.WriteString("#include <stdio.h>\n#include <ucp/api/ucp.h>\n#include \"ucp_abi.h\"\n")
	src.WriteString("#define F(M, R, f) printf(\"%s.%s %zu %zu %zu %zu\\n\", #M, #f, offsetof(M, f), offsetof(R, f), sizeof(((M*)0)->f), sizeof(((R*)0)->f))\n")
	src.WriteString("#define K(n) printf(\"%s %lld %lld\\n\", #n, (long long)P2P_##n, (long long)n)\nint main(void) {\n")
	for _, s := range abiFields {
		for _, f := range s.fields {
			fmt.Fprintf(&src, "\tF(%s, %s, %s);\n", s.mine, s.real, f)
		}
	}
	for _, k := range abiConstants {
		fmt.Fprintf(&src, "\tK(%s);\n", k)
	}
	src.WriteString("\treturn 0;\n}\n")
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "abi.c"), []byte(src.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "abi")
	if out, err := exec.Command(cc, "-o", bin, "-I", inc, "-I", here, filepath.Join(dir, "abi.c")).CombinedOutput(); err != nil {
		t.Fatalf("%s abi.c: %v\n%s", cc, err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	checked := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		switch len(f) {
		case 5: // field: my offset, real offset, my size, real size
			if f[1] != f[2] || f[3] != f[4] {
				t.Errorf("%s: offset %s size %s, ucp.h says offset %s size %s", f[0], f[1], f[3], f[2], f[4])
			}
		case 3: // constant: mine, real
			if f[1] != f[2] {
				t.Errorf("%s = %s, ucp.h says %s", f[0], f[1], f[2])
			}
		default:
			t.Errorf("unexpected line %q", line)
		}
		checked++
	}
	if checked == 0 {
		t.Errorf("nothing checked")
	}
}
