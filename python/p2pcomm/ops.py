"""torch.library custom ops, so that torch.compile(fullgraph=True) can trace
p2pcomm calls: ``torch.ops.p2pcomm.all_reduce`` (out of place),
``torch.ops.p2pcomm.all_reduce_`` (in place), the fused
``all_reduce_residual_rmsnorm`` / ``all_reduce_residual_rmsnorm_`` (residual
in place), and MoE's
``torch.ops.p2pcomm.moe_dispatch`` / ``moe_combine``. Each op's body is the
method it stands for, so every check and error is the same compiled or not.

The ops are defined with a schema and one CompositeExplicitAutograd kernel
each, not with ``torch.library.custom_op``, whose wrapper (an autograd layer,
an output-aliasing check) doubles the host cost of a small call
(docs/BENCHMARKS.md).

A communicator is named by its integer handle, an ExpertParallel by a
one-element tensor of its own (``ep``; the kernel finds the ep by that
tensor's address): an int id is a constant that dynamo guards on (always as
an nn.Module's attribute), so every further ep, one per layer, recompiled
the function until torch.compile's limit, while tensors are guarded by
shape and dtype only. Nothing at trace time looks an ep up: the fake
kernels take every size from their arguments.

The MoE ops change their ep's state (its buffers; the latest dispatch, which
a combine pairs with), so they must run in program order: each declares that
it writes the ep's one-element ``order`` tensor, and torch.compile keeps the
writes to one tensor in order and never drops them. Declared pure, inductor
moved a graph's second dispatch ahead of its first combine; declared an
ordered effect instead, inductor (torch 2.11) failed to lower dispatch's
tuple of outputs. Both tensors are marked static, so CUDA-graph trees
neither copy them nor refuse the declared writes; inductor's freezing and
dynamo's install_free_tensors would make them constants of the graph
instead, so one graph shared by several eps would call the first ep every
time: the fake kernels refuse to trace with either setting on."""

from __future__ import annotations

import weakref

import torch

_live: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_live_eps: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()  # by _op_ident address


def track(comm) -> None:
    _live[comm._handle] = comm


def track_ep(ep) -> None:
    _live_eps[ep._op_ident.data_ptr()] = ep


def _comm(handle: int):
    comm = _live.get(handle)
    if comm is None:
        from .errors import StateError

        raise StateError(f"communicator handle {handle} is closed or unknown")
    return comm


def _ep(ident: torch.Tensor):
    ep = _live_eps.get(ident.data_ptr())
    if ep is None:
        from .errors import StateError

        raise StateError("the ExpertParallel of this op is gone (or the op got a copy of its ep tensor)")
    return ep


_lib = torch.library.Library("p2pcomm", "DEF")  # held for the life of the process: it owns the definitions


def _op(schema: str, body, fake) -> None:
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    _lib.impl(name, body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"p2pcomm::{name}", fake, lib=_lib)


_op("all_reduce(Tensor x, int handle, str op, str algorithm) -> Tensor",
    lambda x, handle, op, algorithm: _comm(handle)._eager_all_reduce(x, op, algorithm),
    lambda x, handle, op, algorithm: torch.empty_like(x, memory_format=torch.contiguous_format))


def _all_reduce_(x, handle, op, algorithm) -> None:
    _comm(handle)._eager_all_reduce_(x, op, algorithm)  # returns x; an op of schema "-> ()" must return None


_op("all_reduce_(Tensor(a!) x, int handle, str op, str algorithm) -> ()", _all_reduce_,
    lambda x, handle, op, algorithm: None)


# The fused all-reduce + residual add + RMSNorm (rmsnorm.py): new outputs, or residual_out into residual.
def _rmsnorm(x, residual, weight, eps, handle, algorithm):
    from .rmsnorm import eager

    return tuple(eager(_comm(handle), x, residual, weight, eps, None, None, algorithm))


def _rmsnorm_(x, residual, weight, eps, handle, algorithm):
    from .rmsnorm import eager

    return eager(_comm(handle), x, residual, weight, eps, residual, None, algorithm).normed


_op("all_reduce_residual_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps, int handle, str algorithm) "
    "-> (Tensor, Tensor)", _rmsnorm,
    lambda x, residual, weight, eps, handle, algorithm: (torch.empty_like(x, memory_format=torch.contiguous_format),
                                                        torch.empty_like(residual,
                                                                         memory_format=torch.contiguous_format)))
_op("all_reduce_residual_rmsnorm_(Tensor x, Tensor(a!) residual, Tensor weight, float eps, int handle, str algorithm) "
    "-> Tensor", _rmsnorm_,
    lambda x, residual, weight, eps, handle, algorithm: torch.empty_like(x, memory_format=torch.contiguous_format))

def _refuse_constant_eps() -> None:
    """UnsupportedError, at trace time, under settings that make an ep's
    tensors constants of the graph (see the module doc)."""
    import torch._inductor.config as inductor_config

    on = [name for name, value in (("torch._inductor.config.freezing", getattr(inductor_config, "freezing", False)),
                                   ("torch._dynamo.config.install_free_tensors",
                                    getattr(torch._dynamo.config, "install_free_tensors", False))) if value]
    if on:
        from .errors import UnsupportedError

        raise UnsupportedError(f"ExpertParallel under torch.compile with {' and '.join(on)}: that makes the ep's "
                               "tensors constants of the graph, and a graph shared by several eps would run the "
                               "first one's; turn it off for code that calls dispatch or combine")


# dispatch returns its result's tensors as three that share no memory (outputs of an op must not
# alias): the rows, the counts ([E/W] per local expert, then R) and the info ([4, R] int32: local
# expert, source rank, source token, weight bits). Eager mode's R depends on the routing: an
# unbacked size while tracing. The fake kernels take every size from their arguments, never from
# the ep: compiled graphs are cached across processes by what the graph holds.
def _fake_dispatch(x, topk_idx, topk_weights, ep, order, capturable, max_rows, num_local):
    _refuse_constant_eps()
    rows = max_rows if capturable else torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty(rows, x.shape[1]), x.new_empty(num_local + 1, dtype=torch.int32),
            x.new_empty(4, rows, dtype=torch.int32))


_op("moe_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor ep, Tensor(a!) order, bool capturable, "
    "SymInt max_rows, SymInt num_local) -> (Tensor, Tensor, Tensor)",
    lambda x, topk_idx, topk_weights, ep, order, capturable, max_rows, num_local:
        _ep(ep)._op_dispatch(x, topk_idx, topk_weights, capturable, max_rows, num_local),
    _fake_dispatch)

# combine names its dispatch by that dispatch's rows (recv.x), the one tensor of it the op sees;
# expert_out has the ep's dtype and hidden size (the body checks).
def _fake_combine(expert_out, recv_x, ep, order, num_tokens):
    _refuse_constant_eps()
    return expert_out.new_empty(num_tokens, expert_out.shape[1])


_op("moe_combine(Tensor expert_out, Tensor recv_x, Tensor ep, Tensor(a!) order, SymInt num_tokens) -> Tensor",
    lambda expert_out, recv_x, ep, order, num_tokens: _ep(ep)._op_combine(expert_out, recv_x, num_tokens),
    _fake_combine)
