"""Loads libp2pcomm.so with ctypes and declares every export's signature."""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import pathlib
import threading

from .errors import ForkError, P2PCommError, error_for

ABI_VERSION = 11
_LOAD_PID = os.getpid()
# True in a child forked after import: hot paths read this flag instead of
# calling os.getpid(), a system call (a microsecond in a VM) per call.
forked = False


def _mark_forked() -> None:
    global forked
    forked = True


os.register_at_fork(after_in_child=_mark_forked)
_HERE = pathlib.Path(__file__).resolve().parent

ALLGATHER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)
BARRIER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)

_u64, _i64, _i32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32
_SIGNATURES = {
    "p2p_abi_version": ([], ctypes.c_int),
    "p2p_last_error": ([ctypes.c_char_p, _i64], _i64),
    "p2p_init": ([ctypes.c_char_p, ALLGATHER_FN, BARRIER_FN, ctypes.c_void_p, ctypes.POINTER(_u64)], ctypes.c_int),
    "p2p_finalize": ([_u64], ctypes.c_int),
    "p2p_rank": ([_u64, ctypes.POINTER(_i32)], ctypes.c_int),
    "p2p_world_size": ([_u64, ctypes.POINTER(_i32)], ctypes.c_int),
    "p2p_alloc": ([_u64, _i64, ctypes.POINTER(_u64)], ctypes.c_int),
    "p2p_free": ([_u64, _u64], ctypes.c_int),
    "p2p_register": ([_u64, _u64, _i64], ctypes.c_int),
    "p2p_deregister": ([_u64, _u64], ctypes.c_int),
    "p2p_all_reduce": ([_u64, _u64, _u64, _i64, _i32, _i32, _i32, _u64], ctypes.c_int),
    "p2p_all_reduce_packed": ([ctypes.c_char_p], ctypes.c_int),
    "p2p_all_reduce_reject": ([_u64, _i32, ctypes.c_char_p, _i64, _i32, _i32, _i32, _u64], ctypes.c_int),
    "p2p_all_reduce_rmsnorm_packed": ([ctypes.c_char_p], ctypes.c_int),
    "p2p_all_reduce_rmsnorm": ([_u64, _u64, _u64, _u64, _u64, _u64, _i64, _i64, _i32, ctypes.c_float, _i32, _u64],
                               ctypes.c_int),
    "p2p_all_reduce_rmsnorm_reject": ([_u64, _i32, ctypes.c_char_p, _i64, _i64, _i32, _i32, _u64], ctypes.c_int),
    "p2p_barrier": ([_u64], ctypes.c_int),
    "p2p_check": ([_u64], ctypes.c_int),
    "p2p_prepare_kernel": ([_u64, ctypes.c_char_p, ctypes.c_char_p], ctypes.c_int),
    "p2p_host_allgather": ([_u64, ctypes.c_void_p, _i64, ctypes.c_void_p], ctypes.c_int),
    "p2p_shutdown": ([], ctypes.c_int),
    "p2p_peer_ptr": ([_u64, _u64, _i64, _i32, ctypes.POINTER(_u64)], ctypes.c_int),
    "p2p_stream_barrier": ([_u64, _u64, ctypes.c_int], ctypes.c_int),
    "p2p_launch": ([_u64, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, _i64, ctypes.c_uint32, ctypes.c_uint32,
                    ctypes.c_uint32, _u64], ctypes.c_int),
    "p2p_device_info": ([_u64, ctypes.POINTER(_i32)], ctypes.c_int),
    "p2p_wait_info": ([_u64, ctypes.POINTER(_u64), ctypes.POINTER(_u64), ctypes.POINTER(_u64)], ctypes.c_int),
    "p2p_register_graph_buffers": ([_u64, ctypes.POINTER(_i64)], ctypes.c_int),
    "p2p_topology": ([_u64, ctypes.POINTER(_i32), _i32], ctypes.c_int),
    "p2p_channel_sizes": ([ctypes.POINTER(_u64), ctypes.POINTER(_u64)], ctypes.c_int),
    "p2p_memory_channels": ([_u64, _u64, _u64, ctypes.c_void_p, _u64, ctypes.POINTER(_u64)], ctypes.c_int),
    "p2p_port_channels": ([_u64, _u64, _u64, ctypes.c_void_p, _u64, ctypes.POINTER(_u64)], ctypes.c_int),
    "p2p_channels_close": ([_u64, _u64], ctypes.c_int),
    "p2p_port_put": ([_u64, _u64, _i32, _u64, _u64, _u64], ctypes.c_int),
    "p2p_port_signal": ([_u64, _u64, _i32], ctypes.c_int),
    "p2p_port_flush": ([_u64, _u64, _i32], ctypes.c_int),
    "p2p_port_wait": ([_u64, _u64, _i32, _u64], ctypes.c_int),
    "p2p_moe_create": ([_u64, ctypes.c_char_p, ctypes.POINTER(_u64), ctypes.c_char_p, _i64], ctypes.c_int),
    "p2p_moe_dispatch": ([ctypes.c_char_p], ctypes.c_int),  # argument blocks: moe.py's _*_ARGS
    "p2p_moe_expand": ([ctypes.c_char_p], ctypes.c_int),
    "p2p_moe_combine": ([ctypes.c_char_p], ctypes.c_int),
    "p2p_moe_destroy": ([_u64], ctypes.c_int),
    "p2p_moe_trace": ([_u64, ctypes.c_char_p, _i64, ctypes.POINTER(_i64)], ctypes.c_int),
    "p2p_precompile": ([_i32, ctypes.c_char_p, _i32, ctypes.c_char_p, _i64], ctypes.c_int),
    "p2p_kernel_compile": ([_u64, ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_u64)], ctypes.c_int),
    "p2p_kernel_params": ([_u64, _u64, ctypes.POINTER(_u64), ctypes.POINTER(_u64), _i32, ctypes.POINTER(_i32)],
                          ctypes.c_int),
    "p2p_kernel_launch": ([_u64, _u64, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
                           ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, _u64, ctypes.c_void_p, _u64],
                          ctypes.c_int),
}

