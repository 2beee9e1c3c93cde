// The slice of UCP's C ABI this package uses, declared here so that the build
// needs no UCX headers. Every parameter struct starts with a field mask that
// names the fields set, so a struct may stop after the last field used: UCP
// reads no field whose bit is clear. abi_test.go compiles these declarations
// against ucp.h, when present, and compares every size and offset.
#include <stddef.h>
#include <stdint.h>

// ucp_params_t, through name.
typedef struct {
	uint64_t field_mask;
	uint64_t features;
	size_t request_size;
	void* request_init;
	void* request_cleanup;
	uint64_t tag_sender_mask;
	int mt_workers_shared;
	size_t estimated_num_eps;
	size_t estimated_num_ppn;
	const char* name;
} p2p_ucp_params;

// ucp_worker_params_t, through name; cpu_mask is ucs_cpu_set_t (1024 bits).
typedef struct {
	uint64_t field_mask;
	int thread_mode;
	unsigned long cpu_mask[16];
	unsigned events;
	void* user_data;
	int event_fd;
	uint64_t flags;
	const char* name;
} p2p_ucp_worker_params;

// ucp_worker_attr_t, through address_length.
typedef struct {
	uint64_t field_mask;
	int thread_mode;
	uint32_t address_flags;
	void* address;
	size_t address_length;
} p2p_ucp_worker_attr;

// ucp_ep_params_t, through name; err_handler is ucp_err_handler_t and
// sockaddr is ucs_sock_addr_t.
typedef struct {
	uint64_t field_mask;
	const void* address;
	int err_mode;
	struct {
		void* cb;
		void* arg;
	} err_handler;
	void* user_data;
	unsigned flags;
	struct {
		const void* addr;
		unsigned addrlen;
	} sockaddr;
	void* conn_request;
	const char* name;
} p2p_ucp_ep_params;

// ucp_mem_map_params_t, through memory_type.
typedef struct {
	uint64_t field_mask;
	void* address;
	size_t length;
	unsigned flags;
	unsigned prot;
	int memory_type;
} p2p_ucp_mem_map_params;

// ucp_request_param_t, through memh; cb and recv_info are unions of pointers.
typedef struct {
	uint32_t op_attr_mask;
	uint32_t flags;
	void* request;
	void* cb;
	uint64_t datatype;
	void* user_data;
	void* reply_buffer;
	int memory_type;
	void* recv_info;
	void* memh;
} p2p_ucp_request_param;

// ucp_am_handler_param_t (whole); cb is ucp_am_recv_callback_t.
typedef struct {
	uint64_t field_mask;
	unsigned id;
	uint32_t flags;
	void* cb;
	void* arg;
} p2p_ucp_am_handler_param;

// ucp_am_recv_param_t, through recv_attr.
typedef struct {
	uint64_t recv_attr;
} p2p_ucp_am_recv_param;

// ucp_context_attr_t, through memory_types.
typedef struct {
	uint64_t field_mask;
	size_t request_size;
	int thread_mode;
	uint64_t memory_types;
} p2p_ucp_context_attr;

// ucp_transport_entry_t and ucp_transports_t.
typedef struct {
	const char* transport_name;
	const char* device_name;
} p2p_ucp_transport_entry;

typedef struct {
	p2p_ucp_transport_entry* entries;
	unsigned num_entries;
	size_t entry_size;
} p2p_ucp_transports;

// ucp_ep_attr_t, through transports; the two sockaddr_storage fields are
// 128 bytes each, 8-byte aligned, and unused here.
typedef struct {
	uint64_t field_mask;
	char name[32];
	uint64_t local_sockaddr[16];
	uint64_t remote_sockaddr[16];
	p2p_ucp_transports transports;
} p2p_ucp_ep_attr;

// Bits and values used, from ucp.h, ucp_def.h and ucs/.
enum {
	P2P_UCP_PARAM_FIELD_FEATURES = 1 << 0,
	P2P_UCP_PARAM_FIELD_MT_WORKERS_SHARED = 1 << 5,
	P2P_UCP_PARAM_FIELD_ESTIMATED_NUM_EPS = 1 << 6,
	P2P_UCP_PARAM_FIELD_NAME = 1 << 8,
	P2P_UCP_FEATURE_RMA = 1 << 1,
	P2P_UCP_FEATURE_AM = 1 << 6,

	P2P_UCP_AM_HANDLER_PARAM_FIELD_ID = 1 << 0,
	P2P_UCP_AM_HANDLER_PARAM_FIELD_CB = 1 << 2,
	P2P_UCP_AM_HANDLER_PARAM_FIELD_ARG = 1 << 3,
	P2P_UCP_AM_SEND_FLAG_EAGER = 1 << 1,
	P2P_UCP_AM_RECV_ATTR_FLAG_RNDV = 1 << 17,

	P2P_UCP_ATTR_FIELD_MEMORY_TYPES = 1 << 2,
	P2P_UCP_EP_ATTR_FIELD_TRANSPORTS = 1 << 3,

	P2P_UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0,
	P2P_UCP_WORKER_ATTR_FIELD_ADDRESS = 1 << 1,
	P2P_UCS_THREAD_MODE_SERIALIZED = 1,

	P2P_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0,
	P2P_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1,
	P2P_UCP_EP_PARAM_FIELD_ERR_HANDLER = 1 << 2,
	P2P_UCP_ERR_HANDLING_MODE_NONE = 0,
	P2P_UCP_ERR_HANDLING_MODE_PEER = 1,
	P2P_UCP_EP_CLOSE_FLAG_FORCE = 1 << 0,

	P2P_UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0,
	P2P_UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1,
	P2P_UCP_MEM_MAP_PARAM_FIELD_PROT = 1 << 3,
	P2P_UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1 << 4,
	P2P_UCP_MEM_MAP_PROT_LOCAL_READ = 1 << 0,
	P2P_UCP_MEM_MAP_PROT_LOCAL_WRITE = 1 << 1,
	P2P_UCP_MEM_MAP_PROT_REMOTE_READ = 1 << 8,
	P2P_UCP_MEM_MAP_PROT_REMOTE_WRITE = 1 << 9,
	P2P_UCS_MEMORY_TYPE_HOST = 0,
	P2P_UCS_MEMORY_TYPE_CUDA = 1,

	P2P_UCP_OP_ATTR_FIELD_FLAGS = 1 << 4,
	P2P_UCP_OP_ATTR_FIELD_MEMORY_TYPE = 1 << 6,
	P2P_UCP_OP_ATTR_FIELD_MEMH = 1 << 8,

	P2P_UCS_OK = 0,
	P2P_UCS_INPROGRESS = 1,
	P2P_UCS_ERR_LAST = -100,
};
