"""Fixtures for tests that run on every rank under torchrun.

Every rank runs the same tests in the same order, so collectives match up.
GPU variants run only with P2PCOMM_TEST_GPU=1 on a machine with GPUs
(`make gpu-test`); elsewhere they skip and say why.
"""

import hashlib
import os

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
# Inductor, before its first CPU build in a process, proves each vector ISA that the CPU reports by
# building a probe and loading it in a fresh interpreter that imports torch: seconds per ISA, in every
# rank. The tests take the CPU's word for it (TORCHINDUCTOR_VEC_ISA_OK=0 or 1 decides otherwise).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import p2pcomm  # noqa: E402
from p2pcomm.communicator import gpus_shared, local_cuda_index  # noqa: E402

WANT_GPU = os.environ.get("P2PCOMM_TEST_GPU") == "1"


def pytest_collection_modifyitems(config, items):
    if "RANK" not in os.environ:
        skip = pytest.mark.skip(reason="distributed tests run under torchrun (make test-dist)")
        for item in items:
            item.add_marker(skip)


def gpu_skip_reason():
    if not WANT_GPU:
        return "GPU tests run only with P2PCOMM_TEST_GPU=1 (make gpu-test on a GPU machine)"
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1")) and not gpus_shared():
        return "fewer GPUs than local ranks (P2PCOMM_SHARE_GPUS=1 shares them, under MPS)"
    return None


# Marks a test (or, as pytestmark, a module) that needs the GPUs.
GPU_ONLY = pytest.mark.skipif(gpu_skip_reason() is not None, reason=str(gpu_skip_reason()))

DEVICES = ["cpu", pytest.param("cuda", marks=GPU_ONLY)]


@pytest.fixture(scope="session")
def group():
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    yield dist.group.WORLD


@pytest.fixture(scope="session")
def comms(group):
    made = {}

    def get(device):
        if device not in made:
            if device == "cuda":
                torch.cuda.set_device(local_cuda_index())
                made[device] = p2pcomm.Communicator(group, device=torch.cuda.current_device())
            else:
                made[device] = p2pcomm.Communicator(group, device="cpu")
        return made[device]

    yield get
    for c in made.values():
        c.close()


def same_on_all_ranks(t: torch.Tensor, group=None) -> bool:
    """True when every rank (of group) holds bit-identical bytes: ranks compare a 256-bit BLAKE2 digest of them
    (the bytes themselves would cross gloo W times per check)."""
    mine = t.detach().cpu().contiguous().view(torch.uint8).flatten()
    digest = hashlib.blake2b(mine.numpy(), digest_size=32)
    digest.update(f"{t.dtype} {tuple(t.shape)}".encode())
    d = torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)
    parts = [torch.empty_like(d) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, d, group=group)
    return all(torch.equal(p, parts[0]) for p in parts)
