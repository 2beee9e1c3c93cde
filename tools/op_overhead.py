"""Host cost of p2pcomm's torch ops (a diagnostic, GPU only).

    torchrun --nproc_per_node=4 tools/op_overhead.py

Times, on every rank (rank 0 prints the slowest rank's figure): an eager MoE
dispatch + combine pair at 128 tokens (bf16, E=256, H=7168, K=8) plainly,
through the ops p2pcomm defines (torch.ops.p2pcomm.*), through the same
bodies behind torch.library.custom_op (abtest::*, defined here), and inside
torch.compile; then an 8 KiB bf16 all-reduce the same ways, back to back.
"""
import os, statistics, time
import torch, torch.distributed as dist
import p2pcomm
from p2pcomm import ops
from p2pcomm.bench.harness import init_distributed
from p2pcomm.bench.moe import routing

@torch.library.custom_op("abtest::moe_dispatch", mutates_args=())
def ab_dispatch(x: torch.Tensor, i: torch.Tensor, w: torch.Tensor, key: torch.Tensor, cap: bool, rows: int,
                nl: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ops._ep(key)._op_dispatch(x, i, w, cap, rows, nl)

@ab_dispatch.register_fake
def _(x, i, w, key, cap, rows, nl):
    return ops._fake_dispatch(x, i, w, key, None, cap, rows, nl)

@torch.library.custom_op("abtest::moe_combine", mutates_args=())
def ab_combine(o: torch.Tensor, rx: torch.Tensor, key: torch.Tensor, n: int) -> torch.Tensor:
    return ops._ep(key)._op_combine(o, rx, n)

@torch.library.custom_op("abtest::all_reduce", mutates_args=())
def ab_all_reduce(x: torch.Tensor, handle: int, op: str, algorithm: str) -> torch.Tensor:
    return ops._comm(handle)._eager_all_reduce(x, op, algorithm)

T, E, H, K = 128, 256, 7168, 8
dev = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")
init_distributed(dev)
rank = dist.get_rank()
comm = p2pcomm.Communicator(device=dev)
ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=T, topk=K, dtype=torch.bfloat16,
                            combine_dtype=torch.bfloat16)
x = torch.randn(T, H, device=dev).to(torch.bfloat16)
idx, w, _ = routing(T, E, K, rank, dev)
small = torch.randn(4096, device=dev, dtype=torch.bfloat16)
key, R, L = ep._op_ident, ep.max_recv_rows, ep.num_local_experts

def wall(fn, n=60):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); dist.barrier()
        t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6

def per_call(fn, n=400):  # host-bound back-to-back calls
    for _ in range(10):
        fn()
    torch.cuda.synchronize(); dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6

def plain():
    r = ep.dispatch(x, idx, w)
    ep.combine(r.x, r)

def direct():
    rx, _, _ = torch.ops.p2pcomm.moe_dispatch(x, idx, w, key, ep._op_order, False, R, L)
    torch.ops.p2pcomm.moe_combine(rx, rx, key, ep._op_order, T)

def wrapped():
    rx, _, _ = torch.ops.abtest.moe_dispatch(x, idx, w, key, False, R, L)
    torch.ops.abtest.moe_combine(rx, rx, key, T)

@torch.compile(fullgraph=True)
def step(a, i, v):
    r = ep.dispatch(a, i, v)
    return ep.combine(r.x, r)

ar = torch.compile(lambda t: comm.all_reduce(t), fullgraph=True)
res = {}
for name, fn in (("moe pair: plain", plain), ("moe pair: ops direct", direct), ("moe pair: ops via custom_op", wrapped),
                 ("moe pair: compiled step", lambda: step(x, idx, w)), ("moe pair: plain again", plain)):
    res[name + " (wall, synced)"] = wall(fn)
h = comm._handle
for name, fn in (("all_reduce 8 KiB: plain", lambda: comm.all_reduce(small)),
                 ("all_reduce 8 KiB: op direct", lambda: torch.ops.p2pcomm.all_reduce(small, h, "sum", "auto")),
                 ("all_reduce 8 KiB: op via custom_op", lambda: torch.ops.abtest.all_reduce(small, h, "sum", "auto")),
                 ("all_reduce 8 KiB: compiled", lambda: ar(small)),
                 ("all_reduce 8 KiB: plain again", lambda: comm.all_reduce(small))):
    res[name + " (per call, back to back)"] = per_call(fn)
t = torch.tensor(list(res.values()), dtype=torch.float64, device=dev)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
if rank == 0:
    for k, v in zip(res, t.cpu().tolist()):
        print(f"{k:62s} {v:8.1f} us")
comm.close()
