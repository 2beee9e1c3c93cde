"""Where an eager all-reduce's host time goes (a diagnostic, GPU only).

    torchrun --nproc_per_node=N tools/host_cost.py

Per rank, back to back, a 4 KiB bf16 in-place all-reduce and its pieces, each
as µs per call at the rate the host issues them: torch SymmetricMemory's
two-shot, p2pcomm's plain call, the same export called by ctypes with its
arguments ready (the Go side and the launch), an empty export (ctypes and the
Go entry), and a kernel launch through torch (`zero_()`). Rank 0 prints every
rank's figures.
"""
import os
import torch, torch.distributed as dist
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


def per_call(fn):
    return per_call_us(fn, calls=2000, warmup=50, finished=False)


rows = {
    "torch symm_mem.two_shot_all_reduce_": per_call(lambda: torch.ops.symm_mem.two_shot_all_reduce_(sym, "sum", group)),
    "p2pcomm comm.all_reduce_(buf)": per_call(lambda: comm.all_reduce_(buf)),
    "p2p_all_reduce by ctypes, arguments ready": per_call(lambda: all_reduce(*args)),
    "an empty export by ctypes": per_call(abi_version),
    "a launch through torch (zero_)": per_call(sym.zero_),
}
every = [None] * dist.get_world_size()
dist.all_gather_object(every, rows)
if dist.get_rank() == 0:
    print(f"{NUMEL * 2 // 1024} KiB bf16, µs per call, ranks 0..{len(every) - 1}")
    for name in rows:
        print(f"{name:45s}" + "".join(f"{r[name]:8.2f}" for r in every))
comm.close()
dist.destroy_process_group()
