"""MoE dispatch/combine benchmark: p2pcomm.ExpertParallel against an
all-to-all baseline over torch.distributed (NCCL on GPU, gloo on CPU).

    torchrun --nproc_per_node=4 -m p2pcomm.bench moe                       # GPU: E=256 H=7168 K=8, 4096 and 128 tokens
    torchrun --nproc_per_node=2 -m p2pcomm.bench moe --device cpu          # small CPU run

Every rank runs it; rank 0 prints two tables and writes CSV and markdown
into --out. Times are medians over --reps of CUDA-event (GPU) or wall (CPU)
times, the slowest rank's; dispatch and combine are timed separately.
GB/s counts only token bytes that cross between ranks: p2pcomm sends a token
row once per destination rank and gets back one partial per (token, rank)
in the combine transit type (column "partials": float32, or the model dtype
with --combine-dtype; both by default); the baseline sends a row per
(token, expert) pair and gets a row of dtype back per pair (the usual
all-to-all dispatcher: count exchange, all_to_all_single of the permuted
rows, local permute into expert-major order, and the reverse for combine).
On GPUs of one node, rows "p2pcomm fp8" dispatch the same tokens quantized to
float8 with a float32 scale per 128 columns (dispatch_dtype=torch.float8_e4m3fn;
GB/s counts those bytes), and combine their dequantized rows (--no-fp8: skip).

The first table times each call after a host barrier and then a stream
barrier (not timed), so that the ranks' streams start the call together
(graph replays after a sleep kernel and then the barrier: see
_LAUNCH_SLACK_CYCLES); with the host barrier alone, a dispatch would also
absorb the ranks' launch skew, which varies from run to run. Mode "graph+buf b2b" replays the graphs back to back after one
alignment, as a captured model runs its layers. With --compile, modes
"compiled" (eager calls inside torch.compile) and "compiled graph"
(capturable calls under mode="reduce-overhead") time the custom-op path. The phase table (--breakdown;
its rows say n/a while golib/moe marks no phases) reruns eager calls, capturable calls
launched from Python and (GPU) CUDA-graph replays, with the ranks' streams
first aligned by a stream barrier (on GPU a barrier kernel), and times each
phase between CUDA events (wall clock on CPU; event-record nodes inside the
graphs) that ExpertParallel records as each phase ends: dispatch: agree
(posting the argument checks and the start barrier; on CPU also the host
sync that reads them), send kernel, mid barrier, size (eager kernels: the
host reads every rank's check and the received counts), expand kernel;
combine: agree, send kernel, mid barrier, reduce kernel, check (eager
kernels: the host reads every rank's check) (on CPU the torch-op steps of
the same names). Each
phase is the slowest rank's median, so phases need not add up to the total.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..communicator import gpus_shared, local_cuda_index
from .harness import DTYPES, Clock, agree_all, header_lines, init_distributed, md_table, mean_over_ranks, na, say, \
    slowest_median, slowest_medians, sync_all, text_table, write_csv
from .moe_phases import PHASE_COLUMNS, PHASE_HEADERS, PHASE_NUMERIC, PhaseRow, aligned_start, num_cell, one_round, \
    phase_times


@dataclasses.dataclass
class MoeRow:
    tokens: int
    impl: str
    mode: str
    partials: str = "-"
    dispatch_us: Optional[float] = None
    dispatch_gbps: Optional[float] = None
    combine_us: Optional[float] = None
    combine_gbps: Optional[float] = None
    status: str = "ok"

    def cells(self) -> list[str]:
        return [str(self.tokens), self.impl, self.mode, self.partials, num_cell(self.dispatch_us, 1),
                num_cell(self.dispatch_gbps, 1), num_cell(self.combine_us, 1), num_cell(self.combine_gbps, 1),
                self.status]


HEADERS = ["tokens/rank", "impl", "mode", "partials", "dispatch us", "dispatch GB/s", "combine us", "combine GB/s",
           "status"]
_NUMERIC = (0, 4, 5, 6, 7)


def routing(T: int, E: int, K: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]  # K distinct experts per token
    w = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    return idx.to(device), w.to(device), g.initial_seed()


def time_pair(dispatch: Callable, combine: Callable, reps: int, warmup: int, device, ctl,
              align: Callable) -> tuple[float, float]:
    """Median seconds (slowest rank) of dispatch() and of combine(recv),
    each rep after a host barrier and align() (a stream barrier: not
    timed, it lines the ranks' streams up)."""
    clock = Clock(device)
    for _ in range(warmup):
        combine(dispatch())
    td, tc = [], []
    for _ in range(reps):
        sync_all(device, ctl)
        align()
        a = clock.mark()
        recv = dispatch()
        b = clock.mark()
        combine(recv)
        c = clock.mark()
        td.append(clock.seconds(a, b))
        tc.append(clock.seconds(b, c))
    return slowest_median(td, ctl), slowest_median(tc, ctl)


def time_back_to_back(dispatch: Callable, combine: Callable, reps: int, device, ctl,
                      align: Callable) -> tuple[float, float]:
    """Median seconds (slowest rank) of dispatch() and of combine(recv) when
    reps pairs run back to back, as a captured model's layers do: one
    alignment, then every call launched without waiting for the GPU, with
    events between the calls. A rank's host skew is paid once, not per call."""
    clock = Clock(device)
    combine(dispatch())  # warm up
    sync_all(device, ctl)
    align()
    marks = [clock.mark()]
    for _ in range(reps):
        recv = dispatch()
        marks.append(clock.mark())
        combine(recv)
        marks.append(clock.mark())
    td = [clock.seconds(marks[2 * i], marks[2 * i + 1]) for i in range(reps)]
    tc = [clock.seconds(marks[2 * i + 1], marks[2 * i + 2]) for i in range(reps)]
    return slowest_median(td, ctl), slowest_median(tc, ctl)


def time_graphs(dispatch: Callable, combine: Callable, reps: int, device, ctl,
                align: Callable, back_to_back: bool = False) -> tuple[float, float]:
    """The same, with dispatch and combine each captured in its own CUDA
    graph; back_to_back: replays launched in a row (time_back_to_back)."""
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
    if back_to_back:
        return time_back_to_back(lambda: gd.replay(), lambda _: gc.replay(), reps, device, ctl, align)
    return time_pair(lambda: gd.replay(), lambda _: gc.replay(), reps, 2, device, ctl, align)


def compiled_calls(ep, x, idx, w, capturable: bool) -> tuple[Callable, Callable]:
    """dispatch() and combine(recv) through torch.compile(fullgraph=True):
    eager calls as they are; capturable ones under mode="reduce-overhead",
    which replays each as a CUDA graph (the inputs marked static, so the
    graphs read them in place)."""
    torch.compiler.reset()  # each ep compiles anew: earlier eps' graphs would count to the recompile limit
    mode = "reduce-overhead" if capturable and x.is_cuda else None
    if mode:
        for t in (x, idx, w):
            torch._dynamo.mark_static_address(t)
    cd = torch.compile(lambda a, i, v: ep.dispatch(a, i, v, capturable=capturable), fullgraph=True, mode=mode)
    cc = torch.compile(lambda out, r: ep.combine(out, r), fullgraph=True, mode=mode)

    def dispatch():
        if mode:
            torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs are done with
        return cd(x, idx, w)

    return dispatch, lambda r: cc(r.x, r)


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


def combine_dtypes(choice: str, dtype: torch.dtype) -> Optional[list]:
    """The combine transit types to run for --combine-dtype (None: not
    allowed with this --dtype)."""
    if choice == "both":
        return [torch.float32] + ([dtype] if dtype != torch.float32 else [])
    if choice == "dtype":
        return [dtype]
    named = DTYPES[choice]
    return [named] if named in (torch.float32, dtype) else None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def run(args) -> int:
    """The benchmark for parser()'s args; tears the process group down on the
    way out, as the all-reduce benchmark does."""
    try:
        return _bench_moe(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _bench_moe(args) -> int:
    device = torch.device(args.device if args.device != "cuda" else f"cuda:{local_cuda_index()}")
    init_distributed(device)
    from ..communicator import Communicator

    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[args.dtype]
    transits = combine_dtypes(args.combine_dtype, dtype)
    if transits is None:
        say(f"--combine-dtype {args.combine_dtype}: use float32, {args.dtype} (= dtype) or both")
        return 2
    cuda = device.type == "cuda"
    hidden = args.hidden or (7168 if cuda else 256)
    tokens = args.tokens or ([4096, 128] if cuda else [64])
    E, K = args.experts, args.topk
    if E % world:
        say(f"--experts {E} is not divisible by the world size {world}")
        return 2
    default_backend = str(dist.get_backend()).lower()
    ctl = dist.group.WORLD if default_backend == "gloo" else dist.new_group(backend="gloo")
    if not cuda:
        base_group = ctl
    elif gpus_shared():
        base_group = None
    else:
        base_group = dist.group.WORLD if "nccl" in default_backend else dist.new_group(backend="nccl")
    base_name = "nccl a2a" if cuda else "gloo a2a"
    comm = Communicator(group=dist.group.WORLD, device=device)
    nodes = len(comm.nodes)
    if not cuda:
        path = "golib/moe's CPU path; num_sms is not bounded"
    elif nodes > 1:
        path = (f"{nodes} nodes: rows cross them through pinned host memory (golib/moe's host path over UCX); "
                "num_sms is not used")
    else:
        path = f"fused kernels (native/kernels/moe_*.cu) on {args.num_sms} SMs"
    header = header_lines(args, device, dtype, world) + [
        f"experts: {E} ({E // world} per rank), hidden: {hidden}, topk: {K}, random routing (distinct experts)",
        f"note: {path}; capturable mode moves worst-case buffers",
        "combine partials travel in: " + ", ".join(_name(t) for t in transits) + " (column partials)",
    ]
    say("\n".join(header) + "\n")
    baseline = AllToAllBaseline(base_group, E, world, rank, device)
    rows: list[MoeRow] = []
    phase_rows: list[PhaseRow] = []
    widths = [11, 8, 10, 8, 11, 13, 10, 12, 6]
    say(text_table(HEADERS, [], _NUMERIC, widths))
    for T in tokens:
        g = torch.Generator().manual_seed(1000 * rank + T)
        x = (torch.randn(T, hidden, generator=g) * 0.5).to(dtype).to(device)
        idx, w, _ = routing(T, E, K, 7 * rank + T, device)
        # Off-rank rows per rank, for GB/s: p2pcomm rows per (token, other destination rank).
        dest = torch.div(idx, E // world, rounding_mode="floor")
        hit = torch.zeros(T, world, dtype=torch.bool, device=device).scatter_(1, dest, True)
        hit[:, rank] = False
        p2p_rows = mean_over_ranks(float(hit.sum()), ctl)
        pair_rows = mean_over_ranks(float((dest != rank).sum()), ctl)
        base_bytes = pair_rows * hidden * dtype.itemsize
        new = []
        ref = None
        try:
            if base_group is None:
                raise RuntimeError("ranks share GPUs, which NCCL refuses")
            st = baseline.dispatch(x, idx, w)
            ref = baseline.combine(st["x"], st)
            td, tc = time_pair(lambda: baseline.dispatch(x, idx, w), lambda s: baseline.combine(s["x"], s),
                               args.reps, args.warmup, device, ctl, aligned_start(comm, False))
            new.append(MoeRow(T, base_name, "eager", args.dtype, td * 1e6, base_bytes / td / 1e9, tc * 1e6,
                              base_bytes / tc / 1e9))
        except Exception as e:  # noqa: BLE001 - reported as a row
            new.append(MoeRow(T, base_name, "eager", args.dtype, status=na(e)))
            if cuda:
                torch.cuda.synchronize()
        run = P2PRun(comm, args, T, hidden, dtype, (x, idx, w), ref, p2p_rows, device, ctl)
        for transit in transits:
            got, phases = run.bench(transit)
            new += got
            phase_rows += phases
        if cuda and nodes == 1 and not args.no_fp8:
            new += run.bench_fp8(transits[0])
        rows += new
        say("\n".join(text_table(HEADERS, [r.cells() for r in new], _NUMERIC, widths).splitlines()[2:]))
    if phase_rows:
        say("\nper phase, us (ranks aligned by a stream barrier first; each phase the slowest rank's median):")
        say(text_table(PHASE_HEADERS, [r.cells() for r in phase_rows], PHASE_NUMERIC))
    if rank == 0 and args.out:
        for p in write_outputs(args.out, f"moe_{device.type}_{args.dtype}_w{world}", header, rows, phase_rows):
            print(f"wrote {p}")
    dist.barrier(group=ctl)
    comm.close()
    return 0


@dataclasses.dataclass
class P2PRun:
    """p2pcomm's rows for one token count: one ExpertParallel per combine
    transit serves every mode (capturable is a per-call choice)."""

    comm: object
    args: argparse.Namespace
    tokens: int
    hidden: int
    dtype: torch.dtype
    data: tuple  # x, topk_idx, topk_weights
    ref: Optional[torch.Tensor]  # the baseline's combine, to check against
    p2p_rows: float  # off-rank rows per rank, for GB/s
    device: torch.device
    ctl: object

    def modes(self) -> list[str]:
        """Modes of the first table; "+buf": x built in ep.get_dispatch_buffer() (no staging copy);
        "b2b": replays back to back (time_back_to_back), not aligned one by one."""
        cuda, graphs = self.device.type == "cuda", not self.args.no_graph
        return ["eager"] + (["graph", "graph+buf", "graph+buf b2b"] if cuda and graphs else []) + \
            (["capturable"] if not cuda and graphs else []) + \
            (["compiled"] + (["compiled graph"] if cuda and graphs else []) if self.args.compile else [])

    def data_for(self, ep, mode: str) -> tuple:
        x, idx, w = self.data
        if "+buf" in mode:
            buf = ep.get_dispatch_buffer(x.shape[0])
            buf.copy_(x)
            x = buf
        return x, idx, w

    def bench(self, transit: torch.dtype) -> tuple[list[MoeRow], list[PhaseRow]]:
        from ..moe import ExpertParallel

        a, T, label = self.args, self.tokens, _name(transit)
        try:
            ep = ExpertParallel(self.comm, num_experts=a.experts, hidden=self.hidden, max_tokens_per_rank=T,
                                topk=a.topk, dtype=self.dtype, num_sms=a.num_sms, combine_dtype=transit)
        except Exception as e:  # noqa: BLE001 - reported as rows
            return [MoeRow(T, "p2pcomm", m, label, status=na(e)) for m in self.modes()], []
        rows = [self.time_mode(ep, mode, transit) for mode in self.modes()]
        phases = [self.time_phases(ep, mode, label) for mode in self.phase_modes()] if a.breakdown else []
        del ep
        return rows, phases

    def bench_fp8(self, transit: torch.dtype) -> list[MoeRow]:
        """Rows of fp8 dispatch (dispatch_dtype=torch.float8_e4m3fn): x quantized once, a float32 scale per
        128 columns; combine takes the received rows dequantized (once, outside the timing), in the model
        dtype. Checked against the baseline's combine within fp8's rounding."""
        from ..moe import ExpertParallel

        a, T, H, label = self.args, self.tokens, self.hidden, _name(transit)
        modes = ["eager"] + (["graph", "graph+buf", "graph+buf b2b"] if not a.no_graph else [])
        try:
            ep = ExpertParallel(self.comm, num_experts=a.experts, hidden=H, max_tokens_per_rank=T, topk=a.topk,
                                dtype=self.dtype, num_sms=a.num_sms, combine_dtype=transit,
                                dispatch_dtype=torch.float8_e4m3fn)
        except Exception as e:  # noqa: BLE001 - reported as rows
            return [MoeRow(T, "p2pcomm fp8", m, label, status=na(e)) for m in modes]
        x, idx, w = self.data
        blocks = x.float().view(T, H // 128, 128)
        scales = (blocks.abs().amax(dim=2) / 448.0).clamp(min=1e-8)
        x8 = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(T, H)
        rows = []
        for mode in modes:
            try:
                capturable = mode != "eager"
                xin, sin = x8, scales
                if "+buf" in mode:  # quantized into the staging buffer: no copy
                    xin, sin = ep.get_dispatch_buffer(T)
                    xin.copy_(x8)
                    sin.copy_(scales)
                recv = ep.dispatch(xin, idx, w, scales=sin, capturable=capturable)
                expert_out = (recv.x.float() * recv.scales.repeat_interleave(128, dim=1)).to(self.dtype)
                y = ep.combine(expert_out, recv)
                ok = agree_all(self.ref is None or _near(y, self.ref), self.ctl)
                dispatch = lambda: ep.dispatch(xin, idx, w, scales=sin, capturable=capturable)  # noqa: E731
                combine = lambda r: ep.combine(expert_out, r)  # noqa: E731
                if capturable:
                    td, tc = time_graphs(dispatch, combine, a.reps, self.device, self.ctl,
                                         aligned_start(self.comm, True), back_to_back=mode.endswith("b2b"))
                else:
                    td, tc = time_pair(dispatch, combine, a.reps, a.warmup, self.device, self.ctl,
                                       aligned_start(self.comm, False))
                sent = self.p2p_rows * H
                rows.append(MoeRow(T, "p2pcomm fp8", mode, label, td * 1e6, sent * (1 + 4 / 128) / td / 1e9,
                                   tc * 1e6, sent * transit.itemsize / tc / 1e9, "ok" if ok else "WRONG"))
            except Exception as e:  # noqa: BLE001
                self._settle()
                rows.append(MoeRow(T, "p2pcomm fp8", mode, label, status=na(e)))
        del ep
        return rows

    def phase_modes(self) -> list[str]:
        cuda, graphs = self.device.type == "cuda", not self.args.no_graph
        return ["eager", "capturable"] + (["graph", "graph+buf"] if cuda and graphs else [])

    def time_phases(self, ep, mode: str, label: str) -> PhaseRow:
        """One phase-table row; the ranks agree that every one measured
        before they compare numbers, so a failure on one rank cannot leave
        the others waiting in a collective."""
        a, failure = self.args, None
        try:
            times = phase_times(ep, *self.data_for(ep, mode), mode.split("+")[0], a.reps, a.warmup, self.device,
                                self.ctl)
        except Exception as e:  # noqa: BLE001 - reported as a row
            times, failure = {}, e
            self._settle()
        if not agree_all(failure is None, self.ctl):
            return PhaseRow(self.tokens, mode, label, {}, status=na(failure) if failure else "n/a: failed elsewhere")
        medians = slowest_medians(times, PHASE_COLUMNS, self.ctl)
        return PhaseRow(self.tokens, mode, label, {n: (v * 1e6 if v is not None else None) for n, v in medians.items()})

    def time_mode(self, ep, mode: str, transit: torch.dtype) -> MoeRow:
        a, label = self.args, _name(transit)
        capturable = mode not in ("eager", "compiled")
        try:
            x, idx, w = self.data_for(ep, mode)
            if mode.startswith("compiled"):
                dispatch, combine = compiled_calls(ep, x, idx, w, capturable)
                y = combine(dispatch())
            else:
                y = one_round(ep, x, idx, w, capturable)
                dispatch = lambda: ep.dispatch(x, idx, w, capturable=capturable)  # noqa: E731
                combine = lambda r: ep.combine(r.x, r)  # noqa: E731
            ok = agree_all(self.ref is None or _close(y, self.ref, self.dtype, transit), self.ctl)
            if mode.startswith("graph"):
                td, tc = time_graphs(dispatch, combine, a.reps, self.device, self.ctl, aligned_start(self.comm, True),
                                     back_to_back=mode.endswith("b2b"))
            else:  # compiled graph: replays, whose launch the sleep covers as for graph
                td, tc = time_pair(dispatch, combine, a.reps, a.warmup, self.device, self.ctl,
                                   aligned_start(self.comm, mode == "compiled graph"))
            sent = self.p2p_rows * self.hidden
            return MoeRow(self.tokens, "p2pcomm", mode, label, td * 1e6, sent * self.dtype.itemsize / td / 1e9,
                          tc * 1e6, sent * transit.itemsize / tc / 1e9, "ok" if ok else "WRONG")
        except Exception as e:  # noqa: BLE001
            self._settle()
            return MoeRow(self.tokens, "p2pcomm", mode, label, status=na(e))

    def _settle(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def _near(y, ref) -> bool:
    """fp8 rows carry 3 mantissa bits: the combine of their dequantized values stays within a few percent
    of the exact rows' (norm-wise)."""
    return bool(torch.linalg.vector_norm((y.float() - ref.float())) <= 0.08 * torch.linalg.vector_norm(ref.float()))


def _close(y, ref, dtype, transit) -> bool:
    # Both sum K weighted rows in float32 (different orders) and round once to dtype; partials
    # rounded to dtype in transit add up to eps/2 of their sum (same signs here: no cancellation).
    eps = torch.finfo(dtype).eps
    rtol = (2 if transit == torch.float32 else 3) * eps
    return bool(torch.allclose(y.double(), ref.double(), rtol=rtol, atol=2 * eps))


def write_outputs(out_dir: str, stem: str, header: list[str], rows: list[MoeRow],
                  phase_rows: list[PhaseRow]) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, stem + ".csv")]
    write_csv(paths[0], header, ["tokens_per_rank", "impl", "mode", "partials", "dispatch_us", "dispatch_gbps",
                                  "combine_us", "combine_gbps", "status"],
               [[r.tokens, r.impl, r.mode, r.partials] + [_csv_num(v) for v in (r.dispatch_us, r.dispatch_gbps,
                                                                                r.combine_us, r.combine_gbps)]
                + [r.status] for r in rows])
    if phase_rows:
        paths.append(os.path.join(out_dir, stem + "_phases.csv"))
        write_csv(paths[-1], header, ["tokens_per_rank", "mode", "partials"]
                   + [c.replace(" ", "_") + "_us" for c in PHASE_COLUMNS] + ["status"],
                   [[r.tokens, r.mode, r.partials] + [_csv_num(r.us.get(c)) for c in PHASE_COLUMNS] + [r.status]
                    for r in phase_rows])
    md_path = os.path.join(out_dir, stem + ".md")
    with open(md_path, "w") as f:
        f.write("# p2pcomm MoE dispatch/combine benchmark\n\n" + "\n".join(f"- {line}" for line in header) + "\n\n")
        f.write(md_table(HEADERS, [r.cells() for r in rows], _NUMERIC) + "\n")
        if phase_rows:
            f.write("\n## Per phase, µs\n\nRanks aligned by a stream barrier first; each phase is the slowest rank's "
                    "median (d. dispatch, c. combine).\n\n")
            f.write(md_table(PHASE_HEADERS, [r.cells() for r in phase_rows], PHASE_NUMERIC) + "\n")
    return paths + [md_path]


def _csv_num(v: Optional[float]) -> str:
    return "" if v is None else f"{v:.3f}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m p2pcomm.bench moe",
                                description="MoE dispatch/combine of p2pcomm.ExpertParallel vs all_to_all_single.")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--combine-dtype", choices=("both", "dtype") + tuple(sorted(DTYPES)), default="both",
                   help="combine transit: float32, the --dtype itself ('dtype' or its name), or both (default)")
    p.add_argument("--experts", type=int, default=256, help="num_experts E (divisible by the world size)")
    p.add_argument("--hidden", type=int, default=None, help="default 7168 on GPU, 256 on CPU")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",") if v], default=None,
                   help="comma-separated tokens per rank (default 4096,128 on GPU, 64 on CPU)")
    p.add_argument("--num-sms", type=int, default=24, help="ExpertParallel num_sms (GPU kernels' blocks)")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions; the median is reported")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-fp8", action="store_true",
                   help="GPU: skip the fp8 dispatch rows (dispatch_dtype=torch.float8_e4m3fn: float8 rows and a "
                        "float32 scale per 128 columns)")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph (capturable) rows")
    p.add_argument("--compile", action="store_true",
                   help="also time dispatch and combine under torch.compile: eager calls (mode compiled) and, on "
                        "GPU, capturable calls under mode='reduce-overhead' (compiled graph)")
    p.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=False,
                   help="also time each phase of dispatch and combine (off: the phases run inside golib/moe, "
                        "which marks none yet, so its rows say n/a)")
    p.add_argument("--out", default=None, help="directory for the CSV and markdown (default: print only)")
    return p

