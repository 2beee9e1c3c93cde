"""torch.library custom ops, so that torch.compile(fullgraph=True) can trace
p2pcomm all-reduces: ``torch.ops.p2pcomm.all_reduce`` (out of place) and
``torch.ops.p2pcomm.all_reduce_`` (in place). A communicator is named by its
integer handle."""

from __future__ import annotations

import weakref

import torch

_live: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def track(comm) -> None:
    _live[comm._handle] = comm


def _comm(handle: int):
    comm = _live.get(handle)
    if comm is None:
        from .errors import StateError

        raise StateError(f"communicator handle {handle} is closed or unknown")
    return comm


@torch.library.custom_op("p2pcomm::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, handle: int, op: str, algorithm: str) -> torch.Tensor:
    return _comm(handle)._eager_all_reduce(x, op, algorithm)


@all_reduce.register_fake
def _(x, handle, op, algorithm):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("p2pcomm::all_reduce_", mutates_args=("x",))
def all_reduce_(x: torch.Tensor, handle: int, op: str, algorithm: str) -> None:
    _comm(handle)._eager_all_reduce_(x, op, algorithm)


@all_reduce_.register_fake
def _(x, handle, op, algorithm):
    return None
