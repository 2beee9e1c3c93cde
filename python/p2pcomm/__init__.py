"""p2pcomm: peer-to-peer collectives for PyTorch over shared and GPU peer memory.

    comm = p2pcomm.Communicator()          # collective; under torchrun or torch.distributed
    out = comm.all_reduce(t, op="sum")     # new tensor
    comm.all_reduce_(t)                    # in place
"""

from .communicator import ALGORITHMS, Communicator, ReduceOp
from .fallback import TorchFallbackCommunicator
from .channels import Kernel, MemoryChannels, PortChannels
from .moe import DispatchResult, ExpertParallel
from .rmsnorm import RMSNormResult
from .errors import (
    BootstrapError, CapacityError, CUDAError, ForkError, InternalError, InvalidArgumentError, MismatchError,
    P2PCommError, PeerTimeoutError, PeerUnavailableError, StateError, UnsupportedError,
)

__version__ = "0.1.0"
__all__ = [
    "ALGORITHMS", "Communicator", "ReduceOp", "P2PCommError", "BootstrapError", "CapacityError", "CUDAError",
    "ForkError", "InternalError", "InvalidArgumentError", "MismatchError", "PeerTimeoutError",
    "PeerUnavailableError", "StateError", "UnsupportedError", "ExpertParallel", "DispatchResult",
    "TorchFallbackCommunicator", "Kernel", "MemoryChannels", "PortChannels", "RMSNormResult",
]
