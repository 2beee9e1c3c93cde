"""ExpertParallel's argument checks. Each returns this rank's first problem as
the exception to raise, or None: the caller raises it only after every rank
has taken part in the call (as a rejected one), so that peers fail with a
MismatchError instead of waiting."""

from __future__ import annotations

from typing import Optional

import torch

from .communicator import _DTYPES
from .errors import InvalidArgumentError, P2PCommError, StateError, UnsupportedError
from .moe_result import DispatchResult

EP_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# fp8 dispatch (dispatch_dtype): e4m3 rows, one float32 scale per FP8_BLOCK columns travelling with them.
FP8 = torch.float8_e4m3fn
FP8_BLOCK = 128


def dtype_code(dtype) -> int:
    """The C ABI's code of an ep dtype; -1 for anything else (unhashable included)."""
    return _DTYPES[dtype] if isinstance(dtype, torch.dtype) and dtype in EP_DTYPES else -1


def config_problem(E, H, Tm, K, dtype, capturable, combine_dtype, num_sms) -> Optional[P2PCommError]:
    """The construction's first bad argument on this rank (ranks may pass different num_sms)."""
    for name, v in (("num_experts", E), ("hidden", H), ("max_tokens_per_rank", Tm), ("topk", K)):
        if isinstance(v, bool) or not isinstance(v, int):
            return InvalidArgumentError(f"{name} must be an int, got {type(v).__name__}")
        if v < 1:
            return InvalidArgumentError(f"{name} must be positive, got {v}")
    if dtype_code(dtype) < 0:
        return UnsupportedError(f"dtype {dtype} is not supported; use one of "
                                f"{', '.join(sorted(str(d) for d in EP_DTYPES))}")
    if not isinstance(capturable, bool):
        return InvalidArgumentError(f"capturable must be a bool, got {type(capturable).__name__}")
    if not isinstance(combine_dtype, torch.dtype):
        return InvalidArgumentError(f"combine_dtype must be a torch.dtype, got {type(combine_dtype).__name__}")
    if combine_dtype not in (torch.float32, dtype):
        return UnsupportedError(f"combine_dtype {combine_dtype} is not supported with dtype {dtype}; use "
                                f"torch.float32 (exact partials) or {dtype} (partials rounded once, half the "
                                "bytes)")
    if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1):
        return InvalidArgumentError(f"num_sms must be a positive int or None, got {num_sms!r}")
    return None


def dispatch_dtype_problem(dtype, dispatch_dtype) -> Optional[P2PCommError]:
    if not isinstance(dispatch_dtype, torch.dtype):
        return InvalidArgumentError(f"dispatch_dtype must be a torch.dtype or None, got "
                                    f"{type(dispatch_dtype).__name__}")
    if dispatch_dtype not in (dtype, FP8):
        return UnsupportedError(f"dispatch_dtype {dispatch_dtype} is not supported; use None (the ep's dtype) "
                                f"or {FP8} (rows with a float32 scale per {FP8_BLOCK} columns)")
    return None


def tensor_problem(device: torch.device, name: str, t, dtypes: tuple, shape: tuple) -> Optional[P2PCommError]:
    """t is a tensor of one of dtypes on device with shape (None: any extent)."""
    # A 2-D tensor that passes, in few steps: each eager call checks every argument.
    if isinstance(t, torch.Tensor) and t.dtype in dtypes and t.device == device and len(shape) == 2:
        got = t.shape
        if len(got) == 2 and (shape[0] is None or got[0] == shape[0]) and (shape[1] is None or got[1] == shape[1]):
            return None
    if not isinstance(t, torch.Tensor):
        return InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        return UnsupportedError(f"{name} has dtype {t.dtype}; expected {' or '.join(map(str, dtypes))}")
    if t.device.type != device.type or (device.type == "cuda" and t.device.index != device.index):
        return InvalidArgumentError(f"{name} is on {t.device} but the communicator is on {device}")
    if t.dim() != len(shape) or any(w is not None and g != w for g, w in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        return InvalidArgumentError(f"{name} has shape {list(t.shape)}; expected {want}")
    return None


def dispatch_problem(ep, x, topk_idx, topk_weights, scales=None) -> Optional[P2PCommError]:
    if ep._closed:
        return StateError("ExpertParallel is closed")
    p = tensor_problem(ep.device, "x", x, (ep.dispatch_dtype,), (None, ep.hidden))
    if p is not None:
        return p
    T = x.shape[0]
    if T > ep.max_tokens_per_rank:
        return InvalidArgumentError(f"x has {T} tokens, more than max_tokens_per_rank={ep.max_tokens_per_rank}")
    if ep._fp8:
        p = tensor_problem(ep.device, "scales", scales, (torch.float32,), (T, ep.hidden // FP8_BLOCK))
    elif scales is not None:
        p = InvalidArgumentError("scales are for fp8 dispatch (ExpertParallel(..., dispatch_dtype="
                                 "torch.float8_e4m3fn)); this ep dispatches rows of its dtype")
    return (p or tensor_problem(ep.device, "topk_idx", topk_idx, (torch.int32, torch.int64), (T, ep.topk))
            or tensor_problem(ep.device, "topk_weights", topk_weights, (torch.float32,), (T, ep.topk)))


def combine_problem(ep, expert_out, recv) -> Optional[P2PCommError]:
    if ep._closed:
        return StateError("ExpertParallel is closed")
    if not isinstance(recv, DispatchResult):
        return InvalidArgumentError(f"recv must be a DispatchResult, got {type(recv).__name__}")
    if recv._ep_id != ep._id:
        return InvalidArgumentError("recv comes from another ExpertParallel")
    if recv._seq != ep._seq:
        return StateError(f"recv is from dispatch #{recv._seq} of this ExpertParallel, but dispatch "
                          f"#{ep._seq} has run since and reused its buffers; combine the latest "
                          "dispatch's result")
    return tensor_problem(ep.device, "expert_out", expert_out, (ep.dtype,), (recv.x.shape[0], ep.hidden))


def id_problem(num_experts: int, topk_idx: torch.Tensor) -> InvalidArgumentError:
    """What the device found wrong with topk_idx: its first entry outside -1 and [0, num_experts)."""
    idx = topk_idx.cpu()
    bad = ((idx < -1) | (idx >= num_experts)).nonzero()
    t, k = bad[0].tolist()
    return InvalidArgumentError(f"topk_idx[{t}, {k}] = {idx[t, k].item()} is not an expert: use -1 or "
                                f"[0, {num_experts}) ({bad.shape[0]} bad entries)")
