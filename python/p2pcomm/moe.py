"""Mixture-of-experts expert parallelism: dispatch tokens to the ranks that
own their experts, and combine the experts' outputs back, through symmetric
memory (CPU: shared memory; GPU: CUDA IPC peer mappings over NVLink).

    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=T_max, topk=K)
    recv = ep.dispatch(x, topk_idx, topk_weights)      # recv.x: rows for this rank's experts
    y = ep.combine(expert_out, recv)                   # back on the source rank, weighted

On GPU (bfloat16, float16, float32; see :attr:`ExpertParallel.uses_kernels`)
dispatch and combine are five fused kernels of native/kernels/moe_*.cu (the
count kernel only for larger batches), on at most ``num_sms`` blocks each,
with the same barriers, buffers and results contract as below:

- ``moe_dispatch_count`` then ``moe_dispatch_send`` (source): each block
  counts its own tokens per destination and per expert; then, from the
  earlier blocks' counts (small batches skip the count kernel: each send
  block counts the tokens before its own), slots per destination and, per
  pair, its rank among this source's pairs of the same expert (in (token,
  k) order); metadata goes into every destination's ``meta[s, slot]``,
  per-source totals into ``hdr``. The token rows themselves are staged (a
  memcpy, or nothing when x was built in
  :meth:`ExpertParallel.get_dispatch_buffer`) in this rank's symmetric
  ``xs[t]``.
- ``moe_dispatch_expand`` (destination, after the mid barrier): row of
  pair (s, slot, k) = first row of its expert + rows of that expert from
  sources before s + the sender's pair rank: expert-major order with no
  sort. Each received token row is read once from the source's ``xs`` over
  NVLink (a pull) and stored once per local expert, so rows cross NVLink
  once per destination and land straight in their final places. Eager mode
  reads ``hdr`` once (the host sync) to size the result exactly.
- Barriers: in capturable calls they are steps inside the kernels
  (moe_common.cuh MoeSync), not barrier kernels: the send kernel's block 0 trades start
  flags with every peer before any block writes into them (not needed, and
  skipped, when this rank has passed the other kind's middle barrier since
  the previous call of this kind: a dispatch after a combine, a combine
  after a dispatch), every block posts its middle flags when done, and the
  kernel that reads what peers wrote (expand, reduce) waits for every
  peer's first. When x must be copied into ``xs``, the copy runs on a side
  stream once the send kernel's block 0 has passed the start barrier
  (``moe_stage_gate``), and ``moe_stage_done`` then posts a staged flag that
  the expands wait for too (a rank with nothing to copy posts it from its
  send kernel; with P2PCOMM_MOE_OVERLAP_STAGE=0 the copy runs after the
  send kernel, and the expand kernel, which follows it, posts both kinds of
  flags itself). Eager
  calls keep their start barrier kernel (it carries the argument checks)
  and, in dispatch, the middle one (the host reads the counts after it);
  eager combine's middle barrier is in its kernels.
  Waits are bounded (P2PCOMM_TIMEOUT_MS) and a timeout names the missing
  rank (PeerTimeoutError). P2PCOMM_MOE_BARRIER_KERNELS=1 (on every rank)
  uses barrier kernels throughout, for comparison.
- Eager calls check arguments without a host sync before the data:
  ``moe_post_status`` posts each rank's check (host-side checks, then the
  expert ids on the device) into every rank's ``status`` row before the
  start barrier, and the kernels that write into peers write nothing if any
  rank failed, so a rejected call moves no data. The host reads every
  rank's check in its one sync (dispatch: with ``hdr``; combine: right
  after the start barrier, from pinned memory, without waiting for the
  call's own kernels) and every rank raises together.
- ``moe_combine_send`` (expert rank): per received token, float32 sum over
  k ascending of round(weight * row), stored into the source's
  ``comb[d, slot]`` in the combine transit type: float32 by default (exact),
  or the ep's dtype with ``combine_dtype=dtype`` (the partial rounded once;
  half the NVLink bytes; see :class:`ExpertParallel` for the accuracy).
- ``moe_combine_reduce`` (source, after the mid barrier): the float32 sum
  over d ascending of the partials of the ranks token t went to, from +0,
  rounded once.
- ``moe_combine_reduce_self`` in its place for a world of 2 with large
  batches (see _SELF_LOCAL_MIN_TOKENS): the send kernel then skips this
  rank's own tokens, and this kernel computes their partial from the expert
  rows itself, rounded as the send kernel would have: the same bits.

The expand's pull and the combine's push take items slot-major with
sources rotated by rank, so every rank's NVLink port is busy at once.
(A pull in combine, partials left on the expert rank and read by the
source, measured slower: the reduce then waits on NVLink reads.)

Every value is computed by one thread in a fixed order, so results are
bit-identical run to run and between eager and capturable mode. Otherwise
(CPU, float64, unsupported shapes, or P2PCOMM_MOE_TORCH=1) it is plain torch
ops that write straight into peers' buffers, ordered by
:meth:`Communicator.stream_barrier`; the protocol below describes them.

Protocol (W ranks, L = E/W local experts, T_max = max_tokens_per_rank):

dispatch on source rank s
  1. start barrier (see "Why two barriers per call" below).
  2. For every destination d: token t goes to d when one of its K experts
     lives on d; its slot there is the exclusive prefix count of such tokens
     (so slots keep token order). Rows are packed locally in slot order and
     copied in one contiguous copy into d's ``recv_x[s, :T]``, metadata (the
     K local expert ids, -1 where the expert is elsewhere; the K weights; t)
     likewise into ``meta[s, :T]``; slots past the count hold tokens not
     meant for d and are never read. The count goes into d's ``counts[s]``.
  3. mid barrier: every peer's writes are visible.
  4. The receiver lists every (source, slot, k) whose local expert is valid
     and stable-sorts them by local expert; since the flat (source, slot, k)
     index already orders by source, token and k, this gives the documented
     expert-major order. Rows are gathered from ``recv_x``.

combine on expert rank d
  1. start barrier.
  2. For each (source, slot) received: partial = sum over k ascending of
     weight_k * expert_out[row(k)], in float32; packed in slot order and
     copied contiguously into the source's ``comb[d, slot]``, converted to
     the combine transit type (float32: exact; the ep's dtype: rounded once).
  3. mid barrier.
  4. The source sums ``comb[d, slot of t on d]`` (widened to float32) over d
     ascending, in float32, only for ranks d its token t was sent to, and
     casts to dtype.

Peers are written in rotated order (rank + 1 first), so ranks that copy at
the same time write into different peers.

Why two barriers per call (on the kernel path, where they are is said
above): the mid barrier orders writes before reads. The
start barrier keeps a fast rank from overwriting a buffer that a slow peer
is still reading from the previous call: ``recv_x``/``meta``/``counts`` are
read by their owner at the end of dispatch and written by peers in the next
dispatch; ``comb`` is read at the end of combine and written in the next
combine (the kernels' ``xs`` and ``comb`` are written by their owner and
read by peers: the same reasoning). When calls strictly alternate, the other call's mid barrier would
already order them, but dispatch twice in a row (or combine twice, or a CUDA
graph holding only one of them) would race; one barrier kernel is cheap
next to that risk.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import struct
import warnings
import weakref
from typing import Optional

import torch

from . import ops
from .communicator import BARRIER_MOE_COMBINE, BARRIER_MOE_DISPATCH, Communicator, TorchFallbackCommunicator
from .errors import InvalidArgumentError, MismatchError, P2PCommError, StateError, UnsupportedError

_EP_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_CONFIG_FIELDS = ("num_experts", "hidden", "topk", "max_tokens_per_rank", "dtype", "combine_dtype", "capturable",
                  "world_size", "P2PCOMM_MOE_TORCH", "P2PCOMM_MOE_BARRIER_KERNELS")


def _dtype_code(dtype) -> int:
    """_EP_DTYPES code of dtype; -1 for anything else (unhashable included)."""
    return _EP_DTYPES.get(dtype, -1) if isinstance(dtype, torch.dtype) else -1


def _torch_path_forced() -> bool:
    """P2PCOMM_MOE_TORCH=1 keeps the torch-op path on GPU; every rank must agree."""
    return os.environ.get("P2PCOMM_MOE_TORCH", "") == "1"


def _barrier_kernels_forced() -> bool:
    """P2PCOMM_MOE_BARRIER_KERNELS=1 orders the kernel path's calls with
    barrier kernels only (as before the in-kernel barriers; for A/B runs);
    every rank must agree."""
    return os.environ.get("P2PCOMM_MOE_BARRIER_KERNELS", "") == "1"


def _stage_overlap_disabled() -> bool:
    """P2PCOMM_MOE_OVERLAP_STAGE=0 copies x into the staging buffer on the
    ep's stream, after the send kernel, instead of on a side stream while
    the send kernel runs (for A/B runs; local to each rank)."""
    return os.environ.get("P2PCOMM_MOE_OVERLAP_STAGE", "") == "0"


def _self_local_mode() -> str:
    """P2PCOMM_MOE_SELF_LOCAL (for A/B runs; local to each rank): unset ->
    "auto" (see _SELF_LOCAL_MIN_TOKENS), 0 -> "never", 1 -> "always" (any
    batch, any transit: same bits either way); anything else -> a warning
    and "auto", never silently."""
    v = os.environ.get("P2PCOMM_MOE_SELF_LOCAL", "").strip()
    modes = {"": "auto", "0": "never", "1": "always"}
    if v not in modes:
        warnings.warn(f"P2PCOMM_MOE_SELF_LOCAL={v!r} is not 0 or 1; using the default", stacklevel=3)
    return modes.get(v, "auto")


def _count_kernel_min_pairs() -> int:
    """Routed (token, k) pairs from which dispatch runs moe_dispatch_count
    before the send kernel; below, each send block counts the tokens before
    its own instead (see _COUNT_KERNEL_MIN_PAIRS). P2PCOMM_MOE_COUNT_PAIRS
    overrides it (for A/B runs; 0: the count kernel whenever the rank has
    tokens; same bits either way, so local to each rank)."""
    v = os.environ.get("P2PCOMM_MOE_COUNT_PAIRS", "").strip()
    if not v:
        return _COUNT_KERNEL_MIN_PAIRS
    if not v.isdigit():
        warnings.warn(f"P2PCOMM_MOE_COUNT_PAIRS={v!r} is not a non-negative integer; using the default "
                      f"{_COUNT_KERNEL_MIN_PAIRS}", stacklevel=3)
        return _COUNT_KERNEL_MIN_PAIRS
    return int(v)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a's and b's storage bytes intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _rows_key(x: torch.Tensor) -> tuple:
    """What identifies a dispatch's rows among live tensors."""
    return x.data_ptr(), tuple(x.shape), x.device


