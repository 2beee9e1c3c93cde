"""ExpertParallel across simulated nodes (P2PCOMM_LOCAL_SIZE), on CPU tensors and on GPU tensors (whose rows
cross nodes through pinned host memory): the float64 reference and the combine emulation of test_moe.py, every
element, and the same bits as one node (on GPUs: as the kernels of one node). Two ranks run 2 nodes x 1, three
3 x 1, four 2 x 2. Eager and capturable calls, T = 0 and uneven T, -1 ids, K from 1 to 12, both transits,
outputs poisoned; bad input on a rank of the last node raises on every rank of every node, and every rank is
usable after."""

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

import p2pcomm
from conftest import DEVICES
from test_moe import (CASES, TRANSITS, assert_same_bits, capture_step, check_combine, check_dispatch, emulate_combine,
                      experts_for, expert_fn, make_inputs, replays, run_round, transit_dtype)
from test_nodes import Nodes

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libucx") is None and not os.environ.get("P2PCOMM_UCX_LIB"),
                                reason="UCX not installed (pip install libucx-cu13)")


def layout(world: int):
    """(name, local size) of the node layout this world size tests."""
    if world in (2, 3):
        return f"{world}x1", 1
    if world % 2 == 0:
        return f"{world // 2}x2", 2
    pytest.skip(f"no layout across nodes for {world} ranks")


@pytest.fixture(scope="module", params=DEVICES)
def nodes(group, request):
    W = dist.get_world_size()
    name, local = layout(W)
    made = Nodes(name, local, list(range(W)), request.param)
    yield made
    made.comm.close()


def ep_of(comm, **kw):
    return p2pcomm.ExpertParallel(comm, **kw)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}_K{c[1]}_{str(c[4])[6:]}_{c[5]}")
def test_eager_across_nodes_match_reference(nodes, comms, case):
    """Every row in the documented order, every element of combine within the float64 reference's bound and
    bit for bit the emulation's and one node's; twice, and two dispatches before a combine."""
    E, K, H, Tm, dtype, routing, minus_one = case
    comm, dev = nodes.comm, nodes.device
    W, r = comm.world_size, comm.rank
    E = experts_for(E, W)
    sizes = [0 if q == 1 else (Tm if q == 0 else 1 + (5 * q) % Tm) for q in range(W)]  # rank 1 sends nothing
    inputs = [make_inputs(E + K, q, sizes[q], H, E, K, dtype, routing, minus_one) for q in range(W)]
    cfg = dict(num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype)
    with ep_of(comm, **cfg) as ep:
        assert ep.uses_kernels is False
        recv, out, y = run_round(ep, inputs, r, dev)
        check_dispatch(recv, inputs, r, W, E, K, dtype)
        check_combine(y, inputs, r, W, E, K, dtype)
        assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype), "combine across nodes")
        other = [make_inputs(E + K + 1, q, sizes[q], H, E, K, dtype, routing, minus_one) for q in range(W)]
        ep.dispatch(inputs[r].x.to(dev), inputs[r].idx.to(dev), inputs[r].w.to(dev))
        recv2, out2, y2 = run_round(ep, other, r, dev)
        check_dispatch(recv2, other, r, W, E, K, dtype)
        check_combine(y2, other, r, W, E, K, dtype)
        assert_same_bits(ep.combine(out2, recv2), y2.cpu(), "second combine of one dispatch")
    with ep_of(comms(dev), **cfg) as one:  # the same ranks as one node (on GPUs, its kernels)
        assert one.uses_kernels == (dev == "cuda")
        assert_same_bits(run_round(one, inputs, r, dev)[2], y.cpu(), "one node against nodes")


@pytest.mark.parametrize("device", DEVICES)
def test_rails_carry_stripes_of_large_puts(group, device, monkeypatch):
    """P2PCOMM_NET_RAILS: rows and partials of more than a stripe's worth per peer travel in stripes over several
    UCX transports; every element still matches the reference and the emulation's bits, counts that differ
    between ranks settle on the fewest, and a bad count on one rank raises on every rank at construction."""
    W, r = dist.get_world_size(), dist.get_rank()
    name, local = layout(W)
    E, K, H, Tm, dtype = experts_for(16, W), 4, 2048, 160, torch.bfloat16  # rows of 4 KiB: ~470 KiB per peer
    cfg = dict(num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype)
    inputs = [make_inputs(29, q, Tm - 7 * q, H, E, K, dtype) for q in range(W)]
    # Two ranks open 8 rails, then settle on 2; more ranks (each opening every rail to every other) settle on
    # 4 where one asks fewer. Then a bad count.
    cases = [{q: "8" for q in range(W)}, {**{q: "4" for q in range(W)}, W - 1: "2"}] if W == 2 else \
        [{**{q: "8" for q in range(W)}, W - 1: "4"}]
    for asked in cases + [{0: "3"}]:
        monkeypatch.setenv("P2PCOMM_NET_RAILS", asked.get(r, "1"))
        made = Nodes(name, local, list(range(W)), device)
        try:
            if asked.get(0) == "3":
                with pytest.raises(p2pcomm.InvalidArgumentError, match="P2PCOMM_NET_RAILS=3"):
                    ep_of(made.comm, **cfg)
                if device == "cpu":  # the communicator goes on (its CPU all-reduce uses no rails)
                    assert torch.equal(made.comm.all_reduce(torch.ones(3)), torch.full((3,), float(W)))
                continue
            for transit in TRANSITS:
                with ep_of(made.comm, combine_dtype=transit_dtype(transit, dtype), **cfg) as ep:
                    recv, out, y = run_round(ep, inputs, r, device)
                    check_dispatch(recv, inputs, r, W, E, K, dtype)
                    check_combine(y, inputs, r, W, E, K, dtype, transit_dtype(transit, dtype))
                    assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype, transit_dtype(transit, dtype)),
                                     f"combine over rails {asked}")
        finally:
            made.comm.close()


