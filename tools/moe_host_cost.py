"""Where an eager MoE dispatch's time goes (a diagnostic, GPU only).

    torchrun --nproc_per_node=N tools/moe_host_cost.py [--tokens 128] [--trace FILE]

bf16, E=256, H=7168, K=8 (DeepSeek's shape). Per rank, back to back (each
eager dispatch syncs the host once, which lines the ranks up), for an eager
dispatch alone and an eager dispatch + combine pair: the wall time per call,
the time its thread waited for the GPU in the call's host syncs (golib/moe's
trace), and the difference, the host time. Then the same pair captured in a
CUDA graph (capturable mode: the GPU's own time), and the Python pieces of a
dispatch run alone (the argument checks, the output allocations, the
result). Last, one profile of eager dispatches (torch.profiler, which also
sees the driver calls p2pcomm's Go core makes): per step, the median host
offset and duration within the call and the GPU time of the kernel it
queued. Rank 0 prints every rank's figures.
"""
import argparse, json, os, statistics, tempfile, time
import torch, torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function
import p2pcomm
from p2pcomm.bench.harness import init_distributed, per_call_us
from p2pcomm.bench.moe import routing
from p2pcomm.moe_checks import dispatch_problem
from p2pcomm.moe_result import _lazy_result

E, H, K = 256, 7168, 8


def per_call(fn):
    return per_call_us(fn, calls=300)


def wall_and_wait(ep, fn, syncs: int, groups=80, group=4):
    """Medians (µs) of one call of fn back to back: its wall time, the time
    spent in its `syncs` host syncs, and the difference. The trace is read
    between groups of calls (its ring keeps a few calls), outside the timed
    ones."""
    for _ in range(20):
        fn()
    ep._trace()
    walls, waits = [], []
    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(groups):
        for _ in range(group):
            t0 = time.perf_counter()
            fn()
            walls.append((time.perf_counter() - t0) * 1e6)
        w = [s["wait_ns"] / 1e3 for s in ep._trace() if s["name"] == "host sync"]
        assert len(w) == syncs * group, f"{len(w)} host syncs in {group} calls"
        waits += [sum(w[i:i + syncs]) for i in range(0, len(w), syncs)]
    hosts = [a - b for a, b in zip(walls, waits)]
    return statistics.median(walls), statistics.median(waits), statistics.median(hosts)


def steps_of(trace_file: str, calls: int):
    """Per step of the profiled dispatches ("D" ranges): name, host offset
    from the call's start, host duration, GPU duration (µs, medians)."""
    events = json.load(open(trace_file))["traceEvents"]
    spans = sorted((e for e in events if e.get("name") == "D" and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])[-calls:]
    gpu = {e["args"]["correlation"]: e["dur"] for e in events
           if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "correlation" in e.get("args", {})}
    api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    rows = {}
    for s in spans:
        inside = sorted((e for e in api if e["tid"] == s["tid"] and s["ts"] <= e["ts"] <= s["ts"] + s["dur"]),
                        key=lambda e: e["ts"])
        seen = {}
        for e in inside:
            n = seen[e["name"]] = seen.get(e["name"], 0) + 1
            key = (e["name"], n)
            rows.setdefault(key, []).append((e["ts"] - s["ts"], e["dur"], gpu.get(e["args"].get("correlation"))))
        rows.setdefault(("whole call", 1), []).append((0, s["dur"], None))
    med = lambda v: statistics.median(v) if v else float("nan")
    out = []
    for (name, n), v in rows.items():
        g = [x[2] for x in v if x[2] is not None]
        out.append((med([x[0] for x in v]), f"{name} #{n}" if n > 1 else name, med([x[1] for x in v]), med(g), len(v)))
    return sorted(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--trace", default=None, help="keep rank 0's profile (chrome trace JSON) here")
    args = ap.parse_args()
    T = args.tokens
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    init_distributed(dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = p2pcomm.Communicator(device=dev)
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=T, topk=K, dtype=torch.bfloat16,
                                combine_dtype=torch.bfloat16)
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    idx, w, _ = routing(T, E, K, rank, dev)
    idx = idx.to(torch.int32)
    recv = ep.dispatch(x, idx, w)
    rows = recv.x.shape[0]

    def pair():
        r = ep.dispatch(x, idx, w)
        ep.combine(r.x, r)

    cap = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=T, topk=K, dtype=torch.bfloat16,
                                 combine_dtype=torch.bfloat16, capturable=True)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        r = cap.dispatch(x, idx, w)
        cap.combine(r.x, r)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            r = cap.dispatch(x, idx, w)
            cap.combine(r.x, r)
    torch.cuda.current_stream().wait_stream(stream)

    counts = torch.empty(ep.num_local_experts + 1, dtype=torch.int32, device=dev)
    res = {}
    for name, fn, syncs in (("eager dispatch", lambda: ep.dispatch(x, idx, w), 1),
                            ("eager dispatch + combine", pair, 2)):
        wall, wait, host = wall_and_wait(ep, fn, syncs)
        res[name + ": wall"], res[name + ": waiting for the GPU"], res[name + ": host"] = wall, wait, host
    res.update({
        "graph replay of dispatch + combine": per_call(graph.replay),
        "python: argument checks": per_call(lambda: dispatch_problem(ep, x, idx, w)),
        "python: output tensors": per_call(lambda: ep._outputs(rows, counts)),
        "python: the result": per_call(lambda: _lazy_result(recv.x, *recv._packed, False, None, 0, 0, T)),
        "python: the result and one view": per_call(lambda: _lazy_result(recv.x, *recv._packed, False, None, 0, 0,
                                                                             T).weight),
    })
    calls = 40
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with record_function("D"):
                ep.dispatch(x, idx, w)
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(path)
    steps = steps_of(path, calls)
    if rank == 0 and args.trace:
        os.replace(path, args.trace)
    else:
        os.remove(path)
    every = [None] * world
    dist.all_gather_object(every, (res, steps))
    if rank == 0:
        print(f"{T} tokens/rank, bf16, E={E} H={H} K={K}, {world} ranks, µs per call, ranks 0..{world - 1}")
        for name in res:
            print(f"{name:46s}" + "".join(f"{r[0][name]:9.1f}" for r in every))
        for q, (_, st) in enumerate(every):
            print(f"\nrank {q}: one eager dispatch under the profiler, medians of {calls} (µs)")
            print(f"{'step':34s}{'host at':>9s}{'host':>8s}{'GPU':>8s}")
            for at, name, d, g, n in st:
                print(f"{name[:34]:34s}{at:9.1f}{d:8.1f}{g:8.1f}" + ("" if n == calls else f"  ({n} calls)"))
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
