"""Where the dispatch's count, send and expand kernels spend their time (a diagnostic, GPU only).

    P2PCOMM_NVRTC_OPTIONS=-DMOE_PROFILE=1 torchrun --nproc_per_node=4 tools/moe_send_profile.py [tokens...]

Captures one capturable dispatch (bf16, E=256, H=7168, K=8, x built in the
ep's buffer) in a CUDA graph, replays it with the ranks' streams aligned
first (as python -m p2pcomm.bench moe does), and reads the %globaltimer
stamps that a -DMOE_PROFILE=1 build writes per block (moe.cu prof_stamp).
Prints, per rank, the median over replays of each step in microseconds:
the count kernel (first block in to last block out; 0 for batches under
moe.py's _COUNT_KERNEL_MIN_PAIRS, whose send blocks count in "sums"), the
gap to the send kernel, the sums of earlier blocks' counts, slots, pair
ranks (median block), what is left of the start barrier's wait after them
(median block: the flags went out at the kernel's start, and blocks with no
tokens wait through all of it), metadata with hdr and sync_end (longest
block), and the whole span; then the expand's steps (see expand_steps). With MOE_PROFILE_BLOCKS=1 ranks 0 and 1 also
print each block's start, end of local steps, barrier passed and end.
"""
import os
import statistics
import sys

import torch
import torch.distributed as dist

import p2pcomm
from p2pcomm.bench.harness import init_distributed
from p2pcomm.communicator import local_cuda_index
from p2pcomm.bench.moe import aligned_start, routing

E, H, K, REPS = 256, 7168, 8, 40
STEPS = ("count", "gap", "sums", "slots", "pair ranks", "barrier", "meta+end", "span")
EXPAND = ("gap", "wait", "wait max", "bases", "rows", "rows max", "span", "dispatch")


def steps(st: torch.Tensor) -> list[float]:
    """st: [G, 8] u32 stamps (ns, low 32 bits) -> the STEPS in us.

    Stamps in time order: 0, 1 count kernel in/out; 2 send kernel start;
    4, 5, 6 after its local steps 1-3; 3 past the start barrier; 7 end.
    """
    t = st.to(torch.int64)
    t = (t - t[:, 0].min()) % (1 << 32)  # wrap-safe, relative to the first count block
    med = lambda v: float(v.median())  # noqa: E731
    return [x / 1e3 for x in (
        int(t[:, 1].max()), int(t[:, 2].min() - t[:, 1].max()),
        med(t[:, 4] - t[:, 2]), med(t[:, 5] - t[:, 4]), med(t[:, 6] - t[:, 5]), med(t[:, 3] - t[:, 6]),
        int((t[:, 7] - t[:, 3]).max()), int(t[:, 7].max()))]


def expand_steps(st: torch.Tensor, ex: torch.Tensor) -> list[float]:
    """st: the send stamps as in steps(); ex: [G, 8] expand stamps (0 start,
    1 past the middle barrier, 2 bases scanned, 3 block done) -> EXPAND in
    us: gap from the last send block's end to the first expand block's
    start, the barrier's wait (median and longest block), the bases, the
    row copies (median and longest block), the expand's span, and the
    dispatch's (first count or send block in to last expand block out)."""
    t0 = st.to(torch.int64)[:, 0].min()
    s = (st.to(torch.int64) - t0) % (1 << 32)
    e = (ex.to(torch.int64) - t0) % (1 << 32)
    med = lambda v: float(v.median())  # noqa: E731
    return [x / 1e3 for x in (
        int(e[:, 0].min() - s[:, 7].max()), med(e[:, 1] - e[:, 0]), int((e[:, 1] - e[:, 0]).max()),
        med(e[:, 2] - e[:, 1]), med(e[:, 3] - e[:, 2]), int((e[:, 3] - e[:, 2]).max()),
        int(e[:, 3].max() - e[:, 0].min()), int(e[:, 3].max()))]


def main() -> None:
    if "MOE_PROFILE=1" not in os.environ.get("P2PCOMM_NVRTC_OPTIONS", ""):
        sys.exit("set P2PCOMM_NVRTC_OPTIONS=-DMOE_PROFILE=1 (the stamps are compiled in only then)")
    tokens = [int(a) for a in sys.argv[1:]] or [4096, 128]
    dev = torch.device("cuda", local_cuda_index())
    init_distributed(dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = p2pcomm.Communicator(group=dist.group.WORLD, device=dev)
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=max(tokens), topk=K,
                                dtype=torch.bfloat16, combine_dtype=torch.bfloat16)
    G, W, Tm = ep._blocks, world, ep.max_tokens_per_rank
    stamps = ep._pair_rank[Tm * K + G * (W + E):].view(G, 8)
    align = aligned_start(comm, True)
    for T in tokens:
        x = ep.get_dispatch_buffer(T)
        x.copy_(torch.randn(T, H, device=dev).to(torch.bfloat16))
        idx, w, _ = routing(T, E, K, 7 * rank + T, dev)
        for _ in range(3):
            ep.dispatch(x, idx, w, capturable=True)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            recv = ep.dispatch(x, idx, w, capturable=True)
        ex_stamps = recv._packed[1].view(-1)[-G * 8:].view(G, 8)  # moe.cu expand_stamp
        rows, ex_rows, raw = [], [], []
        for _ in range(REPS):
            align()
            g.replay()
            torch.cuda.synchronize()
            st = stamps.cpu()
            rows.append(steps(st))
            ex_rows.append(expand_steps(st, ex_stamps.cpu()))
            raw.append(st.to(torch.int64))
        for names, rs, what in ((STEPS, rows, "count and send kernels"), (EXPAND, ex_rows, "expand")):
            meds = torch.tensor([statistics.median(r[i] for r in rs) for i in range(len(names))],
                                dtype=torch.float64, device=dev)
            got = [torch.zeros_like(meds) for _ in range(world)]
            dist.all_gather(got, meds)
            if rank == 0:
                print(f"\n{T} tokens, {G} blocks, graph, x in the buffer, {what}: median of {REPS} replays, us")
                print("| rank | " + " | ".join(names) + " |\n|---:|" + "---:|" * len(names))
                for r, m in enumerate(got):
                    print(f"| {r} | " + " | ".join(f"{v:.1f}" for v in m.tolist()) + " |")
        if os.environ.get("MOE_PROFILE_BLOCKS") and rank in (0, 1):
            r = torch.stack(raw)  # [REPS, G, 8]
            r = (r - r[:, :, 2].min(dim=1).values[:, None, None]) % (1 << 32)
            med = r.median(dim=0).values
            print(f"rank {rank}, {T} tokens: per block, median us after the first block's start: start, "
                  "local steps done, past the barrier, end")
            for b in range(G):
                print(f"  block {b:2d}: " + " ".join(f"{float(med[b, i]) / 1e3:5.1f}" for i in (2, 6, 3, 7)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
