"""torch.library custom ops, so that torch.compile(fullgraph=True) can trace
p2pcomm calls: ``torch.ops.p2pcomm.all_reduce`` (out of place),
``torch.ops.p2pcomm.all_reduce_`` (in place), and MoE's
``torch.ops.p2pcomm.moe_dispatch`` / ``moe_combine``. A communicator is named
by its integer handle, an ExpertParallel by a string (an int attribute that
changes between objects would be traced as a symbolic int); each op's eager body is
the method it stands for, so every check and error is the same."""

from __future__ import annotations

import weakref

import torch

_live: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_live_eps: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def track(comm) -> None:
    _live[comm._handle] = comm


def track_ep(ep) -> None:
    _live_eps[ep._op_key] = ep


def _ep(key: str):
    ep = _live_eps.get(key)
    if ep is None:
        from .errors import StateError

        raise StateError(f"ExpertParallel {key} is gone")
    return ep


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


# dispatch returns its result's tensors as three that share no memory (a custom op's outputs must
# not alias): the rows, the counts ([E/W] per local expert, then R) and the info ([4, R] int32:
# local expert, source rank, source token, weight bits). Eager mode's R depends on the routing:
# an unbacked size while tracing. The fake kernels take every size from their arguments, never
# from the ep: compiled graphs are cached across processes by what the graph holds.
@torch.library.custom_op("p2pcomm::moe_dispatch", mutates_args=())
def moe_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, ep_key: str,
                 capturable: bool, max_rows: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ep(ep_key)._op_dispatch(x, topk_idx, topk_weights, capturable, max_rows, num_local)


@moe_dispatch.register_fake
def _(x, topk_idx, topk_weights, ep_key, capturable, max_rows, num_local):
    rows = max_rows if capturable else torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty(rows, x.shape[1]), x.new_empty(num_local + 1, dtype=torch.int32),
            x.new_empty(4, rows, dtype=torch.int32))


# combine names its dispatch by that dispatch's rows (recv.x), the one tensor of it the op sees;
# expert_out has the ep's dtype and hidden size (the body checks).
@torch.library.custom_op("p2pcomm::moe_combine", mutates_args=())
def moe_combine(expert_out: torch.Tensor, recv_x: torch.Tensor, ep_key: str, num_tokens: int) -> torch.Tensor:
    return _ep(ep_key)._op_combine(expert_out, recv_x, num_tokens)


@moe_combine.register_fake
def _(expert_out, recv_x, ep_key, num_tokens):
    return expert_out.new_empty(num_tokens, expert_out.shape[1])
