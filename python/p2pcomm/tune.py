"""Measure each all-reduce algorithm on this machine and write the table that
``algorithm="auto"`` uses. Run on the GPUs, one process per GPU::

    torchrun --nproc_per_node=4 -m p2pcomm.tune [--out PATH]

The table lands in P2PCOMM_TUNE_FILE, else ~/.cache/p2pcomm/tune.json; it
holds one table per world size, so run it once per world size you use.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics

def _no_multicast() -> None:
    for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Only algorithms that round 16-bit floats once: ring and recursive doubling
# round at every step, so auto never runs them.
CANDIDATES = ("oneshot_ll", "twoshot_ll", "oneshot_ll128", "oneshot_lamport", "twoshot_lamport", "oneshot_push",
              "twoshot_push", "oneshot", "twoshot")
# Above this the LL, push and Lamport algorithms fall back to the plain ones
# (their slots hold 1 MiB of LL payload, 2 MiB pushed, 3.75 MiB of LL128, 8
# MiB / world of Lamport, per rank).
LL_MAX_BYTES = 8 << 20


def default_path() -> pathlib.Path:
    env = os.environ.get("P2PCOMM_TUNE_FILE")
    if env:
        return pathlib.Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "p2pcomm" / "tune.json"


def time_us(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = []
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        reps.append(start.elapsed_time(end) * 1000 / iters)
    return statistics.median(reps)


def build_table(best: list[tuple[int, str]]) -> list[dict]:
    """Merge consecutive sizes with the same winner into max_bytes rows."""
    rows: list[dict] = []
    for nbytes, algo in best:
        if rows and rows[-1]["algorithm"] == algo:
            rows[-1]["max_bytes"] = nbytes
        else:
            rows.append({"max_bytes": nbytes, "algorithm": algo})
    if rows:
        rows[-1]["max_bytes"] = 1 << 62
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ap.add_argument("--max-bytes", type=int, default=256 << 20)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    _no_multicast()

    import p2pcomm

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    comm = p2pcomm.Communicator(dist.group.WORLD, device=local)
    dtype = getattr(torch, args.dtype)
    esize = torch.empty(0, dtype=dtype).element_size()
    best = []
    nbytes = 4096
    while nbytes <= args.max_bytes:
        x = comm.empty(nbytes // esize, dtype)
        x.normal_()
        iters = 200 if nbytes <= (1 << 20) else 20
        results = {}
        for algo in CANDIDATES:
            if nbytes > LL_MAX_BYTES and algo.endswith(("_ll", "_push", "_ll128", "_lamport")):
                continue  # past their slots these run the plain algorithms
            try:
                comm.all_reduce_(x, algorithm=algo)
            except p2pcomm.CapacityError:  # e.g. ring needs twice the scratch
                continue
            results[algo] = time_us(lambda: comm.all_reduce_(x, algorithm=algo), iters)
        # Every rank must write the same table: rank 0 decides.
        winner = [min(results, key=results.get)]
        dist.broadcast_object_list(winner, src=0)
        best.append((nbytes, winner[0]))
        if comm.rank == 0:
            print(f"{nbytes:>12} B  " + "  ".join(f"{a}={t:8.1f}us" for a, t in results.items()) + f"  -> {winner[0]}")
        nbytes *= 2
    if comm.rank == 0:
        path = args.out or default_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.loads(path.read_text()) if path.exists() else {"tables": {}}
        data["device"] = torch.cuda.get_device_name()
        data.setdefault("tables", {})[str(comm.world_size)] = build_table(best)
        path.write_text(json.dumps(data, indent=1))
        print(f"wrote {path}")
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
