"""Where an eager all-reduce's host time goes (a diagnostic, GPU only).

    torchrun --nproc_per_node=N tools/host_cost.py

Per rank, back to back, a 4 KiB bf16 in-place all-reduce and its pieces, each
as µs per call at the rate the host issues them: torch SymmetricMemory's
two-shot, p2pcomm's plain call, the same export called by ctypes with its
arguments ready (the Go side and the launch), an empty export (ctypes and the
Go entry), and a kernel launch through torch (`zero_()`). 2000 calls fill the
GPU's launch queue, so a call whose kernel takes longer than its host part
runs at the GPU's pace; 200 calls show the host's pace alone. Then both
all-reduces again in turns, 7 rounds each, the order swapped every round
(medians): a host whose pace drifts weighs on both alike. Last, one
profile of each all-reduce (torch.profiler, which also sees the driver calls
p2pcomm's Go core makes): the median host time of its launch call and the
GPU time of its kernel. Rank 0 prints every rank's figures.
"""
import json, os, statistics, tempfile
import torch, torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function
import torch.distributed._symmetric_memory as symm_mem
import p2pcomm
from p2pcomm import _lib
from p2pcomm.bench.harness import per_call_us
from p2pcomm.communicator import _ALGO_CODES, _DTYPES, _OP_CODES, _raw_stream

NUMEL = 2048
dist.init_process_group("nccl")
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(dev)
comm = p2pcomm.Communicator(device=dev)
buf = comm.empty(NUMEL, dtype=torch.bfloat16).normal_()
sym = symm_mem.empty(NUMEL, dtype=torch.bfloat16, device=dev)
symm_mem.rendezvous(sym, dist.group.WORLD)
sym.normal_()
group = dist.group.WORLD.group_name
args = (comm._handle, buf.data_ptr(), buf.data_ptr(), NUMEL, _DTYPES[buf.dtype], _OP_CODES["sum"],
        _ALGO_CODES["auto"], _raw_stream(dev.index))
all_reduce, abi_version = comm._all_reduce, _lib.lib().p2p_abi_version


def per_call(fn, calls=2000):
    return per_call_us(fn, calls=calls, warmup=50, finished=False)


def launch_and_kernel(fn, calls=200):
    """Medians (µs) over calls of fn under the profiler: the host time of its
    launch call (the runtime's or driver's), and its kernel's GPU time."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with record_function("call"):
                fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.remove(path)
    launches = [e["dur"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "aunch" in e["name"]]
    kernels = [e["dur"] for e in events if e.get("cat") == "kernel"]
    med = lambda v: statistics.median(v) if v else float("nan")
    return med(launches), med(kernels)


def alternating(a, b, calls, rounds=7):
    """Medians (µs per call) of a and b timed in turn, rounds times, the
    order swapped every round: a host whose pace drifts during the run
    weighs on both the same."""
    ta, tb = [], []
    for i in range(rounds):
        for fn, out in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
            out.append(per_call_us(fn, calls=calls, reps=1, warmup=50, finished=False))
    return statistics.median(ta), statistics.median(tb)


two_shot = lambda: torch.ops.symm_mem.two_shot_all_reduce_(sym, "sum", group)
plain = lambda: comm.all_reduce_(buf)
rows = {
    "torch symm_mem.two_shot_all_reduce_": per_call(two_shot),
    "p2pcomm comm.all_reduce_(buf)": per_call(plain),
    "p2p_all_reduce by ctypes, arguments ready": per_call(lambda: all_reduce(*args)),
    "an empty export by ctypes": per_call(abi_version),
    "a launch through torch (zero_)": per_call(sym.zero_),
    "torch two-shot, 200 calls (the host's pace)": per_call(two_shot, 200),
    "p2pcomm, 200 calls (the host's pace)": per_call(plain, 200),
}
for calls in (2000, 200):
    t, p = alternating(two_shot, plain, calls)
    rows[f"torch two-shot, {calls} calls, in turns"], rows[f"p2pcomm, {calls} calls, in turns"] = t, p
for name, fn in (("torch two-shot", two_shot), ("p2pcomm", plain)):
    rows[name + ": its launch call"], rows[name + ": its kernel on the GPU"] = launch_and_kernel(fn)
every = [None] * dist.get_world_size()
dist.all_gather_object(every, rows)
if dist.get_rank() == 0:
    print(f"{NUMEL * 2 // 1024} KiB bf16, µs per call, ranks 0..{len(every) - 1}")
    for name in rows:
        print(f"{name:45s}" + "".join(f"{r[name]:8.2f}" for r in every))
comm.close()
dist.destroy_process_group()
