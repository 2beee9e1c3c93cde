"""Where an eager MoE call spends host time (a diagnostic, GPU only).

    torchrun --nproc_per_node=4 tools/moe_host_profile.py [tokens...]

Runs eager dispatch + combine back to back (bf16, E=256, H=7168, K=8, bf16
partials, no host barrier between calls, as a model would) and prints, on
rank 0, the host wall time between ExpertParallel's phase marks (medians),
the wall time per call, then cProfile's top functions for one more loop.
"""
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

import p2pcomm
from p2pcomm.bench import init_distributed
from p2pcomm.bench_moe import routing

E, H, K, ITERS = 256, 7168, 8, 60


def main() -> None:
    tokens = [int(a) for a in sys.argv[1:]] or [4096, 128]
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    init_distributed(dev)
    rank = dist.get_rank()
    comm = p2pcomm.Communicator(group=dist.group.WORLD, device=dev)
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=max(tokens), topk=K,
                                dtype=torch.bfloat16, combine_dtype=torch.bfloat16)
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
