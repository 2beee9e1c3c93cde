"""MoE dispatch/combine benchmark: p2pcomm.ExpertParallel against an
all-to-all baseline over torch.distributed (NCCL on GPU, gloo on CPU).

    torchrun --nproc_per_node=4 -m p2pcomm.bench moe                       # GPU: E=256 H=7168 K=8, 4096 and 128 tokens
    torchrun --nproc_per_node=2 -m p2pcomm.bench moe --device cpu          # small CPU run

Every rank runs it; rank 0 prints a table and writes CSV and markdown into
--out. Times are medians over --reps of CUDA-event (GPU) or wall (CPU)
times, the slowest rank's; dispatch and combine are timed separately.
GB/s counts only token bytes that cross between ranks: p2pcomm sends a token
row once per destination rank and gets back one float32 partial per (token,
rank); the baseline sends a row per (token, expert) pair and gets a row of
dtype back per pair (the usual all-to-all dispatcher: count exchange,
all_to_all_single of the permuted rows, local permute into expert-major
order, and the reverse for combine).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .bench import _DTYPES, header_lines, init_distributed, md_table, say


@dataclasses.dataclass
class MoeRow:
    tokens: int
    impl: str
    mode: str
    dispatch_us: Optional[float] = None
    dispatch_gbps: Optional[float] = None
    combine_us: Optional[float] = None
    combine_gbps: Optional[float] = None
    status: str = "ok"

    def cells(self) -> list[str]:
        f = lambda v, p: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        return [str(self.tokens), self.impl, self.mode, f(self.dispatch_us, 1), f(self.dispatch_gbps, 1),
                f(self.combine_us, 1), f(self.combine_gbps, 1), self.status]


HEADERS = ["tokens/rank", "impl", "mode", "dispatch us", "dispatch GB/s", "combine us", "combine GB/s", "status"]
_NUMERIC = (0, 3, 4, 5, 6)


def text_table(rows: list[list[str]], widths: list[int]) -> str:
    widths = [max([len(h), w] + [len(r[i]) for r in rows]) for i, (h, w) in enumerate(zip(HEADERS, widths))]
    line = lambda cells: "  ".join(c.rjust(w) if i in _NUMERIC else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(HEADERS), line(["-" * w for w in widths])] + [line(r) for r in rows])


def routing(T: int, E: int, K: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]  # K distinct experts per token
    w = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    return idx.to(device), w.to(device), g.initial_seed()


class Clock:
    """Start/stop marks that read the same on CPU and GPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


def sync_all(device, ctl) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group=ctl)


def slowest_median(times: list[float], ctl) -> float:
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctl)
    return t.item()


def mean_over_ranks(v: float, ctl) -> float:
    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t, group=ctl)
    return t.item() / dist.get_world_size()


def time_pair(dispatch: Callable, combine: Callable, reps: int, warmup: int, device, ctl) -> tuple[float, float]:
    """Median seconds (slowest rank) of dispatch() and of combine(recv)."""
    clock = Clock(device)
    for _ in range(warmup):
        combine(dispatch())
    td, tc = [], []
    for _ in range(reps):
        sync_all(device, ctl)
        a = clock.mark()
        recv = dispatch()
        b = clock.mark()
        combine(recv)
        c = clock.mark()
        td.append(clock.seconds(a, b))
        tc.append(clock.seconds(b, c))
    return slowest_median(td, ctl), slowest_median(tc, ctl)