_OK, _INVALID, _UNSUPPORTED = 0, 1, 2

# -- GPU kernels (native/kernels/moe_dispatch.cu, moe_combine.cu) ---------------------------------
# ctypes mirrors of the kernels' by-value parameter structs; the sizes are
# pinned by static_asserts in moe_common.cuh and checked here at import.
_DISPATCH_FILE, _COMBINE_FILE = "moe_dispatch.cu", "moe_combine.cu"
_KERNEL_TYPES = {torch.bfloat16: "bf16", torch.float16: "half16", torch.float32: "float"}
_MAX_RANKS, _MAX_TOPK, _MAX_EXPERTS, _THREADS = 8, 32, 4096, 512
_DEFAULT_SMS = 24
# Eager dispatch copies x into the staging buffer on a side stream, under the send kernel, only from
# this size up: the fork and join cost the host ~25 µs (events, stream switches; 4 x H200 host), more
# than a smaller copy takes on the GPU (~2 µs for 128 tokens of 7168 bf16), and eager calls of small
# batches are bound by the host.
_EAGER_OVERLAP_BYTES = 8 << 20
# The count kernel saves each send block from recounting every token before its range, which costs
# the last block T*K id loads; for small batches that costs less than the kernel's launch (4 x H200,
# bf16, K=8, graph: dispatch 3 µs faster without it at 128 tokens, 2 at 256 and 512, even at 1024,
# 20 slower at 4096).
_COUNT_KERNEL_MIN_PAIRS = 8192
_SEND_SHARED_MAX = 48 << 10  # moe_dispatch_send's dynamic shared memory with the ids copied in (ids_shared)
_Ptrs = ctypes.c_uint64 * _MAX_RANKS
_DISPATCH_KERNELS = ("moe_dispatch_count", "moe_dispatch_send", "moe_dispatch_expand")
_PLAIN_KERNELS = ("moe_post_status", "moe_stage_gate", "moe_stage_done")  # not templated
_COMBINE_KERNELS = ("moe_combine_send", "moe_combine_reduce", "moe_combine_reduce_self")  # on <T, transit type>
# A world of 2 with topk up to _SELF_LOCAL_MAX_TOPK (moe_combine.cu's kCombWide) may combine "self-local": the
# send kernel pushes only the peer's partials and moe_combine_reduce_self sums this rank's own rows
# itself. It does so when the partials travel in the ep's dtype and the batch has at least
# _SELF_LOCAL_MIN_TOKENS tokens. 2 x H200, E=256, H=7168, K=8, 4096 tokens, graph: bf16 partials
# 443-446 us against 474-483 (the send no longer reads this rank's rows: 196 against 367 us); float32
# partials fill NVLink, so the send stayed where it was and the longer reduce made it slower (620
# against 557); at 128 tokens the reduce's chains of loads cost more than the send saves.
_SELF_LOCAL_MAX_TOPK = 8
_SELF_LOCAL_MIN_TOKENS = 1024


# World sizes whose combine reduce sums every rank's partials in one group (moe_combine.cu's
# moe_combine_reduce<T, C, G> with G = the world size); others take groups of 4 (G = 0). 4 x H200,
# 4096 tokens, bf16 partials: combine 660 -> 639 us; 3 measured only with ranks sharing GPUs under MPS
# (docs/BENCHMARKS.md).
_REDUCE_ONE_GROUP_WORLDS = (2, 3, 4)


def _kernel_expr(kernel: str, dtype: torch.dtype, combine_dtype: torch.dtype, world: int) -> str:
    """The name expression of ``kernel`` as moe_*.cu instantiate it for a
    world of ``world`` ranks."""
    t = _KERNEL_TYPES[dtype]
    if kernel in _PLAIN_KERNELS:
        return kernel
    if kernel == "moe_combine_reduce":
        group = world if world in _REDUCE_ONE_GROUP_WORLDS else 0
        return f"{kernel}<{t}, {_KERNEL_TYPES[combine_dtype]}, {group}>"
    return f"{kernel}<{t}, {_KERNEL_TYPES[combine_dtype]}>" if kernel in _COMBINE_KERNELS else f"{kernel}<{t}>"


def kernel_expressions() -> set:
    """Every kernel name expression this module may launch (each must be a
    ``// p2pcomm:instantiate`` line of moe_dispatch.cu or moe_combine.cu)."""
    exprs = set()
    for dtype in _KERNEL_TYPES:
        for transit in {torch.float32, dtype}:
            for world in range(2, _MAX_RANKS + 1):
                exprs.update(_kernel_expr(k, dtype, transit, world)
                             for k in _PLAIN_KERNELS + _DISPATCH_KERNELS + _COMBINE_KERNELS)
    return exprs


# In-kernel barriers (moe_common.cuh MoeSync): mode bits, kinds, flag words per rank, local state bytes.
_SYNC_START, _SYNC_ARRIVE, _SYNC_WAIT, _SYNC_ARRIVE_FIRST, _SYNC_STAGE_GO, _SYNC_STAGED, _SYNC_POST_STAGED = \
    1, 2, 4, 8, 16, 32, 64
_SYNC_MODES = 2 * _SYNC_POST_STAGED  # every combination of the bits above (a MoeSync built for each)
_DISPATCH, _COMBINE = 0, 1
_MAX_SYNC_BLOCKS = 256
_SYNC_FLAG_WORDS = 2 * 2 * _MAX_RANKS + 2 * _MAX_RANKS * _MAX_SYNC_BLOCKS  # start, staged, per-block mid flags
_SYNC_STATE_BYTES = 2 * 2112
_SYNC_GRID_SHIFT = 8  # mode >> it: the send kernels' grid, whose blocks' middle flags the waiters read


class _Sync(ctypes.Structure):
    _fields_ = [("peer_flags", _Ptrs), ("state", ctypes.c_uint64), ("signal", ctypes.c_uint64),
                ("err", ctypes.c_uint64), ("timeout_ns", ctypes.c_uint64), ("mode", ctypes.c_int32),
                ("kind", ctypes.c_int32)]


class _DispatchParams(ctypes.Structure):
    _fields_ = [("peer_meta", _Ptrs), ("peer_hdr", _Ptrs), ("topk_idx", ctypes.c_uint64), ("topk_w", ctypes.c_uint64),
                ("send_slot", ctypes.c_uint64), ("pair_rank", ctypes.c_uint64), ("num_tokens", ctypes.c_int32), ("max_tokens", ctypes.c_int32),
                ("hidden", ctypes.c_int32), ("topk", ctypes.c_int32), ("num_experts", ctypes.c_int32),
                ("rank", ctypes.c_int32), ("world", ctypes.c_int32), ("idx_bytes", ctypes.c_int32),
                ("counted", ctypes.c_int32), ("ids_shared", ctypes.c_int32), ("status", ctypes.c_uint64),
                ("sync", _Sync)]


class _ExpandParams(ctypes.Structure):
    _fields_ = [("peer_xs", _Ptrs), ("meta", ctypes.c_uint64), ("hdr", ctypes.c_uint64),
                ("out_x", ctypes.c_uint64), ("out_info", ctypes.c_uint64), ("expert_counts", ctypes.c_uint64),
                ("comb_rows", ctypes.c_uint64), ("row_cap", ctypes.c_int64), ("max_tokens", ctypes.c_int32),
                ("hidden", ctypes.c_int32), ("topk", ctypes.c_int32), ("num_local", ctypes.c_int32),
                ("world", ctypes.c_int32), ("rank", ctypes.c_int32), ("sync", _Sync)]


class _CombineParams(ctypes.Structure):
    _fields_ = [("peer_comb", _Ptrs), ("expert_out", ctypes.c_uint64), ("meta", ctypes.c_uint64),
                ("hdr", ctypes.c_uint64), ("comb_rows", ctypes.c_uint64), ("send_slot", ctypes.c_uint64),
                ("y", ctypes.c_uint64), ("row_cap", ctypes.c_int64), ("num_tokens", ctypes.c_int32),
                ("max_tokens", ctypes.c_int32), ("hidden", ctypes.c_int32), ("topk", ctypes.c_int32),
                ("rank", ctypes.c_int32), ("world", ctypes.c_int32), ("num_local", ctypes.c_int32),
                ("self_local", ctypes.c_int32), ("status", ctypes.c_uint64), ("sync", _Sync)]


class _PostParams(ctypes.Structure):
    _fields_ = [("peer_status", _Ptrs), ("topk_idx", ctypes.c_uint64), ("num_ids", ctypes.c_int32),
                ("num_experts", ctypes.c_int32), ("idx_bytes", ctypes.c_int32), ("code", ctypes.c_int32),
                ("id_code", ctypes.c_int32), ("rank", ctypes.c_int32), ("world", ctypes.c_int32),
                ("pad", ctypes.c_int32)]


# (struct, size, {field: offset}) as tabled in moe_common.cuh.
_PARAM_LAYOUTS = (
    (_Sync, 104, {"state": 64, "err": 80, "timeout_ns": 88, "mode": 96, "kind": 100}),
    (_DispatchParams, 312, {"peer_hdr": 64, "topk_idx": 128, "pair_rank": 152, "num_tokens": 160, "world": 184,
                            "idx_bytes": 188, "counted": 192, "ids_shared": 196, "status": 200, "sync": 208}),
    (_ExpandParams, 248, {"meta": 64, "out_x": 80, "comb_rows": 104, "row_cap": 112, "max_tokens": 120,
                          "world": 136, "rank": 140, "sync": 144}),
    (_PostParams, 104, {"topk_idx": 64, "num_ids": 72, "code": 84, "id_code": 88, "world": 96}),
    (_CombineParams, 264, {"expert_out": 64, "send_slot": 96, "y": 104, "row_cap": 112, "num_tokens": 120,
                           "world": 140, "num_local": 144, "status": 152, "sync": 160}),
)


