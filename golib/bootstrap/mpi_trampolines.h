// Trampolines for the MPI entry points: Go cannot call a C function pointer,
// so each signature gets one static inline function that casts the pointer
// and calls it. No MPI header is included, so the build needs no MPI. Open
// MPI's handles (MPI_Comm, MPI_Datatype, MPI_Errhandler) are pointers and
// travel as void*; return codes and counts are int.
#include <stddef.h>

static inline int p2p_mpi_v(void* f) { return ((int (*)(void))f)(); }
static inline int p2p_mpi_p(void* f, void* a) { return ((int (*)(void*))f)(a); }
static inline int p2p_mpi_p_p(void* f, void* a, void* b) { return ((int (*)(void*, void*))f)(a, b); }

// MPI_Init_thread without argc and argv, which MPI-2 and later allow.
static inline int p2p_mpi_init_thread(void* f, int required, int* provided) {
	return ((int (*)(int*, char***, int, int*))f)(NULL, NULL, required, provided);
}

static inline int p2p_mpi_allgather(void* f, const void* send, int sendcount, void* sendtype,
		void* recv, int recvcount, void* recvtype, void* comm) {
	return ((int (*)(const void*, int, void*, void*, int, void*, void*))f)(
			send, sendcount, sendtype, recv, recvcount, recvtype, comm);
}

static inline int p2p_mpi_error_string(void* f, int code, char* buf, int* len) {
	return ((int (*)(int, char*, int*))f)(code, buf, len);
}