def capturable_rounds(W, transit, seed):
    """The capturable tests' configuration: E, K, H, Tm, dtype, T per rank (uneven, one rank none), three
    rounds of inputs with -1 ids, and combine's dtype."""
    E, K, H, Tm, dtype = 4 * W, 4, 48, 12, torch.bfloat16
    sizes = [(Tm - 3, 0, Tm, 5)[q % 4] for q in range(W)]
    rounds = [[make_inputs(seed + i, q, sizes[q], H, E, K, dtype, "random", 0.25) for q in range(W)] for i in range(3)]
    return E, K, H, Tm, dtype, sizes, rounds, transit_dtype(transit, dtype)


@pytest.mark.parametrize("transit", TRANSITS)
def test_capturable_across_nodes(nodes, transit):
    """Capturable rounds with uneven T (one rank none) and -1 ids: recv.x and the expert output rows past
    num_rows poisoned with NaN, which must not reach any result."""
    comm, dev = nodes.comm, nodes.device
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype, sizes, rounds, combine_dtype = capturable_rounds(W, transit, 200)
    with ep_of(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype, capturable=True,
               combine_dtype=combine_dtype) as ep:
        recv = None
        for inputs in rounds:
            if recv is not None:
                recv.x.fill_(float("nan"))  # rows this dispatch does not write show up
            inp = inputs[r]
            recv = ep.dispatch(inp.x.to(dev), inp.idx.to(dev), inp.w.to(dev))
            assert recv.capturable and recv.x.shape == (W * Tm * K, H)
            check_dispatch(recv, inputs, r, W, E, K, dtype, capturable=True)
            out = expert_fn(recv.x, recv.local_expert, recv.src_rank)
            out[int(recv.num_rows.item()):] = float("nan")
            y = ep.combine(out, recv)
            assert_no_failure(ep, y)
            check_combine(y, inputs, r, W, E, K, dtype, combine_dtype)
            assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype, combine_dtype), "capturable combine")


def assert_no_failure(ep, y):
    """A capturable call across nodes that failed on the GPU's side leaves y NaN and raises at the next call:
    make that call (no tokens) to say why."""
    if not bool(y.isnan().any()):
        return
    try:
        ep.dispatch(torch.empty(0, ep.hidden, dtype=ep.dtype, device=y.device),
                    torch.empty(0, ep.topk, dtype=torch.int64, device=y.device),
                    torch.empty(0, ep.topk, dtype=torch.float32, device=y.device))
        torch.cuda.synchronize()
    except p2pcomm.P2PCommError as e:
        raise AssertionError(f"the call failed: {e}") from e
    raise AssertionError("combine's output holds NaN, and the next call raised nothing")


def still_works(ep, comm):
    W = comm.world_size
    inputs = [make_inputs(3, q, 4, ep.hidden, ep.num_experts, ep.topk, ep.dtype, "random", 0.2) for q in range(W)]
    recv, out, y = run_round(ep, inputs, comm.rank, comm.device.type)
    check_dispatch(recv, inputs, comm.rank, W, ep.num_experts, ep.topk, ep.dtype)
    check_combine(y, inputs, comm.rank, W, ep.num_experts, ep.topk, ep.dtype)


