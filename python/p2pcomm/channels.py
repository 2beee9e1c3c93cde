"""Channels for users' own kernels, and the NVRTC kernels that use them.

    mem = comm.memory_channels(buf)      # collective; buf from comm.empty or registered
    port = comm.port_channels(buf)       # collective; peers on other nodes too (the proxy + UCX)
    k = p2pcomm.Kernel(SOURCE, "all_gather")
    k((world,), (512,), mem, buf, comm.rank, chunk_bytes)

A channel set holds one device handle per rank (``MemoryChannel`` or
``PortChannel`` of native/kernels/channel.cuh; entry r talks to rank r, the
entry of this rank is zero) in device memory: a kernel takes it as
``MemoryChannel*`` / ``PortChannel*``. ``handle(peer)`` gives one handle's
bytes, to pass by value. The communicator owns what the handles point to;
close the set (or the communicator) only once no kernel uses them.

Port channels also work from the host (CPU ranks, or a GPU rank that wants
the proxy to move data for it): ``put``, ``signal``, ``flush`` and ``wait``
push the same triggers the GPU pushes.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Optional, Sequence

import torch

from . import _lib
from .errors import InvalidArgumentError, StateError


def _sizes() -> tuple[int, int]:
    mem, port = ctypes.c_uint64(), ctypes.c_uint64()
    _lib.check(_lib.lib().p2p_channel_sizes(ctypes.byref(mem), ctypes.byref(port)))
    return mem.value, port.value


class Channels:
    """One kind of channel over one registered tensor, to every rank."""

    kind = "memory"

    def __init__(self, comm, tensor: torch.Tensor):
        self.comm, self.tensor = comm, tensor
        self.entry_bytes = _sizes()[0 if self.kind == "memory" else 1]
        world = comm.world_size
        raw = (ctypes.c_uint8 * (world * self.entry_bytes))()
        set_id = ctypes.c_uint64()
        make = _lib.lib().p2p_memory_channels if self.kind == "memory" else _lib.lib().p2p_port_channels
        comm._check(make(comm._h(), tensor.data_ptr(), tensor.numel() * tensor.element_size(), raw,
                         ctypes.sizeof(raw), ctypes.byref(set_id)))
        self._set: Optional[int] = set_id.value
        self._raw = bytes(raw)
        host = torch.frombuffer(bytearray(self._raw), dtype=torch.uint8)
        # Kernels read the handles from device memory; the CPU backend keeps them on the host.
        self.handles = host.to(tensor.device) if tensor.device.type == "cuda" else host

    def __len__(self) -> int:
        return self.comm.world_size

    def handle(self, peer: int) -> bytes:
        """The device handle to rank ``peer``, to pass to a kernel by value."""
        self._peer(peer)
        h = self._raw[peer * self.entry_bytes:(peer + 1) * self.entry_bytes]
        if not any(h):
            raise InvalidArgumentError(f"no {self.kind} channel to rank {peer}: it is on another node "
                                       "(port channels reach every rank)")
        return h

    def data_ptr(self) -> int:
        """Where the handles lie (device memory on GPU): a kernel's ``MemoryChannel*`` / ``PortChannel*``."""
        self._open()
        return self.handles.data_ptr()

    def close(self) -> None:
        """Collective. Release the channels; kernels using them must be done."""
        if self._set is not None:
            set_id, self._set = self._set, None
            _lib.check(_lib.lib().p2p_channels_close(self.comm._h(), set_id))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ranks={len(self)}, bytes={self.tensor.numel() * self.tensor.element_size()})"

    def _open(self) -> int:
        if self._set is None:
            raise StateError(f"{type(self).__name__} used after close()")
        return self._set

    def _peer(self, peer: int) -> int:
        if not isinstance(peer, int) or not 0 <= peer < self.comm.world_size:
            raise InvalidArgumentError(f"peer {peer!r} is not a rank of this communicator (0..{self.comm.world_size - 1})")
        if peer == self.comm.rank:
            raise InvalidArgumentError(f"rank {peer} has no channel to itself")
        return peer


class MemoryChannels(Channels):
    """Peer memory over CUDA IPC (ranks of this node): ``MemoryChannel`` handles."""

    kind = "memory"


class PortChannels(Channels):
    """Through the proxy (the copy engine inside a node, UCX between nodes): ``PortChannel`` handles,
    usable from the host too."""

    kind = "port"

    def put(self, peer: int, dst_offset: int, src_offset: int, nbytes: int) -> None:
        """Copy ``nbytes`` from this rank's tensor at byte ``src_offset`` to the peer's at ``dst_offset``
        (asynchronous: complete after :meth:`flush`, visible to the peer after its :meth:`wait`)."""
        _lib.check(_lib.lib().p2p_port_put(self.comm._h(), self._open(), self._peer(peer), dst_offset, src_offset,
                                           nbytes))

    def signal(self, peer: int) -> None:
        """Add one to the peer's semaphore once every earlier put to it has landed."""
        _lib.check(_lib.lib().p2p_port_signal(self.comm._h(), self._open(), self._peer(peer)))

    def flush(self, peer: int) -> None:
        """Wait until every earlier put and signal to the peer is complete (bounded by P2PCOMM_TIMEOUT_MS)."""
        _lib.check(_lib.lib().p2p_port_flush(self.comm._h(), self._open(), self._peer(peer)))

    def wait(self, peer: int, count: int = 1) -> None:
        """Wait until ``count`` more signals of the peer have arrived (bounded by P2PCOMM_TIMEOUT_MS)."""
        _lib.check(_lib.lib().p2p_port_wait(self.comm._h(), self._open(), self._peer(peer), count))


