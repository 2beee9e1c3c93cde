"""An ep marks its op tensors static for CUDA-graph trees without importing
torch._dynamo (a second of each process): the mark must be the very one
torch._dynamo.mark_static_address sets."""

import os

import jobs

SCRIPT = """
import sys, torch
from p2pcomm import moe
ours = torch.zeros(1)
moe._mark_static_address(ours)
assert "torch._dynamo" not in sys.modules, "marking imported torch._dynamo"
import torch._dynamo
theirs = torch.zeros(1)
torch._dynamo.mark_static_address(theirs)
assert ours.__dict__ == theirs.__dict__, (ours.__dict__, theirs.__dict__)
again = torch.zeros(1)
moe._mark_static_address(again)  # dynamo loaded now: torch's own function
assert again.__dict__ == theirs.__dict__
"""


def test_static_mark_is_torchs_without_importing_dynamo():
    run = jobs.run(SCRIPT, dict(os.environ), timeout=120)  # forked from a process that imported torch alone
    assert run.returncode == 0, run.stderr
