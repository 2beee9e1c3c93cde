"""Mixture-of-experts expert parallelism: dispatch tokens to the ranks that
own their experts, and combine the experts' outputs back, through symmetric
memory (CPU: shared memory; GPU: CUDA IPC peer mappings over NVLink).

    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=T_max, topk=K)
    recv = ep.dispatch(x, topk_idx, topk_weights)      # recv.x: rows for this rank's experts
    y = ep.combine(expert_out, recv)                   # back on the source rank, weighted

This module checks arguments and makes the results and the torch.library
ops; golib/moe does the rest (buffers, kernels and their order, barriers,
the CPU path) in at most two C calls per eager dispatch or combine. On GPU
the calls run the kernels of native/kernels/moe_*.cu; on the CPU backend
the same protocol runs in host memory, with the same bits.

Each call is a start barrier, the writes into peers, a middle barrier and
the reads of what peers wrote. Dispatch: each source writes, for every
destination, the tokens with an expert there (in token order) and their
metadata; the destination orders its (source, slot, k) pairs by local
expert. Combine: each expert rank sums weight * expert output per token in
float32 (k ascending), rounds once to the transit type, and writes it into
the token's source, which sums those partials in float32 (ranks ascending)
and rounds once. Every value is computed by one thread in a fixed order:
results are bit-identical run to run, between eager and capturable mode,
and between the CPU and GPU paths.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import struct
import sys
import warnings
import weakref
from typing import Optional

import torch

from . import _lib, ops
from .communicator import Communicator, _raw_stream
from .fallback import TorchFallbackCommunicator
from .moe_checks import (FP8, FP8_BLOCK, combine_problem, config_problem, dispatch_dtype_problem, dispatch_problem,
                         dtype_code, id_problem)
from .moe_result import DispatchResult, _lazy_result, _packed_result
from .errors import InvalidArgumentError, MismatchError, P2PCommError, StateError, UnsupportedError

# Tests only: override golib/moe's thresholds between paths that give the same bits (None: its
# defaults). Bytes of x up to which eager dispatch's send kernel stages x (else a copy on the
# caller's stream); routed (token, k) pairs from which dispatch runs its count kernel
# (P2PCOMM_MOE_COUNT_PAIRS also sets it).
_EAGER_KERNEL_STAGE_BYTES: Optional[int] = None
_COUNT_KERNEL_MIN_PAIRS: Optional[int] = None

# The argument blocks of p2p_moe_dispatch, p2p_moe_expand and p2p_moe_combine (golib/capi/moe.go):
# dispatch: ep, x, scales, topk_idx, topk_w, T, idx_bytes, check, capturable, reserved, out_x,
# out_scales, out_info, out_counts, out_rows, stream, checks, rows; expand: ep, out_x, out_scales,
# out_info, out_counts, rows, stream; combine: ep, expert_out, expert_rows, y, T, check, capturable,
# stream, checks.
_DISPATCH_ARGS = struct.Struct("<QQQQQqiiiiQQQQqQQQ")
_EXPAND_ARGS = struct.Struct("<QQQQQqQ")
_COMBINE_ARGS = struct.Struct("<QQqQqiiQQ")


def _tuning() -> dict:
    """golib/moe's thresholds from the environment and the test hooks (local to each rank: same
    bits either way). P2PCOMM_MOE_COUNT_PAIRS: pairs from which dispatch runs its count kernel;
    P2PCOMM_MOE_SELF_LOCAL: 0 never, 1 always, unset automatic (a world of 2 summing its own
    tokens' partials in the reduce). Bad values warn, never silently."""
    pairs = os.environ.get("P2PCOMM_MOE_COUNT_PAIRS", "").strip()
    if pairs and not pairs.isdigit():
        warnings.warn(f"P2PCOMM_MOE_COUNT_PAIRS={pairs!r} is not a non-negative integer; using the default",
                      stacklevel=3)
        pairs = ""
    v = os.environ.get("P2PCOMM_MOE_SELF_LOCAL", "").strip()
    modes = {"": "auto", "0": "never", "1": "always"}
    if v not in modes:
        warnings.warn(f"P2PCOMM_MOE_SELF_LOCAL={v!r} is not 0 or 1; using the default", stacklevel=3)
    return {"eager_kernel_stage_bytes": _EAGER_KERNEL_STAGE_BYTES, "self_local": modes.get(v, "auto"),
            "count_kernel_min_pairs": min(int(pairs), 2**62) if pairs else _COUNT_KERNEL_MIN_PAIRS}


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a's and b's storage bytes intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _rows_key(x: torch.Tensor) -> tuple:
    """What identifies a dispatch's rows among live tensors."""
    return x.data_ptr(), tuple(x.shape), x.device


def _destroy(handle: int, pid: int) -> None:
    # Best effort at garbage collection or exit: not collective, never raises.
    if os.getpid() == pid and _lib._lib is not None:
        _lib._lib.p2p_moe_destroy(handle)


def _mark_static_address(t: torch.Tensor) -> None:
    """torch._dynamo.mark_static_address(t) without importing dynamo when
    nothing has yet: the import costs about a second of each process, and
    the mark is an attribute of the tensor (tests/python/test_static_mark.py
    checks it is the one torch sets)."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.mark_static_address(t)
    else:
        t._dynamo_static_input_type = "unguarded"


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
      float32 or float64 (CPU only: the GPU kernels take 16-byte multiples
      of rows of the first three; see :attr:`uses_kernels`).
    - ``capturable``: default mode of :meth:`dispatch` (see there).
    - ``num_sms``: blocks (so at most that many SMs) of each GPU kernel;
      default 24, clamped to the GPU's SM count. Ranks may pass different
      values: all use the smallest (each rank's kernels count the blocks of
      its peers' send kernels by their own grid). Ignored on the CPU.
      Large combines are bound by SMs, dispatch by NVLink
      (docs/BENCHMARKS.md).
    - ``combine_dtype``: the type partials travel in during :meth:`combine`:
      torch.float32 (default; None means the same) or the ep's ``dtype``.
      Anything else raises UnsupportedError (InvalidArgumentError if it is
      not a torch.dtype).
    - ``dispatch_dtype``: None (the ep's ``dtype``) or torch.float8_e4m3fn:
      dispatch then takes float8 rows and their float32 scales, one per 128
      columns (``dispatch(x, ..., scales=...)``), and moves both bit for
      bit, about half the bytes of bf16 rows; expert outputs and combine
      keep ``dtype``. GPU kernels of one node only (UnsupportedError on the
      CPU and across nodes); hidden a multiple of 512.

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
    (float64 rows are summed in float32 too.)

    Memory: symmetric buffers of about T_max*H*itemsize (GPU; CPU: W times
    that) + W*(T_max+1)*(H*combine itemsize + (3K+1)*4) bytes per rank,
    held until the communicator closes; in capturable mode each dispatch
    also returns worst-case [W*T_max*K, H] rows.
    """

    _next_id = 0

    def __init__(self, comm: Communicator, num_experts: int, hidden: int, max_tokens_per_rank: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16, *, capturable: bool = False, num_sms: Optional[int] = None,
                 combine_dtype: Optional[torch.dtype] = torch.float32, dispatch_dtype: Optional[torch.dtype] = None):
        if not isinstance(comm, Communicator):
            raise InvalidArgumentError(f"comm must be a p2pcomm.Communicator, got {type(comm).__name__}")
        if isinstance(comm, TorchFallbackCommunicator):
            raise UnsupportedError("ExpertParallel needs peer memory: this communicator fell back to "
                                   "torch.distributed")
        self.comm = comm
        self.world_size, self.rank = comm.world_size, comm.rank
        self.device = comm.device
        self.num_sms = num_sms
        self._closed = True  # until the handle exists
        combine_dtype = torch.float32 if combine_dtype is None else combine_dtype
        dispatch_dtype = dtype if dispatch_dtype is None else dispatch_dtype
        E, H, Tm, K = num_experts, hidden, max_tokens_per_rank, topk
        problem = (config_problem(E, H, Tm, K, dtype, capturable, combine_dtype, num_sms)
                   or dispatch_dtype_problem(dtype, dispatch_dtype))
        fp8 = problem is None and dispatch_dtype == FP8
        ints = lambda v: v if isinstance(v, int) and not isinstance(v, bool) else -1  # noqa: E731
        config = {"num_experts": ints(E), "hidden": ints(H), "max_tokens": ints(Tm), "topk": ints(K),
                  "dtype": dtype_code(dtype), "combine_dtype": dtype_code(combine_dtype),
                  "capturable": capturable is True, "num_sms": num_sms if problem is None and num_sms else 0,
                  "dispatch_fp8": fp8,
                  "rejected": problem is not None, "tuning": _tuning()}
        # Go builds the kernels, then agrees on the configuration across ranks on the host before
        # any collective allocation: a bad rank makes every rank raise instead of waiting.
        handle, info = ctypes.c_uint64(), ctypes.create_string_buffer(1024)
        rc = _lib.lib().p2p_moe_create(comm._h(), json.dumps(config).encode(), ctypes.byref(handle), info,
                                       len(info))
        if problem is not None:
            raise problem
        comm._check(rc)
        info = json.loads(info.value)
        self._handle, self._closed = handle.value, False
        self._finalizer = weakref.finalize(self, _destroy, self._handle, os.getpid())
        self.num_experts, self.hidden, self.topk = E, H, K
        self.max_tokens_per_rank, self.dtype, self.capturable = Tm, dtype, bool(capturable)
        self.combine_dtype, self.dispatch_dtype, self._fp8 = combine_dtype, dispatch_dtype, fp8
        self.num_local_experts = E // self.world_size
        self.max_recv_rows = info["max_recv_rows"]
        self._kernels, self._blocks = info["kernels"], info["blocks"]
        self._self_local_min_tokens = info["self_local_min_tokens"]  # tests: golib/moe's threshold
        # GPU: the staging buffer peers read rows from, where x may be built in place.
        self._xs = (comm._wrap(info["staging"], Tm * H * torch.empty(0, dtype=dtype).element_size())
                    .view(dtype).view(Tm, H) if self._kernels else None)
        # fp8: float8 rows at its start, their float32 scales after Tm rows (golib/moe xsScales).
        self._fp8_xs = None
        if self._xs is not None and fp8:
            raw = self._xs.view(-1).view(torch.uint8)
            self._fp8_xs = (raw[:Tm * H].view(FP8).view(Tm, H),
                            raw[Tm * H:Tm * H + Tm * H // FP8_BLOCK * 4].view(torch.float32).view(Tm, H // FP8_BLOCK))
        self._local_xs = None  # get_dispatch_buffer's tensor on the CPU
        ExpertParallel._next_id += 1
        self._id = ExpertParallel._next_id
        # The latest dispatch that moved data: its number (0: none yet) and mode, the same on every
        # rank (same calls in the same order): combine takes its mode from here, not from recv.
        self._seq, self._seq_capturable = 0, self.capturable
        # The latest result (weakly) and, from the custom op, the latest one without its rows (see _recv_of).
        self._latest, self._op_recv, self._op_rows = None, None, None
        # Every rank's verdict of an eager call, and an eager dispatch's rows, as Go returns them.
        self._checks, self._rows = (ctypes.c_int32 * self.world_size)(), ctypes.c_int64()
        self._checks_ptr, self._rows_ptr = ctypes.addressof(self._checks), ctypes.addressof(self._rows)
        lib = _lib.lib()  # the entry points, looked up once
        self._dispatch_fn, self._expand_fn, self._combine_fn = (lib.p2p_moe_dispatch, lib.p2p_moe_expand,
                                                                lib.p2p_moe_combine)
        # What names this ep to the torch ops, and the tensor they declare they write, so that
        # compiled code keeps this ep's calls in order (ops.py). Static: CUDA-graph trees
        # (mode="reduce-overhead") neither copy them nor refuse the declared writes.
        self._op_ident = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._op_order = torch.zeros(1, dtype=torch.int32, device=self.device)
        for t in (self._op_ident, self._op_order):
            _mark_static_address(t)
        ops.track_ep(self)

    @property
    def uses_kernels(self) -> bool:
        """True when dispatch and combine run the GPU kernels of native/kernels/moe_*.cu: every GPU
        ep of one node (a configuration they cannot take, such as float64 or rows of a size that is not a
        multiple of 16 bytes, raises UnsupportedError there); False on the CPU, and on GPUs across nodes,
        where rows travel through pinned host memory with the CPU path's protocol (the GPU lays them
        out and computes the partials, with the same bits); there capturable calls of 16-bit or float32
        rows whose size is a multiple of 16 bytes run their host part as host functions on the stream
        (never waiting for the host; a CUDA graph records them), and eager calls cannot be captured."""
        return self._kernels

    def __repr__(self) -> str:
        return (f"ExpertParallel(rank={self.rank}, world_size={self.world_size}, num_experts={self.num_experts}, "
                f"hidden={self.hidden}, max_tokens_per_rank={self.max_tokens_per_rank}, topk={self.topk}, "
                f"dtype={self.dtype}, capturable={self.capturable}, combine_dtype={self.combine_dtype}"
                + (f", dispatch_dtype={self.dispatch_dtype})" if self._fp8 else ")"))

    def close(self) -> None:
        """Release this rank's own resources (streams, events, pinned memory); the symmetric
        memory is released when the communicator closes. Not collective; idempotent. Across
        nodes on GPUs it first waits for the device, so capturable calls still queued finish
        (each waits for its peers at most ``P2PCOMM_TIMEOUT_MS``)."""
        if not self._closed:
            self._closed = True
            self._latest = self._op_recv = None
            self._finalizer()

    def __enter__(self) -> "ExpertParallel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- dispatch ------------------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                 scales: Optional[torch.Tensor] = None, capturable: Optional[bool] = None) -> DispatchResult:
        """Collective. Send each token to the ranks owning its experts.

        - ``x``: [T, H] tensor of the ep's dtype on the communicator's device,
          0 <= T <= max_tokens_per_rank (T may differ per rank, and be 0).
        - ``topk_idx``: [T, K] int32 or int64, global expert ids; -1 means
          no expert for that k.
        - ``topk_weights``: [T, K] float32.
        - ``scales``: with ``dispatch_dtype=torch.float8_e4m3fn`` only: x is
          then float8_e4m3fn and ``scales`` [T, H/128] float32, one per 128
          columns of each row (DeepSeek's layout; how x was quantized is the
          caller's). Both travel bit for bit: ``recv.x`` is float8 and
          ``recv.scales`` [R, H/128] float32 holds each row's scales.
          Expert outputs and combine stay in the ep's dtype.
        - ``capturable``: None uses the constructor's mode. Eager (False):
          checks expert ids (a rank with bad input raises its specific
          error and every other rank raises MismatchError; no data moves),
          and returns exactly R rows, with one host sync (on GPU after the
          send kernels, which write nothing when a rank's check failed; on
          the CPU backend before any data moves). Capturable (True): no host
          sync at all, so it can be
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
            if self._fp8:
                raise UnsupportedError("fp8 dispatch under torch.compile is not supported: call it outside the "
                                       "compiled region")
            if scales is not None:
                raise InvalidArgumentError("scales are for fp8 dispatch (ExpertParallel(..., dispatch_dtype="
                                           "torch.float8_e4m3fn)); this ep dispatches rows of its dtype")
            return self._traced_dispatch(x, topk_idx, topk_weights, capturable)
        recv = self._dispatch(x, topk_idx, topk_weights, capturable, scales)
        # A compiled combine finds it by its rows (_recv_of); an op-made result is stale now.
        self._latest, self._op_recv = weakref.ref(recv), None
        return recv

    def _dispatch(self, x, topk_idx, topk_weights, capturable: bool, scales=None) -> DispatchResult:
        problem = dispatch_problem(self, x, topk_idx, topk_weights, scales)
        if problem is not None and (capturable or self._closed):
            raise problem  # capturable: alone, before any barrier; closed: it can post to no peer
        T, xp, sp, ip, wp, idx_bytes = 0, 0, 0, 0, 0, 4
        if problem is None:
            x, T = self._rows_in(x), x.shape[0]
            idx, w = topk_idx.contiguous(), topk_weights.contiguous()
            xp, ip, wp, idx_bytes = x.data_ptr(), idx.data_ptr(), w.data_ptr(), idx.element_size()
            if self._fp8:
                scales = self._fp8_in_buffer(scales, self._fp8_xs[1])
                sp = scales.data_ptr()
        stream = _raw_stream(self.comm._device_index)
        # The counts' size is known before the call: an eager call makes them while the GPU works.
        counts = torch.empty(self.num_local_experts + 1, dtype=torch.int32, device=self.device)
        rows = self.max_recv_rows if capturable else 0
        out = self._outputs(rows, counts) if capturable else None
        rc = self._dispatch_fn(_DISPATCH_ARGS.pack(
            self._handle, xp, sp, ip, wp, T, idx_bytes, self._code(problem), capturable, 0,
            *(self._out_ptrs(out) if out else (0, 0, 0, 0)), rows, stream, self._checks_ptr, self._rows_ptr))
        if rc:
            _lib.check(rc)
        if not capturable:
            self._raise_rejected(self._checks, problem, topk_idx, "dispatch")
            rows = self._rows.value
            out = self._outputs(rows, counts)
            rc = self._expand_fn(_EXPAND_ARGS.pack(self._handle, *self._out_ptrs(out), rows, stream))
            if rc:
                _lib.check(rc)
        # Data moved: earlier results no longer match the buffers.
        self._seq, self._seq_capturable = self._seq + 1, capturable
        out_x, out_scales, info, counts = out
        return _lazy_result(out_x, counts, info, capturable, out_scales, self._id, self._seq, T)

    def _outputs(self, rows: int, counts: torch.Tensor) -> tuple:
        """A dispatch's outputs: x [rows, H], scales [rows, H/128] (fp8; else None), info [4, rows],
        and counts [L+1] (see moe_result._VIEWS)."""
        dev = self.device
        return (torch.empty(rows, self.hidden, dtype=self.dispatch_dtype, device=dev),
                torch.empty(rows, self.hidden // FP8_BLOCK, dtype=torch.float32, device=dev) if self._fp8 else None,
                torch.empty(4, rows, dtype=torch.int32, device=dev), counts)

    @staticmethod
    def _out_ptrs(out: tuple) -> tuple:
        return tuple(0 if t is None else t.data_ptr() for t in out)

    def _rows_in(self, x: torch.Tensor) -> torch.Tensor:
        """x as golib/moe reads it: contiguous; on GPU not a view elsewhere inside the staging buffer
        it is copied into (x built at the buffer's start is read in place, not copied)."""
        if self._xs is None:
            return x.contiguous()
        if self._fp8:
            return self._fp8_in_buffer(x, self._fp8_xs[0])
        if x.data_ptr() == self._xs.data_ptr() and x.is_contiguous():
            return x
        if not x.is_contiguous() or _overlaps(x, self._xs):
            return x.clone(memory_format=torch.contiguous_format)
        return x

    def _fp8_in_buffer(self, t: torch.Tensor, place: torch.Tensor) -> torch.Tensor:
        """fp8 rows or scales as golib/moe reads them: in place when built at the start of their place in the
        staging buffer (get_dispatch_buffer), cloned when a view elsewhere inside that buffer (the copy into
        place would overwrite it), else contiguous and 16-byte aligned."""
        if t.data_ptr() == place.data_ptr() and t.is_contiguous():
            return t
        if _overlaps(t, self._xs):
            return t.clone(memory_format=torch.contiguous_format)
        return self._aligned(t)

    @staticmethod
    def _code(problem: Optional[P2PCommError]) -> int:
        """This rank's verdict as posted to its peers: 0 passed, else the error's status code."""
        return 0 if problem is None else (UnsupportedError if isinstance(problem, UnsupportedError)
                                          else InvalidArgumentError).code

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
        """combine, given the problem found with recv so far (then recv may be None)."""
        if problem is None:
            problem = combine_problem(self, expert_out, recv)
        capturable = self._seq_capturable
        if problem is not None and (capturable or self._closed):
            raise problem
        y, args = None, (0, 0, 0, 0)  # expert_out, its rows, y, T
        if problem is None:
            out = self._aligned(expert_out)
            y = torch.empty(recv._num_tokens, self.hidden, dtype=self.dtype, device=self.device)
            args = (out.data_ptr(), out.shape[0], y.data_ptr(), recv._num_tokens)
        rc = self._combine_fn(_COMBINE_ARGS.pack(self._handle, *args, self._code(problem), capturable,
                                                 _raw_stream(self.comm._device_index), self._checks_ptr))
        if rc:
            _lib.check(rc)
        if not capturable:
            self._raise_rejected(self._checks, problem, None, "combine")
        return y

    def _aligned(self, t: torch.Tensor) -> torch.Tensor:
        """t, contiguous, and on GPU 16-byte aligned (the kernels' vector loads)."""
        t = t.contiguous()
        return t if self._xs is None or t.data_ptr() % 16 == 0 else t.clone()

    def get_dispatch_buffer(self, num_tokens: Optional[int] = None):
        """[num_tokens, H] tensor (default max_tokens_per_rank rows) of the
        ep's dtype, for building the next dispatch's ``x`` in place: passing
        it as ``x`` skips the copy of x into the symmetric staging buffer
        that peers read tokens from (on GPU T*H elements per dispatch).
        Always the same memory (rows [0, num_tokens) of it), so
        fill it only after this rank's combine of the previous dispatch (or
        any later collective of this ep's communicator) is on the stream:
        until then peers may still be reading the previous tokens from it.
        Any other x is copied into its rows [0, T) (on GPU), so a view of x
        elsewhere inside it changes there. Not collective. On the CPU a
        plain tensor (never written by dispatch). With
        ``dispatch_dtype=torch.float8_e4m3fn``, a pair ``(x, scales)``:
        [num_tokens, H] float8_e4m3fn and [num_tokens, H/128] float32 in the
        same buffer; passing both (``dispatch(x, ..., scales=scales)``) skips
        both copies, passing one skips its own."""
        n = self.max_tokens_per_rank if num_tokens is None else num_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.max_tokens_per_rank:
            raise InvalidArgumentError(f"num_tokens must be an int in [0, {self.max_tokens_per_rank}], got {n!r}")
        if self._fp8:  # GPU only (construction refuses fp8 elsewhere)
            rows, scales = self._fp8_xs
            return rows[:n], scales[:n]
        if self._xs is None:
            if self._local_xs is None:
                self._local_xs = torch.empty(self.max_tokens_per_rank, self.hidden, dtype=self.dtype,
                                             device=self.device)
            return self._local_xs[:n]
        return self._xs[:n]

    def _trace(self) -> list:
        """Tests: golib/moe's GPU steps since the last call (moe.Launch: name, grid, block, shared, side)."""
        buf, n = ctypes.create_string_buffer(1 << 16), ctypes.c_int64()
        _lib.check(_lib.lib().p2p_moe_trace(self._handle, buf, len(buf), ctypes.byref(n)))
        return json.loads(buf.value) or []

    # -- torch.compile -------------------------------------------------------------------------------

    def _traced_dispatch(self, x, topk_idx, topk_weights, capturable: bool) -> DispatchResult:
        """dispatch as torch.compile traces it: the custom op (body: _op_dispatch), viewed."""
        L = self.num_local_experts
        out_x, counts, info = torch.ops.p2pcomm.moe_dispatch(x, topk_idx, topk_weights, self._op_ident, self._op_order,
                                                             capturable, self.max_recv_rows, L)
        return _packed_result(out_x, counts, info, capturable, _ep_id=0, _seq=0, _num_tokens=x.shape[0],
                              _from_op=True)

    def _op_dispatch(self, x, topk_idx, topk_weights, capturable: bool, max_rows: int, num_local: int) -> tuple:
        """The body of torch.ops.p2pcomm.moe_dispatch: its result is kept here without its rows
        (combine gets them back as its input)."""
        if (max_rows, num_local) != (self.max_recv_rows, self.num_local_experts):
            raise InvalidArgumentError(f"moe_dispatch: max_rows={max_rows}, num_local={num_local}, but this ep has "
                                       f"{self.max_recv_rows} and {self.num_local_experts}")
        recv = self.dispatch(x, topk_idx, topk_weights, capturable=capturable)
        counts, info = recv._packed
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

    # -- argument checks -----------------------------------------------------------------------------

    def _raise_rejected(self, checks, problem: Optional[P2PCommError], topk_idx, what: str) -> None:
        """Once any rank's check failed, raises on every rank: its own error, else MismatchError."""
        bad = [q for q in range(self.world_size) if checks[q]]
        if not bad:
            return
        if problem is None and checks[self.rank]:
            problem = id_problem(self.num_experts, topk_idx)
        if problem is not None:
            raise problem
        raise MismatchError(f"ExpertParallel.{what}: rank {', '.join(map(str, bad))} rejected its arguments "
                            "(see the error on that rank)")