_lock = threading.Lock()
_lib = None


def _candidates():
    env = os.environ.get("P2PCOMM_LIB")
    if env:
        yield pathlib.Path(env)
        return
    yield _HERE / "libp2pcomm.so"
    yield _HERE.parent.parent / "build" / "libp2pcomm.so"  # a source checkout


def lib() -> ctypes.CDLL:
    """Return the loaded library, loading it on first use. Never unloaded:
    a Go runtime cannot be dlclose'd."""
    global _lib
    check_not_forked()
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            _lib = _load()
    return _lib


def _offer_ucx_wheel() -> None:
    """Adds this interpreter's libucx wheel to the folders the library
    searches for UCX (P2PCOMM_UCX_DIRS), found without importing it, which
    would load UCX."""
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return
    if spec is None or not spec.origin:
        return
    lib_dir = str(pathlib.Path(spec.origin).parent / "lib")
    dirs = os.environ.get("P2PCOMM_UCX_DIRS", "")
    if lib_dir not in dirs.split(os.pathsep):
        os.environ["P2PCOMM_UCX_DIRS"] = os.pathsep.join(d for d in (dirs, lib_dir) if d)


def _load() -> ctypes.CDLL:
    _offer_ucx_wheel()
    tried = []
    for path in _candidates():
        if not path.exists():
            tried.append(f"{path} (missing)")
            continue
        handle = ctypes.CDLL(str(path))
        handle.p2p_abi_version.argtypes, handle.p2p_abi_version.restype = [], ctypes.c_int
        version = handle.p2p_abi_version()  # first: an older library may lack newer exports
        if version != ABI_VERSION:
            raise P2PCommError(f"{path} has C ABI version {version}, this package needs {ABI_VERSION}: rebuild it")
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(handle, name)
            fn.argtypes, fn.restype = argtypes, restype
        atexit.register(_shutdown, handle)
        return handle
    raise P2PCommError(
        "libp2pcomm.so not found; tried " + ", ".join(tried)
        + ". Build it with `make lib` or reinstall p2pcomm (`pip install .`), or set P2PCOMM_LIB."
    )


def _shutdown(handle) -> None:
    # MPI must be finalized before exit or mpirun reports the rank as failed.
    if os.getpid() == _LOAD_PID:
        handle.p2p_shutdown()


def check_not_forked() -> None:
    """A forked child cannot call into the Go runtime its parent started:
    its threads are gone and the call would hang. Fail instead."""
    if forked:
        raise ForkError(
            f"p2pcomm was imported in process {_LOAD_PID} and is now used in its forked child {os.getpid()}; "
            "the Go runtime does not survive fork. Use the 'spawn' start method, or import p2pcomm in the child."
        )


def last_error() -> str:
    n = _lib.p2p_last_error(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    _lib.p2p_last_error(buf, n + 1)
    return buf.value.decode("utf-8", "replace")


def check(rc: int) -> None:
    """Raise the exception for a non-zero status, with the library's message."""
    if rc != 0:
        raise error_for(rc, last_error())
