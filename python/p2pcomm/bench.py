"""Benchmarks p2pcomm against torch.distributed; run under torchrun.

    torchrun --nproc_per_node=2 -m p2pcomm.bench [allreduce] [--device cpu|cuda] [--dtype float32] ...
    torchrun --nproc_per_node=8 -m p2pcomm.bench moe ...     # p2pcomm.bench_moe, when present

Every rank runs it; rank 0 prints a table, then a summary (the last thing
printed), and writes CSV, markdown and a PNG plot into --out.
"""

from __future__ import annotations

import os

# Never let NCCL, torch or NVSHMEM use NVLink multicast on shared machines;
# set before torch.distributed reads them.
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import importlib  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from .communicator import gpus_shared  # noqa: E402

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


# -- small helpers ---------------------------------------------------------------------------------

def parse_bytes(text: str) -> int:
    """'4096', '4K', '64KiB', '1M' -> bytes (binary units)."""
    s = text.strip().upper()
    i = len(s)
    while i and not s[i - 1].isdigit():
        i -= 1
    if s[i:] not in _UNITS or not s[:i]:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4096, 64K, 1M")
    return int(s[:i]) * _UNITS[s[i:]]


def fmt_bytes(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def rank0() -> bool:
    return dist.get_rank() == 0


def say(*a, **k) -> None:
    if rank0():
        print(*a, **k, flush=True)


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


def text_table(headers: list[str], rows: list[list[str]], min_widths: Optional[list[int]] = None) -> str:
    widths = [max([len(h), (min_widths or [0] * len(headers))[i]] + [len(r[i]) for r in rows])
              for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) if i in (0, 3, 4, 5) else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# -- the timing harness ----------------------------------------------------------------------------

class Timer:
    """Times `n` back-to-back calls of a function, the same way on every rank,
    and agrees on iteration counts and results over a CPU (gloo) group."""

    def __init__(self, device: torch.device, ctl_group, reps: int):
        self.device, self.ctl, self.reps = device, ctl_group, reps
        self.cuda = device.type == "cuda"

    def _barrier(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier(group=self.ctl)

    def agree_max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctl)
        return t.tolist()

    def agree_all(self, ok: bool) -> bool:
        t = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctl)
        return bool(t.item())

    def run(self, fn: Callable[[], object], n: int, graph: bool = False,
            after_capture: Optional[Callable[[], object]] = None) -> float:
        """Seconds for n calls (graph: one replay of n captured calls, after
        after_capture(), e.g. p2pcomm's register_graph_buffers)."""
        if graph:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()  # warm up on the side stream, as capture requires
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                for _ in range(n):
                    fn()
            if after_capture is not None:
                after_capture()
            g.replay()
            self._barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        self._barrier()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return time.perf_counter() - t0

    def measure(self, fn: Callable[[], object], refill: Callable[[], None], *, iters: Optional[int],
                warmup: Optional[int], rep_seconds: float, cap: int, graph: bool = False,
                after_capture: Optional[Callable[[], object]] = None) -> tuple[float, int]:
        """Median seconds per call over self.reps repetitions, and the call count
        per repetition. Data is refilled (untimed) before each repetition."""
        refill()
        for _ in range(warmup if warmup is not None else 2):
            fn()
        if iters is None:
            refill()
            probe = self.agree_max([self.run(fn, 2)])[0] / 2
            iters = int(rep_seconds / max(probe, 1e-7))
        n = max(1, min(iters, cap))
        times = []
        for _ in range(self.reps):
            refill()
            times.append(self.run(fn, n, graph, after_capture) / n)
        return statistics.median(self.agree_max(times)), n


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
        from .communicator import Communicator

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
                    rows.append(Row(size, impl.name, impl.algorithm, mode=mode, status=_na(e)))
        except Exception as e:  # noqa: BLE001 - one failing impl should not end the run
            rows.append(Row(size, impl.name, impl.algorithm, status=_na(e)))
            if device.type == "cuda":
                torch.cuda.synchronize()
    base = {r.mode: r.latency_us for r in rows if r.impl in ("gloo", "nccl") and r.latency_us}
    base_eager = base.get("eager")
    for r in rows:
        if r.latency_us and base_eager:
            r.speedup = base_eager / r.latency_us
    return rows


def _na(e: BaseException) -> str:
    msg = str(e).splitlines()[0][:100] if str(e) else ""
    return f"n/a: {type(e).__name__}: {msg}"


