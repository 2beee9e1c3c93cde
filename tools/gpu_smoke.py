"""Quick GPU check under torchrun: every algorithm x dtype x a few sizes
against torch.distributed (NCCL), printing one line per case on rank 0."""

import os
import time

import torch
import torch.distributed as dist

import p2pcomm

local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl")
t0 = time.time()
comm = p2pcomm.Communicator(dist.group.WORLD, device=local)
rank = comm.rank
if rank == 0:
    print(f"communicator up in {time.time() - t0:.2f}s: {comm}")
bad = 0
for algo in p2pcomm.ALGORITHMS:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64):
        for n in (1, 7, 4097, 1 << 20):
            t0 = time.time()
            g = torch.Generator(device="cuda").manual_seed(n * 10 + rank)
            x = (torch.randn(n, device="cuda", generator=g) * 100).to(dtype)
            want = x.clone().to(torch.float64 if dtype.is_floating_point else torch.int64)
            dist.all_reduce(want)
            try:
                got = comm.all_reduce(x, algorithm=algo)
                torch.cuda.synchronize()
                comm.check()
                err = (got.double() - want.double()).abs().max().item() if n else 0.0
                tol = {torch.float32: 1e-3, torch.float64: 1e-9, torch.bfloat16: 4.0, torch.float16: 0.5}.get(dtype, 0)
                ok = err <= tol * max(1.0, want.double().abs().max().item() / 100)
            except p2pcomm.P2PCommError as e:
                ok, err = False, f"{type(e).__name__}: {e}"
            bad += not ok
            if rank == 0 and (not ok or n == 4097):
                print(f"{'ok ' if ok else 'BAD'} {algo:>18} {str(dtype):>15} n={n:<8} err={err} ({time.time() - t0:.2f}s)")
bad_t = torch.tensor([bad], device="cuda")
dist.all_reduce(bad_t)
if rank == 0:
    print(f"SMOKE {'PASSED' if bad_t.item() == 0 else 'FAILED'}: {bad_t.item()} bad cases over all ranks")
comm.close()
dist.destroy_process_group()
