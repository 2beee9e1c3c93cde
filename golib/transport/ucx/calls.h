// Trampolines: Go cannot call a C function pointer, so each UCP entry point
// gets one static inline function that casts the pointer and calls it.
// Parameter structs are built here, on the C stack, so that no Go pointer is
// kept by UCP. Handles travel as void*, ucs_status_t as int.
#include <string.h>
#include "ucp_abi.h"

// p2p_ucx_split turns a ucs_status_ptr_t into a request (NULL when the call
// completed or failed at once) and a status: UCS_OK, UCS_INPROGRESS, or the
// error encoded in the pointer (values in [UCS_ERR_LAST, 0)).
static inline void* p2p_ucx_split(void* p, int* status) {
	intptr_t v = (intptr_t)p;
	if (p == NULL) {
		*status = P2P_UCS_OK;
		return NULL;
	}
	if (v < 0 && v >= P2P_UCS_ERR_LAST) {
		*status = (int)v;
		return NULL;
	}
	*status = P2P_UCS_INPROGRESS;
	return p;
}

// p2p_ucx_ep_failed is every endpoint's error handler: it records the first
// failure in the peer's slot (C memory) for Go to read; no Go code runs
// inside UCP's callback.
static void p2p_ucx_ep_failed(void* arg, void* ep, int status) {
	(void)ep;
	int expected = 0;
	__atomic_compare_exchange_n((int*)arg, &expected, status, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

static inline int p2p_ucx_slot(const int* slots, int i) { return __atomic_load_n(&slots[i], __ATOMIC_SEQ_CST); }

static inline void p2p_ucx_get_version(void* f, unsigned* major, unsigned* minor, unsigned* release) {
	((void (*)(unsigned*, unsigned*, unsigned*))f)(major, minor, release);
}
static inline const char* p2p_ucx_version_string(void* f) { return ((const char* (*)(void))f)(); }
static inline const char* p2p_ucx_status_string(void* f, int status) { return ((const char* (*)(int))f)(status); }

static inline int p2p_ucx_config_read(void* f, void** config) {
	return ((int (*)(const char*, const char*, void**))f)(NULL, NULL, config);
}
static inline int p2p_ucx_config_modify(void* f, void* config, const char* name, const char* value) {
	return ((int (*)(void*, const char*, const char*))f)(config, name, value);
}
static inline void p2p_ucx_call_p(void* f, void* a) { ((void (*)(void*))f)(a); }
static inline void p2p_ucx_call_pp(void* f, void* a, void* b) { ((void (*)(void*, void*))f)(a, b); }
static inline int p2p_ucx_status_p(void* f, void* a) { return ((int (*)(void*))f)(a); }
static inline int p2p_ucx_status_pp(void* f, void* a, void* b) { return ((int (*)(void*, void*))f)(a, b); }
static inline unsigned p2p_ucx_progress(void* f, void* worker) { return ((unsigned (*)(void*))f)(worker); }

// p2p_ucx_init creates a context for RMA. api_minor is the
// UCP API version this code is written against. shared: workers of the
// context run on several threads at once.
static inline int p2p_ucx_init(void* f, unsigned api_major, unsigned api_minor, void* config,
		size_t num_eps, const char* name, int shared, void** context) {
	p2p_ucp_params p;
	memset(&p, 0, sizeof p);
	p.field_mask = P2P_UCP_PARAM_FIELD_FEATURES | P2P_UCP_PARAM_FIELD_ESTIMATED_NUM_EPS | P2P_UCP_PARAM_FIELD_NAME;
	p.features = P2P_UCP_FEATURE_RMA | P2P_UCP_FEATURE_AM;
	if (shared) {
		p.field_mask |= P2P_UCP_PARAM_FIELD_MT_WORKERS_SHARED;
		p.mt_workers_shared = 1;
	}
	p.estimated_num_eps = num_eps;
	p.name = name;
	return ((int (*)(unsigned, unsigned, const p2p_ucp_params*, const void*, void**))f)(
			api_major, api_minor, &p, config, context);
}

static inline int p2p_ucx_worker_create(void* f, void* context, void** worker) {
	p2p_ucp_worker_params p;
	memset(&p, 0, sizeof p);
	p.field_mask = P2P_UCP_WORKER_PARAM_FIELD_THREAD_MODE;
	p.thread_mode = P2P_UCS_THREAD_MODE_SERIALIZED;
	return ((int (*)(void*, const p2p_ucp_worker_params*, void**))f)(context, &p, worker);
}

static inline int p2p_ucx_worker_address(void* f, void* worker, void** address, size_t* length) {
	p2p_ucp_worker_attr a;
	memset(&a, 0, sizeof a);
	a.field_mask = P2P_UCP_WORKER_ATTR_FIELD_ADDRESS;
	int st = ((int (*)(void*, p2p_ucp_worker_attr*))f)(worker, &a);
	*address = a.address;
	*length = a.address_length;
	return st;
}

// p2p_ucx_ep_create connects to a peer's worker address with err_mode
// (UCP_ERR_HANDLING_MODE_*); with peer failure handling the first failure
// lands in *slot.
static inline int p2p_ucx_ep_create(void* f, void* worker, const void* address, int err_mode, int* slot, void** ep) {
	p2p_ucp_ep_params p;
	memset(&p, 0, sizeof p);
	p.field_mask = P2P_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | P2P_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
			P2P_UCP_EP_PARAM_FIELD_ERR_HANDLER;
	p.address = address;
	p.err_mode = err_mode;
	p.err_handler.cb = (void*)p2p_ucx_ep_failed;
	p.err_handler.arg = slot;
	return ((int (*)(void*, const p2p_ucp_ep_params*, void**))f)(worker, &p, ep);
}

static inline void* p2p_ucx_ep_flush(void* f, void* ep, int* status) {
	p2p_ucp_request_param p;
	memset(&p, 0, sizeof p);
	return p2p_ucx_split(((void* (*)(void*, const p2p_ucp_request_param*))f)(ep, &p), status);
}

// p2p_ucx_ep_close closes without flushing: the caller flushed what it
// needed, and a dead peer cannot answer a flush.
static inline void* p2p_ucx_ep_close(void* f, void* ep, int* status) {
	p2p_ucp_request_param p;
	memset(&p, 0, sizeof p);
	p.op_attr_mask = P2P_UCP_OP_ATTR_FIELD_FLAGS;
	p.flags = P2P_UCP_EP_CLOSE_FLAG_FORCE;
	return p2p_ucx_split(((void* (*)(void*, const p2p_ucp_request_param*))f)(ep, &p), status);
}

// Addresses arrive as integers: they name memory outside the Go heap.
static inline int p2p_ucx_mem_map(void* f, void* context, uint64_t address, size_t length, int memory_type, void** memh) {
	p2p_ucp_mem_map_params p;
	memset(&p, 0, sizeof p);
	p.field_mask = P2P_UCP_MEM_MAP_PARAM_FIELD_ADDRESS | P2P_UCP_MEM_MAP_PARAM_FIELD_LENGTH |
			P2P_UCP_MEM_MAP_PARAM_FIELD_PROT | P2P_UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
	p.address = (void*)(uintptr_t)address;
	p.length = length;
	p.prot = P2P_UCP_MEM_MAP_PROT_LOCAL_READ | P2P_UCP_MEM_MAP_PROT_LOCAL_WRITE |
			P2P_UCP_MEM_MAP_PROT_REMOTE_READ | P2P_UCP_MEM_MAP_PROT_REMOTE_WRITE;
	p.memory_type = memory_type;
	return ((int (*)(void*, const p2p_ucp_mem_map_params*, void**))f)(context, &p, memh);
}

static inline int p2p_ucx_rkey_pack(void* f, void* context, void* memh, void** buffer, size_t* size) {
	return ((int (*)(void*, void*, void**, size_t*))f)(context, memh, buffer, size);
}
static inline int p2p_ucx_rkey_unpack(void* f, void* ep, const void* buffer, void** rkey) {
	return ((int (*)(void*, const void*, void**))f)(ep, buffer, rkey);
}

// p2p_ucx_put starts a put of length bytes; memh (may be NULL) is the
// source's registration, which spares UCP a lookup.
static inline void* p2p_ucx_put(void* f, void* ep, uint64_t buffer, size_t length, uint64_t remote,
		void* rkey, void* memh, int memory_type, int* status) {
	p2p_ucp_request_param p;
	memset(&p, 0, sizeof p);
	p.op_attr_mask = P2P_UCP_OP_ATTR_FIELD_MEMORY_TYPE;
	p.memory_type = memory_type;
	if (memh != NULL) {
		p.op_attr_mask |= P2P_UCP_OP_ATTR_FIELD_MEMH;
		p.memh = memh;
	}
	return p2p_ucx_split(((void* (*)(void*, const void*, size_t, uint64_t, void*, const p2p_ucp_request_param*))f)(
			ep, (const void*)(uintptr_t)buffer, length, remote, rkey, &p), status);
}

// p2p_ucx_memory_types is the bit set of UCS memory types the context
// reaches (bit UCS_MEMORY_TYPE_CUDA: some transport can touch device memory,
// if only through cuda_copy).
static inline int p2p_ucx_memory_types(void* f, void* context, uint64_t* types) {
	p2p_ucp_context_attr a;
	memset(&a, 0, sizeof a);
	a.field_mask = P2P_UCP_ATTR_FIELD_MEMORY_TYPES;
	int st = ((int (*)(void*, p2p_ucp_context_attr*))f)(context, &a);
	*types = a.memory_types;
	return st;
}

// p2p_ucx_ep_transports writes the names of the endpoint's transports,
// each followed by a comma, into buf (len bytes, NUL-terminated).
static inline int p2p_ucx_ep_transports(void* f, void* ep, char* buf, size_t len) {
	p2p_ucp_transport_entry e[16];
	p2p_ucp_ep_attr a;
	memset(&a, 0, sizeof a);
	memset(e, 0, sizeof e);
	a.field_mask = P2P_UCP_EP_ATTR_FIELD_TRANSPORTS;
	a.transports.entries = e;
	a.transports.num_entries = 16;
	a.transports.entry_size = sizeof e[0];
	int st = ((int (*)(void*, p2p_ucp_ep_attr*))f)(ep, &a);
	buf[0] = 0;
	if (st != P2P_UCS_OK) return st;
	for (unsigned i = 0; i < a.transports.num_entries && i < 16; i++) {
		if (e[i].transport_name == NULL) continue;
		size_t used = strlen(buf);
		if (used + strlen(e[i].transport_name) + 2 > len) break;
		strcat(buf, e[i].transport_name);
		strcat(buf, ",");
	}
	return st;
}

// Small staging ring entries travel as one active message instead of two
// puts around a fence: the header is the landing slot's address, the data
// the entry (its 64-byte header, then its bytes). The receiver's handler,
// run inside ucp_worker_progress, copies the entry into the landing slot
// and stores its sequence word last, so the ring reads it as it reads a
// put entry. No Go code runs inside UCP's callback.
enum { P2P_AM_LAND = 1 };

// p2p_landing bounds what a handler may write: the landing rings.
typedef struct {
	uint64_t base, size;
} p2p_landing;

static int p2p_ucx_am_land(void* arg, const void* header, size_t header_length, void* data, size_t length,
		const p2p_ucp_am_recv_param* param) {
	const p2p_landing* l = (const p2p_landing*)arg;
	uint64_t addr;
	if (header_length != sizeof addr || length < 8 || (param->recv_attr & P2P_UCP_AM_RECV_ATTR_FLAG_RNDV)) {
		return P2P_UCS_OK; // not ours: the ring never sees it, and the sender times out naming us
	}
	memcpy(&addr, header, sizeof addr);
	if (addr % 8 != 0 || addr < l->base || addr - l->base > l->size || length > l->size - (addr - l->base)) {
		return P2P_UCS_OK;
	}
	uint64_t seq;
	memcpy(&seq, data, sizeof seq);
	memcpy((char*)(uintptr_t)addr + 8, (const char*)data + 8, length - 8);
	__atomic_store_n((uint64_t*)(uintptr_t)addr, seq, __ATOMIC_RELEASE);
	return P2P_UCS_OK;
}

// p2p_ucx_set_am sets the worker's handler of active messages id.
static inline int p2p_ucx_set_am(void* f, void* worker, unsigned id, void* cb, void* arg) {
	p2p_ucp_am_handler_param p;
	memset(&p, 0, sizeof p);
	p.field_mask = P2P_UCP_AM_HANDLER_PARAM_FIELD_ID | P2P_UCP_AM_HANDLER_PARAM_FIELD_CB |
			P2P_UCP_AM_HANDLER_PARAM_FIELD_ARG;
	p.id = id;
	p.cb = cb;
	p.arg = arg;
	return ((int (*)(void*, const p2p_ucp_am_handler_param*))f)(worker, &p);
}

static inline int p2p_ucx_set_am_land(void* f, void* worker, p2p_landing* l) {
	return p2p_ucx_set_am(f, worker, P2P_AM_LAND, (void*)p2p_ucx_am_land, l);
}

// p2p_ucx_am_send sends active message id, eagerly: header_length bytes at
// header, then length bytes of host memory at buffer; both live until the
// request completes (UCP may send later, e.g. while the endpoint connects,
// and older UCP cannot copy the header).
static inline void* p2p_ucx_am_send(void* f, void* ep, unsigned id, const void* header, size_t header_length,
		uint64_t buffer, size_t length, void* memh, int* status) {
	p2p_ucp_request_param p;
	memset(&p, 0, sizeof p);
	p.op_attr_mask = P2P_UCP_OP_ATTR_FIELD_FLAGS | P2P_UCP_OP_ATTR_FIELD_MEMORY_TYPE;
	p.flags = P2P_UCP_AM_SEND_FLAG_EAGER;
	p.memory_type = P2P_UCS_MEMORY_TYPE_HOST;
	if (memh != NULL) {
		p.op_attr_mask |= P2P_UCP_OP_ATTR_FIELD_MEMH;
		p.memh = memh;
	}
	return p2p_ucx_split(((void* (*)(void*, unsigned, const void*, size_t, const void*, size_t,
			const p2p_ucp_request_param*))f)(ep, id, header, header_length, (const void*)(uintptr_t)buffer, length, &p),
			status);
}

// p2p_ucx_am_land_send sends an entry of length bytes at buffer to the
// landing slot whose address is the 8 bytes at addr.
static inline void* p2p_ucx_am_land_send(void* f, void* ep, uint64_t addr, uint64_t buffer, size_t length,
		void* memh, int* status) {
	return p2p_ucx_am_send(f, ep, P2P_AM_LAND, (const void*)(uintptr_t)addr, sizeof(uint64_t), buffer, length, memh,
			status);
}

// A put to host memory with the signal behind it travels as one active
// message when the endpoint has a single lane (tcp): the header names the
// destination, the signal word and its new total, the data follows. The
// receiver's handler copies the data, then stores the total (never a
// smaller one than the word holds), so a kernel polling the word sees the
// data first: one send instead of a put, a fence and a put.
enum { P2P_AM_PUTSIG = 2 };

typedef struct {
	uint64_t dst, word, total;
} p2p_putsig_header;

// p2p_ranges bounds what the handler may write: this rank's registered
// host memory, replaced whole (under the transport's lock, which progress
// holds while handlers run) whenever a registration comes or goes.
typedef struct {
	uint64_t n;
	uint64_t r[]; // base, size pairs
} p2p_ranges;

typedef struct {
	p2p_ranges* ranges;
} p2p_putsig_target;

static inline int p2p_ranges_hold(const p2p_ranges* rs, uint64_t addr, uint64_t n) {
	if (rs == NULL) return 0;
	for (uint64_t i = 0; i < rs->n; i++) {
		uint64_t base = rs->r[2 * i], size = rs->r[2 * i + 1];
		if (addr >= base && addr - base <= size && n <= size - (addr - base)) return 1;
	}
	return 0;
}

static int p2p_ucx_am_putsig(void* arg, const void* header, size_t header_length, void* data, size_t length,
		const p2p_ucp_am_recv_param* param) {
	const p2p_putsig_target* t = (const p2p_putsig_target*)arg;
	p2p_putsig_header h;
	if (header_length != sizeof h || (param->recv_attr & P2P_UCP_AM_RECV_ATTR_FLAG_RNDV)) {
		return P2P_UCS_OK; // not ours: nothing lands, and the sender's waiter times out naming us
	}
	memcpy(&h, header, sizeof h);
	if (h.word % 8 != 0 || !p2p_ranges_hold(t->ranges, h.dst, length) || !p2p_ranges_hold(t->ranges, h.word, 8)) {
		return P2P_UCS_OK;
	}
	memcpy((void*)(uintptr_t)h.dst, data, length);
	uint64_t* w = (uint64_t*)(uintptr_t)h.word;
	if (__atomic_load_n(w, __ATOMIC_RELAXED) < h.total) {
		__atomic_store_n(w, h.total, __ATOMIC_RELEASE);
	}
	return P2P_UCS_OK;
}

static inline int p2p_ucx_set_am_putsig(void* f, void* worker, p2p_putsig_target* t) {
	return p2p_ucx_set_am(f, worker, P2P_AM_PUTSIG, (void*)p2p_ucx_am_putsig, t);
}

// p2p_ucx_am_putsig_send sends length bytes at src under the header at
// header (C memory); both live until the request completes.
static inline void* p2p_ucx_am_putsig_send(void* f, void* ep, void* header, uint64_t src, size_t length, void* memh,
		int* status) {
	return p2p_ucx_am_send(f, ep, P2P_AM_PUTSIG, header, sizeof(p2p_putsig_header), src, length, memh, status);
}
