"""TorchFallbackCommunicator: the Communicator API over torch.distributed,
for GPUs that cannot reach each other's memory."""

from __future__ import annotations

import os

import torch

from . import rmsnorm as _rmsnorm
from .communicator import Communicator, ReduceOp, _parse_algorithm, _parse_op
from .errors import InvalidArgumentError, MismatchError, UnsupportedError


class TorchFallbackCommunicator(Communicator):
    """What ``Communicator(..., fallback="torch")`` returns when the GPUs of
    the group cannot access each other's memory: the same API over
    ``torch.distributed`` on the given group. Peer memory (``peer_tensor``,
    kernels) is not available. Constructed directly, it takes a group (or
    the initialized default group) and never tries peer memory."""

    @classmethod
    def _open(cls, group, device: torch.device, bootstrap: str) -> "TorchFallbackCommunicator":
        import torch.distributed as dist

        if group is None:
            raise InvalidArgumentError("TorchFallbackCommunicator needs a torch.distributed group")
        self = object.__new__(cls)
        self._pid = os.getpid()
        self.device = device
        self._dist, self._group = dist, group
        self._handle = -1  # open, but no native communicator behind it
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        return self

    def close(self) -> None:
        self._handle = 0

    def all_reduce(self, tensor, op="sum", algorithm: str = "auto"):
        return self.all_reduce_(tensor.clone(memory_format=torch.contiguous_format), op, algorithm)

    def all_reduce_(self, tensor, op="sum", algorithm: str = "auto"):
        self._h()
        code = _parse_op(op)
        _parse_algorithm(algorithm)
        self._check_tensor(tensor, reduced=True)
        dist = self._dist
        table = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.SUM, ReduceOp.PROD: dist.ReduceOp.PRODUCT,
                 ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX}
        dist.all_reduce(tensor, op=table[code], group=self._group)
        if code == ReduceOp.AVG:
            if tensor.dtype.is_floating_point:
                tensor.div_(self.world_size)
            else:
                tensor.copy_(torch.div(tensor, self.world_size, rounding_mode="floor"))
        return tensor

    def empty(self, shape, dtype=torch.float32):
        self._h()
        return torch.empty(shape, dtype=dtype, device=self.device)

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps: float = 1e-6, *, residual_out=None,
                                    normed_out=None, algorithm: str = "auto"):
        return _rmsnorm.fallback(self, x, residual, weight, eps, residual_out, normed_out, algorithm)

    def register_buffer(self, tensor) -> None:
        self._h()
        self._check_tensor(tensor)

    def deregister_buffer(self, tensor) -> None:
        self._h()

    def register_graph_buffers(self) -> int:
        self._h()
        return 0

    def barrier(self) -> None:
        self._h()
        self._dist.barrier(group=self._group)

    def stream_barrier(self, _call: int = 1) -> None:
        self.barrier()

    def host_allgather(self, data: bytes) -> list:
        self._h()
        got = [None] * self.world_size
        self._dist.all_gather_object(got, bytes(data), group=self._group)
        if any(len(g) != len(data) for g in got):
            raise MismatchError(f"host_allgather: ranks sent {[len(g) for g in got]} bytes")
        return got

    def check(self) -> None:
        self._h()

    def peer_tensor(self, tensor, rank):
        raise UnsupportedError("peer memory is unavailable: this communicator fell back to torch.distributed")

    def memory_channels(self, tensor):
        raise UnsupportedError("channels need peer memory: this communicator fell back to torch.distributed")

    port_channels = memory_channels

    def launch_kernel(self, *args, **kwargs):
        raise UnsupportedError("kernels need peer memory: this communicator fell back to torch.distributed")

    def prepare_kernel(self, *args, **kwargs):
        raise UnsupportedError("kernels need peer memory: this communicator fell back to torch.distributed")

    @property
    def sm_count(self) -> int:
        return 0
