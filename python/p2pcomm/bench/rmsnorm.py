"""The fused all-reduce + residual add + RMSNorm against the same steps
unfused, in one run; under torchrun:

    torchrun --nproc_per_node=N -m p2pcomm.bench rmsnorm [--tokens 1,8,128] [--hidden 4096,8192] [--out DIR]

Per (hidden, tokens) and mode (eager; CUDA graph on GPU), the time per call of
  fused      comm.all_reduce_residual_rmsnorm (each of --algorithms)
  unfused    comm.all_reduce(x), then torch's add and rms_norm
  nccl       dist.all_reduce(x) in place (gloo on CPU), then the same torch ops
(the slowest rank's median), the speedups of the first fused algorithm, and a
status: WRONG when a fused residual_out differs from the unfused one in a bit
or a fused normed from torch's rms_norm by more than two units in the last
place. Rank 0 prints the table and writes it as markdown and CSV into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from .allreduce import max_inplace_iters, timing_data
from .harness import DTYPES, Timer, add_timing_args, header_lines, init_distributed, md_table, na, rank0, say, text_table, write_csv

EPS = 1e-6


@dataclasses.dataclass
class Row:
    hidden: int
    tokens: int
    mode: str
    fused_us: dict  # algorithm -> µs (None: could not run)
    unfused_us: Optional[float] = None
    base_us: Optional[float] = None
    status: str = "ok"


def _us(v: Optional[float]) -> str:
    return f"{v:.1f}" if v else "-"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def headers(algorithms: list[str], base_name: str) -> list[str]:
    return (["hidden", "tokens", "mode"] + [f"fused {a} us" for a in algorithms]
            + ["unfused us", f"{base_name} + torch us", f"{algorithms[0]} vs unfused", f"vs {base_name}", "status"])


def cells(r: Row, algorithms: list[str]) -> list[str]:
    first = r.fused_us.get(algorithms[0])
    return ([str(r.hidden), str(r.tokens), r.mode] + [_us(r.fused_us.get(a)) for a in algorithms]
            + [_us(r.unfused_us), _us(r.base_us), _ratio(r.unfused_us, first), _ratio(r.base_us, first), r.status])


def torch_steps(summed, residual, weight):
    """The residual add and RMSNorm after an all-reduce, as a model runs them unfused."""
    out = summed + residual
    return torch.nn.functional.rms_norm(out, (out.shape[-1],), weight, EPS), out


def check(comm, x, residual, weight, algorithms) -> str:
    """ok, or WRONG with the first difference: every fused algorithm against
    the unfused p2pcomm steps (residual_out bit for bit, normed within two
    units in the last place of torch's rms_norm)."""
    want_normed, want_out = torch_steps(comm.all_reduce(x), residual, weight)
    ulp = torch.finfo(x.dtype).eps
    bad = []
    for algo in algorithms:
        normed, out = comm.all_reduce_residual_rmsnorm(x, residual, weight, EPS, algorithm=algo)
        if not torch.equal(out.view(torch.int16), want_out.view(torch.int16)):
            bad.append(f"{algo} residual_out")
        err = (normed.float() - want_normed.float()).abs()
        if (err > 2 * ulp * want_normed.float().abs() + 1e-6).any():
            bad.append(f"{algo} normed")
    return "ok" if not bad else "WRONG: " + ", ".join(bad)


def bench_shape(args, timer: Timer, comm, base_group, hidden: int, tokens: int, dtype, device, modes) -> list[Row]:
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(1000 * rank + tokens + hidden)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    normed_out, residual_out = torch.empty_like(x), torch.empty_like(x)
    base_buf = torch.empty_like(x)
    base_fill = timing_data(x.numel(), dtype, device, 99 + rank, world).view(x.shape)
    status = check(comm, x, residual, weight, args.algorithms)
    if not timer.agree_all(status == "ok") and status == "ok":
        status = "WRONG on another rank"
    nbytes = x.numel() * x.element_size()

    def fused(algo):
        return lambda: comm.all_reduce_residual_rmsnorm(x, residual, weight, EPS, residual_out=residual_out,
                                                        normed_out=normed_out, algorithm=algo)

    def unfused():
        return torch_steps(comm.all_reduce(x), residual, weight)

    def base():
        dist.all_reduce(base_buf, group=base_group)
        return torch_steps(base_buf, residual, weight)

    def measure(fn, mode, refill=lambda: None, cap=args.max_iters, after_capture=None):
        try:
            sec, _ = timer.measure(fn, refill, iters=args.iters, warmup=args.warmup, rep_seconds=args.rep_ms / 1e3,
                                   cap=cap, graph=mode == "graph", after_capture=after_capture)
            return sec * 1e6
        except Exception as e:  # noqa: BLE001 - one failing step should not end the run
            say(f"  {hidden} x {tokens} {mode}: {na(e)}")
            if device.type == "cuda":
                torch.cuda.synchronize()
            return None

    rows = []
    for mode in modes:
        times = {}
        for algo in args.algorithms:
            if algo == "oneshot_ll" and nbytes > (1 << 20) or algo == "oneshot_lamport" and nbytes > (8 << 20) // world:
                times[algo] = None  # runs the two-shot: the LL (Lamport) buffers hold 1 MiB (8 MiB / world) per rank
                continue
            times[algo] = measure(fused(algo), mode)
        unfused_us = measure(unfused, mode, after_capture=comm.register_graph_buffers)
        base_us = measure(base, mode, refill=lambda: base_buf.copy_(base_fill),
                          cap=min(args.max_iters, max_inplace_iters(dtype, world)))
        rows.append(Row(hidden, tokens, mode, times, unfused_us, base_us, status))
    return rows


def bench_rmsnorm(args) -> int:
    from ..communicator import Communicator, local_cuda_index

    device = torch.device(args.device if args.device != "cuda" else f"cuda:{local_cuda_index()}")
    init_distributed(device)
    world = dist.get_world_size()
    dtype = DTYPES[args.dtype]
    default_backend = str(dist.get_backend()).lower()
    ctl = dist.group.WORLD if default_backend == "gloo" else dist.new_group(backend="gloo")
    if device.type == "cuda":
        base_group = dist.group.WORLD if "nccl" in default_backend else dist.new_group(backend="nccl")
    else:
        base_group = ctl
    base_name = "nccl" if device.type == "cuda" else "gloo"
    header = header_lines(args, device, dtype, world)
    say("\n".join(header) + "\n")
    comm = Communicator(group=dist.group.WORLD, device=device)
    timer = Timer(device, ctl, args.reps)
    modes = ["eager"] + (["graph"] if args.graph and device.type == "cuda" else [])
    cols = headers(args.algorithms, base_name)
    numeric = [i for i in range(len(cols)) if i not in (2, len(cols) - 1)]
    widths = [6, 6, 5] + [max(len(c), 8) for c in cols[3:-1]] + [6]
    say(text_table(cols, [], numeric, widths))
    rows: list[Row] = []
    start = time.perf_counter()
    for hidden in args.hidden:
        for tokens in args.tokens:
            new = bench_shape(args, timer, comm, base_group, hidden, tokens, dtype, device, modes)
            rows += new
            say("\n".join(text_table(cols, [cells(r, args.algorithms) for r in new], numeric, widths).splitlines()[2:]))
    say(f"\n({time.perf_counter() - start:.1f} s)")
    if rank0() and args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"rmsnorm_{device.type}_{args.dtype}_w{world}")
        with open(stem + ".md", "w") as f:
            f.write("# p2pcomm all-reduce + residual add + RMSNorm benchmark\n\n"
                    + "\n".join(f"- {line}" for line in header) + "\n\n"
                    + md_table(cols, [cells(r, args.algorithms) for r in rows], numeric) + "\n")
        write_csv(stem + ".csv", header, ["hidden", "tokens", "mode"] + [f"fused_{a}_us" for a in args.algorithms]
                  + ["unfused_us", f"{base_name}_us", "status"],
                  [[r.hidden, r.tokens, r.mode] + [f"{r.fused_us[a]:.3f}" if r.fused_us.get(a) else ""
                                                   for a in args.algorithms]
                   + [f"{r.unfused_us:.3f}" if r.unfused_us else "", f"{r.base_us:.3f}" if r.base_us else "", r.status]
                   for r in rows])
        print(f"wrote {stem}.md and {stem}.csv")
    dist.barrier(group=ctl)
    comm.close()
    return 0


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m p2pcomm.bench rmsnorm",
                                description="Fused all-reduce + residual add + RMSNorm against p2pcomm's all-reduce "
                                            "and NCCL's followed by torch's add and rms_norm.")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--tokens", type=_ints, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                   help="rows per call, comma-separated (default 1,2,4,...,512)")
    p.add_argument("--hidden", type=_ints, default=[4096, 8192], help="row lengths, comma-separated (default 4096,8192)")
    p.add_argument("--algorithms", type=lambda s: [a.strip() for a in s.split(",") if a.strip()],
                   default=["auto", "oneshot_ll", "oneshot_lamport", "twoshot"],
                   help="fused algorithms to time; the speedups are the first one's (default auto,oneshot_ll,"
                        "oneshot_lamport,twoshot)")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                   help="GPU: also time CUDA-graph replays of the captured calls (default on)")
    add_timing_args(p, max_iters=1000)
    p.add_argument("--out", default=None, help="directory for the markdown table and CSV (default: print only)")
    return p


def run(args) -> int:
    """The benchmark for parser()'s args; tears the process group down on the way out."""
    from ..rmsnorm import ALGORITHMS

    bad = [a for a in args.algorithms if a not in ALGORITHMS]
    if bad or not args.algorithms:
        parser().error(f"unknown algorithm(s) {', '.join(bad)}: use {', '.join(ALGORITHMS)}")
    if args.rep_ms is None:
        args.rep_ms = 20.0 if args.device == "cuda" else 40.0
    try:
        return bench_rmsnorm(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
