"""The fused all-reduce + residual add + RMSNorm of tensor-parallel inference,
behind :meth:`Communicator.all_reduce_residual_rmsnorm`. Per row of the last
dimension (``hidden``), in float32:

    sum          = all_reduce(x)                       rounded once to the dtype: comm.all_reduce's bits
    residual_out = round(float(sum) + float(residual))
    normed       = round(float(residual_out) * rsqrt(mean(float(residual_out)^2) + eps) * float(weight))

One kernel on GPU (native/kernels/allreduce_rmsnorm.cu), the all-reduce then a
host pass on CPU (golib/hostcoll). Checks that need no numbers from Go are made
here; the library checks the rest (dtype, row length, eps, algorithm) and, like
these, takes part in the call for a rank that fails them, so every rank raises.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import NamedTuple

import torch

from . import _lib
from .errors import InvalidArgumentError, P2PCommError, UnsupportedError

# Algorithms of the fused call: the LL one-shot (no barrier; up to 1 MiB of x
# per rank), the Lamport one-shot (no barrier, no flags; up to 8 MiB / world)
# and the two-shot. auto: on two ranks Lamport as far as its buffers go, on
# more LL to 128 KiB; then the two-shot.
ALGORITHMS = ("auto", "oneshot_ll", "oneshot_lamport", "twoshot")
# Their C ABI codes are golib/collective's Algorithm numbers.
_ALGO_CODES = {"auto": 0, "oneshot_ll": 5, "oneshot_lamport": 10, "twoshot": 2}
_DTYPES = {torch.float16: 2, torch.bfloat16: 3}
# p2p_all_reduce_rmsnorm_args: handle, x, residual, weight, normed,
# residual_out, rows, hidden, dtype, eps, algo, reserved, stream.
_ARGS = struct.Struct("<6Q2qifiiQ")


class RMSNormResult(NamedTuple):
    """What :meth:`Communicator.all_reduce_residual_rmsnorm` returns (a tuple:
    ``normed, residual_out = comm.all_reduce_residual_rmsnorm(...)``)."""

    normed: torch.Tensor  # rmsnorm(residual_out) * weight
    residual: torch.Tensor  # residual_out: all_reduce(x) + residual


# _result builds an RMSNormResult without the generated __new__'s Python frame.
_result = functools.partial(tuple.__new__, RMSNormResult)
_F32_MAX = torch.finfo(torch.float32).max


def _float32(v) -> float:
    """v as the library's float32 takes it: beyond its range an infinity,
    which the library rejects on every rank (struct would raise here, on this
    rank alone)."""
    try:
        f = float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf
    return f if math.isnan(f) or abs(f) <= _F32_MAX else math.copysign(math.inf, f)


def _stream(comm) -> int:
    i = comm._device_index
    return torch._C._cuda_getCurrentRawStream(i) if i >= 0 else 0


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + b.numel() * b.element_size() and pb < pa + a.numel() * a.element_size()


def _check_out(comm, out, x, name: str, inputs) -> None:
    if out is None:
        return
    try:
        comm._check_tensor(out)
    except P2PCommError as e:
        raise type(e)(f"{name}: {e}") from None
    if out.shape != x.shape or out.dtype != x.dtype:
        raise InvalidArgumentError(f"{name} is {tuple(out.shape)} {out.dtype}, x {tuple(x.shape)} {x.dtype}")
    for other_name, other in inputs:
        if other is not None and out.numel() and other.numel() and _overlap(out, other):
            raise InvalidArgumentError(f"{name} overlaps {other_name}")


def check(comm, x, residual, weight, eps, residual_out, normed_out, algorithm) -> tuple:
    """Raise the P2PCommError of the first argument the call cannot take;
    return (rows, hidden, dtype code, algorithm code)."""
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        try:
            comm._check_tensor(t)
        except P2PCommError as e:
            raise type(e)(f"{name}: {e}") from None
    if x.dtype not in _DTYPES:
        raise UnsupportedError(f"all_reduce_residual_rmsnorm takes float16 or bfloat16, not {x.dtype}")
    if residual.dtype != x.dtype or weight.dtype != x.dtype:
        raise InvalidArgumentError(f"x, residual and weight must share a dtype: {x.dtype}, {residual.dtype}, "
                                   f"{weight.dtype}")
    if x.dim() < 1:
        raise InvalidArgumentError("x has no dimension: want [..., hidden]")
    hidden = x.shape[-1]
    if residual.shape != x.shape:
        raise InvalidArgumentError(f"residual is {tuple(residual.shape)}, x {tuple(x.shape)}: want the same shape")
    if weight.shape != (hidden,):
        raise InvalidArgumentError(f"weight is {tuple(weight.shape)}, want ({hidden},): the hidden size of x")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise InvalidArgumentError(f"eps must be a number, not {type(eps).__name__}")
    if not isinstance(algorithm, str) or algorithm not in _ALGO_CODES:
        raise UnsupportedError(f"unknown algorithm {algorithm!r} for all_reduce_residual_rmsnorm: "
                               f"use one of {', '.join(ALGORITHMS)}")
    if residual_out is not None and residual_out is not residual:
        _check_out(comm, residual_out, x, "residual_out", (("x", x), ("weight", weight), ("residual", residual)))
    elif residual_out is residual and x.numel() and (_overlap(residual, x) or _overlap(residual, weight)):
        raise InvalidArgumentError("residual_out (residual, in place) overlaps "
                                   + ("x" if _overlap(residual, x) else "weight"))
    _check_out(comm, normed_out, x, "normed_out", (("x", x), ("weight", weight), ("residual", residual),
                                                    ("residual_out", residual_out)))
    rows = x.numel() // hidden if hidden else 0
    return rows, hidden, _DTYPES[x.dtype], _ALGO_CODES[algorithm]


def reject(comm, error: P2PCommError, x, algorithm) -> None:
    """Take part in the call for a rank whose arguments failed the checks, so
    that its peers raise MismatchError instead of waiting; rows, hidden and
    dtype, as far as x tells them, pick the kernel they run."""
    h = comm._h()
    rows = hidden = 0
    dcode = 3
    if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] > 0:
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        dcode = _DTYPES.get(x.dtype, 3)
    rc = _lib.lib().p2p_all_reduce_rmsnorm_reject(h, error.code, str(error).encode(), rows, hidden, dcode,
                                                   _ALGO_CODES.get(algorithm, 0) if isinstance(algorithm, str) else 0,
                                                   _stream(comm))
    if rc not in (0, error.code):
        comm._check(rc)


def _span_overlap(a: int, an: int, b: int, bn: int) -> bool:
    return a < b + bn and b < a + an


def _fast(comm, x, residual, weight, eps, residual_out, normed_out, algorithm):
    """The packed arguments, normed and residual_out of a call that is plainly
    fine, found by cheap lookups only (each pointer and attribute read once):
    the per-call host cost of eager calls. None sends the call to check(),
    which explains what is wrong. The library checks the row length and eps."""
    i = comm._device_index
    acode = _ALGO_CODES.get(algorithm) if type(algorithm) is str else None
    if (acode is None or type(eps) is not float or not -_F32_MAX <= eps <= _F32_MAX
            or type(x) is not torch.Tensor or type(residual) is not torch.Tensor
            or type(weight) not in (torch.Tensor, torch.nn.Parameter)):
        return None
    dtype = x.dtype
    dcode = _DTYPES.get(dtype)
    shape = x.shape
    if (dcode is None or residual.dtype is not dtype or weight.dtype is not dtype or not shape
            or residual.shape != shape or not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous())):
        return None
    hidden = shape[-1]
    if weight.shape != (hidden,):
        return None
    if i >= 0:
        # get_device() is the index on any device type: is_cuda says which.
        if not (x.is_cuda and residual.is_cuda and weight.is_cuda
                and x.get_device() == i and residual.get_device() == i and weight.get_device() == i):
            return None
    elif not (x.is_cpu and residual.is_cpu and weight.is_cpu):
        return None
    xp, rp, wp = x.data_ptr(), residual.data_ptr(), weight.data_ptr()
    n = x.numel()
    nb, wb = 2 * n, 2 * hidden  # both dtypes are 2 bytes
    if residual_out is None:
        out = torch.empty_like(residual, memory_format=torch.contiguous_format)
        op = out.data_ptr()
    elif residual_out is residual:
        out, op = residual, rp
        if n and (_span_overlap(rp, nb, xp, nb) or _span_overlap(rp, nb, wp, wb)):
            return None
    else:
        out = residual_out
        op = _plain_out(out, i, dtype, shape)
        if op is None or (n and (_span_overlap(op, nb, xp, nb) or _span_overlap(op, nb, wp, wb)
                                 or _span_overlap(op, nb, rp, nb))):
            return None
    if normed_out is None:
        normed = torch.empty_like(x, memory_format=torch.contiguous_format)
        np_ = normed.data_ptr()
    else:
        normed = normed_out
        np_ = _plain_out(normed, i, dtype, shape)
        if np_ is None or (n and (_span_overlap(np_, nb, xp, nb) or _span_overlap(np_, nb, wp, wb)
                                  or _span_overlap(np_, nb, rp, nb) or _span_overlap(np_, nb, op, nb))):
            return None
    if i >= 0 and (xp | rp | wp | op | np_) % 16:
        return None
    return (_ARGS.pack(comm._handle, xp, rp, wp, np_, op, n // hidden if hidden else 0, hidden, dcode, eps, acode, 0,
                       torch._C._cuda_getCurrentRawStream(i) if i >= 0 else 0),
            normed, out)


def _plain_out(t, i, dtype, shape):
    """t's data pointer when it is plainly a valid output (an exact tensor of
    the call's dtype and shape, contiguous, on this device), else None."""
    if (type(t) is not torch.Tensor or t.dtype is not dtype or t.shape != shape or not t.is_contiguous()
            or (not t.is_cuda or t.get_device() != i if i >= 0 else not t.is_cpu)):
        return None
    return t.data_ptr()


