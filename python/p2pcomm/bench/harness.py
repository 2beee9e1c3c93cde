"""What every benchmark of p2pcomm.bench shares: sizes, tables, the run's
header, torch.distributed setup, and timing the same way on every rank with
the slowest rank's figure reported."""

from __future__ import annotations

import os

# Never let NCCL, torch or NVSHMEM use NVLink multicast on shared machines;
# set before torch.distributed reads them.
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable, Iterable, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ..communicator import gpus_shared  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


# -- sizes and messages ----------------------------------------------------------------------------

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


def na(e: BaseException) -> str:
    """The status cell of a row that could not run."""
    msg = str(e).splitlines()[0][:100] if str(e) else ""
    return f"n/a: {type(e).__name__}: {msg}"


# -- tables ----------------------------------------------------------------------------------------

def text_table(headers: list[str], rows: list[list[str]], numeric: Iterable[int] = (),
               min_widths: Optional[list[int]] = None) -> str:
    """Aligned columns, the numeric ones right-justified; min_widths keeps
    tables printed piecewise aligned."""
    numeric = set(numeric)
    min_widths = min_widths or [0] * len(headers)
    widths = [max([len(h), m] + [len(r[i]) for r in rows]) for i, (h, m) in enumerate(zip(headers, min_widths))]
    line = lambda cells: "  ".join(c.rjust(w) if i in numeric else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def md_table(headers: list[str], rows: list[list], numeric: Iterable[int] = ()) -> str:
    """A markdown table, columns padded, the numeric ones right-aligned."""
    numeric = set(numeric)
    cells = [list(headers)] + [[str(c) for c in r] for r in rows]
    widths = [max(3, *(len(r[i]) for r in cells)) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.rjust(w) if i in numeric else c.ljust(w)  # noqa: E731
                                       for i, (c, w) in enumerate(zip(r, widths))) + " |"
    rule = "|" + "|".join("-" * (w + 1) + ":" if i in numeric else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def write_csv(path: str, header: list[str], columns: list[str], rows: list[list]) -> None:
    """A CSV whose first lines are the run's header as # comments."""
    with open(path, "w", newline="") as f:
        for line in header:
            f.write(f"# {line}\n")
        wr = csv.writer(f)
        wr.writerow(columns)
        wr.writerows(rows)


def header_lines(args, device, dtype, world) -> list[str]:
    """What the run was: date, host, device, world, versions, command."""
    if device.type == "cuda":
        dev_name = torch.cuda.get_device_name(device)
    else:
        dev_name = _cpu_name() + f" ({os.cpu_count()} cores)"
    from .. import __version__

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


# -- torch.distributed -----------------------------------------------------------------------------

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


def sync_all(device, ctl) -> None:
    """Every rank's GPU idle, then a host barrier on ctl."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group=ctl)


def agree_all(ok: bool, ctl) -> bool:
    """Whether ok holds on every rank."""
    t = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctl)
    return bool(t.item())


def slowest_median(times: list[float], ctl) -> float:
    """The largest of the ranks' medians."""
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctl)
    return t.item()


def slowest_medians(times: dict, names: list[str], ctl) -> dict:
    """{name: slowest rank's median seconds, None where no rank has it}."""
    t = torch.tensor([statistics.median(times[n]) if times.get(n) else -1.0 for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctl)
    return {n: (v if v >= 0 else None) for n, v in zip(names, t.tolist())}


def mean_over_ranks(v: float, ctl) -> float:
    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t, group=ctl)
    return t.item() / dist.get_world_size()


# -- timing ----------------------------------------------------------------------------------------

def per_call_us(fn: Callable[[], object], calls: int, reps: int = 5, warmup: int = 20, finished: bool = True) -> float:
    """This rank's median over reps of the microseconds per call of fn called back to back, every rank starting
    together (GPU idle, then a barrier): the rate calls finish at, or with finished=False the rate the host
    issues them (the clock stops before waiting for the GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if finished:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


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


class Timer:
    """Times `n` back-to-back calls of a function, the same way on every rank,
    and agrees on iteration counts and results over a CPU (gloo) group."""

    def __init__(self, device: torch.device, ctl_group, reps: int):
        self.device, self.ctl, self.reps = device, ctl_group, reps
        self.cuda = device.type == "cuda"

    def _barrier(self) -> None:
        sync_all(self.device, self.ctl)

    def agree_max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctl)
        return t.tolist()

    def agree_all(self, ok: bool) -> bool:
        return agree_all(ok, self.ctl)

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


def add_timing_args(p, max_iters: int) -> None:
    """The options of a benchmark timed by Timer.measure."""
    p.add_argument("--iters", type=int, default=None,
                   help="calls per timed repetition (default: enough for --rep-ms per repetition)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions; the median is reported")
    p.add_argument("--rep-ms", type=float, default=None,
                   help="target duration of one timed repetition (default 40 on CPU, 20 on GPU)")
    p.add_argument("--max-iters", type=int, default=max_iters, help="cap on calls per repetition")