class Kernel:
    """A CUDA kernel of the caller's source, compiled by NVRTC for the communicator's GPU with
    ``channel.cuh`` (and ``p2p_common.cuh``) on the include path, cached like p2pcomm's own.

    ``name`` is the kernel's name, or a name expression of a template instantiation
    (``"my_kernel<float>"``). Calling it launches on the current stream (capturable in a CUDA
    graph): ``kernel(grid, block, *args, shared_bytes=0, stream=None)``. Arguments are packed by
    the kernel's own parameter layout: tensors and channel sets as pointers, Python ints and
    floats as the parameter's size, ``bytes`` (e.g. ``channels.handle(peer)``) as they are.
    """

    def __init__(self, source: str, name: str, comm=None):
        self.source, self.name, self.comm = source, name, comm
        self._kernel: Optional[int] = None
        self._params: list[tuple[int, int]] = []

    def _compiled(self, comm) -> int:
        if self._kernel is None:
            k = ctypes.c_uint64()
            _lib.check(_lib.lib().p2p_kernel_compile(comm._h(), self.source.encode(), self.name.encode(),
                                                     ctypes.byref(k)))
            offsets, sizes, n = (ctypes.c_uint64 * 256)(), (ctypes.c_uint64 * 256)(), ctypes.c_int32()
            _lib.check(_lib.lib().p2p_kernel_params(comm._h(), k.value, offsets, sizes, 256, ctypes.byref(n)))
            self._kernel, self._params = k.value, [(offsets[i], sizes[i]) for i in range(n.value)]
        return self._kernel

    def __call__(self, grid: Sequence[int], block: Sequence[int], *args, shared_bytes: int = 0, stream=None,
                 comm=None) -> None:
        comm = comm or self.comm or _only_communicator()
        kernel = self._compiled(comm)
        if len(args) != len(self._params):
            raise InvalidArgumentError(f"kernel {self.name} takes {len(self._params)} arguments, got {len(args)}")
        end = max((o + s for o, s in self._params), default=0)
        buf = bytearray(end)
        for i, (arg, (off, size)) in enumerate(zip(args, self._params)):
            buf[off:off + size] = _pack(arg, size, f"argument {i} of {self.name}")
        g, b = _dim3(grid, "grid"), _dim3(block, "block")
        if stream is None:
            stream = torch.cuda.current_stream(comm.device).cuda_stream
        elif isinstance(stream, torch.cuda.Stream):
            stream = stream.cuda_stream
        raw = (ctypes.c_uint8 * max(len(buf), 1)).from_buffer(buf if buf else bytearray(1))
        _lib.check(_lib.lib().p2p_kernel_launch(comm._h(), kernel, *g, *b, shared_bytes, stream, raw, len(buf)))


def _dim3(v, what: str) -> tuple[int, int, int]:
    v = (v,) if isinstance(v, int) else tuple(v)
    if not 1 <= len(v) <= 3 or any(not isinstance(x, int) or x < 1 for x in v):
        raise InvalidArgumentError(f"{what} {v!r}: want 1 to 3 positive ints")
    return v + (1,) * (3 - len(v))


def _pack(arg, size: int, what: str) -> bytes:
    if isinstance(arg, (torch.Tensor, Channels)):
        if size != 8:
            raise InvalidArgumentError(f"{what}: a pointer for a {size}-byte parameter")
        return struct.pack("<Q", arg.data_ptr())
    if isinstance(arg, (bytes, bytearray)):
        if len(arg) != size:
            raise InvalidArgumentError(f"{what}: {len(arg)} bytes for a {size}-byte parameter")
        return bytes(arg)
    if isinstance(arg, bool) or isinstance(arg, int):
        fmt = {1: "<b", 2: "<h", 4: "<i", 8: "<q"}.get(size)
        if fmt is None:
            raise InvalidArgumentError(f"{what}: an int for a {size}-byte parameter")
        v = int(arg)
        if v >= 1 << (8 * size - 1):  # unsigned parameters take values past the signed range
            fmt = fmt.upper()
        try:
            return struct.pack(fmt, v)
        except struct.error as e:
            raise InvalidArgumentError(f"{what}: {v} does not fit {size} bytes") from e
    if isinstance(arg, float):
        fmt = {4: "<f", 8: "<d"}.get(size)
        if fmt is None:
            raise InvalidArgumentError(f"{what}: a float for a {size}-byte parameter")
        return struct.pack(fmt, arg)
    raise InvalidArgumentError(f"{what}: cannot pass {type(arg).__name__} (tensor, channels, int, float or bytes)")


def _only_communicator():
    """The open GPU communicator of the current device, when there is exactly one."""
    from .communicator import open_communicators

    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    found = [c for c in open_communicators() if c.device.type == "cuda" and c.device.index == device]
    if len(found) != 1:
        raise InvalidArgumentError(f"{len(found)} open GPU communicators on the current device: pass comm= to "
                                   "Kernel (or when calling it)")
    return found[0]
