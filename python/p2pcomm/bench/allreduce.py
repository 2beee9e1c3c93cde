"""All-reduce latency and bus bandwidth of p2pcomm against torch.distributed
(NCCL on GPU, gloo on CPU) and torch SymmetricMemory; run under torchrun.

    torchrun --nproc_per_node=2 -m p2pcomm.bench [allreduce] [--device cpu|cuda] [--dtype float32] ...

Every rank runs it; rank 0 prints a table, then a summary (the last thing
printed), and writes CSV, markdown and a PNG plot into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .harness import (DTYPES, Timer, add_timing_args, fmt_bytes, header_lines, init_distributed, md_table, na,
                      parse_bytes, rank0, say, text_table, write_csv)

# -- data ----------------------------------------------------------------------------------------------

def tolerances(dtype: torch.dtype, world: int) -> tuple[float, float]:
    """(rtol, atol) for comparing sums of `world` standard normals reduced in
    different orders."""
    eps = torch.finfo(dtype).eps
    return 4 * eps * world, 16 * eps * world


def timing_data(numel: int, dtype: torch.dtype, device, gen_seed: int, world: int) -> torch.Tensor:
    """Positive random values small enough that repeated in-place sums stay
    finite and never become subnormal (which would skew CPU timings)."""
    g = torch.Generator().manual_seed(gen_seed)
    fi = torch.finfo(dtype)
    scale = 2.0 ** (math.log2(fi.tiny) + 2)
    x = (torch.rand(numel, generator=g, dtype=torch.float64) + 1.0) * scale
    return x.to(dtype).to(device)


def max_inplace_iters(dtype: torch.dtype, world: int) -> int:
    """How many in-place sums timing_data survives before overflowing."""
    fi = torch.finfo(dtype)
    doublings = math.log2(fi.max) - (math.log2(fi.tiny) + 3)
    return max(1, int(doublings / math.log2(max(world, 2))) - 2)


# -- results ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    size: int
    impl: str
    algorithm: str
    latency_us: Optional[float] = None
    busbw_gbps: Optional[float] = None
    speedup: Optional[float] = None
    iters: int = 0
    mode: str = "eager"
    status: str = "ok"  # ok | WRONG | n/a: reason

    def cells(self) -> list[str]:
        lat = f"{self.latency_us:.1f}" if self.latency_us is not None else "-"
        bw = f"{self.busbw_gbps:.2f}" if self.busbw_gbps is not None else "-"
        sp = f"{self.speedup:.2f}x" if self.speedup is not None else "-"
        impl = self.impl if self.mode == "eager" else f"{self.impl} ({self.mode})"
        return [fmt_bytes(self.size), impl, self.algorithm, lat, bw, sp, self.status]


HEADERS = ["size", "impl", "algorithm", "latency us", "busBW GB/s", "vs baseline", "status"]
_NUMERIC = (0, 3, 4, 5)  # right-justified columns of HEADERS (and of the summary)


# -- implementations -------------------------------------------------------------------------------

@dataclasses.dataclass
class Impl:
    """One way to all-reduce a buffer of `numel` elements.

    setup(numel) returns (buf, call): buf is what the caller fills, call
    all-reduces it (in place, or into `result(buf)`)."""

    name: str
    algorithm: str
    setup: Callable[[int], tuple[torch.Tensor, Callable[[], object]]]
    result: Callable[[torch.Tensor], torch.Tensor] = lambda buf: buf
    in_place: bool = True
    baseline: bool = False
    unavailable: str = ""
    graph_ok: bool = True
    after_capture: Optional[Callable[[], object]] = None


def build_impls(args, device: torch.device, dtype: torch.dtype, max_numel: int, base_group, world: int):
    impls: list[Impl] = []
    base_name = "nccl" if device.type == "cuda" else "gloo"

    def torch_setup(numel):
        buf = torch.empty(numel, dtype=dtype, device=device)
        return buf, lambda: dist.all_reduce(buf, group=base_group)

    impls.append(Impl(base_name, "-", torch_setup, baseline=True))

    comm, why = None, ""
    try:
        from ..communicator import Communicator

        comm = Communicator(group=dist.group.WORLD, device=device)
    except Exception as e:  # noqa: BLE001 - reported as a row, not fatal
        why = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
    sym = None
    if comm is not None:
        try:
            sym = comm.empty(max_numel, dtype)
        except Exception as e:  # noqa: BLE001
            why = f"n/a: comm.empty: {e}"
    for algo in args.algorithms:
        def sym_setup(numel, algo=algo):
            buf = sym[:numel]
            return buf, lambda: comm.all_reduce_(buf, algorithm=algo)

        def staged_setup(numel, algo=algo):
            buf = torch.empty(numel, dtype=dtype, device=device)
            return buf, lambda: comm.all_reduce_(buf, algorithm=algo)

        impls.append(Impl("p2pcomm", algo, sym_setup, unavailable=why if sym is None else ""))
        # Graph mode maps the captured input for its replays (register_graph_buffers), as an
        # application would; eager calls on it keep staging.
        impls.append(Impl("p2pcomm-staged", algo, staged_setup, unavailable=why if comm is None else "",
                          after_capture=comm.register_graph_buffers if comm is not None else None))

    if device.type == "cuda":
        impls += torch_symm_mem_impls(device, dtype, max_numel, base_group)
    return impls, comm


def torch_symm_mem_impls(device, dtype, max_numel, group) -> list[Impl]:
    """torch SymmetricMemory's one-shot and two-shot all-reduce, or rows
    saying why they are unavailable."""
    names = [("torch-symm", "oneshot"), ("torch-symm", "twoshot")]
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group)
        group_name = group.group_name
        out = torch.empty(max_numel, dtype=dtype, device=device)
        ops = torch.ops.symm_mem
    except Exception as e:  # noqa: BLE001
        why = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
        return [Impl(n, a, lambda numel: None, unavailable=why) for n, a in names]

    def one_shot(numel):
        b, o = buf[:numel], out[:numel]
        return b, lambda: ops.one_shot_all_reduce_out(b, "sum", group_name, o)

    def two_shot(numel):
        b = buf[:numel]
        return b, lambda: ops.two_shot_all_reduce_(b, "sum", group_name)

    return [Impl("torch-symm", "oneshot", one_shot, result=lambda b: out[:b.numel()], in_place=False),
            Impl("torch-symm", "twoshot", two_shot)]


# -- the all-reduce benchmark ----------------------------------------------------------------------

def sizes_for(args, elem: int) -> list[int]:
    if args.sizes:
        sizes = args.sizes
    else:
        sizes, s = [], args.min_bytes
        while s <= args.max_bytes:
            sizes.append(s)
            s *= args.step
    return [s for s in sizes if s >= elem and s % elem == 0]


def bench_size(args, timer: Timer, impls: list[Impl], size: int, dtype, device, world: int, rank: int) -> list[Row]:
    numel = size // dtype.itemsize
    gen = torch.Generator().manual_seed(1234 + 7919 * rank + size)
    check_in = torch.randn(numel, generator=gen, dtype=torch.float32).to(dtype).to(device)
    timing_in = timing_data(numel, dtype, device, 99 + rank + size, world)
    expected = None
    rows: list[Row] = []
    rtol, atol = tolerances(dtype, world)
    cap = args.max_iters
    busbytes = size * 2 * (world - 1) / world
    rep_seconds = args.rep_ms / 1e3
    modes = ["eager"] + (["graph"] if args.graph and device.type == "cuda" else [])
    for impl in impls:
        if impl.unavailable:
            rows.append(Row(size, impl.name, impl.algorithm, status=impl.unavailable))
            continue
        try:
            buf, call = impl.setup(numel)
            buf.copy_(check_in)
            call()
            got = impl.result(buf).clone()
            if impl.baseline:
                expected = got
                ok = torch.isfinite(got.float()).all().item()
            else:
                ok = expected is not None and torch.allclose(got.double(), expected.double(), rtol=rtol, atol=atol)
            ok = timer.agree_all(bool(ok))
            icap = min(cap, max_inplace_iters(dtype, world)) if impl.in_place else cap
            for mode in modes:
                if mode == "graph" and not impl.graph_ok:
                    continue
                try:
                    sec, n = timer.measure(call, lambda: buf.copy_(timing_in), iters=args.iters, warmup=args.warmup,
                                           rep_seconds=rep_seconds, cap=icap, graph=mode == "graph",
                                           after_capture=impl.after_capture)
                    rows.append(Row(size, impl.name, impl.algorithm, sec * 1e6, busbytes / sec / 1e9, iters=n,
                                    mode=mode, status="ok" if ok else "WRONG"))
                except Exception as e:  # noqa: BLE001
                    if mode == "eager":
                        raise
                    rows.append(Row(size, impl.name, impl.algorithm, mode=mode, status=na(e)))
        except Exception as e:  # noqa: BLE001 - one failing impl should not end the run
            rows.append(Row(size, impl.name, impl.algorithm, status=na(e)))
            if device.type == "cuda":
                torch.cuda.synchronize()
    base = {r.mode: r.latency_us for r in rows if r.impl in ("gloo", "nccl") and r.latency_us}
    base_eager = base.get("eager")
    for r in rows:
        if r.latency_us and base_eager:
            r.speedup = base_eager / r.latency_us
    return rows


def summary(rows: list[Row], base_name: str) -> tuple[list[str], list[list[str]]]:
    """Per size: the baseline, the best p2pcomm (symmetric and staged) and
    their speedups."""
    headers = ["size", f"{base_name} us", "p2pcomm us (algo)", "speedup", "staged us (algo)", "speedup"]
    out = []
    for size in sorted({r.size for r in rows}):
        here = [r for r in rows if r.size == size and r.mode == "eager"]
        base = next((r for r in here if r.impl == base_name and r.latency_us), None)
        cells = [fmt_bytes(size), f"{base.latency_us:.1f}" if base else "-"]
        for name in ("p2pcomm", "p2pcomm-staged"):
            cands = [r for r in here if r.impl == name and r.latency_us and r.status == "ok"]
            best = min(cands, key=lambda r: r.latency_us, default=None)
            if best is None:
                cells += ["-", "-"]
            else:
                cells += [f"{best.latency_us:.1f} ({best.algorithm})", f"{best.speedup:.2f}x" if best.speedup else "-"]
        out.append(cells)
    return headers, out


def write_outputs(out_dir: str, stem: str, header: list[str], rows: list[Row]) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    csv_path = os.path.join(out_dir, stem + ".csv")
    write_csv(csv_path, header,
              ["size_bytes", "impl", "algorithm", "mode", "latency_us", "busbw_gbps", "speedup", "iters", "status"],
              [[r.size, r.impl, r.algorithm, r.mode,
                f"{r.latency_us:.3f}" if r.latency_us else "", f"{r.busbw_gbps:.4f}" if r.busbw_gbps else "",
                f"{r.speedup:.4f}" if r.speedup else "", r.iters, r.status] for r in rows])
    paths.append(csv_path)
    md_path = os.path.join(out_dir, stem + ".md")
    with open(md_path, "w") as f:
        f.write("# p2pcomm all-reduce benchmark\n\n" + "\n".join(f"- {line}" for line in header) + "\n\n")
        f.write(md_table(HEADERS, [r.cells() for r in rows], _NUMERIC) + "\n")
    paths.append(md_path)
    png = plot(os.path.join(out_dir, stem + ".png"), header, rows)
    if png:
        paths.append(png)
    return paths


def plot(path: str, header: list[str], rows: list[Row]) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"no plot: matplotlib unavailable ({e})")
        return None
    series: dict[str, list[Row]] = {}
    for r in rows:
        if r.latency_us and r.status == "ok":
            key = f"{r.impl} {r.algorithm}" if r.algorithm != "-" else r.impl
            if r.mode != "eager":
                key += f" ({r.mode})"
            series.setdefault(key, []).append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for key, rs in sorted(series.items()):
        rs.sort(key=lambda r: r.size)
        style = "k-o" if key in ("gloo", "nccl") else ("--" if "staged" in key else "-")
        kw = {"marker": "o", "markersize": 3} if style != "k-o" else {}
        ax1.plot([r.size for r in rs], [r.latency_us for r in rs], style, label=key, **kw)
        ax2.plot([r.size for r in rs], [r.busbw_gbps for r in rs], style, label=key, **kw)
    for ax, ylabel in ((ax1, "latency (µs)"), (ax2, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7, loc="best")
    fig.suptitle("p2pcomm all-reduce — " + "; ".join(header[1:5]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_allreduce(args) -> int:
    from ..communicator import local_cuda_index

    device = torch.device(args.device if args.device != "cuda" else f"cuda:{local_cuda_index()}")
    init_distributed(device)
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    if args.max_bytes is None:
        args.max_bytes = (256 << 20) if device.type == "cuda" else (64 << 20)
    # A gloo group carries the harness's own agreement, and is the CPU baseline.
    default_backend = str(dist.get_backend()).lower()
    ctl = dist.group.WORLD if default_backend == "gloo" else dist.new_group(backend="gloo")
    if device.type == "cuda":
        base_group = dist.group.WORLD if "nccl" in default_backend else dist.new_group(backend="nccl")
    else:
        base_group = ctl
    base_name = "nccl" if device.type == "cuda" else "gloo"
    sizes = sizes_for(args, dtype.itemsize)
    if not sizes:
        say("no sizes to run: check --min-bytes/--max-bytes/--sizes")
        return 2
    header = header_lines(args, device, dtype, world)
    say("\n".join(header) + "\n")
    impls, comm = build_impls(args, device, dtype, max(sizes) // dtype.itemsize, base_group, world)
    timer = Timer(device, ctl, args.reps)
    rows: list[Row] = []
    start = time.perf_counter()
    widths = [7, 24, 18, 10, 10, 11, 6]  # fixed, so rows printed as they come line up
    say(text_table(HEADERS, [], _NUMERIC, widths))
    for size in sizes:
        new = bench_size(args, timer, impls, size, dtype, device, world, rank)
        rows += new
        say("\n".join(text_table(HEADERS, [r.cells() for r in new], _NUMERIC, widths).splitlines()[2:]))
    say(f"\n({time.perf_counter() - start:.1f} s)")
    if rank0() and args.out:
        stem = f"allreduce_{device.type}_{args.dtype or str(dtype).replace('torch.', '')}_w{world}"
        for p in write_outputs(args.out, stem, header, rows):
            print(f"wrote {p}")
        h, s = summary(rows, base_name)
        print(f"\nsummary: best p2pcomm vs {base_name} ({str(dtype).replace('torch.', '')}, {world} ranks, {device.type})")
        print(text_table(h, s, _NUMERIC), flush=True)
    if comm is not None:
        dist.barrier(group=ctl)
        comm.close()
    return 0


# -- command line ----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m p2pcomm.bench",
                                description="All-reduce latency and bus bandwidth of p2pcomm vs torch.distributed. "
                                            "Subcommands: allreduce (default), moe, p2p.")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default float32 on CPU, bfloat16 on GPU")
    p.add_argument("--min-bytes", type=parse_bytes, default=4096)
    p.add_argument("--max-bytes", type=parse_bytes, default=None, help="default 64 MiB on CPU, 256 MiB on GPU")
    p.add_argument("--step", type=int, choices=(2, 4), default=4, help="size multiplier between rows")
    p.add_argument("--sizes", type=lambda s: [parse_bytes(x) for x in s.split(",") if x],
                   help="explicit comma-separated sizes, e.g. 4K,64K,1M,16M (overrides min/max)")
    add_timing_args(p, max_iters=2000)
    p.add_argument("--graph", action="store_true", help="GPU: also time CUDA-graph replays of the captured calls")
    p.add_argument("--algorithms", type=lambda s: [a.strip() for a in s.split(",") if a.strip()], default=None,
                   help="p2pcomm algorithms: auto, oneshot_ll, twoshot_ll, oneshot_ll128, oneshot_lamport, "
                        "twoshot_lamport, oneshot_push, twoshot_push, oneshot, twoshot, ring, recursive_doubling (default: auto and every distinct "
                        "algorithm of the device: on CPU the _ll, _lamport and _push names run one-shot and two-shot, so "
                        "they are left out)")
    p.add_argument("--out", default=None, help="directory for the CSV, markdown and PNG (default: print only)")
    return p


def run(args) -> int:
    """The benchmark for parser()'s args; tears the process group down on the way out."""
    from ..communicator import ALGORITHMS

    if args.algorithms is None:
        args.algorithms = ["auto", "oneshot", "twoshot"] if args.device == "cpu" else [
            "auto", "oneshot_ll", "twoshot_ll", "oneshot_ll128", "oneshot_lamport", "twoshot_lamport", "oneshot_push",
            "twoshot_push", "oneshot", "twoshot"]

    bad = [a for a in args.algorithms if a not in ALGORITHMS]
    if bad:
        parser().error(f"unknown algorithm(s) {', '.join(bad)}: use {', '.join(ALGORITHMS)}")
    if args.rep_ms is None:
        args.rep_ms = 20.0 if args.device == "cuda" else 40.0
    try:
        return bench_allreduce(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
