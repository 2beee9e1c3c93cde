"""A/B kernel variants on the GPUs in one run (under torchrun): for each
variant (extra NVRTC -D options, grid limit) build a communicator, check it
against NCCL on fresh random data, then time chosen cases eagerly and as
CUDA-graph replays, with torch SymmetricMemory's one-shot and two-shot at the
same sizes (first column). Prints one table on rank 0.

    torchrun --nproc_per_node=N tools/gpu_micro.py [--sizes 512K,2M] [--algos twoshot,twoshot_ll] [--no-torch]
        [--rounds R] [variant...]

A variant is a name of VARIANTS or an environment of its own, NAME=VALUE[+NAME=VALUE...]; without any,
only "default" runs."""

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import p2pcomm

VARIANTS = {
    "default": {},
    "blocks32": {"P2PCOMM_MAX_BLOCKS": "32"},
}
KB, MB = 1 << 10, 1 << 20
CASES = [(n, a) for n in (4 * KB, 32 * KB) for a in ("oneshot_ll", "oneshot_push", "oneshot")]
CASES += [(n, a) for n in (256 * KB, 512 * KB, 1 * MB)
          for a in ("oneshot_ll", "oneshot_push", "twoshot_ll", "twoshot_push", "oneshot", "twoshot")]
CASES += [(n, a) for n in (2 * MB, 4 * MB, 8 * MB) for a in ("twoshot_ll", "twoshot_push", "twoshot")]
CHECKED = ("oneshot", "twoshot", "ring", "oneshot_ll", "twoshot_ll", "oneshot_push", "twoshot_push", "oneshot_ll128",
           "oneshot_lamport", "twoshot_lamport")


def timed(fn, iters, graph):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(iters):
                fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = []
    for _ in range(7):
        dist.barrier()
        torch.cuda.synchronize()
        a.record()
        run()
        b.record()
        b.synchronize()
        reps.append(a.elapsed_time(b) * 1000 / iters)
    return statistics.median(reps)