def _slow(comm, x, residual, weight, eps, residual_out, normed_out, algorithm):
    """_fast's triple for a call that check() passes; raises (after taking
    part in the call, so that every rank raises) otherwise."""
    try:
        rows, hidden, dcode, acode = check(comm, x, residual, weight, eps, residual_out, normed_out, algorithm)
    except P2PCommError as e:
        reject(comm, e, x, algorithm)
        raise
    normed = normed_out if normed_out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    out = residual_out if residual_out is not None else torch.empty_like(residual,
                                                                          memory_format=torch.contiguous_format)
    return (_ARGS.pack(comm._handle, x.data_ptr(), residual.data_ptr(), weight.data_ptr(), normed.data_ptr(),
                       out.data_ptr(), rows, hidden, dcode, _float32(eps), acode, 0, _stream(comm)),
            normed, out)


def eager(comm, x, residual, weight, eps, residual_out=None, normed_out=None, algorithm="auto") -> RMSNormResult:
    """The call itself (also the body of the torch.library ops)."""
    if _lib.forked or not comm._handle:
        comm._h()  # raises
    call = _fast(comm, x, residual, weight, eps, residual_out, normed_out, algorithm)
    if call is None:
        call = _slow(comm, x, residual, weight, eps, residual_out, normed_out, algorithm)
    args, normed, out = call
    rc = comm._rmsnorm(args)
    if rc:
        comm._check(rc)
    return _result((normed, out))


