"""A one-minute tour of p2pcomm; run under torchrun.

    torchrun --nproc_per_node=2 -m p2pcomm.demo

Creates a Communicator (GPU when CUDA is available, else CPU), all-reduces a
small random tensor, checks it against torch.distributed in float64, and
prints a short latency table of p2pcomm vs torch.distributed (gloo on CPU,
NCCL on GPU). Rank 0 prints.
"""

from __future__ import annotations

import os

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from . import Communicator  # noqa: E402

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)  # bytes


def _init() -> torch.device:
    """Initialize torch.distributed from torchrun's environment if the
    caller has not, and return this rank's device."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
        dist.init_process_group(backend="nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
    return device


def _latency_us(fn, refill, device: torch.device, max_iters: int, budget_s: float = 0.25) -> float:
    """Median microseconds per call of fn, over 5 timed repetitions, the
    slowest rank's. refill (untimed) restores the data before each one."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    refill()
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    iters = max(1, min(max_iters, int(budget_s / 5 / max(probe.item(), 1e-6))))
    reps = []
    for _ in range(5):
        refill()
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        reps.append((time.perf_counter() - t0) / iters)
    worst = torch.tensor(reps, dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return statistics.median(worst.tolist()) * 1e6


def parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="torchrun --nproc_per_node=N -m p2pcomm.demo", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def main(argv: Optional[list[str]] = None) -> int:
    parser().parse_args(argv)
    device = _init()
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = "nccl" if device.type == "cuda" else "gloo"
    comm = Communicator(group=dist.group.WORLD, device=device)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{comm!r}: {world} ranks, torch.distributed backend {backend}")

    # Correctness: a small random all-reduce, checked in float64.
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, generator=gen, dtype=torch.float64)
    got = comm.all_reduce(x.to(device=device, dtype=torch.float32))
    want = x.to(device)
    dist.all_reduce(want)
    err = (got.double() - want).abs().max().item()
    ok = err <= 1e-5 * world
    say(f"all_reduce(sum) of 8 random floats on rank 0: {[round(v, 4) for v in got.cpu().tolist()]}")
    say(f"max |p2pcomm - torch.distributed (float64)| = {err:.2e}: {'OK' if ok else 'MISMATCH'}")

    # Latency: in place on symmetric memory (comm.empty, no staging copy).
    say(f"\n{'size':>7}  {'p2pcomm us':>10}  {backend + ' us':>10}  {'speedup':>7}")
    sym = comm.empty(max(SIZES) // 4, torch.float32)
    plain = torch.empty(max(SIZES) // 4, dtype=torch.float32, device=device)
    for size in SIZES:
        n = size // 4
        a, b = sym[:n], plain[:n]
        data = torch.rand(n, generator=gen).to(device) + 1  # never time on zeros
        # In-place sums grow by world each call: refill before every
        # repetition and stop well before float32 overflows.
        max_iters = max(1, int(120 / math.log2(max(world, 2))) - 8)
        ours = _latency_us(lambda: comm.all_reduce_(a), lambda: a.copy_(data), device, max_iters)
        theirs = _latency_us(lambda: dist.all_reduce(b), lambda: b.copy_(data), device, max_iters)
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        say(f"{label:>7}  {ours:10.1f}  {theirs:10.1f}  {theirs / ours:6.1f}x")
    dist.barrier()
    comm.close()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
