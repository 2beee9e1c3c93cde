"""The MoE benchmark's timing pieces that its phase table needs: aligned
starts of the ranks' streams, one dispatch + combine round, and the time of
each phase ExpertParallel marks (see p2pcomm.bench.moe)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from .harness import Clock, agree_all, sync_all


# Phases as ExpertParallel._phase names them, in call order ("stage" only on the kernel path, "size" and
# "check" only on its eager calls).
DISPATCH_PHASES = ("agree", "stage", "send", "mid barrier", "size", "expand")
COMBINE_PHASES = ("agree", "send", "mid barrier", "reduce", "check")
PHASE_COLUMNS = [f"dispatch {p}" for p in DISPATCH_PHASES + ("total",)] + \
    [f"combine {p}" for p in COMBINE_PHASES + ("total",)]
PHASE_HEADERS = ["tokens/rank", "mode", "partials"] + \
    [c.replace("dispatch ", "d.").replace("combine ", "c.").replace("mid barrier", "mid") for c in PHASE_COLUMNS] + \
    ["status"]
PHASE_NUMERIC = (0,) + tuple(range(3, 3 + len(PHASE_COLUMNS)))


@dataclasses.dataclass
class PhaseRow:
    tokens: int
    mode: str
    partials: str
    us: dict  # PHASE_COLUMNS name -> microseconds, or None where the path has no such phase
    status: str = "ok"

    def cells(self) -> list[str]:
        return [str(self.tokens), self.mode, self.partials] + \
            [num_cell(self.us.get(c), 1) for c in PHASE_COLUMNS] + [self.status]


def num_cell(v: Optional[float], places: int) -> str:
    return "-" if v is None else f"{v:.{places}f}"


# Graph replays start after a sleep kernel of this many clock cycles (tens
# of microseconds) and then a stream barrier: the sleep gives this rank's
# host time to launch the barrier and the replay behind it, and the barrier,
# which ends on every GPU within a flag's flight of the last arrival, lines
# the GPUs up whatever their clocks. The sleep comes first because its
# length follows each GPU's clock: after the barrier it would skew the GPUs
# again, and the dispatch's in-kernel start barrier would add the slowest
# GPU's lag to every other rank's time. Without any sleep the replays would
# measure the host's launch skew. Eager calls get no sleep: their host time
# is part of their cost.
_LAUNCH_SLACK_CYCLES = 150_000


def aligned_start(comm, graphs: bool) -> Callable:
    """What time_pair runs before each timed rep: for graph replays the sleep
    above, then a stream barrier (none across nodes, where calls start on
    the host: the host barrier before it lines them up)."""
    def align() -> None:
        if graphs and torch.cuda.is_available():
            torch.cuda._sleep(_LAUNCH_SLACK_CYCLES)
        stream_barrier(comm)
    return align


def stream_barrier(comm) -> None:
    """comm.stream_barrier() on a communicator of one node; nothing across nodes."""
    if len(comm.nodes) == 1:
        comm.stream_barrier()


def one_round(ep, x, idx, w, capturable: bool):
    recv = ep.dispatch(x, idx, w, capturable=capturable)
    return ep.combine(recv.x, recv)


def phase_times(ep, x, idx, w, mode: str, reps: int, warmup: int, device, ctl) -> dict:
    """Per-rep seconds of each phase, {PHASE_COLUMNS name: [s, ...]}, of
    dispatch then combine in `mode` (eager, capturable, or graph: both
    captured with the phase marks inside), the ranks' streams aligned by a
    stream barrier before each rep (not timed)."""
    if mode == "graph":
        return _graph_phase_times(ep, x, idx, w, reps, device, ctl)
    clock = Clock(device)
    capturable = mode == "capturable"
    for _ in range(warmup):
        one_round(ep, x, idx, w, capturable)
    times: dict = {}
    for _ in range(reps):
        sync_all(device, ctl)
        stream_barrier(ep.comm)  # every rank's stream starts within one barrier's skew of the others
        start = clock.mark()
        dispatch_marks, combine_marks = [], []
        try:
            ep._on_phase = lambda name: dispatch_marks.append((name, clock.mark()))
            recv = ep.dispatch(x, idx, w, capturable=capturable)
            ep._on_phase = lambda name: combine_marks.append((name, clock.mark()))
            ep.combine(recv.x, recv)
        finally:
            ep._on_phase = None
        _add_phases(times, "dispatch", start, dispatch_marks, clock)
        _add_phases(times, "combine", dispatch_marks[-1][1], combine_marks, clock)
    return times


def _graph_phase_times(ep, x, idx, w, reps: int, device, ctl) -> dict:
    """phase_times for CUDA graphs: the phase marks are event-record nodes
    (torch.cuda.Event(external=True)) captured with dispatch and combine,
    so each replay re-records them. No replay runs unless every rank
    captured."""
    clock = Clock(device)

    def recorder(marks: list):
        def mark(name: str) -> None:
            e = torch.cuda.Event(enable_timing=True, external=True)
            e.record()
            marks.append((name, e))
        return mark

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        one_round(ep, x, idx, w, True)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    sync_all(device, ctl)
    gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    dispatch_marks, combine_marks, captured = [], [], None
    try:
        ep._on_phase = recorder(dispatch_marks)
        with torch.cuda.graph(gd):
            recv = ep.dispatch(x, idx, w, capturable=True)
        ep._on_phase = recorder(combine_marks)
        with torch.cuda.graph(gc, pool=gd.pool()):
            ep.combine(recv.x, recv)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        captured = e
    finally:
        ep._on_phase = None
    if not agree_all(captured is None, ctl):
        raise RuntimeError(f"graph capture with phase events failed on some rank: {captured!r}")
    sync_all(device, ctl)
    times: dict = {}
    align = aligned_start(ep.comm, True)
    for _ in range(reps):
        sync_all(device, ctl)
        align()
        start = clock.mark()
        gd.replay()
        gc.replay()
        _add_phases(times, "dispatch", start, dispatch_marks, clock)
        _add_phases(times, "combine", dispatch_marks[-1][1], combine_marks, clock)
    return times


def _add_phases(times: dict, call: str, begin, marks: list, clock: Clock) -> None:
    """Append each phase's seconds (from the previous mark, the first from
    begin) and the call's total to times["<call> <phase>"]."""
    if not marks:
        raise RuntimeError(f"no phase marks: ExpertParallel's {call} marked no phases")
    before = begin
    for name, mark in marks:
        times.setdefault(f"{call} {name}", []).append(clock.seconds(before, mark))
        before = mark
    times.setdefault(f"{call} total", []).append(clock.seconds(begin, marks[-1][1]))
