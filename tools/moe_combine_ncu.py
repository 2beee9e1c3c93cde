"""One rank's moe_combine_send under Nsight Compute: where its warps stall.

The kernel waits for its peers in its start barrier inside captured calls;
here the calls are eager with P2PCOMM_MOE_BARRIER_KERNELS=1, so the send
kernel has no barrier inside and ncu can replay it on its own (its stores
into the peers' buffers repeat the same bytes). Rank 0 runs under ncu (see
tools/moe_combine_ncu.sh), the others plainly; all make the same calls.

    bash tools/moe_combine_ncu.sh          # on a 4-GPU device machine
"""
import os

import torch
import torch.distributed as dist

from p2pcomm.bench.harness import init_distributed
from p2pcomm.bench.moe import routing
from p2pcomm.communicator import Communicator
from p2pcomm.moe import ExpertParallel

E, H, K, T = 256, 7168, 8, int(os.environ.get("TOKENS", "4096"))


def main() -> None:
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    init_distributed(device)
    rank = dist.get_rank()
    comm = Communicator(group=dist.group.WORLD, device=device)
    ep = ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=T, topk=K, dtype=torch.bfloat16,
                        num_sms=24, combine_dtype=torch.bfloat16)
    idx, w, _ = routing(T, E, K, 1000 + rank, device)
    x = torch.randn(T, H, device=device).to(torch.bfloat16)
    for _ in range(3):  # ncu takes the third combine send (--launch-skip 2)
        recv = ep.dispatch(x, idx, w)
        ep.combine(recv.x, recv)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