def test_bad_inputs_raise_on_every_rank_of_every_node(nodes):
    """The last rank (on the last node) passes bad arguments: it raises its own error, every other rank
    MismatchError naming it, no data moves, and every rank goes on."""
    comm, dev = nodes.comm, nodes.device
    W, r = comm.world_size, comm.rank
    bad_rank = W - 1
    E, K, H, Tm = 2 * W, 2, 64, 8
    with ep_of(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K) as ep:
        good = make_inputs(9, r, 4, H, E, K, torch.bfloat16)
        x, idx, w = good.x.to(dev), good.idx.to(dev), good.w.to(dev)
        big = make_inputs(9, r, Tm + 1, H, E, K, torch.bfloat16)
        big.x, big.idx, big.w = big.x.to(dev), big.idx.to(dev), big.w.to(dev)
        bad_id = idx.clone()
        bad_id[2, 1] = E
        cases = [((big.x, big.idx, big.w), p2pcomm.InvalidArgumentError, "max_tokens"),
                 ((x, bad_id, w), p2pcomm.InvalidArgumentError, r"topk_idx\[2, 1\] = "),
                 ((x.float(), idx, w), p2pcomm.UnsupportedError, "x has dtype")]
        for args, error, message in cases:
            if r == bad_rank:
                with pytest.raises(error, match=message):
                    ep.dispatch(*args)
            else:
                with pytest.raises(p2pcomm.MismatchError, match=f"rank {bad_rank}"):
                    ep.dispatch(x, idx, w)
        still_works(ep, comm)
        recv = ep.dispatch(x, idx, w)
        out = recv.x.clone()
        if r == bad_rank:
            with pytest.raises(p2pcomm.InvalidArgumentError, match="expert_out has shape"):
                ep.combine(torch.zeros(out.shape[0] + 1, H, dtype=out.dtype, device=dev), recv)
        else:
            with pytest.raises(p2pcomm.MismatchError, match=f"rank {bad_rank}"):
                ep.combine(out, recv)
        still_works(ep, comm)
    comm.check()


@pytest.mark.parametrize("device", DEVICES)
def test_communicator_closed_before_its_ep(group, device):
    """Closing the communicator first closes its eps (their UCX registrations cover its memory): the ep then
    raises, closes quietly, and a new communicator works."""
    W = dist.get_world_size()
    name, local = layout(W)
    fresh = Nodes(name, local, list(range(W)), device)
    ep = ep_of(fresh.comm, num_experts=2 * W, hidden=32, max_tokens_per_rank=4, topk=2)
    still_works(ep, fresh.comm)
    dist.barrier()
    fresh.comm.close()
    with pytest.raises(p2pcomm.P2PCommError):
        still_works(ep, fresh.comm)
    ep.close()
    again = Nodes(name, local, list(range(W)), device)
    with ep_of(again.comm, num_experts=2 * W, hidden=32, max_tokens_per_rank=4, topk=2) as ep2:
        still_works(ep2, again.comm)
    again.comm.close()


@pytest.mark.parametrize("transit", TRANSITS)
def test_cuda_graph_replays_across_nodes(nodes, transit):
    """On GPUs across nodes, capturable dispatch + expert + combine recorded in one CUDA graph (the host's
    exchanges run as host functions on the stream) and replayed with new routing and data: uneven T (one rank
    none), -1 ids, recv.x poisoned before every replay; every row in the documented order, combine within the
    float64 reference's bound and bit for bit the emulation's."""
    if nodes.device != "cuda":
        pytest.skip("CUDA graphs: GPU tensors only")
    comm = nodes.comm
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype, sizes, rounds, combine_dtype = capturable_rounds(W, transit, 400)
    with ep_of(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype, capturable=True,
               combine_dtype=combine_dtype) as ep:
        static_x = torch.zeros(sizes[r], H, dtype=dtype, device="cuda")
        graph, load, recv, y = capture_step(ep, static_x, rounds[0], r)
        for inputs in replays(graph, load, recv, rounds[1:] + rounds[:1]):
            assert_no_failure(ep, y)
            check_dispatch(recv, inputs, r, W, E, K, dtype, capturable=True)
            check_combine(y, inputs, r, W, E, K, dtype, combine_dtype)
            assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype, combine_dtype), "replayed combine")
        # An eager round after the replays.
        recv, out, y = run_round(ep, rounds[1], r, "cuda")
        check_dispatch(recv, rounds[1], r, W, E, K, dtype)
        assert_same_bits(y, emulate_combine(rounds[1], r, W, E, K, dtype, combine_dtype), "eager combine after replays")
    comm.check()


def test_eager_call_in_a_cuda_graph_is_refused(nodes):
    """An eager call across nodes waits for the host between its copies, which a CUDA graph cannot hold:
    recording one raises UnsupportedError on every rank before anything is recorded, and the ep goes on."""
    if nodes.device != "cuda":
        pytest.skip("CUDA graphs: GPU tensors only")
    comm = nodes.comm
    W, r = comm.world_size, comm.rank
    E, K, H, Tm = 2 * W, 2, 64, 8
    with ep_of(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K) as ep:
        inp = make_inputs(11, r, 4, H, E, K, torch.bfloat16)
        x, idx, w = inp.x.cuda(), inp.idx.cuda(), inp.w.cuda()
        graph, raised = torch.cuda.CUDAGraph(), None
        with torch.cuda.graph(graph):
            try:
                ep.dispatch(x, idx, w)
            except p2pcomm.UnsupportedError as e:
                raised = e
        assert raised is not None and "CUDA graph" in str(raised)
        still_works(ep, comm)
    comm.check()