def header_lines(args, device, dtype, world) -> list[str]:
    if device.type == "cuda":
        dev_name = torch.cuda.get_device_name(device)
    else:
        dev_name = _cpu_name() + f" ({os.cpu_count()} cores)"
    from . import __version__

    return [
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"host: {socket.gethostname()}",
        f"device: {device.type} — {dev_name}",
        f"world size: {world}",
        f"dtype: {str(dtype).replace('torch.', '')}",
        f"torch: {torch.__version__}, p2pcomm: {__version__}, python: {platform.python_version()}",
        f"command: {' '.join([os.path.basename(sys.executable), '-m', 'p2pcomm.bench'] + sys.argv[1:])}",
    ]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


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
    with open(csv_path, "w", newline="") as f:
        for line in header:
            f.write(f"# {line}\n")
        w = csv.writer(f)
        w.writerow(["size_bytes", "impl", "algorithm", "mode", "latency_us", "busbw_gbps", "speedup", "iters", "status"])
        for r in rows:
            w.writerow([r.size, r.impl, r.algorithm, r.mode,
                        f"{r.latency_us:.3f}" if r.latency_us else "", f"{r.busbw_gbps:.4f}" if r.busbw_gbps else "",
                        f"{r.speedup:.4f}" if r.speedup else "", r.iters, r.status])
    paths.append(csv_path)
    md_path = os.path.join(out_dir, stem + ".md")
    with open(md_path, "w") as f:
        f.write("# p2pcomm all-reduce benchmark\n\n" + "\n".join(f"- {line}" for line in header) + "\n\n")
        f.write(md_table(HEADERS, [r.cells() for r in rows]) + "\n")
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
    from .communicator import local_cuda_index

    device = torch.device(args.device if args.device != "cuda" else f"cuda:{local_cuda_index()}")
    init_distributed(device)
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = _DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
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
    say(text_table(HEADERS, [], widths))
    for size in sizes:
        new = bench_size(args, timer, impls, size, dtype, device, world, rank)
        rows += new
        say("\n".join(text_table(HEADERS, [r.cells() for r in new], widths).splitlines()[2:]))
    say(f"\n({time.perf_counter() - start:.1f} s)")
    if rank0() and args.out:
        stem = f"allreduce_{device.type}_{args.dtype or str(dtype).replace('torch.', '')}_w{world}"
        for p in write_outputs(args.out, stem, header, rows):
            print(f"wrote {p}")
        h, s = summary(rows, base_name)
        print(f"\nsummary: best p2pcomm vs {base_name} ({str(dtype).replace('torch.', '')}, {world} ranks, {device.type})")
        print(text_table(h, s), flush=True)
    if comm is not None:
        dist.barrier(group=ctl)
        comm.close()
    return 0


def init_distributed(device: torch.device) -> None:
    """Initialize torch.distributed from torchrun's environment when the
    caller has not: NCCL for GPU, else (CPU, shared GPUs) gloo."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
        nccl = device.type == "cuda" and not gpus_shared()  # NCCL refuses ranks sharing a GPU
        kw = {"device_id": device} if nccl else {}
        dist.init_process_group(backend="nccl" if nccl else "gloo", **kw)


# -- command line ----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m p2pcomm.bench",
                                description="All-reduce latency and bus bandwidth of p2pcomm vs torch.distributed. "
                                            "Subcommands: allreduce (default), moe, p2p.")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="default float32 on CPU, bfloat16 on GPU")
    p.add_argument("--min-bytes", type=parse_bytes, default=4096)
    p.add_argument("--max-bytes", type=parse_bytes, default=None, help="default 64 MiB on CPU, 256 MiB on GPU")
    p.add_argument("--step", type=int, choices=(2, 4), default=4, help="size multiplier between rows")
    p.add_argument("--sizes", type=lambda s: [parse_bytes(x) for x in s.split(",") if x],
                   help="explicit comma-separated sizes, e.g. 4K,64K,1M,16M (overrides min/max)")
    p.add_argument("--iters", type=int, default=None,
                   help="calls per timed repetition (default: enough for --rep-ms per repetition)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions; the median is reported")
    p.add_argument("--rep-ms", type=float, default=None,
                   help="target duration of one timed repetition (default 40 on CPU, 20 on GPU)")
    p.add_argument("--max-iters", type=int, default=2000, help="cap on calls per repetition")
    p.add_argument("--graph", action="store_true", help="GPU: also time CUDA-graph replays of the captured calls")
    p.add_argument("--algorithms", type=lambda s: [a.strip() for a in s.split(",") if a.strip()], default=None,
                   help="p2pcomm algorithms: auto, oneshot_ll, twoshot_ll, oneshot_push, twoshot_push, oneshot, twoshot, "
                        "ring, recursive_doubling (default: auto and every distinct algorithm of the device: on CPU "
                        "the _ll and _push names run one-shot and two-shot, so they are left out)")
    p.add_argument("--out", default=None, help="directory for the CSV, markdown and PNG (default: print only)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and not argv[0].startswith("-") else "allreduce"
    if command == "moe":
        return run_moe(argv)
    if command == "p2p":
        from . import bench_p2p

        return bench_p2p.bench_p2p(bench_p2p.parser().parse_args(argv))
    if command != "allreduce":
        print(f"unknown subcommand {command!r}: use allreduce, moe or p2p", file=sys.stderr)
        return 2
    args = parser().parse_args(argv)
    from .communicator import ALGORITHMS

    if args.algorithms is None:
        args.algorithms = ["auto", "oneshot", "twoshot"] if args.device == "cpu" else [
            "auto", "oneshot_ll", "twoshot_ll", "oneshot_push", "twoshot_push", "oneshot", "twoshot"]

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


def run_moe(argv: list[str]) -> int:
    """Extension point: `python -m p2pcomm.bench moe ...` runs
    p2pcomm.bench_moe.bench_moe(args), whose module also owns its parser
    (a `parser()` function, when it has one)."""
    try:
        mod = importlib.import_module(".bench_moe", __package__)
    except ImportError as e:
        if getattr(e, "name", "") not in (f"{__package__}.bench_moe", "bench_moe"):
            raise
        if os.environ.get("RANK", "0") == "0":
            print("moe benchmark not available in this build (p2pcomm.bench_moe is missing)")
        return 2
    args = mod.parser().parse_args(argv) if hasattr(mod, "parser") else argparse.Namespace(argv=argv)
    return mod.bench_moe(args) or 0


if __name__ == "__main__":
    sys.exit(main())
