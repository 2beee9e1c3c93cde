"""The Communicator: one per process group, constructed collectively."""

from __future__ import annotations

import ctypes
import enum
import json
import math
import os
import struct
import warnings
import weakref
from typing import Optional, Sequence, Union

import torch

from . import _lib
from . import rmsnorm as _rmsnorm
from .errors import (BootstrapError, InvalidArgumentError, P2PCommError, PeerUnavailableError,
                     StateError, UnsupportedError)


class ReduceOp(enum.IntEnum):
    """Reduction operators; the values are the C ABI's."""

    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    AVG = 4


_DTYPES = {
    torch.float32: 0, torch.float64: 1, torch.float16: 2,
    torch.bfloat16: 3, torch.int32: 4, torch.int64: 5,
}
ALGORITHMS = ("auto", "oneshot", "twoshot", "ring", "recursive_doubling", "oneshot_ll", "twoshot_ll", "oneshot_push",
              "twoshot_push", "oneshot_ll128", "oneshot_lamport", "twoshot_lamport")
_ALGO_CODES = {name: i for i, name in enumerate(ALGORITHMS)}
# The operation a stream barrier serves (golib/collective Call; the C ABI's numbers).
BARRIER_STREAM, BARRIER_MOE_DISPATCH, BARRIER_MOE_COMBINE = 1, 2, 3
_ENV_PREFIXES = ("P2PCOMM_", "OMPI_", "PMI_", "PMIX_")
_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID")


_OP_CODES = {**{o.name.lower(): o.value for o in ReduceOp}, **{o: o.value for o in ReduceOp}}


# p2p_all_reduce_args: handle, src, dst, count, dtype, op, algo, reserved,
# stream. One packed block costs less to pass than eight ctypes arguments.
_ALL_REDUCE_ARGS = struct.Struct("<QQQqiiiiQ")


def _raw_stream(device_index: int) -> int:
    """The current CUDA stream of a device (0 for the CPU backend, index -1),
    read the way torch's own compiled code reads it."""
    return torch._C._cuda_getCurrentRawStream(device_index) if device_index >= 0 else 0


def _unsupported_dtype(dtype) -> UnsupportedError:
    return UnsupportedError(f"dtype {dtype} is not supported; use one of {', '.join(sorted(map(str, _DTYPES)))}")


def _parse_op(op) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            pass
    else:
        name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]  # torch.distributed.ReduceOp
        if name.upper() in ReduceOp.__members__:
            return ReduceOp[name.upper()]
    raise UnsupportedError(f"unknown reduce op {op!r}: use one of {', '.join(o.name.lower() for o in ReduceOp)}")


def _parse_algorithm(algorithm) -> int:
    if algorithm in ALGORITHMS:
        return ALGORITHMS.index(algorithm)
    raise UnsupportedError(f"unknown algorithm {algorithm!r}: use one of {', '.join(ALGORITHMS)}")


def gpus_shared() -> bool:
    """Whether P2PCOMM_SHARE_GPUS=1 lets ranks share GPUs (under MPS; tests
    of a larger world than the GPUs at hand, tools/gpu_shared.sh)."""
    return os.environ.get("P2PCOMM_SHARE_GPUS") == "1"


def local_cuda_index() -> int:
    """This process's GPU: LOCAL_RANK (the current device without it), taken
    modulo the visible GPUs when P2PCOMM_SHARE_GPUS=1 lets ranks share them
    (a test of a larger world than the GPUs at hand, under MPS)."""
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        return torch.cuda.current_device()
    if gpus_shared():
        return int(local) % torch.cuda.device_count()
    return int(local)


def _parse_device(device) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", local_cuda_index())
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"device {dev} is neither cpu nor cuda")
    return dev


