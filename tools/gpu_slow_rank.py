"""A rank that comes late (a sleep, SLOW_S) to ExpertParallel's construction,
against a short P2PCOMM_TIMEOUT_MS (GPU; the test suite's version is
test_moe.py::test_rank_late_to_construction).

    P2PCOMM_TIMEOUT_MS=3000 SLOW_S=8 torchrun --nproc_per_node=2 tools/gpu_slow_rank.py

Before 5f784dd the early rank raised PeerTimeoutError in the config
all-reduce while the late one went on and waited in the first allocation
until faulthandler (DUMP_S) dumped it there (2 x H100, 2026-11-25); since,
every rank prints "ctor ok" and exits."""
import os, time, faulthandler, sys
faulthandler.dump_traceback_later(int(os.environ.get("DUMP_S", "60")), exit=True)
import torch, torch.distributed as dist
import p2pcomm
from p2pcomm.bench.harness import init_distributed
from p2pcomm.communicator import local_cuda_index
dev = torch.device("cuda", local_cuda_index())
init_distributed(dev)
r = dist.get_rank()
ctl = dist.new_group(backend="gloo")
comm = p2pcomm.Communicator(group=dist.group.WORLD, device=dev)
comm.all_reduce(torch.ones(8, dtype=torch.int64, device=dev))  # kernels compiled on both ranks
torch.cuda.synchronize()
dist.barrier(group=ctl)
if r == 1:
    time.sleep(float(os.environ.get("SLOW_S", "8")))
t0 = time.time()
try:
    ep = p2pcomm.ExpertParallel(comm, num_experts=16, hidden=256, max_tokens_per_rank=16, topk=2, dtype=torch.bfloat16)
    print(r, "ctor ok", round(time.time() - t0, 1), flush=True)
except Exception as e:
    print(r, "ctor failed", type(e).__name__, str(e)[:200], round(time.time() - t0, 1), flush=True)
dist.barrier(group=ctl)
print(r, "after barrier", flush=True)
try:
    comm.close()
    print(r, "closed", flush=True)
except Exception as e:
    print(r, "close failed", type(e).__name__, str(e)[:200], flush=True)
dist.destroy_process_group()
print(r, "done", flush=True)