def _check_param_layouts() -> None:
    for struct, size, offsets in _PARAM_LAYOUTS:
        if ctypes.sizeof(struct) != size:
            raise ImportError(f"{struct.__name__} is {ctypes.sizeof(struct)} bytes; moe_common.cuh says {size}")
        for field, off in offsets.items():
            if getattr(struct, field).offset != off:
                raise ImportError(f"{struct.__name__}.{field} at {getattr(struct, field).offset}; moe_common.cuh says {off}")


_check_param_layouts()


@dataclasses.dataclass(frozen=True)
class DispatchResult:
    """What :meth:`ExpertParallel.dispatch` received on this rank.

    Rows are expert-major: ordered by local expert, then source rank, then
    source token index, then k (a token routed twice to the same expert, at
    two k's, gives two rows). All tensors are on the communicator's device.

    - ``x``: [R, H] tensor of the ep's dtype, contiguous: the token rows.
    - ``expert_counts``: [E/W] int32: rows per local expert (sums to R).
    - ``num_rows``: [1] int32: R, on the device (never needs a host sync).
    - ``local_expert``: [R] int32: local expert id of each row (0..E/W-1).
    - ``src_rank``: [R] int32: the rank the token came from.
    - ``src_token``: [R] int32: the token's row index in that rank's ``x``.
    - ``weight``: [R] float32: the token's topk weight for this (expert, k).
    - ``capturable``: True when made in capturable mode: then R is the
      worst case R_max = W * max_tokens_per_rank * topk, only the first
      ``num_rows`` rows are valid and the rest are undefined (stale data,
      possibly NaN; weight and src fields there are undefined too).

    The private fields carry what :meth:`ExpertParallel.combine` needs; a
    result stays valid for combine until the next dispatch of the same ep
    (which reuses the ep's buffers): combine with an older one raises
    StateError (see :meth:`ExpertParallel.combine`).
    """

    x: torch.Tensor
    expert_counts: torch.Tensor
    num_rows: torch.Tensor
    local_expert: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    weight: torch.Tensor
    capturable: bool
    _ep_id: int = dataclasses.field(repr=False)
    _seq: int = dataclasses.field(repr=False)  # which dispatch of the ep made it (1, 2, ...)
    _num_tokens: int = dataclasses.field(repr=False)  # T on this (source) rank
    _send_mask: torch.Tensor = dataclasses.field(repr=False)  # [W, T] bool: token t went to rank d
    _send_slot: torch.Tensor = dataclasses.field(repr=False)  # [W, T] int64: its slot there (T_max if not)
    # Capturable: [S, K] row of (slot, k) (0 if none), its weight (0 if none), valid mask.
    # Eager: [R] row, weight, and slot of each pair, listed layer by layer (_comb_layers: sizes).
    _comb_rows: torch.Tensor = dataclasses.field(repr=False)
    _comb_weight: torch.Tensor = dataclasses.field(repr=False)
    _comb_valid: torch.Tensor = dataclasses.field(repr=False)
    _comb_ranges: tuple = dataclasses.field(repr=False)  # ((source, start, length), ...) into S
    _comb_slot: Optional[torch.Tensor] = dataclasses.field(repr=False)
    _comb_layers: Optional[tuple] = dataclasses.field(repr=False)
    # Made by the GPU kernels: combine's state lives in the ep's buffers (send_slot, comb_rows).
    _kernel: bool = dataclasses.field(default=False, repr=False)
    # The kernels' (counts [L+1], info [4, R]), of which the public fields are views (the custom op's outputs).
    _packed: Optional[tuple] = dataclasses.field(default=None, repr=False)
    # Traced by torch.compile: the public fields are the op's outputs; combine finds the rest by x.
    _from_op: bool = dataclasses.field(default=False, repr=False)


def _packed_result(x, counts, info, num_local: int, capturable: bool, **private) -> DispatchResult:
    """A DispatchResult made of views of the kernels' packed outputs, as
    the kernel path and the traced op both return them: counts [L+1] (rows
    per local expert, then R) and info [4, R] (local expert, source rank,
    source token, weight's float32 bits)."""
    L = num_local
    return DispatchResult(
        x=x, expert_counts=counts[:L], num_rows=counts[L:], local_expert=info[0], src_rank=info[1],
        src_token=info[2], weight=info[3].view(torch.float32), capturable=capturable, _send_mask=None,
        _send_slot=None, _comb_rows=None, _comb_weight=None, _comb_valid=None, _comb_ranges=(), _comb_slot=None,
        _comb_layers=None, **private)


