"""The full GPU matrix: every algorithm x op x dtype x size, including 64M
elements, against a float64 reduction of every rank's input. GPU only; run
with P2PCOMM_TEST_GPU=1 (make gpu-test). Staging is raised so that ring and
recursive doubling fit 64M float64 elements."""

import os

import pytest
import torch
import torch.distributed as dist

import p2pcomm
from conftest import GPU_ONLY, gpus_shared, local_cuda_index

pytestmark = [GPU_ONLY, pytest.mark.skipif(gpus_shared(),
                                           reason="the reference gathers through NCCL, which refuses ranks sharing a GPU")]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = ["sum", "prod", "min", "max", "avg"]
SIZES = [1, 7, 4097, (1 << 20) + 3, 64 << 20]
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module")
def big_comm(group):
    torch.cuda.set_device(local_cuda_index())
    old = os.environ.get("P2PCOMM_STAGING_BYTES")
    os.environ["P2PCOMM_STAGING_BYTES"] = str(1100 << 20)
    try:
        comm = p2pcomm.Communicator(group, device=torch.cuda.current_device())
    finally:
        if old is None:
            os.environ.pop("P2PCOMM_STAGING_BYTES")
        else:
            os.environ["P2PCOMM_STAGING_BYTES"] = old
    # The reference gathers every rank's input on the GPUs, through NCCL.
    comm.nccl = dist.new_group(backend="nccl")
    yield comm
    comm.close()


def make_input(n, dtype, op, rank, seed):
    g = torch.Generator(device="cuda").manual_seed(seed * 16 + rank)
    if dtype.is_floating_point:
        x = torch.randn(n, device="cuda", generator=g, dtype=torch.float32)
        if op == "prod":
            x = x.sign() * (0.5 + x.abs().clamp(max=1.5))
        return x.to(dtype)
    hi = 4 if op == "prod" else 1000
    return torch.randint(-hi, hi + 1, (n,), device="cuda", generator=g, dtype=dtype)


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot", "ring", "recursive_doubling", "oneshot_ll", "twoshot_ll",
                                       "oneshot_push", "twoshot_push", "oneshot_ll128", "oneshot_lamport",
                                       "twoshot_lamport"])
def test_matrix(big_comm, algorithm, n):
    if n == SIZES[-1] and algorithm.endswith(("_ll", "_push", "_ll128", "_lamport")):
        pytest.skip("runs the plain one-shot/two-shot at this size (past the LL slots), tested above")
    comm = big_comm
    w, r = comm.world_size, comm.rank
    for di, dtype in enumerate(DTYPES):
        for oi, op in enumerate(OPS):
            seed = (SIZES.index(n) * 10 + di) * 10 + oi
            mine = make_input(n, dtype, op, r, seed)
            gathered = [torch.empty_like(mine) for _ in range(w)]
            dist.all_gather(gathered, mine, group=comm.nccl)
            wide = torch.float64 if dtype.is_floating_point else torch.int64
            stack = torch.stack([g.to(wide) for g in gathered])
            if op in ("sum", "avg"):
                want = stack.sum(0)
                if op == "avg":
                    want = want / w if dtype.is_floating_point else torch.div(want, w, rounding_mode="floor")
            elif op == "prod":
                want = stack.prod(0)
            else:
                want = stack.amin(0) if op == "min" else stack.amax(0)
            out = torch.full_like(mine, float("nan") if dtype.is_floating_point else -1)
            comm._reduce(mine, out, op, algorithm)
            comm.check()
            if not dtype.is_floating_point or op in ("min", "max"):
                assert torch.equal(out.to(wide), want), f"{algorithm} {op} {dtype} n={n}"
            else:
                scale = stack.abs().sum(0) if op in ("sum", "avg") else want.abs()
                if op == "avg":
                    scale = scale / w
                bad = ((out.to(torch.float64) - want).abs() > TOL[dtype] * (scale + 1e-3)).sum().item()
                assert bad == 0, f"{algorithm} {op} {dtype} n={n}: {bad} elements off"
            del gathered, stack, want, out, mine
    torch.cuda.synchronize()
