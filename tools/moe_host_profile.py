"""Where an eager MoE call spends host time (a diagnostic, GPU only).

    torchrun --nproc_per_node=4 tools/moe_host_profile.py [--costs] [tokens...]

Runs eager dispatch + combine back to back (bf16, E=256, H=7168, K=8, bf16
partials, no host barrier between calls, as a model would) and prints, on
rank 0, the host wall time between ExpertParallel's phase marks (medians),
the wall time per call, then cProfile's top functions for one more loop.
``--costs`` first prints what the pieces an eager call is made of cost the
host (median us on rank 0): a ctypes call into Go, a kernel launch through
Go, a stream barrier, events, allocations, a host sync on an idle GPU.
"""
import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

import p2pcomm
from p2pcomm.bench.harness import init_distributed
from p2pcomm.communicator import local_cuda_index
from p2pcomm.bench.moe import routing

E, H, K, ITERS = 256, 7168, 8, 60


def host_costs(comm, ep, dev, rank, n=300) -> None:
    """Median host time of each building block of an eager call."""
    from p2pcomm import moe

    post = moe._PostParams(peer_status=ep._ptr_status[0], topk_idx=0, num_ids=0, num_experts=ep.num_experts,
                           idx_bytes=4, code=0, id_code=1, rank=rank, world=comm.world_size)
    small = torch.zeros(4, dtype=torch.int32, device=dev)
    pinned = torch.empty(4, dtype=torch.int32, pin_memory=True)
    ev, stream = torch.cuda.Event(), torch.cuda.Stream(dev)

    def tolist_idle():
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        small.tolist()
        return time.perf_counter_ns() - t0

    def pinned_idle():
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        pinned.copy_(small, non_blocking=True)
        ev.record()
        ev.synchronize()
        return time.perf_counter_ns() - t0

    def record_wait():
        ev.record()
        stream.wait_event(ev)

    pieces = [
        ("ctypes -> Go (p2p_device_info)", lambda: comm.sm_count),
        ("kernel launch through Go (moe_post_status)", lambda: ep._launch("moe_post_status", post, 1)),
        ("stream barrier (Go barrier kernel)", comm.stream_barrier),
        ("event record + wait_event", record_wait),
        ("torch.empty [128, 7168] bf16 on GPU", lambda: torch.empty(128, 7168, dtype=torch.bfloat16, device=dev)),
        ("torch.cuda.current_stream()", lambda: torch.cuda.current_stream(dev)),
        ("_DispatchParams built", lambda: moe._DispatchParams(peer_meta=ep._ptr_meta, peer_hdr=ep._ptr_hdr,
                                                              sync=ep._syncs[0, 0])),
    ]
    rows = []
    for name, f in pieces:
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            f()
            times.append(time.perf_counter_ns() - t0)
        rows.append((name, statistics.median(times) / 1e3))
        torch.cuda.synchronize()
        comm.barrier()
    for name, f in (("tolist of 4 ints, GPU idle (D2H + sync)", tolist_idle),
                    ("pinned copy + event sync, GPU idle", pinned_idle)):
        rows.append((name, statistics.median(f() for _ in range(n)) / 1e3))
    # Waits for a GPU that is busy for ~500 us: how late the host gets back (ready - GPU done).
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 1_000_000

    def late(wait):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        wait()
        host = (time.perf_counter_ns() - t0) / 1e3
        return host - start.elapsed_time(end) * 1e3

    def spin():
        pinned.copy_(small, non_blocking=True)
        ev.record()
        while not ev.query():
            pass

    def blocking():
        pinned.copy_(small, non_blocking=True)
        ev.record()
        ev.synchronize()

    for name, wait in (("tolist after ~500 us of GPU work: host late by", small.tolist),
                       ("pinned copy + event sync, same: late by", blocking),
                       ("pinned copy + event.query() spin, same: late by", spin)):
        rows.append((name, statistics.median(late(wait) for _ in range(60))))
    if rank == 0:
        print("\n== host cost of each piece (median us, rank 0) ==")
        for name, us in rows:
            print(f"  {name:46s} {us:8.2f}")


def main() -> None:
    args = sys.argv[1:]
    costs = "--costs" in args
    tokens = [int(a) for a in args if a != "--costs"] or [4096, 128]
    dev = torch.device("cuda", local_cuda_index())
    init_distributed(dev)
    rank = dist.get_rank()
    comm = p2pcomm.Communicator(group=dist.group.WORLD, device=dev)
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=max(tokens), topk=K,
                                dtype=torch.bfloat16, combine_dtype=torch.bfloat16)
    if costs:
        host_costs(comm, ep, dev, rank)
    for T in tokens:
        x = torch.randn(T, H, device=dev).to(torch.bfloat16)
        idx, w, _ = routing(T, E, K, 7 * rank + T, dev)
        marks = []
        ep._on_phase = lambda name: marks.append((name, time.perf_counter_ns()))
        per = {}
        calls = {"dispatch": [], "combine": []}
        for i in range(ITERS):
            for what in ("dispatch", "combine"):
                marks.clear()
                t0 = time.perf_counter_ns()
                if what == "dispatch":
                    recv = ep.dispatch(x, idx, w)
                else:
                    ep.combine(recv.x, recv)
                t1 = time.perf_counter_ns()
                if i < 10:
                    continue
                calls[what].append((t1 - t0) / 1e3)
                prev = t0
                for name, t in marks + [("return", t1)]:
                    per.setdefault((what, name), []).append((t - prev) / 1e3)
                    prev = t
        torch.cuda.synchronize()
        if rank == 0:
            print(f"\n== {T} tokens: host us per phase (median of {ITERS - 10}) ==")
            for (what, name), v in per.items():
                print(f"  {what:9s} {name:12s} {statistics.median(v):8.1f}")
            for what, v in calls.items():
                print(f"  {what:9s} call wall    {statistics.median(v):8.1f}")
        ep._on_phase = None
        prof = cProfile.Profile() if rank == 0 else None
        if prof:
            prof.enable()
        for i in range(30):
            recv = ep.dispatch(x, idx, w)
            ep.combine(recv.x, recv)
        torch.cuda.synchronize()
        if prof:
            prof.disable()
            print(f"-- cProfile, 30 eager dispatch+combine, {T} tokens (tottime) --")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    ep.close()
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