class ExpertParallel:
    """Expert-parallel dispatch and combine over a :class:`Communicator`.

    Collective: every rank constructs it with the same arguments; they are
    checked across ranks and a mismatch raises ValueError naming the field
    on every rank. Rank r owns experts [r*E/W, (r+1)*E/W).

    - ``num_experts`` (E): divisible by the world size W.
    - ``hidden`` (H): the token row width.
    - ``max_tokens_per_rank`` (T_max): the most tokens any rank dispatches
      in one call (buffers are sized for it).
    - ``topk`` (K): experts per token.
    - ``dtype``: of token rows and expert outputs: bfloat16, float16,
      float32 or float64.
    - ``capturable``: default mode of :meth:`dispatch` (see there).
    - ``num_sms``: blocks (so at most that many SMs) of each GPU kernel;
      default 24, clamped to the GPU's SM count. Ranks may pass different
      values: all use the smallest (each rank's kernels count the blocks of
      its peers' send kernels by their own grid). Ignored by the torch-op
      path (CPU, float64, or shapes the kernels do not take; see
      :attr:`uses_kernels`). Large combines are bound by SMs at 24 (4 x
      H200, 4096 tokens, bf16 partials: ~620 us on 24; 598 on 32 and 562 on
      48 before its reduce kept more loads in flight); dispatch is bound by
      NVLink from ~20 up.
    - ``combine_dtype``: the type partials travel in during :meth:`combine`:
      torch.float32 (default; None means the same) or the ep's ``dtype``.
      Anything else raises UnsupportedError (InvalidArgumentError if it is
      not a torch.dtype).

    Accuracy of combine. Each expert rank d sums its share of a token in
    float32 (k ascending) into a partial p_d; the token's rank adds the
    partials in float32 (d ascending) and rounds once to dtype. With
    combine_dtype=float32 the partials arrive exact, so y is within
    eps/2*|y| + (K+W)*eps32*S of the exact sum (eps: dtype's, eps32:
    float32's, S = sum over k of |w_k * out_k|). With combine_dtype=dtype
    each p_d is rounded once to dtype before it travels (half the bytes),
    adding at most eps/2 * sum over d of |p_d| <= eps/2 * S: no more than
    the final rounding when the contributions share a sign, more when they
    cancel. Tokens whose experts all live on one rank get the same bits
    either way. Both are deterministic and bit-identical run to run.

    Memory: symmetric buffers of about T_max*H*itemsize (kernels; torch-op
    path: W times that) + W*(T_max+1)*(H*combine itemsize + (3K+1)*4)
    bytes per rank, held until the communicator closes; in capturable mode
    each dispatch also returns worst-case [W*T_max*K, H] rows.
    """

    _next_id = 0

    def __init__(self, comm: Communicator, num_experts: int, hidden: int, max_tokens_per_rank: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16, *, capturable: bool = False, num_sms: Optional[int] = None,
                 combine_dtype: Optional[torch.dtype] = torch.float32):
        if not isinstance(comm, Communicator):
            raise InvalidArgumentError(f"comm must be a p2pcomm.Communicator, got {type(comm).__name__}")
        self.comm = comm
        self.world_size, self.rank = comm.world_size, comm.rank
        self.device = comm.device
        self.num_sms = num_sms
        combine_dtype = torch.float32 if combine_dtype is None else combine_dtype
        problem = self._local_config_problem(num_experts, hidden, max_tokens_per_rank, topk, dtype, capturable,
                                             combine_dtype, num_sms)
        if problem is None:
            problem = self._prepare_kernels(num_experts, hidden, max_tokens_per_rank, topk, dtype)
        self._blocks = self._agree_on_config(problem, num_experts, hidden, max_tokens_per_rank, topk, dtype,
                                             capturable, combine_dtype,
                                             self._wanted_blocks(None if problem is not None else num_sms))
        if problem is not None:
            raise problem
        if num_experts % self.world_size:
            raise InvalidArgumentError(f"num_experts={num_experts} must be divisible by the world size "
                                       f"{self.world_size}")
        W, K = self.world_size, topk
        self.num_experts, self.hidden, self.topk = num_experts, hidden, topk
        self.max_tokens_per_rank, self.dtype, self.capturable = max_tokens_per_rank, dtype, bool(capturable)
        self.combine_dtype = combine_dtype
        self.num_local_experts = num_experts // W
        self.max_recv_rows = W * max_tokens_per_rank * K
        ExpertParallel._next_id += 1
        self._id = ExpertParallel._next_id
        # The latest dispatch that moved data: its number (0: none yet) and mode. Every rank agrees
        # on both (same calls in the same order), so combine takes its mode from here, not from recv.
        self._seq, self._seq_capturable = 0, self.capturable
        # The latest result (weakly) and, from the custom op, the latest one without its rows (see _recv_of).
        self._latest, self._op_recv, self._op_rows = None, None, None
        self._on_phase = None  # benchmarks: called with each phase's name as it ends (see _phase)
        Tm, dev = max_tokens_per_rank, self.device
        # The same on every rank: it decides the allocations below.
        self._kernels = self._kernels_usable(num_experts, hidden, max_tokens_per_rank, topk, dtype)
        self._in_kernel = self._kernels and not _barrier_kernels_forced()  # barriers inside the kernels
        # Symmetric buffers, all collective allocations in the same order on every rank.
        # Token rows: kernels stage each source's own rows ([T_max, H], read by the destinations);
        # the torch-op path writes them into the destinations ([W, T_max, H]: [source, slot]).
        rows = comm.empty((Tm, hidden) if self._kernels else (W, Tm, hidden), dtype)
        self._xs, self._recv_x = (rows, None) if self._kernels else (None, rows)
        self._local_xs = None  # get_dispatch_buffer's tensor on the torch-op path
        # [source, slot]: local ids | weight bits | token | pair ranks (kernels only; see moe_common.cuh)
        self._meta = comm.empty((W, Tm, 3 * K + 1), torch.int32)
        self._counts = comm.empty(W, torch.int32)  # tokens sent by each source
        # Eager argument checks of each rank, one row per call parity (see _post_status).
        self._status = comm.empty((2, W), torch.int32)
        self._checks = 0  # eager calls so far: the parity of the next one
        # [expert rank, slot] partials; row Tm is gathered (and masked) for tokens not sent to a rank.
        self._comb = comm.empty((W, Tm + 1, hidden), combine_dtype)
        # Kernels: per source, tokens sent, then pairs sent per local expert.
        self._hdr = comm.empty((W, self.num_local_experts + 1), torch.int32)
        # Kernels: flags of the in-kernel barriers (moe_common.cuh MoeSync), written by peers, only growing.
        self._sync_flags = comm.empty(_SYNC_FLAG_WORDS, torch.int64) if self._kernels else None
        for t in (rows, self._meta, self._counts, self._status, self._comb, self._hdr, self._sync_flags):
            if t is not None:
                t.zero_()
        # Peers post into _status before their first start barrier: zero everywhere first.
        comm.stream_barrier()
        peers = lambda t: [t if d == self.rank else comm.peer_tensor(t, d) for d in range(W)]  # noqa: E731
        self._peer_recv_x = [p[self.rank] for p in peers(self._recv_x)] if not self._kernels else []
        self._peer_meta = [p[self.rank] for p in peers(self._meta)]
        self._peer_counts = [p[self.rank:self.rank + 1] for p in peers(self._counts)]
        self._peer_status = [[p[par, self.rank:self.rank + 1] for p in peers(self._status)] for par in (0, 1)]
        self._peer_comb = [p[self.rank] for p in peers(self._comb)]
        # Device constants, so that no call copies from the host (CUDA graphs forbid it).
        self._ranks = torch.arange(W, device=dev).view(W, 1, 1)
        self._token_ids = torch.arange(Tm, dtype=torch.int32, device=dev)
        self._slot_ids = torch.arange(Tm, device=dev)
        self._grid = torch.arange(W * Tm, device=dev)
        self._flat_ids = torch.arange(W * Tm * K, device=dev)
        self._expert_ids = torch.arange(self.num_local_experts + 1, dtype=torch.int32, device=dev)
        self._layer_ids = torch.arange(K, device=dev)
        self._codes = torch.tensor([_OK, _INVALID, _UNSUPPORTED], dtype=torch.int32, device=dev)
        self._setup_kernels()
        # What names this ep to the torch ops, and the tensor they declare they write, so that
        # compiled code keeps this ep's calls in order (ops.py). Static: CUDA-graph trees
        # (mode="reduce-overhead") neither copy them nor refuse the declared writes.
        self._op_ident = torch.zeros(1, dtype=torch.int32, device=dev)
        self._op_order = torch.zeros(1, dtype=torch.int32, device=dev)
        for t in (self._op_ident, self._op_order):
            torch._dynamo.mark_static_address(t)
        ops.track_ep(self)

    @property
    def uses_kernels(self) -> bool:
        """True when dispatch and combine run the fused GPU kernels of
        native/kernels/moe_*.cu; False on the torch-op path (CPU; float64;
        hidden * itemsize not a multiple of 16 bytes; world > 8; topk > 32;
        num_experts > 4096; or P2PCOMM_MOE_TORCH=1, which must then be set on
        every rank)."""
        return self._kernels

    def _kernels_usable(self, E: int, H: int, Tm: int, K: int, dtype: torch.dtype) -> bool:
        """Whether a config (checked by _local_config_problem) takes the
        kernels (see uses_kernels)."""
        W = self.world_size
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return (self.device.type == "cuda" and dtype in _KERNEL_TYPES and (H * itemsize) % 16 == 0
                and W <= _MAX_RANKS and K <= _MAX_TOPK and E <= _MAX_EXPERTS
                and W * Tm * K < 2 ** 31 and not _torch_path_forced())

    def _setup_kernels(self) -> None:
        W, K, Tm = self.world_size, self.topk, self.max_tokens_per_rank
        if not self._kernels:
            return
        # Peer pointer tables, once: entry d is rank d's copy, mapped here.
        ptrs = lambda t: [t.data_ptr() if d == self.rank else self.comm.peer_tensor(t, d).data_ptr()  # noqa: E731
                          for d in range(W)] + [0] * (_MAX_RANKS - W)
        self._ptr_xs, self._ptr_meta = _Ptrs(*ptrs(self._xs)), _Ptrs(*ptrs(self._meta))
        self._ptr_hdr, self._ptr_comb = _Ptrs(*ptrs(self._hdr)), _Ptrs(*ptrs(self._comb))
        # Each rank's status row of either parity (moe_post_status writes slot [rank]).
        self._ptr_status = [_Ptrs(*[q + par * W * 4 if q else 0 for q in ptrs(self._status)]) for par in (0, 1)]
        # Eager combine reads the checks into pinned memory right after the start barrier, so that
        # its one host wait ends there, not after the call's own kernels.
        self._status_host = torch.empty(W, dtype=torch.int32, pin_memory=True)
        self._status_ready = torch.cuda.Event()
        # x's copy into the staging buffer runs on a side stream while the send kernel runs (see
        # _dispatch_kernels): the stream, and the events that fork it from the caller's and join it back.
        self._stage_overlap = not _stage_overlap_disabled()
        self._count_min_pairs = _count_kernel_min_pairs()
        self._self_local = _self_local_mode() if W == 2 and K <= _SELF_LOCAL_MAX_TOPK else "never"
        self._side = torch.cuda.Stream(self.device) if self._stage_overlap else None
        self._fork, self._join = torch.cuda.Event(), torch.cuda.Event()
        dev = self.device
        # Local state: valid from one dispatch until the next (the DispatchResult contract).
        self._send_slot = torch.full((Tm, W), -1, dtype=torch.int32, device=dev)  # slot of token t on rank d
        # Scratch: pair ranks (moe_dispatch_send), then each block's counts (moe_dispatch_count).
        self._pair_rank = torch.empty(Tm * K + self._blocks * (W + self.num_experts), dtype=torch.int32,
                                      device=dev)
        self._comb_row_map = torch.full((W * Tm, K), -1, dtype=torch.int32, device=dev)  # (source, slot, k) -> row
        # In-kernel barriers: local state (call counters per send block, go, free_epoch; zeroed once) and
        # the MoeSync of each (kind, mode), built once: eager calls are bound by host time.
        self._sync_state = torch.zeros(_SYNC_STATE_BYTES // 8, dtype=torch.int64, device=dev)
        signal, err, timeout_ns = self.comm.wait_info()
        flags = _Ptrs(*ptrs(self._sync_flags))
        self._syncs = {}
        for kind in (_DISPATCH, _COMBINE):
            for mode in range(_SYNC_MODES):
                self._syncs[kind, mode] = _Sync(peer_flags=flags, state=self._sync_state.data_ptr(), signal=signal,
                                                err=err, timeout_ns=timeout_ns,
                                                mode=mode | self._blocks << _SYNC_GRID_SHIFT, kind=kind)

    def __repr__(self) -> str:
        return (f"ExpertParallel(rank={self.rank}, world_size={self.world_size}, num_experts={self.num_experts}, "
                f"hidden={self.hidden}, max_tokens_per_rank={self.max_tokens_per_rank}, topk={self.topk}, "
                f"dtype={self.dtype}, capturable={self.capturable}, combine_dtype={self.combine_dtype})")

    def close(self) -> None:
        """Drop this rank's references. The symmetric memory is released
        when the communicator closes. Not collective; idempotent."""
        self._peer_recv_x = self._peer_meta = self._peer_counts = self._peer_status = self._peer_comb = []
        self._latest = self._op_recv = None

    def __enter__(self) -> "ExpertParallel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- construction checks -------------------------------------------------------------------------

    def _local_config_problem(self, E, H, Tm, K, dtype, capturable, combine_dtype,
                              num_sms) -> Optional[P2PCommError]:
        """This rank's first bad argument, or None (raised only after every
        rank has agreed, so that the others raise MismatchError instead of
        waiting for it). num_sms is not compared across ranks: they take
        the smallest grid (_agree_on_config)."""
        for name, v in (("num_experts", E), ("hidden", H), ("max_tokens_per_rank", Tm), ("topk", K)):
            if isinstance(v, bool) or not isinstance(v, int):
                return InvalidArgumentError(f"{name} must be an int, got {type(v).__name__}")
            if v < 1:
                return InvalidArgumentError(f"{name} must be positive, got {v}")
        if _dtype_code(dtype) < 0:
            return UnsupportedError(f"dtype {dtype} is not supported; use one of "
                                    f"{', '.join(sorted(str(d) for d in _EP_DTYPES))}")
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

    def _prepare_kernels(self, E: int, H: int, Tm: int, K: int, dtype: torch.dtype) -> Optional[P2PCommError]:
        """Compiles the MoE kernels (and the stream barrier's), when this
        config takes them, before the ranks line up in _agree_on_config, so
        that no rank compiles inside a call while its peers wait in their
        kernels (a cold compile takes seconds; P2PCOMM_TIMEOUT_MS bounds
        those waits). A failure becomes this rank's problem, which every
        rank learns in the agreement."""
        if isinstance(self.comm, TorchFallbackCommunicator) or not self._kernels_usable(E, H, Tm, K, dtype):
            return None
        try:
            self.comm.prepare_kernel(_DISPATCH_FILE, "moe_post_status")
            self.comm.prepare_kernel(_COMBINE_FILE, _kernel_expr("moe_combine_send", dtype, dtype, self.world_size))
        except P2PCommError as e:
            return e
        return None

    def _wanted_blocks(self, num_sms: Optional[int]) -> int:
        """This rank's grid for the kernels: num_sms (checked; None: 24)
        within the GPU's SMs and the barriers' block limit."""
        sms = self.comm.sm_count if self.device.type == "cuda" else 0
        return max(1, min(num_sms or _DEFAULT_SMS, sms if sms > 0 else _DEFAULT_SMS, _MAX_SYNC_BLOCKS))

    def _agree_on_config(self, problem, E, H, Tm, K, dtype, capturable, combine_dtype, blocks) -> int:
        """All ranks exchange (config, who failed) before the first
        collective allocation, so a mismatch raises everywhere instead of
        hanging there. The exchange is on the host (comm.host_allgather,
        bounded by the bootstrap's timeout): as a GPU all-reduce, a rank
        that came late (still compiling kernels, say) made its peers time
        out while it went on alone into the allocations and waited there
        for the group's timeout (2 x H100, 2026-11-25). Returns the smallest
        grid any rank wants: a kernel waits for the middle flags of as many
        blocks of each peer's send kernel as it has itself, so the grids
        must agree."""
        W = self.world_size
        ints = lambda v: v if isinstance(v, int) and not isinstance(v, bool) else -1  # noqa: E731
        fields = [ints(E), ints(H), ints(K), ints(Tm), _dtype_code(dtype), _dtype_code(combine_dtype),
                  int(capturable) if isinstance(capturable, bool) else -1, W, int(_torch_path_forced()),
                  int(_barrier_kernels_forced())]
        failed = [0] * W
        if problem is not None:
            failed[self.rank] = 1
        vec = [max(-2 ** 62, min(v, 2 ** 62)) for v in fields + failed + [blocks]]  # any int packs
        packed = self.comm.host_allgather(struct.pack(f"<{len(vec)}q", *vec))
        rows = [struct.unpack(f"<{len(vec)}q", b) for b in packed]
        lo, hi = [min(c) for c in zip(*rows)], [max(c) for c in zip(*rows)]
        bad_ranks = [r for r in range(W) if hi[len(fields) + r]]
        if bad_ranks and problem is None:
            raise MismatchError(f"ExpertParallel: rank {', '.join(map(str, bad_ranks))} rejected its arguments "
                                "or could not build its kernels (its own exception says which)")
        if problem is not None:
            return blocks  # the caller raises, with the specific message
        differ = [f"{_CONFIG_FIELDS[i]} (from {lo[i]} to {hi[i]})" for i in range(len(fields)) if lo[i] != hi[i]]
        if differ:
            raise InvalidArgumentError("ExpertParallel: ranks passed different " + ", ".join(differ)
                                       + "; every rank must pass the same configuration (dtypes and capturable "
                                         "are compared as codes)")
        return lo[-1]

    # -- dispatch ------------------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                 capturable: Optional[bool] = None) -> DispatchResult:
        """Collective. Send each token to the ranks owning its experts.

        - ``x``: [T, H] tensor of the ep's dtype on the communicator's device,
          0 <= T <= max_tokens_per_rank (T may differ per rank, and be 0).
        - ``topk_idx``: [T, K] int32 or int64, global expert ids; -1 means
          no expert for that k.
        - ``topk_weights``: [T, K] float32.
        - ``capturable``: None uses the constructor's mode. Eager (False):
          checks expert ids (a rank with bad input raises its specific
          error and every other rank raises MismatchError; no data moves),
          and returns exactly R rows, with one host sync (on GPU after the
          send kernels, which write nothing when a rank's check failed; on
          the CPU backend a second one before any data moves). Capturable
          (True): no host sync at all, so it can be
          captured in a CUDA graph: recv.x is [R_max, H] with the valid count
          in ``recv.num_rows``; expert ids outside [0, E) are treated as -1
          (not checked); shapes and dtypes are still checked, but a rank
          that fails them raises alone and its peers time out in the next
          barrier (the middle one when the call follows a combine, since
          the peers' calls then skip the start barrier: their metadata
          reaches the failed rank, whose latest result is no longer valid).
          Every rank must pass the same mode.

        Returns a :class:`DispatchResult`. Work is ordered on the current
        CUDA stream; inputs are not modified (except a view of x inside
        :meth:`get_dispatch_buffer`'s memory: see there).

        Under ``torch.compile`` (fullgraph too) the call is the custom op
        ``torch.ops.p2pcomm.moe_dispatch``, whose body is this method: the
        same checks and errors when the compiled code runs; in eager mode R
        is a data-dependent size there.
        """
        capturable = self.capturable if capturable is None else bool(capturable)
        if torch.compiler.is_compiling():
            return self._traced_dispatch(x, topk_idx, topk_weights, capturable)
        recv = self._dispatch(x, topk_idx, topk_weights, capturable)
        # A compiled combine finds it by its rows (_recv_of); an op-made result is stale now.
        self._latest, self._op_recv = weakref.ref(recv), None
        return recv

    def _dispatch(self, x, topk_idx, topk_weights, capturable: bool) -> DispatchResult:
        problem = self._check_dispatch(x, topk_idx, topk_weights)
        if capturable:
            if problem is not None:
                raise problem
            if not self._in_kernel:  # else the start barrier is inside moe_dispatch_send
                self.comm.stream_barrier(BARRIER_MOE_DISPATCH)  # start barrier (see module doc)
        elif self._kernels:
            # No host sync before the data: the send kernels read every rank's posted status and
            # write nothing if one rejected its arguments; the one sync (for R) raises together.
            status = self._post_status(problem, topk_idx)
            self._phase("agree")
            return self._dispatch_kernels(x, topk_idx, topk_weights, False, status, problem)
        else:
            self._agree(problem, topk_idx, "dispatch")
        self._phase("agree")
        # Data moves from here on: earlier results no longer match the buffers.
        self._seq, self._seq_capturable = self._seq + 1, capturable
        if self._kernels:
            return self._dispatch_kernels(x, topk_idx, topk_weights, capturable)
        W, K, L, Tm, H = self.world_size, self.topk, self.num_local_experts, self.max_tokens_per_rank, self.hidden
        T = x.shape[0]

        # 1. Routing on the source: which tokens go to which rank, into which slot.
        idx = topk_idx.long()
        ok = (idx >= 0) & (idx < self.num_experts)
        dest = torch.where(ok, torch.div(idx, L, rounding_mode="floor"), -1)  # [T, K]
        local = torch.where(ok, idx.remainder(L), -1)
        here = dest.unsqueeze(0) == self._ranks  # [W, T, K]
        local_ids = torch.where(here, local.unsqueeze(0), -1).to(torch.int32)
        send = here.any(dim=2)  # [W, T]
        slot = torch.where(send, send.long().cumsum(dim=1) - 1, Tm)  # [W, T]; Tm: not sent
        # Tokens in slot order, those sent first: packing rows locally turns each peer write into
        # one contiguous copy (a peer memcpy at NVLink speed) instead of a scatter over NVLink.
        packed = torch.sort((~send).to(torch.int32), dim=1, stable=True).indices  # [W, T]
        count = send.sum(dim=1, dtype=torch.int32)  # [W]
        wbits = topk_weights.contiguous().view(torch.int32)
        meta = torch.cat([local_ids, wbits.unsqueeze(0).expand(W, T, K),
                          self._token_ids[:T].view(1, T, 1).expand(W, T, 1)], dim=2)  # [W, T, 2K+1]

        # 2. Write rows, metadata and counts straight into every destination's buffers.
        for d in self._peers_rotated():  # slots past count[d] get unsent tokens, never read
            self._peer_recv_x[d][:T].copy_(x.index_select(0, packed[d]))
            self._peer_meta[d][:T, :2 * K + 1].copy_(meta[d].index_select(0, packed[d]))
            self._peer_counts[d].copy_(count[d:d + 1])
        self._phase("send")
        self.comm.stream_barrier(BARRIER_MOE_DISPATCH)  # 3. mid barrier: every source's writes are visible here
        self._phase("mid barrier")

        # 4. Expand into expert-major order on the receiver.
        got = self._meta  # [W, Tm, 2K+1]
        slot_ok = self._slot_ids.view(1, Tm) < self._counts.view(W, 1)  # [W, Tm]
        lid = got[:, :, :K]
        pair_ok = slot_ok.unsqueeze(2) & (lid >= 0) & (lid < L)  # [W, Tm, K]
        key = torch.where(pair_ok, lid, L).flatten()  # invalid pairs sort last
        sorted_key, perm = torch.sort(key, stable=True)  # flat index orders (source, token, k) already
        bounds = torch.searchsorted(sorted_key, self._expert_ids)  # [L+1] first row of each expert
        expert_counts = (bounds[1:] - bounds[:-1]).to(torch.int32)
        num_rows = bounds[L:].to(torch.int32)
        if capturable:
            rows, R = perm, self.max_recv_rows
            slot_list, ranges = self._grid, tuple((s, s * Tm, Tm) for s in range(W))
        else:
            # Pairs per layer: layer j holds each slot's j-th pair here, in k order (see combine).
            pairs = pair_ok.sum(dim=2).view(W * Tm, 1)
            layer_sizes = (pairs > self._layer_ids).sum(dim=0)  # [K]
            host = torch.cat([num_rows, self._counts, layer_sizes.to(torch.int32)]).tolist()  # the host sync
            R, counts, layers = host[0], host[1:W + 1], tuple(n for n in host[W + 1:] if n)
            rows = perm[:R]
            ranges, start = [], 0
            for s, c in enumerate(counts):
                ranges.append((s, start, c))
                start += c
            ranges = tuple(ranges)
            slot_list = torch.cat([self._slot_ids[:c] + s * Tm for s, c in enumerate(counts)])
        grid_slot = torch.div(rows, K, rounding_mode="floor")  # source * Tm + slot
        src = torch.div(grid_slot, Tm, rounding_mode="floor")
        recv_x = self._recv_x.view(W * Tm, H).index_select(0, grid_slot)
        weights_grid = got[:, :, K:2 * K].contiguous().view(torch.float32).reshape(W * Tm, K)
        tokens_grid = got[:, :, 2 * K].reshape(W * Tm)
        weight = weights_grid.flatten().index_select(0, rows)
        src_token = tokens_grid.index_select(0, grid_slot)

        # What combine needs: for each (source, slot) the row of each k, in k order.
        inverse = torch.empty_like(perm).index_copy_(0, perm, self._flat_ids)  # flat (slot, k) -> row
        pair_ok_grid = pair_ok.reshape(W * Tm, K).index_select(0, slot_list)
        comb_rows = torch.where(pair_ok_grid, inverse.view(W * Tm, K).index_select(0, slot_list), 0)
        comb_weight = torch.where(pair_ok_grid, weights_grid.index_select(0, slot_list), 0.0)
        if capturable:
            layers, comb_slot = None, None
        else:  # the pairs listed layer by layer: (slot, k) flat indices into [S, K]
            S = comb_rows.shape[0]
            ranks_in_slot = pair_ok_grid.cumsum(dim=1) - 1
            lkey = torch.where(pair_ok_grid, ranks_in_slot * S + torch.arange(S, device=self.device).view(S, 1), K * S)
            order = torch.sort(lkey.flatten()).indices[:R]  # keys are unique
            comb_slot = torch.div(order, K, rounding_mode="floor")
            comb_rows = comb_rows.flatten().index_select(0, order)
            comb_weight = comb_weight.flatten().index_select(0, order)
        self._phase("expand")
        return DispatchResult(
            x=recv_x, expert_counts=expert_counts, num_rows=num_rows, local_expert=sorted_key[:R],
            src_rank=src.to(torch.int32), src_token=src_token, weight=weight, capturable=capturable,
            _ep_id=self._id, _seq=self._seq, _num_tokens=T, _send_mask=send, _send_slot=slot, _comb_rows=comb_rows,
            _comb_weight=comb_weight, _comb_valid=pair_ok_grid, _comb_ranges=ranges, _comb_slot=comb_slot,
            _comb_layers=layers)

    # -- combine -------------------------------------------------------------------------------------

    def combine(self, expert_out: torch.Tensor, recv: DispatchResult) -> torch.Tensor:
        """Collective. Return [T, H] of the ep's dtype on the rank that
        dispatched: y[t] = sum over k of topk_weights[t, k] * expert_out of
        row (t, k), over the token's valid experts; zeros for a token with
        none.

        - ``expert_out``: [R, H] of the ep's dtype on the communicator's
          device, in ``recv.x``'s row order (R = recv.x.shape[0]; in
          capturable mode rows past ``recv.num_rows`` are ignored, and may
          hold anything, NaN included).
        - ``recv``: this rank's result of the latest :meth:`dispatch` of this
          ep (combining one result several times is fine). An older result
          raises StateError: the ep's buffers now hold the newer routing.

        Summation order, fixed so results are bit-identical run to run: on
        each expert rank d, a float32 partial per token, adding weight *
        output for k = 0, 1, ..., K-1 (those on d), rounded to
        ``combine_dtype`` (exact for float32); then on the token's rank,
        partials added in float32 for d = 0, 1, ..., W-1; one final cast to
        dtype (accuracy: see :class:`ExpertParallel`).

        The mode is the latest dispatch's, which every rank shares. Eager
        waits on the host once to agree that every rank's arguments are
        valid (on GPU: for the start barrier, not for the call's kernels,
        which send nothing when a check failed): a rank with bad arguments
        (a stale ``recv`` included) raises its error and every other rank
        raises MismatchError, all still usable.
        Capturable never syncs: a rank with bad arguments raises alone, before
        any barrier, and its peers time out (PeerTimeoutError after
        P2PCOMM_TIMEOUT_MS): in the middle barrier when the call follows a
        dispatch, which skips the start barrier (their partials reach the
        failed rank, which has given up anyway), else in the start barrier;
        the argument checks are host-side and run when the call is made (or
        captured), not on graph replays.

        Under ``torch.compile`` the call is the custom op
        ``torch.ops.p2pcomm.moe_combine``: it names its dispatch by
        ``recv.x``, so ``recv`` must be this ep's latest result, from
        compiled code or not (an older one raises StateError, and in eager
        mode the other ranks MismatchError, as above). Under
        ``mode="reduce-overhead"`` dispatch in compiled code too: CUDA-graph
        trees copy a plain result's ``recv.x`` into their own buffer when
        they record (``torch._dynamo.mark_static_address`` on it does not
        stop that), and combine refuses the copy with StateError, on every
        rank alike.
        """
        if torch.compiler.is_compiling():
            return torch.ops.p2pcomm.moe_combine(expert_out, recv.x, self._op_ident, self._op_order,
                                                 recv._num_tokens)
        problem = None
        if isinstance(recv, DispatchResult) and recv._from_op:  # returned by compiled code
            recv, problem = self._recv_of(recv.x)
        return self._combine(expert_out, recv, problem)

    def _combine(self, expert_out, recv: Optional[DispatchResult], problem: Optional[P2PCommError]) -> torch.Tensor:
        """combine, given the problem found with recv so far (then recv may
        be None), so that eager calls raise it on every rank together."""
        if problem is None:
            problem = self._check_combine(expert_out, recv)
        if self._seq_capturable:
            if problem is not None:
                raise problem
            if not self._in_kernel:  # else the start barrier is inside moe_combine_send
                self.comm.stream_barrier(BARRIER_MOE_COMBINE)  # start barrier (see module doc)
        elif self._kernels:
            # As in dispatch: the send kernels check every rank's status; one host sync at the end.
            status = self._post_status(problem, None)
            self._phase("agree")
            return self._combine_kernels(expert_out, recv, status, problem)
        else:
            self._agree(problem, None, "combine")
        self._phase("agree")
        if recv._kernel:
            return self._combine_kernels(expert_out, recv)
        K = self.topk
        out = expert_out
        if out.shape[0] == 0:  # nothing received: gather indices (all masked) need a row to point at
            out = torch.zeros(1, self.hidden, dtype=self.dtype, device=self.device)
        # 1. One float32 partial per received (source, token), k in ascending order.
        # Both modes round weight * row to float32, then add it: the same bits. Capturable adds
        # -0.0 (an exact no-op, even on -0.0) for missing pairs; eager adds only the pairs that
        # exist, layer j holding each slot's j-th pair in k order, so each index_add_ touches a
        # slot at most once (deterministic) and the work is R rows, not S*K.
        S = recv._comb_valid.shape[0]
        acc = torch.zeros(S, self.hidden, dtype=torch.float32, device=self.device)
        if recv._comb_layers is None:
            for k in range(K):
                part = out.index_select(0, recv._comb_rows[:, k]).float().mul_(recv._comb_weight[:, k:k + 1])
                acc.add_(torch.where(recv._comb_valid[:, k:k + 1], part, -0.0))  # unused rows may hold NaN
        else:
            start = 0
            for n in recv._comb_layers:
                sl = slice(start, start + n)
                part = out.index_select(0, recv._comb_rows[sl]).float().mul_(recv._comb_weight[sl].unsqueeze(1))
                acc.index_add_(0, recv._comb_slot[sl], part)
                start += n
        # 2. Into each source's buffer at [this rank, slot]: one contiguous copy per source,
        # rounded once to the transit type there (copy_ rounds to nearest even).
        ranges = {s: (start, n) for s, start, n in recv._comb_ranges}
        for s in self._peers_rotated():
            start, n = ranges[s]
            self._peer_comb[s][:n].copy_(acc[start:start + n])
        self._phase("send")
        self.comm.stream_barrier(BARRIER_MOE_COMBINE)  # 3. mid barrier
        self._phase("mid barrier")
        # 4. Sum the partials of the ranks each token went to, in rank order.
        T = recv._num_tokens
        y = torch.zeros(T, self.hidden, dtype=torch.float32, device=self.device)
        for d in range(self.world_size):
            part = self._comb[d].index_select(0, recv._send_slot[d]).float()  # row T_max where not sent: masked
            y.add_(torch.where(recv._send_mask[d].unsqueeze(1), part, 0.0))
        y = y.to(self.dtype)
        self._phase("reduce")
        return y

    def _peers_rotated(self) -> list:
        """Every rank, from rank + 1 up and wrapping to this rank last: ranks
        that copy at the same time write into different peers, instead of
        all into rank 0 first (one rank's link would bound them all)."""
        W = self.world_size
        return [(self.rank + 1 + i) % W for i in range(W)]

    def _phase(self, name: str) -> None:
        """Marks the end of a phase for a benchmark's hook (bench_moe's
        breakdown records a CUDA event there). Phases: dispatch: agree
        (argument checks posted, start barrier; torch-op path: and read),
        stage (kernels: x into the staging buffer), send, mid barrier, size
        (eager kernels: the host reads the checks and counts), expand;
        combine: agree, send, mid barrier, reduce, check (eager kernels: the
        host reads the checks)."""
        if self._on_phase is not None:
            self._on_phase(name)

    # -- torch.compile -------------------------------------------------------------------------------

    def _traced_dispatch(self, x, topk_idx, topk_weights, capturable: bool) -> DispatchResult:
        """dispatch as torch.compile traces it: the custom op, whose body
        is _op_dispatch, and a result made of views of its outputs."""
        L = self.num_local_experts
        out_x, counts, info = torch.ops.p2pcomm.moe_dispatch(x, topk_idx, topk_weights, self._op_ident, self._op_order,
                                                             capturable, self.max_recv_rows, L)
        return _packed_result(out_x, counts, info, L, capturable, _ep_id=0, _seq=0, _num_tokens=x.shape[0],
                              _from_op=True)

    def _op_dispatch(self, x, topk_idx, topk_weights, capturable: bool, max_rows: int, num_local: int) -> tuple:
        """The body of torch.ops.p2pcomm.moe_dispatch: dispatch, its result
        kept here without its rows (combine gets them back as its input)."""
        if (max_rows, num_local) != (self.max_recv_rows, self.num_local_experts):
            raise InvalidArgumentError(f"moe_dispatch: max_rows={max_rows}, num_local={num_local}, but this ep has "
                                       f"{self.max_recv_rows} and {self.num_local_experts}")
        recv = self.dispatch(x, topk_idx, topk_weights, capturable=capturable)
        if recv._packed is not None:
            counts, info = recv._packed
        else:  # the torch-op path: separate tensors
            counts = torch.cat([recv.expert_counts, recv.num_rows])
            info = torch.stack([recv.local_expert, recv.src_rank, recv.src_token.to(torch.int32),
                                recv.weight.view(torch.int32)])
        self._op_recv, self._op_rows = dataclasses.replace(recv, x=None, _packed=None), _rows_key(recv.x)
        return recv.x, counts, info

    def _op_combine(self, expert_out, recv_x, num_tokens: int) -> torch.Tensor:
        """The body of torch.ops.p2pcomm.moe_combine."""
        recv, problem = self._recv_of(recv_x)
        if problem is None and recv._num_tokens != num_tokens:
            problem = StateError(f"recv was dispatched with {recv._num_tokens} tokens, not {num_tokens}")
        return self._combine(expert_out, recv, problem)

    def _recv_of(self, recv_x: torch.Tensor) -> tuple:
        """(result, None) for the result of this ep's latest dispatch whose
        rows are recv_x: made by the custom op (kept without rows) or by a
        plain call (kept weakly: the caller holds it); (None, StateError)
        when there is none: an older dispatch's rows, which combine must
        refuse."""
        key = _rows_key(recv_x)
        if self._op_recv is not None and self._op_rows == key and self._op_recv._seq == self._seq:
            return dataclasses.replace(self._op_recv, x=recv_x), None
        latest = self._latest() if self._latest is not None else None
        if latest is not None and _rows_key(latest.x) == key:
            return latest, None
        return None, StateError("recv is not the result of this ExpertParallel's latest dispatch (a newer dispatch "
                                "has reused its buffers); combine the latest dispatch's result")

    # -- GPU kernels -----------------------------------------------------------------------------------

    def _launch(self, kernel: str, params: ctypes.Structure, grid: int, shared_bytes: int = 0) -> None:
        expr = _kernel_expr(kernel, self.dtype, self.combine_dtype, self.world_size)
        file = _COMBINE_FILE if kernel in _COMBINE_KERNELS else _DISPATCH_FILE
        self.comm.launch_kernel(file, expr, params, grid, _THREADS, shared_bytes)

    @staticmethod
    def _aligned(t: torch.Tensor) -> torch.Tensor:
        """t, contiguous and 16-byte aligned (the kernels' vector loads)."""
        t = t.contiguous()
        return t if t.data_ptr() % 16 == 0 else t.clone()

    def get_dispatch_buffer(self, num_tokens: Optional[int] = None) -> torch.Tensor:
        """[num_tokens, H] tensor (default max_tokens_per_rank rows) of the
        ep's dtype, for building the next dispatch's ``x`` in place: passing
        it as ``x`` skips the copy of x into the symmetric staging buffer
        that peers read tokens from (on GPU about 60 MB at 4096 tokens of
        7168 bf16). Always the same memory (rows [0, num_tokens) of it), so
        fill it only after this rank's combine of the previous dispatch (or
        any later collective of this ep's communicator) is on the stream:
        until then peers may still be reading the previous tokens from it.
        Any other x is copied into its rows [0, T) (on GPU), so a view of x
        elsewhere inside it changes there. Not collective. On the torch-op
        path a plain tensor (never written by dispatch)."""
        n = self.max_tokens_per_rank if num_tokens is None else num_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.max_tokens_per_rank:
            raise InvalidArgumentError(f"num_tokens must be an int in [0, {self.max_tokens_per_rank}], got {n!r}")
        if self._xs is None:
            if self._local_xs is None:
                self._local_xs = torch.empty(self.max_tokens_per_rank, self.hidden, dtype=self.dtype,
                                             device=self.device)
            return self._local_xs[:n]
        return self._xs[:n]

    def _stage(self, x: torch.Tensor) -> None:
        """Puts x's rows into the staging buffer xs, where peers read them
        (after the start barrier: peers read xs until then), with a device-to-device
        memcpy, which uses no SM of the ep's budget and measured faster than
        the send kernel's SMs doing it (4 x H200, 4096 tokens of 7168 bf16:
        31 against ~50 µs). Callers check _staged_rows first."""
        xs = self._xs[:x.shape[0]]
        if _overlaps(x, self._xs):  # a view elsewhere inside the buffer: copy out first
            x = x.clone()
        xs.copy_(x)

    def _staged_rows(self, x: torch.Tensor) -> bool:
        """Whether dispatch must copy x into the staging buffer (see _stage)."""
        return x.shape[0] > 0 and not (x.data_ptr() == self._xs.data_ptr() and x.is_contiguous())

    def _dispatch_kernels(self, x, topk_idx, topk_weights, capturable: bool, status: Optional[torch.Tensor] = None,
                          problem: Optional[P2PCommError] = None) -> DispatchResult:
        """dispatch on the kernel path: moe_dispatch_count (from
        _COUNT_KERNEL_MIN_PAIRS routed pairs up), moe_dispatch_send
        (metadata and hdr into the destinations), the mid barrier, then
        moe_dispatch_expand pulls the rows and builds the expert-major result
        here.

        Capturable: the barriers are inside the kernels (moe_common.cuh MoeSync): the
        send kernel runs the start barrier, so x is staged only once past it
        (peers may read the previous rows until then): on a side stream, where
        moe_stage_gate waits for the send kernel's block 0 to pass it, so the
        copy overlaps the rest of the send kernel (or, with
        P2PCOMM_MOE_OVERLAP_STAGE=0, after the send kernel), and moe_stage_done
        posts a staged flag after it that every expand waits for besides the
        send blocks' middle flags (a rank with nothing to copy posts it from
        its send kernel; without the overlap the expand kernel posts both
        kinds itself). Eager calls come after _post_status's start barrier
        (their copy of x forks onto the side stream right away when x holds
        at least _EAGER_OVERLAP_BYTES, else runs before the send kernel) and pass
        status, every rank's posted argument check (the send kernel writes
        nothing if one failed), and problem, this rank's own; the mid
        barrier is a barrier kernel, since the host reads the counts after
        it. Every rank launches the send kernel in every call, a rejected
        one included: its blocks count calls (the barriers' epochs)."""
        W, K, L, Tm, H = self.world_size, self.topk, self.num_local_experts, self.max_tokens_per_rank, self.hidden
        T = x.shape[0] if problem is None else 0
        staged = problem is None and self._staged_rows(x)
        if problem is None:
            idx, w = topk_idx.contiguous(), topk_weights.contiguous()
            idx_ptr, w_ptr, idx_bytes = idx.data_ptr(), w.data_ptr(), idx.element_size()
        else:
            idx_ptr, w_ptr, idx_bytes = 0, 0, 4
        in_kernel = capturable and self._in_kernel
        # The copy of x into xs runs on the side stream while the send kernel runs. Eager calls fork
        # after their start barrier kernel; capturable ones before the send kernel, whose block 0
        # then releases the copy (moe_stage_gate) once past its start barrier: until then peers may
        # read the previous rows.
        overlap = (staged and self._stage_overlap
                   and (in_kernel or (not capturable and x.numel() * x.element_size() >= _EAGER_OVERLAP_BYTES)))
        # The send kernel's blocks post the middle flags unless x is copied after it (no overlap). Every
        # rank posts a staged flag once per call, which every expand waits for, whether or not that rank
        # copies x (ranks differ: x built in get_dispatch_buffer(), T = 0): moe_stage_done after the
        # overlapped copy, the send kernel when there is no copy, the expand after a copy that follows
        # the send kernel.
        send_mode = _SYNC_START | (_SYNC_ARRIVE if overlap or not staged else 0) \
            | (_SYNC_STAGE_GO if overlap else 0) | (0 if staged else _SYNC_POST_STAGED) if in_kernel else 0
        counted = problem is None and T > 0 and T * K >= self._count_min_pairs
        # Small batches without the count kernel: the send kernel copies the ids into shared memory
        # first (up to _SEND_SHARED_MAX bytes with its expert counters).
        ids_shared = problem is None and not counted and 4 * (self.num_experts + T * K) <= _SEND_SHARED_MAX
        p = _DispatchParams(peer_meta=self._ptr_meta, peer_hdr=self._ptr_hdr, topk_idx=idx_ptr, topk_w=w_ptr,
                            send_slot=self._send_slot.data_ptr(), pair_rank=self._pair_rank.data_ptr(),
                            num_tokens=T, max_tokens=Tm, hidden=H, topk=K, num_experts=self.num_experts,
                            rank=self.rank, world=W, idx_bytes=idx_bytes, counted=int(counted), ids_shared=int(ids_shared),
                            status=0 if status is None else status.data_ptr(),
                            sync=self._syncs[_DISPATCH, send_mode])
        if overlap:
            main = torch.cuda.current_stream(self.device)
            self._fork.record(main)
            self._side.wait_event(self._fork)
        elif staged and not capturable:  # eager: after the start barrier kernel
            self._stage(x)
        if not capturable:
            self._phase("stage")
        if counted:
            self._launch("moe_dispatch_count", p, self._blocks, 4 * (W + self.num_experts))  # same grid as send
        self._launch("moe_dispatch_send", p, self._blocks, 4 * (self.num_experts + (T * K if ids_shared else 0)))
        if overlap:
            with torch.cuda.stream(self._side):
                if capturable:
                    self.comm.launch_kernel(_DISPATCH_FILE, "moe_stage_gate", p, 1, 32, 0)
                self._stage(x)
                if capturable:
                    self.comm.launch_kernel(_DISPATCH_FILE, "moe_stage_done", p, 1, 32, 0)
                self._join.record(self._side)
            main.wait_event(self._join)  # the rows are staged before the mid barrier
        self._phase("send")
        if capturable:
            if staged and not overlap:  # after the start barrier: no peer reads the previous rows any more
                self._stage(x)
            self._phase("stage")
            if not in_kernel:
                self.comm.stream_barrier(BARRIER_MOE_DISPATCH)  # mid barrier
            self._phase("mid barrier")
            R = self.max_recv_rows
            expand_mode = _SYNC_WAIT | _SYNC_STAGED | (_SYNC_ARRIVE_FIRST if staged and not overlap else 0) \
                if in_kernel else 0
        else:
            # Mid barrier: every source's staged rows, metadata and hdr are ready.
            self.comm.stream_barrier(BARRIER_MOE_DISPATCH)
            self._phase("mid barrier")
            host = torch.cat([status, self._hdr.view(-1)]).tolist()  # the one host sync: checks, exact sizes
            self._raise_rejected(host[:W], problem, topk_idx, "dispatch")
            R = sum(sum(host[W + s * (L + 1) + 1:W + (s + 1) * (L + 1)]) for s in range(W))
            self._seq, self._seq_capturable = self._seq + 1, False  # data moved: earlier results are stale
            expand_mode = 0
        out_x = torch.empty(R, H, dtype=self.dtype, device=self.device)
        info = torch.empty(4, R, dtype=torch.int32, device=self.device)  # local expert | source | token | weight
        counts = torch.empty(L + 1, dtype=torch.int32, device=self.device)  # rows per local expert | R
        self._phase("size")
        e = _ExpandParams(peer_xs=self._ptr_xs, meta=self._meta.data_ptr(), hdr=self._hdr.data_ptr(),
                          out_x=out_x.data_ptr(), out_info=info.data_ptr(), expert_counts=counts.data_ptr(),
                          comb_rows=self._comb_row_map.data_ptr(), row_cap=R, max_tokens=Tm, hidden=H, topk=K,
                          num_local=L, world=W, rank=self.rank, sync=self._syncs[_DISPATCH, expand_mode])
        self._launch("moe_dispatch_expand", e, self._blocks, 4 * (W + 1) * L)
        self._phase("expand")
        return _packed_result(out_x, counts, info, L, capturable, _ep_id=self._id, _seq=self._seq, _num_tokens=T,
                              _kernel=True, _packed=(counts, info))

    def _combine_kernels(self, expert_out: torch.Tensor, recv: DispatchResult, status: Optional[torch.Tensor] = None,
                         problem: Optional[P2PCommError] = None) -> torch.Tensor:
        """combine on the kernel path: moe_combine_send puts partials
        (float32 or dtype: combine_dtype) into the sources' comb, each of its
        blocks posts its mid barrier flags, and moe_combine_reduce waits for
        every peer's, then sums the partials here (moe_common.cuh MoeSync). The start
        barrier is the send kernel's own in capturable calls; eager calls
        come after _post_status's start barrier kernel and pass status and
        problem as in _dispatch_kernels, and end with the one host sync that
        reads every rank's check. Every rank launches the send kernel, a
        rejected call included (it posts the mid flags all the same)."""
        if status is not None:  # final once the start barrier has run: read it back without waiting
            self._status_host.copy_(status, non_blocking=True)
            self._status_ready.record()
        T, H = (recv._num_tokens, self.hidden) if problem is None else (0, self.hidden)
        out = self._aligned(expert_out) if problem is None else None
        y = torch.empty(T, H, dtype=self.dtype, device=self.device) if problem is None else None
        in_kernel = self._in_kernel
        self_local = self._self_local == "always" or (self._self_local == "auto" and self.combine_dtype == self.dtype
                                                      and T >= _SELF_LOCAL_MIN_TOKENS)
        send_mode = _SYNC_ARRIVE | (_SYNC_START if status is None else 0) if in_kernel else 0
        p = _CombineParams(peer_comb=self._ptr_comb, expert_out=0 if out is None else out.data_ptr(),
                           meta=self._meta.data_ptr(), hdr=self._hdr.data_ptr(),
                           comb_rows=self._comb_row_map.data_ptr(), send_slot=self._send_slot.data_ptr(),
                           y=0 if y is None else y.data_ptr(), row_cap=0 if out is None else out.shape[0],
                           num_tokens=T, max_tokens=self.max_tokens_per_rank, hidden=H, topk=self.topk,
                           rank=self.rank, world=self.world_size, num_local=self.num_local_experts,
                           self_local=int(self_local), status=0 if status is None else status.data_ptr(),
                           sync=self._syncs[_COMBINE, send_mode])
        self._launch("moe_combine_send", p, self._blocks)
        self._phase("send")
        if not in_kernel:
            self.comm.stream_barrier(BARRIER_MOE_COMBINE)  # mid barrier (else: sync_end above, sync_wait below)
        self._phase("mid barrier")
        if problem is None and T:
            p.sync = self._syncs[_COMBINE, _SYNC_WAIT if in_kernel else 0]
            packs = T * H * out.element_size() // 16
            reduce = "moe_combine_reduce_self" if self_local else "moe_combine_reduce"
            self._launch(reduce, p, max(1, min(self._blocks, -(-packs // _THREADS))))
        self._phase("reduce")
        if status is not None:
            # Waits only for the start barrier's copy: the GPU goes on with this call's kernels.
            self._status_ready.synchronize()
            self._raise_rejected(self._status_host.tolist(), problem, None, "combine")
            self._phase("check")
        return y

    # -- argument checks -----------------------------------------------------------------------------

    def _post_status(self, problem: Optional[P2PCommError], topk_idx: Optional[torch.Tensor]) -> torch.Tensor:
        """Eager calls: posts this rank's argument check into every peer's
        status row of this call's parity, then the start barrier; returns
        that row here (every rank's check once the barrier has run). The
        check is the host's (problem) or, when that passed and topk_idx is
        given, whether every expert id is in [-1, E), computed on the device
        (no sync): on the kernel path by moe_post_status, which also posts
        (one launch), else by torch ops and a copy per peer. Two rows, by
        call parity, because ranks read their row after the barrier: a peer
        that has read its own may post the next call's status at once, but
        not the one after (that needs this rank at the next start barrier).
        A closed ep can no longer post to its peers: it raises at once."""
        if not self._peer_status:
            raise problem if problem is not None else StateError("ExpertParallel is closed")
        code = _OK if problem is None else _UNSUPPORTED if isinstance(problem, UnsupportedError) else _INVALID
        par = self._checks & 1
        self._checks += 1
        check_ids = code == _OK and topk_idx is not None and topk_idx.numel() > 0
        if self._kernels:
            idx = topk_idx.contiguous() if check_ids else None
            p = _PostParams(peer_status=self._ptr_status[par], topk_idx=idx.data_ptr() if check_ids else 0,
                            num_ids=idx.numel() if check_ids else 0, num_experts=self.num_experts,
                            idx_bytes=idx.element_size() if check_ids else 4, code=code, id_code=_INVALID,
                            rank=self.rank, world=self.world_size)
            self._launch("moe_post_status", p, 1)
        else:
            posted = self._id_problem(topk_idx) if check_ids else self._codes[code].view(1)
            for d in range(self.world_size):
                self._peer_status[par][d].copy_(posted)
        # Also the start barrier (see module doc); combine posts no ids.
        self.comm.stream_barrier(BARRIER_MOE_DISPATCH if topk_idx is not None else BARRIER_MOE_COMBINE)
        return self._status[par]

    def _raise_rejected(self, status: list, problem: Optional[P2PCommError], device_input, what: str) -> None:
        """Raises, on every rank alike, once any rank's posted check failed:
        this rank's own error, else MismatchError naming the ranks."""
        bad = [q for q, c in enumerate(status) if c]
        if not bad:
            return
        if problem is None and status[self.rank]:
            problem = self._id_problem_detail(device_input)
        if problem is not None:
            raise problem
        raise MismatchError(f"ExpertParallel.{what}: rank {', '.join(map(str, bad))} rejected its arguments "
                            "(see the error on that rank)")

    def _agree(self, problem: Optional[P2PCommError], topk_idx: Optional[torch.Tensor], what: str) -> None:
        """Eager torch-op path: posts the status (_post_status), then all
        read all statuses at once (one host sync) and raise together, before
        any data moves."""
        status = self._post_status(problem, topk_idx)
        self._raise_rejected(status.tolist(), problem, topk_idx, what)

    def _id_problem(self, topk_idx: torch.Tensor) -> torch.Tensor:
        bad = ((topk_idx < -1) | (topk_idx >= self.num_experts)).any()
        return torch.where(bad, self._codes[_INVALID], self._codes[_OK]).view(1)

    def _id_problem_detail(self, topk_idx: torch.Tensor) -> InvalidArgumentError:
        idx = topk_idx.cpu()
        bad = ((idx < -1) | (idx >= self.num_experts)).nonzero()
        t, k = bad[0].tolist()
        return InvalidArgumentError(f"topk_idx[{t}, {k}] = {idx[t, k].item()} is not an expert: use -1 or "
                                    f"[0, {self.num_experts}) ({bad.shape[0]} bad entries)")

    def _check_tensor(self, name: str, t, dtypes: tuple, shape: tuple) -> Optional[P2PCommError]:
        if not isinstance(t, torch.Tensor):
            return InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            return UnsupportedError(f"{name} has dtype {t.dtype}; expected {' or '.join(map(str, dtypes))}")
        dev = self.device
        if t.device.type != dev.type or (dev.type == "cuda" and t.device.index != dev.index):
            return InvalidArgumentError(f"{name} is on {t.device} but the communicator is on {dev}")
        if t.dim() != len(shape) or any(w is not None and g != w for g, w in zip(t.shape, shape)):
            want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
            return InvalidArgumentError(f"{name} has shape {list(t.shape)}; expected {want}")
        return None

    def _check_dispatch(self, x, topk_idx, topk_weights) -> Optional[P2PCommError]:
        if not self._peer_status:
            return StateError("ExpertParallel is closed")
        p = self._check_tensor("x", x, (self.dtype,), (None, self.hidden))
        if p is not None:
            return p
        T = x.shape[0]
        if T > self.max_tokens_per_rank:
            return InvalidArgumentError(f"x has {T} tokens, more than max_tokens_per_rank="
                                        f"{self.max_tokens_per_rank}")
        return (self._check_tensor("topk_idx", topk_idx, (torch.int32, torch.int64), (T, self.topk))
                or self._check_tensor("topk_weights", topk_weights, (torch.float32,), (T, self.topk)))

    def _check_combine(self, expert_out, recv) -> Optional[P2PCommError]:
        if not self._peer_status:
            return StateError("ExpertParallel is closed")
        if not isinstance(recv, DispatchResult):
            return InvalidArgumentError(f"recv must be a DispatchResult, got {type(recv).__name__}")
        if recv._ep_id != self._id:
            return InvalidArgumentError("recv comes from another ExpertParallel")
        if recv._seq != self._seq:
            return StateError(f"recv is from dispatch #{recv._seq} of this ExpertParallel, but dispatch "
                              f"#{self._seq} has run since and reused its buffers; combine the latest "
                              "dispatch's result")
        return self._check_tensor("expert_out", expert_out, (self.dtype,), (recv.x.shape[0], self.hidden))
