"""torch.library.opcheck of the all-reduce ops p2pcomm defines (ops.py):
schema, fake kernels against the real ones, autograd registration, AOT
dispatch with dynamic shapes; both of them inside torch.compile; and the
MoE ops called directly. Every rank runs the same checks in the same order,
so each collective call inside them meets its peers'. The CPU backend
suffices: the registration does not depend on the device, and the GPU's
compile tests (test_gpu, test_moe) run the same ops under inductor. The MoE
ops are not opcheck'ed: opcheck passes them clones, and they find their ep
by the address of its tensor (dispatch) and their dispatch by the rows'
address (combine), so a clone is refused, as a stale result is; test_moe
compiles them instead."""

import pytest
import torch

import p2pcomm


@pytest.mark.parametrize("op", ["all_reduce", "all_reduce_"])
def test_opcheck_all_reduce(comms, op):
    comm = comms("cpu")
    x = torch.randn(1000, generator=torch.Generator().manual_seed(comm.rank))
    torch.library.opcheck(getattr(torch.ops.p2pcomm, op).default, (x, comm._handle, "sum", "auto"))


@pytest.mark.parametrize("capturable", [False, True])
def test_moe_ops_called_directly(comms, capturable):
    comm = comms("cpu")
    W, r = comm.world_size, comm.rank
    E, K, H, Tm = 4 * W, 2, 32, 8
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K)
    g = torch.Generator().manual_seed(r)
    T = Tm - r % Tm  # differs per rank
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    args = (x, idx, w, ep._op_ident, ep._op_order, capturable, ep.max_recv_rows, ep.num_local_experts)
    with pytest.raises(p2pcomm.StateError, match="copy of its ep tensor"):  # every rank: nothing waits
        torch.ops.p2pcomm.moe_dispatch(x, idx, w, ep._op_ident.clone(), *args[4:])
    # The op's result combines like any other, and matches plain calls bit for bit.
    rows, counts, info = torch.ops.p2pcomm.moe_dispatch(*args)
    y = torch.ops.p2pcomm.moe_combine(rows, rows, ep._op_ident, ep._op_order, T)
    recv = ep.dispatch(x, idx, w, capturable=capturable)
    assert torch.equal(y.view(torch.int16), ep.combine(recv.x, recv).view(torch.int16))
    assert torch.equal(rows[:int(counts[-1])], recv.x[:int(recv.num_rows)])


def test_compiled_all_reduce_in_and_out_of_place(comms):
    """Both all-reduce ops inside torch.compile(fullgraph=True) on the CPU
    backend (the GPU's test_gpu compiles the out-of-place one with inductor)."""
    comm = comms("cpu")
    W = comm.world_size

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x):
        y = comm.all_reduce(x * 2)
        comm.all_reduce_(x, op="max")
        return y + 1

    x = torch.full((1000,), float(comm.rank + 1))
    y = step(x)
    assert torch.equal(y, torch.full_like(x, 2 * W * (W + 1) / 2 + 1))
    assert torch.equal(x, torch.full_like(x, float(W))), "in place: every element the max over ranks"