class _TorchBootstrap:
    """Hands Go an all-gather and a barrier over a torch.distributed group,
    as ctypes callbacks. Exceptions cannot cross into Go: they are kept and
    re-raised as the cause of the BootstrapError."""

    def __init__(self, group):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.error: Optional[BaseException] = None
        backend = str(dist.get_backend(group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        self.allgather = _lib.ALLGATHER_FN(self._allgather)
        self.barrier = _lib.BARRIER_FN(self._barrier)

    def _allgather(self, _ctx, send, nbytes, recv):
        try:
            world = self.dist.get_world_size(self.group)
            mine = torch.frombuffer(bytearray(ctypes.string_at(send, nbytes)), dtype=torch.uint8) if nbytes else \
                torch.empty(0, dtype=torch.uint8)
            mine = mine.to(self.device)
            parts = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(world)]
            self.dist.all_gather(parts, mine, group=self.group)
            if nbytes:
                data = torch.cat(parts).cpu()  # contiguous uint8: copied straight from its storage
                ctypes.memmove(recv, data.data_ptr(), data.numel())
            return 0
        except BaseException as e:  # noqa: BLE001 - must not unwind into Go
            self.error = e
            return 1

    def _barrier(self, _ctx):
        try:
            self.dist.barrier(group=self.group)
            return 0
        except BaseException as e:  # noqa: BLE001
            self.error = e
            return 1

    def release(self) -> None:
        """Drops the group and the callbacks once Go can no longer call them. The callbacks hold bound
        methods of this object, a cycle that only the garbage collector would break, maybe as the
        interpreter exits: a process group released that late can abort the process. A kept error goes
        too: its traceback holds this object and the group."""
        self.allgather = self.barrier = self.group = self.error = None


_OPEN: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


def open_communicators() -> list:
    """Communicators of this process that are not closed (for p2pcomm.Kernel without comm=)."""
    return [c for c in list(_OPEN) if c._handle]


class Communicator:
    """A group of ranks that all-reduce through peer memory.

    Collective: every rank of ``group`` constructs it with the same
    arguments. ``group`` is a ``torch.distributed`` process group; when None
    and torch.distributed is initialized the default group is used, else the
    ranks meet through MPI (under mpirun) or TCP (torchrun's environment:
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; see README). ``device`` is
    "cpu", "cuda", "cuda:N", an int or a torch.device; None picks the GPU of
    LOCAL_RANK when CUDA is available, else the CPU backend.

    ``Communicator(...)`` is a factory: with ``fallback="torch"`` and a
    group, ranks whose GPUs cannot reach each other's memory (every rank
    learns it alike) get a :class:`TorchFallbackCommunicator` instead of
    ``PeerUnavailableError``.
    """

    def __new__(cls, group=None, device=None, *, bootstrap: str = "auto", fallback: Optional[str] = None):
        _lib.check_not_forked()
        if fallback not in (None, "torch"):
            raise InvalidArgumentError(f"fallback={fallback!r}: use None (raise) or 'torch'")
        device = _parse_device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        import torch.distributed as dist

        if group is None and bootstrap in ("auto", "torch") and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        try:
            return cls._open(group, device, bootstrap)
        except PeerUnavailableError as e:
            if fallback != "torch" or group is None:
                raise
            # Every rank sees the failure (it is exchanged), so all fall back.
            warnings.warn(f"p2pcomm: {e}; all-reduce goes through torch.distributed instead (fallback='torch')",
                          stacklevel=2)
            from .fallback import TorchFallbackCommunicator  # it subclasses Communicator

            return TorchFallbackCommunicator._open(group, device, bootstrap)

    @classmethod
    def _open(cls, group, device: torch.device, bootstrap: str) -> "Communicator":
        """The native communicator over ``group`` (or the bootstrap's ranks
        when None); raises PeerUnavailableError on every rank alike."""
        self = object.__new__(cls)
        self._handle = 0
        self._pid = os.getpid()
        self.device = device
        env = {k: v for k, v in os.environ.items() if k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)}
        torch_bs = None
        if group is not None:
            import torch.distributed as dist

            torch_bs = _TorchBootstrap(group)
            env["P2PCOMM_GROUP_RANK"] = str(dist.get_rank(group))
            env["P2PCOMM_GROUP_SIZE"] = str(dist.get_world_size(group))
        if self.device.type == "cuda" and "P2PCOMM_TUNE_FILE" not in env:
            from .tune import default_path

            if default_path().exists():
                env["P2PCOMM_TUNE_FILE"] = str(default_path())
        config = {"bootstrap": bootstrap, "device": self.device.index if self.device.type == "cuda" else -1, "env": env}
        self._handle = self._native_init(config, torch_bs)
        lib = _lib.lib()
        self._finalizer = weakref.finalize(self, _finalize, self._handle, self._pid, torch_bs)
        self._bootstrap = torch_bs  # the callbacks must outlive the handle
        self._allocations: dict[int, object] = {}
        r, w = ctypes.c_int32(), ctypes.c_int32()
        _lib.check(lib.p2p_rank(self._handle, ctypes.byref(r)))
        _lib.check(lib.p2p_world_size(self._handle, ctypes.byref(w)))
        self.rank, self.world_size = r.value, w.value
        self._all_reduce = lib.p2p_all_reduce
        self._all_reduce_packed = lib.p2p_all_reduce_packed
        self._rmsnorm = lib.p2p_all_reduce_rmsnorm_packed
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        from . import ops

        ops.track(self)
        _OPEN.add(self)
        return self

    @staticmethod
    def _native_init(config: dict, torch_bs) -> int:
        handle = ctypes.c_uint64()
        rc = _lib.lib().p2p_init(
            json.dumps(config).encode(),
            torch_bs.allgather if torch_bs else _lib.ALLGATHER_FN(),
            torch_bs.barrier if torch_bs else _lib.BARRIER_FN(),
            None, ctypes.byref(handle),
        )
        if rc != 0 and torch_bs is not None:
            cause = torch_bs.error
            torch_bs.release()  # no handle: Go holds the callbacks no more
            try:
                _lib.check(rc)
            except BootstrapError as e:
                if cause is not None:
                    raise e from cause
                raise
        _lib.check(rc)
        return handle.value

    def _check(self, rc: int) -> None:
        """_lib.check, chaining what a torch.distributed callback raised."""
        try:
            _lib.check(rc)
        except BootstrapError as e:
            cause = getattr(self._bootstrap, "error", None)
            if cause is not None:
                self._bootstrap.error = None
                raise e from cause
            raise

    # -- lifecycle -----------------------------------------------------------------------------------

    def _h(self) -> int:
        _lib.check_not_forked()
        if not self._handle:
            raise StateError("communicator is closed")
        return self._handle

    def close(self) -> None:
        """Release this rank's resources. Not collective; idempotent. Tensors
        from :meth:`empty` must not be used afterwards."""
        if self._handle:
            self._allocations.clear()
            self._finalizer.detach()
            h, self._handle = self._handle, 0
            try:
                _lib.check(_lib.lib().p2p_finalize(h))
            finally:
                if self._bootstrap is not None:
                    self._bootstrap.release()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._handle else "closed"
        return f"Communicator(rank={getattr(self, 'rank', '?')}, world_size={getattr(self, 'world_size', '?')}, device={self.device}, {state})"

    # -- memory --------------------------------------------------------------------------------------

    def empty(self, shape: Union[int, Sequence[int]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Collective. A tensor in symmetric memory (every rank allocates the
        same size, and peers can read it directly), so all-reduce on it needs
        no staging copy. Lives until :meth:`close`. Any dtype (all-reduce
        takes those of :data:`ReduceOp`'s list)."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        numel = math.prod(shape)
        if numel < 0 or any(d < 0 for d in shape):
            raise InvalidArgumentError(f"negative dimension in shape {shape}")
        used = numel * torch.empty(0, dtype=dtype).element_size()
        nbytes = max(used, 1)
        ptr = ctypes.c_uint64()
        self._check(_lib.lib().p2p_alloc(self._h(), nbytes, ctypes.byref(ptr)))
        flat = self._wrap(ptr.value, nbytes)
        self._allocations[ptr.value] = flat
        return flat[:used].view(dtype).view(shape)

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Collective. Make ``tensor`` usable in place by peers (GPU: opens its
        IPC handle on every rank once; CPU tensors outside symmetric memory are
        staged through shared memory, so this only validates)."""
        self._check_tensor(tensor)
        self._check(_lib.lib().p2p_register(self._h(), tensor.data_ptr(), tensor.numel() * tensor.element_size()))

    def deregister_buffer(self, tensor: torch.Tensor) -> None:
        """Collective. Undo :meth:`register_buffer`."""
        self._check(_lib.lib().p2p_deregister(self._h(), tensor.data_ptr()))

    def register_graph_buffers(self) -> int:
        """Collective. Call after capturing CUDA graphs and before replaying
        them, on every rank: maps the unregistered inputs of the two-shot
        all-reduces captured since the last call on every rank, so that those
        graphs' replays read them in place instead of copying them into
        staging (replays are correct either way). Calls outside the graphs
        still stage these tensors: unlike :meth:`register_buffer`, nothing
        asks the memory to be used alike on every rank once the graph is
        gone. Every rank must have captured the same calls; an input some
        rank has freed since, or one in memory CUDA IPC cannot export
        (torch's expandable segments), is skipped. The mappings stay until
        :meth:`close`. Returns how many inputs were mapped (0 on CPU)."""
        n = ctypes.c_int64()
        self._check(_lib.lib().p2p_register_graph_buffers(self._h(), ctypes.byref(n)))
        return n.value

    # -- collectives ---------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op="sum", algorithm: str = "auto") -> torch.Tensor:
        """Collective. Return a new tensor holding the reduction of ``tensor``
        over all ranks; ``tensor`` is unchanged. ``op``: sum, prod, min, max,
        avg (a string, :class:`ReduceOp` or ``torch.distributed.ReduceOp``);
        avg on integers floors like ``torch.div(rounding_mode="floor")``.
        Results are bit-identical on every rank. On GPU the work is ordered on
        the current stream and may be captured in a CUDA graph; under
        torch.compile it is the custom op ``torch.ops.p2pcomm.all_reduce``.

        Errors that only the GPU can see (ranks that disagree on the size,
        dtype or op, or on where a registered input sits; a peer that never
        arrives) are raised asynchronously: by the next call or :meth:`check`
        once the stream has reached them."""
        if torch.compiler.is_compiling():  # traced: no host checks here, the op's eager body does them
            return torch.ops.p2pcomm.all_reduce(tensor, self._handle, _parse_op(op).name.lower(), algorithm)
        return self._eager_all_reduce(tensor, op, algorithm)

    def all_reduce_(self, tensor: torch.Tensor, op="sum", algorithm: str = "auto") -> torch.Tensor:
        """Collective. Like :meth:`all_reduce` but in place; returns ``tensor``."""
        if torch.compiler.is_compiling():
            torch.ops.p2pcomm.all_reduce_(tensor, self._handle, _parse_op(op).name.lower(), algorithm)
            return tensor
        self._reduce(tensor, tensor, op, algorithm)
        return tensor

    def _eager_all_reduce(self, tensor, op, algorithm):
        if not isinstance(tensor, torch.Tensor):
            self._reduce_slow(tensor, tensor, op, algorithm)  # raises on every rank, after telling peers
        out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        self._reduce(tensor, out, op, algorithm)
        return out

    def _eager_all_reduce_(self, tensor, op, algorithm):
        self._reduce(tensor, tensor, op, algorithm)
        return tensor

    def _reduce(self, src: torch.Tensor, dst: torch.Tensor, op, algorithm) -> None:
        # Hot path: plain lookups only; anything unusual takes the slow path,
        # which validates, explains, and lets peers know (reject).
        code = _OP_CODES.get(op) if isinstance(op, (str, ReduceOp)) else None
        algo = _ALGO_CODES.get(algorithm) if type(algorithm) is str else None
        dtype = _DTYPES.get(src.dtype) if isinstance(src, torch.Tensor) else None
        if (code is None or algo is None or dtype is None or not self._handle or _lib.forked
                or src.get_device() != self._device_index or src.is_meta or not src.is_contiguous()):
            self._reduce_slow(src, dst, op, algorithm)
            return
        ptr = src.data_ptr()
        if self._device_index >= 0 and ptr % 16:
            self._reduce_slow(src, dst, op, algorithm)
            return
        rc = self._all_reduce_packed(_ALL_REDUCE_ARGS.pack(
            self._handle, ptr, ptr if dst is src else dst.data_ptr(), src.numel(), dtype, code, algo, 0,
            _raw_stream(self._device_index)))
        if rc:
            _lib.check(rc)

    def _reduce_slow(self, src, dst, op, algorithm) -> None:
        h = self._h()
        try:
            code = _parse_op(op).value
            algo = _parse_algorithm(algorithm)
            self._check_tensor(src, reduced=True)
            dtype = _DTYPES[src.dtype]
        except P2PCommError as e:
            # Take part anyway, so that peers fail with a mismatch instead of
            # waiting; size, dtype, op and algorithm help the GPU pick their
            # kernel and grid.
            numel = src.numel() if isinstance(src, torch.Tensor) else 0
            dcode = _DTYPES.get(getattr(src, "dtype", None), 0)
            try:  # any spelling the call accepts ("MAX", torch.distributed.ReduceOp.MAX)
                ocode = _parse_op(op).value
            except P2PCommError:
                ocode = 0
            acode = ALGORITHMS.index(algorithm) if algorithm in ALGORITHMS else 0
            stream = _raw_stream(self._device_index)
            rc = _lib.lib().p2p_all_reduce_reject(h, e.code, str(e).encode(), numel, dcode, ocode, acode, stream)
            if rc not in (0, e.code):
                _lib.check(rc)
            raise
        stream = _raw_stream(self._device_index)
        _lib.check(self._all_reduce(h, src.data_ptr(), dst.data_ptr(), src.numel(), dtype, code, algo, stream))

    def all_reduce_residual_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                    eps: float = 1e-6, *, residual_out: Optional[torch.Tensor] = None,
                                    normed_out: Optional[torch.Tensor] = None,
                                    algorithm: str = "auto") -> "_rmsnorm.RMSNormResult":
        """Collective. The all-reduce (sum) of ``x``, plus ``residual``, then
        RMSNorm over the last dimension times ``weight``, in one kernel on GPU:
        returns ``(normed, residual_out)`` (an :class:`RMSNormResult`) with

            residual_out = round(float(all_reduce(x)) + float(residual))
            normed       = round(float(residual_out) * rsqrt(mean(float(residual_out)**2) + eps) * float(weight))

        per row, in float32; ``all_reduce(x)`` is :meth:`all_reduce`'s result
        bit for bit (float32 in rank order, rounded once), and ranks with the
        same residual get the same bits. ``x`` and ``residual``: [..., hidden],
        ``weight``: [hidden], all float16 or all bfloat16, contiguous, on this
        communicator's device; hidden a multiple of 8, at most 16384; any
        number of rows. ``residual_out`` / ``normed_out``: tensors to write
        into (shaped like x) instead of new ones; ``residual_out=residual``
        updates the residual in place. ``algorithm``: auto, oneshot_ll,
        oneshot_lamport or twoshot (CPU: the all-reduce's one-shot or two-shot). CUDA graphs and
        torch.compile (the custom ops ``torch.ops.p2pcomm.all_reduce_residual_rmsnorm``
        and ``all_reduce_residual_rmsnorm_``) work as for :meth:`all_reduce`;
        bad arguments raise on every rank."""
        if torch.compiler.is_compiling():
            return _rmsnorm.traced(self, x, residual, weight, eps, residual_out, normed_out, algorithm)
        return _rmsnorm.eager(self, x, residual, weight, eps, residual_out, normed_out, algorithm)

    def memory_channels(self, tensor: torch.Tensor):
        """Collective. ``MemoryChannel`` handles over ``tensor`` (from :meth:`empty` or registered) to
        every rank of this node (peer memory over CUDA IPC): see :mod:`p2pcomm.channels`."""
        from .channels import MemoryChannels

        self._check_tensor(tensor)
        return MemoryChannels(self, tensor)

    def port_channels(self, tensor: torch.Tensor):
        """Collective. ``PortChannel`` handles over ``tensor`` (from :meth:`empty` or registered) to
        every rank: the proxy carries their puts (the copy engine inside a node, UCX between nodes).
        Usable from the host too: see :mod:`p2pcomm.channels`."""
        from .channels import PortChannels

        self._check_tensor(tensor)
        return PortChannels(self, tensor)

    @property
    def nodes(self) -> list:
        """The ranks of each node (a host, or a group of ``P2PCOMM_LOCAL_SIZE`` consecutive ranks)."""
        node_of = (ctypes.c_int32 * self.world_size)()
        _lib.check(_lib.lib().p2p_topology(self._h(), node_of, self.world_size))
        nodes: dict = {}
        for r, n in enumerate(node_of):
            nodes.setdefault(n, []).append(r)
        return [nodes[n] for n in sorted(nodes)]

    @property
    def node(self) -> int:
        """This rank's node: an index into :attr:`nodes`."""
        return next(i for i, ranks in enumerate(self.nodes) if self.rank in ranks)

    def peer_tensor(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s copy of ``tensor`` (from :meth:`empty`, or registered
        on GPU), mapped into this process: same shape and dtype, and writes to
        it land in that rank's memory. Not collective. Order accesses with
        :meth:`stream_barrier`. Valid until :meth:`close`."""
        self._check_tensor(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        ptr = ctypes.c_uint64()
        _lib.check(_lib.lib().p2p_peer_ptr(self._h(), tensor.data_ptr(), nbytes, rank, ctypes.byref(ptr)))
        return self._wrap(ptr.value, max(nbytes, 1))[:nbytes].view(tensor.dtype).view(tensor.shape)

    def _wrap(self, ptr: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over memory the library owns (not freed by torch)."""
        if self.device.type == "cpu":
            return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=torch.uint8)
        return torch.as_tensor(_CudaArray(ptr, nbytes), device=self.device)

    def stream_barrier(self, _call: int = 1) -> None:
        """Collective. A barrier ordered on the current CUDA stream: work
        enqueued after it sees every rank's work enqueued before it. Never
        blocks the host on GPU and can be captured in a CUDA graph; on CPU it
        is :meth:`barrier`. ``_call`` (internal: ``BARRIER_*``) is the
        operation a peer's timeout names."""
        stream = _raw_stream(self._device_index)
        _lib.check(_lib.lib().p2p_stream_barrier(self._h(), stream, _call))

    def launch_kernel(self, file: str, expr: str, params: ctypes.Structure, grid: int, block: int,
                      shared_bytes: int = 0) -> None:
        """GPU only, not collective: run kernel ``expr`` (a name expression that
        ``native/kernels/<file>`` declares with ``// p2pcomm:instantiate``) on the
        current stream, with ``params`` (a ctypes struct mirroring the kernel's
        one by-value argument). For collectives built in Python, e.g. MoE."""
        _lib.check(_lib.lib().p2p_launch(
            self._h(), file.encode(), expr.encode(), ctypes.addressof(params), ctypes.sizeof(params),
            grid, block, shared_bytes, _raw_stream(self._device_index)))

    def prepare_kernel(self, file: str, expr: str) -> None:
        """GPU only, not collective: compile and load ``native/kernels/<file>``
        (which declares ``expr``) and the stream barrier's kernel now, so
        that no later launch compiles. Run it before a host-side exchange
        that lines the ranks up (a rank compiling inside a collective call
        keeps its peers waiting in their kernels)."""
        _lib.check(_lib.lib().p2p_prepare_kernel(self._h(), file.encode(), expr.encode()))

    @property
    def sm_count(self) -> int:
        """Multiprocessors of this rank's GPU (0 on the CPU backend)."""
        n = ctypes.c_int32()
        _lib.check(_lib.lib().p2p_device_info(self._h(), ctypes.byref(n)))
        return n.value

    def wait_info(self) -> tuple:
        """(signal, error word, timeout_ns) for kernels launched with
        :meth:`launch_kernel` that wait on peers: device addresses of this
        rank's signal block and of the error word :meth:`check` reads, so
        that their waits are bounded and reported like the library's own
        (p2p_common.cuh's Waiter). GPU backend only."""
        sig, err, timeout = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        _lib.check(_lib.lib().p2p_wait_info(self._h(), ctypes.byref(sig), ctypes.byref(err), ctypes.byref(timeout)))
        return sig.value, err.value, timeout.value

    def barrier(self) -> None:
        """Collective. Return once every rank has called it."""
        self._check(_lib.lib().p2p_barrier(self._h()))

    def host_allgather(self, data: bytes) -> list:
        """Collective. Every rank's ``data`` (the same length on all), as a
        list indexed by rank, exchanged on the host through the bootstrap
        (the ``torch.distributed`` group, MPI or TCP): bounded by that
        timeout, never by ``P2PCOMM_TIMEOUT_MS``. For setup steps whose
        outcome every rank must share: a GPU collective can time out on a
        rank whose peer came late and succeed on that peer."""
        n = len(data)
        out = ctypes.create_string_buffer(n * self.world_size)
        self._check(_lib.lib().p2p_host_allgather(self._h(), data, n, out))
        raw = out.raw
        return [raw[r * n:(r + 1) * n] for r in range(self.world_size)]

    def check(self) -> None:
        """Raise an error recorded asynchronously (e.g. a GPU kernel whose
        peer never arrived), if any."""
        _lib.check(_lib.lib().p2p_check(self._h()))

    def can_use(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`all_reduce` accepts ``tensor`` (device, dtype, layout,
        alignment), so callers can route others elsewhere without an exception."""
        try:
            self._check_tensor(tensor, reduced=True)
        except P2PCommError:
            return False
        return bool(self._handle)

    def _check_tensor(self, t: torch.Tensor, reduced: bool = False) -> None:
        """Raises unless t is a contiguous tensor on this device; ``reduced``: of a dtype all-reduce takes."""
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"expected a torch.Tensor, got {type(t).__name__}")
        if reduced and t.dtype not in _DTYPES:
            raise _unsupported_dtype(t.dtype)
        if not t.is_contiguous():
            raise InvalidArgumentError("tensor is not contiguous: call .contiguous() first")
        if t.device.type != self.device.type or (self.device.type == "cuda" and t.device.index != self.device.index):
            raise InvalidArgumentError(f"tensor is on {t.device} but this communicator is on {self.device}")
        if t.is_cuda and t.data_ptr() % 16:
            raise InvalidArgumentError("GPU tensors must start on a 16-byte boundary (a view with an odd offset?): "
                                       "pass a contiguous copy")


class _CudaArray:
    """Exposes a raw device allocation to torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


def _finalize(handle: int, pid: int, torch_bs=None) -> None:
    # Best effort at garbage collection or exit: not collective, never raises.
    if os.getpid() == pid and _lib._lib is not None:
        _lib._lib.p2p_finalize(handle)
    if torch_bs is not None:
        torch_bs.release()
