"""Benchmarks of p2pcomm against torch's own collectives, run under torchrun:

    torchrun --nproc_per_node=N -m p2pcomm.bench [allreduce] ...   # all-reduce (allreduce.py)
    torchrun --nproc_per_node=N -m p2pcomm.bench moe ...           # MoE dispatch/combine (moe.py)
    torchrun --nproc_per_node=2 -m p2pcomm.bench p2p ...           # channels, FIFO, UCX (p2p.py)
    torchrun --nproc_per_node=N -m p2pcomm.bench rmsnorm ...       # all-reduce + residual add + RMSNorm (rmsnorm.py)

Each benchmark module has parser() and run(args); harness.py holds what they
share (tables, the run's header, torch.distributed setup, timing).
"""