def parse_bytes(s):
    units = {"K": KB, "M": MB}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def torch_symm(cases):
    """torch SymmetricMemory's one-shot and two-shot at every size of cases:
    returns run(samples, first), which times each once into column first."""
    import torch.distributed._symmetric_memory as symm_mem
    sizes = sorted({n for n, _ in cases})
    buf = symm_mem.empty(max(sizes) // 2, dtype=torch.bfloat16, device="cuda")
    handle = symm_mem.rendezvous(buf, dist.group.WORLD)
    group = dist.group.WORLD.group_name
    out = torch.empty_like(buf)

    def run(samples, first):
        for nbytes in sizes:
            x, o = buf[:nbytes // 2], out[:nbytes // 2]
            x.normal_()
            iters = 100 if nbytes <= (1 << 20) else 20
            for label, fn in (("oneshot", lambda: torch.ops.symm_mem.one_shot_all_reduce_out(x, "sum", group, o)),
                              ("twoshot", lambda: torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", group))):
                for graph in (False, True):
                    key = (nbytes, f"torch-symm {label}", "reg", "graph" if graph else "eager")
                    samples.setdefault((key, first), []).append(timed(fn, iters, graph))
        return handle  # keeps the rendezvous alive with the closure
    return run


def main():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=lambda s: [parse_bytes(x) for x in s.split(",") if x], default=None)
    ap.add_argument("--algos", type=lambda s: [a for a in s.split(",") if a], default=None)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="times each case runs, variants taking turns")
    ap.add_argument("variants", nargs="*")
    args = ap.parse_args()
    cases = CASES
    if args.sizes or args.algos:
        sizes = args.sizes or sorted({n for n, _ in CASES})
        algos = args.algos or ["twoshot"]
        cases = [(n, a) for n in sizes for a in algos]
    names = args.variants or ["default"]
    for name in names:  # NAME=VALUE[+NAME=VALUE...]: the environment of an ad-hoc variant
        if name not in VARIANTS:
            pairs = [kv.split("=", 1) for kv in name.split("+")]
            if any(len(kv) != 2 for kv in pairs):
                ap.error(f"variant {name!r}: not one of {', '.join(VARIANTS)}, nor NAME=VALUE[+NAME=VALUE...]")
            VARIANTS[name] = dict(pairs)
    rows = {}
    torch_round = None
    if not args.no_torch:
        try:
            torch_round = torch_symm(cases)
        except (ImportError, AttributeError, RuntimeError) as e:  # a torch without SymmetricMemory's ops
            if dist.get_rank() == 0:
                print(f"no torch SymmetricMemory rows: {e}")
    comms = {}
    for name in names:
        saved = {k: os.environ.get(k) for k in VARIANTS[name]}
        os.environ.update(VARIANTS[name])
        comms[name] = p2pcomm.Communicator(dist.group.WORLD, device=local)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    for name, comm in comms.items():
        bad = 0
        for n in (3, 4097, 1 << 20, 5_000_003):
            for algo in CHECKED:
                for i in range(3):
                    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
                    want = x.float()
                    dist.all_reduce(want)
                    got = comm.all_reduce(x, algorithm=algo).float()
                    bad += int(((got - want).abs() > 0.02 * want.abs() + 0.05).sum())
        torch.cuda.synchronize()
        comm.check()
        bad_t = torch.tensor([bad], device="cuda")
        dist.all_reduce(bad_t)
        rows.setdefault(("WRONG elements", "", "", ""), {})[name] = float(bad_t.item())
    # Inputs once per size (and communicator, for registered ones): comm.empty
    # memory lives until the communicator closes.
    sizes = sorted({n for n, _ in cases})
    plains = {n: torch.randn(n // 2, device="cuda", dtype=torch.bfloat16) for n in sizes}
    regs = {(n, name): comm.empty(n // 2, torch.bfloat16).normal_() for n in sizes for name, comm in comms.items()}
    # Rounds interleave the variants case by case, so that a drift of the
    # machine's pace lands on every variant alike; the median of rounds.
    samples = {}
    for _ in range(args.rounds):
        if torch_round is not None:
            torch_round(samples, names[0])
        for nbytes, algo in cases:
            iters = 100 if nbytes <= (1 << 20) else 20
            for name, comm in comms.items():
                x, plain = regs[(nbytes, name)], plains[nbytes]
                for label, fn in (("reg", lambda: comm.all_reduce_(x, algorithm=algo)),
                                  ("staged", lambda: comm.all_reduce(plain, algorithm=algo))):
                    for graph in (False, True):
                        key = (nbytes, algo, label, "graph" if graph else "eager")
                        samples.setdefault((key, name), []).append(timed(fn, iters, graph))
        for name, comm in comms.items():
            samples.setdefault((("barrier", "-", "-", "graph"), name), []).append(timed(comm.stream_barrier, 50, True))
    for (key, name), vals in samples.items():
        rows.setdefault(key, {})[name] = statistics.median(vals)
    for name, comm in comms.items():
        # Host cost of one eager call (enqueue only; 300 calls fit the launch queue).
        small = comm.empty(2048, torch.bfloat16)
        import time
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(300):
                comm.all_reduce_(small)
            host = (time.perf_counter() - t0) * 1e6 / 300
        torch.cuda.synchronize()
        rows.setdefault(("host us/call 4096 auto", "", "", "eager"), {})[name] = host
    for comm in comms.values():
        comm.close()
    if dist.get_rank() == 0:
        print(f"\nmicro: {dist.get_world_size()} x {torch.cuda.get_device_name()}, bf16, us "
              f"(median of 7, then of {args.rounds} rounds)")
        print(f"{'case':<40}" + "".join(f"{n:>10}" for n in names))
        for key, vals in rows.items():
            label = " ".join(str(k) for k in key)
            print(f"{label:<40}" + "".join(f"{vals.get(n, float('nan')):>10.1f}" for n in names))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