def traced(comm, x, residual, weight, eps, residual_out=None, normed_out=None, algorithm="auto") -> RMSNormResult:
    """The call under torch.compile: the custom ops p2pcomm::all_reduce_residual_rmsnorm
    (new outputs) and all_reduce_residual_rmsnorm_ (residual_out into residual);
    outputs into other given tensors are copies there."""
    eps = float(eps)
    if residual_out is residual:
        normed = torch.ops.p2pcomm.all_reduce_residual_rmsnorm_(x, residual, weight, eps, comm._handle, algorithm)
        out = residual
    else:
        normed, out = torch.ops.p2pcomm.all_reduce_residual_rmsnorm(x, residual, weight, eps, comm._handle, algorithm)
        if residual_out is not None:
            residual_out.copy_(out)
            out = residual_out
    if normed_out is not None:
        normed_out.copy_(normed)
        normed = normed_out
    return RMSNormResult(normed, out)


def reference(summed: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> RMSNormResult:
    """The residual add and RMSNorm of an all-reduce's result, with torch ops
    and the same rounding points (the fallback communicator's, and tests')."""
    out = (summed.float() + residual.float()).to(residual.dtype)
    v = out.float()
    normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return RMSNormResult(normed.to(residual.dtype), out)


def fallback(comm, x, residual, weight, eps, residual_out=None, normed_out=None, algorithm="auto") -> RMSNormResult:
    """TorchFallbackCommunicator's call: all-reduce over torch.distributed, then
    reference(); the same checks, but no limit on the row length."""
    comm._h()
    check(comm, x, residual, weight, eps, residual_out, normed_out, algorithm)
    res = reference(comm.all_reduce(x), residual, weight, float(eps))
    normed, out = res
    if residual_out is not None:
        out = residual_out.copy_(out)
    if normed_out is not None:
        normed = normed_out.copy_(normed)
    return RMSNormResult(normed, out)
