"""What an ExpertParallel dispatch returns: :class:`DispatchResult`, views of
the dispatch's packed outputs (see p2pcomm.moe)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class DispatchResult:
    """What :meth:`ExpertParallel.dispatch` received on this rank.

    Rows are expert-major: ordered by local expert, then source rank, then
    source token index, then k (a token routed twice to the same expert, at
    two k's, gives two rows). All tensors are on the communicator's device.

    - ``x``: [R, H] tensor of the ep's dtype (its dispatch_dtype: float8
      for fp8 dispatch), contiguous: the token rows.
    - ``scales``: fp8 dispatch: [R, H/128] float32, each row's scales as its
      source passed them; None otherwise.
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

    A result stays valid for combine until the next dispatch of the same ep
    (which reuses the ep's buffers, where combine's state lives): combine
    with an older one raises StateError (see :meth:`ExpertParallel.combine`).
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
    # (counts [L+1], info [4, R]), of which the public fields are views (the custom op's outputs).
    _packed: Optional[tuple] = dataclasses.field(default=None, repr=False)
    # Traced by torch.compile: the public fields are the op's outputs; combine finds the rest by x.
    _from_op: bool = dataclasses.field(default=False, repr=False)
    scales: Optional[torch.Tensor] = None

    def __getattr__(self, name: str):
        # Reached only for an attribute the instance lacks: the views of a
        # result made by _lazy_result, each made when first read. A small
        # eager dispatch would otherwise spend more host time on six views,
        # which a caller that passes recv on to combine never reads, than on
        # the rest of its Python.
        view = _VIEWS.get(name)
        if view is None or self._packed is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        counts, info = self._packed
        value = view(counts, info)
        if not torch.compiler.is_compiling():
            object.__setattr__(self, name, value)  # kept: the same tensor on every read
        return value


# Each public view of a packed result: counts [L+1] (rows per local expert,
# then R) and info [4, R] (local expert, source rank, source token, weight's
# float32 bits).
_VIEWS = {
    "expert_counts": lambda counts, info: counts[:-1],
    "num_rows": lambda counts, info: counts[-1:],
    "local_expert": lambda counts, info: info[0],
    "src_rank": lambda counts, info: info[1],
    "src_token": lambda counts, info: info[2],
    "weight": lambda counts, info: info[3].view(torch.float32),
}


def _packed_result(x, counts, info, capturable: bool, scales=None, **private) -> DispatchResult:
    """A DispatchResult of views of counts and info (see _VIEWS), made now."""
    views = {name: view(counts, info) for name, view in _VIEWS.items()}
    return DispatchResult(x=x, capturable=capturable, scales=scales, **views, **private)


def _lazy_result(x, counts, info, capturable: bool, scales, ep_id: int, seq: int, num_tokens: int) -> DispatchResult:
    """_packed_result of an eager call, whose views are made when first read
    (DispatchResult.__getattr__)."""
    r = object.__new__(DispatchResult)
    r.__dict__.update(x=x, capturable=capturable, scales=scales, _ep_id=ep_id, _seq=seq, _num_tokens=num_tokens,
                      _packed=(counts, info), _from_op=False)
    return r