def time_graphs(dispatch: Callable, combine: Callable, reps: int, device, ctl) -> tuple[float, float]:
    """The same, with dispatch and combine each captured in its own CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        combine(dispatch())  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    sync_all(device, ctl)
    gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(gd):
        recv = dispatch()
    with torch.cuda.graph(gc, pool=gd.pool()):
        combine(recv)
    sync_all(device, ctl)
    return time_pair(lambda: gd.replay(), lambda _: gc.replay(), reps, 2, device, ctl)


class AllToAllBaseline:
    """Dispatch/combine with torch.distributed.all_to_all_single, one row per
    (token, expert) pair."""

    def __init__(self, group, E: int, W: int, rank: int, device):
        self.group, self.E, self.W, self.L, self.rank, self.device = group, E, W, E // W, rank, device

    def dispatch(self, x, idx, w):
        T, K = idx.shape
        flat = idx.flatten()
        key = torch.where(flat >= 0, flat, self.E)
        order = torch.sort(key, stable=True).indices  # pairs by expert: by destination rank, then expert
        n = int((flat >= 0).sum())
        order = order[:n]
        experts = flat[order]
        counts = torch.zeros(self.E, dtype=torch.int64, device=self.device).index_add_(
            0, experts, torch.ones_like(experts))  # pairs per global expert
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # [source, local expert]
        send_split = counts.view(self.W, self.L).sum(1).tolist()
        rc = recv_counts.view(self.W, self.L)
        recv_split = rc.sum(1).tolist()
        rows = x.index_select(0, torch.div(order, K, rounding_mode="floor"))
        got = x.new_empty(sum(recv_split), x.shape[1])
        dist.all_to_all_single(got, rows, recv_split, send_split, group=self.group)
        # Received source-major, expert-sorted within a source: permute to expert-major.
        local = torch.repeat_interleave(torch.arange(self.L, device=self.device).repeat(self.W), rc.flatten())
        src = torch.repeat_interleave(torch.arange(self.W, device=self.device), rc.sum(1))
        perm = torch.sort(local * self.W + src, stable=True).indices
        return dict(x=got.index_select(0, perm), perm=perm, order=order, send_split=send_split,
                    recv_split=recv_split, T=T, K=K, w=w)

    def combine(self, out, st):
        back = torch.empty_like(out).index_copy_(0, st["perm"], out)  # source-major again
        home = out.new_empty(sum(st["send_split"]), out.shape[1])
        dist.all_to_all_single(home, back, st["send_split"], st["recv_split"], group=self.group)
        order, K = st["order"], st["K"]
        weight = st["w"].flatten().index_select(0, order).unsqueeze(1)
        y = torch.zeros(st["T"], out.shape[1], dtype=torch.float32, device=self.device)
        y.index_add_(0, torch.div(order, K, rounding_mode="floor"), home.float() * weight)
        return y.to(out.dtype)


def bench_moe(args) -> int:
    device = torch.device(args.device if args.device != "cuda" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    init_distributed(device)
    from .communicator import Communicator
    from .moe import ExpertParallel

    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = _DTYPES[args.dtype]
    cuda = device.type == "cuda"
    hidden = args.hidden or (7168 if cuda else 256)
    tokens = args.tokens or ([4096, 128] if cuda else [64])
    E, K = args.experts, args.topk
    if E % world:
        say(f"--experts {E} is not divisible by the world size {world}")
        return 2
    default_backend = str(dist.get_backend()).lower()
    ctl = dist.group.WORLD if default_backend == "gloo" else dist.new_group(backend="gloo")
    base_group = (dist.group.WORLD if "nccl" in default_backend else dist.new_group(backend="nccl")) if cuda else ctl
    base_name = "nccl a2a" if cuda else "gloo a2a"
    header = header_lines(args, device, dtype, world) + [
        f"experts: {E} ({E // world} per rank), hidden: {hidden}, topk: {K}, random routing (distinct experts)",
        ("note: fused kernels (native/kernels/moe.cu) on " + str(args.num_sms) + " SMs; float32 partials in combine"
         if cuda and dtype in (torch.bfloat16, torch.float16, torch.float32) else
         "note: torch-op implementation; num_sms is not bounded") + "; capturable mode moves worst-case buffers",
    ]
    say("\n".join(header) + "\n")
    comm = Communicator(group=dist.group.WORLD, device=device)
    baseline = AllToAllBaseline(base_group, E, world, rank, device)
    rows: list[MoeRow] = []
    widths = [11, 8, 10, 11, 13, 10, 12, 6]
    say(text_table([], widths))
    for T in tokens:
        g = torch.Generator().manual_seed(1000 * rank + T)
        x = (torch.randn(T, hidden, generator=g) * 0.5).to(dtype).to(device)
        idx, w, _ = routing(T, E, K, 7 * rank + T, device)
        # Off-rank bytes per rank, for GB/s: p2pcomm rows per (token, other destination rank).
        dest = torch.div(idx, E // world, rounding_mode="floor")
        hit = torch.zeros(T, world, dtype=torch.bool, device=device).scatter_(1, dest, True)
        hit[:, rank] = False
        p2p_rows = mean_over_ranks(float(hit.sum()), ctl)
        pair_rows = mean_over_ranks(float((dest != rank).sum()), ctl)
        p2p_bytes = (p2p_rows * hidden * dtype.itemsize, p2p_rows * hidden * 4)
        base_bytes = (pair_rows * hidden * dtype.itemsize,) * 2
        new = []
        ref = None
        try:
            st = baseline.dispatch(x, idx, w)
            ref = baseline.combine(st["x"], st)
            td, tc = time_pair(lambda: baseline.dispatch(x, idx, w), lambda s: baseline.combine(s["x"], s),
                               args.reps, args.warmup, device, ctl)
            new.append(MoeRow(T, base_name, "eager", td * 1e6, base_bytes[0] / td / 1e9, tc * 1e6,
                              base_bytes[1] / tc / 1e9))
        except Exception as e:  # noqa: BLE001 - reported as a row
            new.append(MoeRow(T, base_name, "eager", status=_na(e)))
            if cuda:
                torch.cuda.synchronize()
        modes = ["eager"] + (["graph"] if cuda and not args.no_graph else []) + \
            (["capturable"] if not cuda and not args.no_graph else [])
        for mode in modes:
            try:
                ep = ExpertParallel(comm, num_experts=E, hidden=hidden, max_tokens_per_rank=T, topk=K, dtype=dtype,
                                    capturable=mode != "eager", num_sms=args.num_sms)
                recv = ep.dispatch(x, idx, w)
                y = ep.combine(recv.x, recv)
                ok = ref is None or _close(y, ref, dtype, K)
                ok = _agree(bool(ok), ctl)
                if mode == "graph":
                    td, tc = time_graphs(lambda: ep.dispatch(x, idx, w), lambda r: ep.combine(r.x, r), args.reps,
                                         device, ctl)
                else:
                    td, tc = time_pair(lambda: ep.dispatch(x, idx, w), lambda r: ep.combine(r.x, r), args.reps,
                                       args.warmup, device, ctl)
                new.append(MoeRow(T, "p2pcomm", mode, td * 1e6, p2p_bytes[0] / td / 1e9, tc * 1e6,
                                  p2p_bytes[1] / tc / 1e9, "ok" if ok else "WRONG"))
                del ep, recv, y
            except Exception as e:  # noqa: BLE001
                new.append(MoeRow(T, "p2pcomm", mode, status=_na(e)))
                if cuda:
                    torch.cuda.synchronize()
        rows += new
        say("\n".join(text_table([r.cells() for r in new], widths).splitlines()[2:]))
    if rank == 0:
        for p in write_outputs(args.out, f"moe_{device.type}_{args.dtype}_w{world}", header, rows):
            print(f"wrote {p}")
    dist.barrier(group=ctl)
    comm.close()
    return 0


def _close(y, ref, dtype, K) -> bool:
    # Both sum K weighted rows in float32 (different orders) and round once to dtype.
    eps = torch.finfo(dtype).eps
    return bool(torch.allclose(y.double(), ref.double(), rtol=2 * eps, atol=2 * eps))


def _agree(ok: bool, ctl) -> bool:
    t = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctl)
    return bool(t.item())


def _na(e: BaseException) -> str:
    msg = str(e).splitlines()[0][:100] if str(e) else ""
    return f"n/a: {type(e).__name__}: {msg}"


def write_outputs(out_dir: str, stem: str, header: list[str], rows: list[MoeRow]) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, stem + ".csv")
    with open(csv_path, "w", newline="") as f:
        for line in header:
            f.write(f"# {line}\n")
        wr = csv.writer(f)
        wr.writerow(["tokens_per_rank", "impl", "mode", "dispatch_us", "dispatch_gbps", "combine_us", "combine_gbps",
                     "status"])
        for r in rows:
            wr.writerow([r.tokens, r.impl, r.mode] + ["" if v is None else f"{v:.3f}" for v in
                                                      (r.dispatch_us, r.dispatch_gbps, r.combine_us, r.combine_gbps)]
                        + [r.status])
    md_path = os.path.join(out_dir, stem + ".md")
    with open(md_path, "w") as f:
        f.write("# p2pcomm MoE dispatch/combine benchmark\n\n" + "\n".join(f"- {line}" for line in header) + "\n\n")
        f.write(md_table(HEADERS, [r.cells() for r in rows]) + "\n")
    return [csv_path, md_path]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m p2pcomm.bench moe",
                                description="MoE dispatch/combine of p2pcomm.ExpertParallel vs all_to_all_single.")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    p.add_argument("--experts", type=int, default=256, help="num_experts E (divisible by the world size)")
    p.add_argument("--hidden", type=int, default=None, help="default 7168 on GPU, 256 on CPU")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",") if v], default=None,
                   help="comma-separated tokens per rank (default 4096,128 on GPU, 64 on CPU)")
    p.add_argument("--num-sms", type=int, default=24, help="ExpertParallel num_sms (GPU kernels' blocks)")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions; the median is reported")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph (capturable) rows")
    p.add_argument("--out", default="bench_out", help="directory for the CSV and markdown")
    return p
