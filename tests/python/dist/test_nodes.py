"""All-reduce across simulated nodes (P2PCOMM_LOCAL_SIZE): the hierarchical algorithm on every op, dtype and
size of the single-node matrix, against a float64 reference, every element, bit-identical on every rank; bad
input on every rank. Two ranks run 2 nodes x 1; four run 2 nodes x 2 and, on ranks 0-2, 3 nodes x 1 (at the
largest size those two share out the ops, for time). Failures of a rank: tests/python/test_nodes_failures.py."""

import importlib.util
import os
import zlib

import pytest
import torch
import torch.distributed as dist

import p2pcomm
from test_allreduce import DTYPES, OPS, SIZES, assert_matches, poison, rank_input, reference

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libucx") is None and not os.environ.get("P2PCOMM_UCX_LIB"),
                                reason="UCX not installed (pip install libucx-cu13)")


def layouts(world: int):
    """(name, local size, member ranks) of the node layouts this world size tests."""
    if world == 2:
        return [("2x1", 1, [0, 1])]
    if world >= 4:
        return [("2x2", 2, [0, 1, 2, 3]), ("3x1", 1, [0, 1, 2])]
    return [(f"{world}x1", 1, list(range(world)))]


class Nodes:
    """A communicator over `ranks` in nodes of `local_size`, and the gloo group of the same ranks."""

    def __init__(self, name, local_size, ranks, device):
        self.name, self.ranks = name, ranks
        self.group = dist.new_group(ranks)  # every rank makes every group, in the same order
        self.member = dist.get_rank() in ranks
        self.comm = None
        if self.member:
            os.environ["P2PCOMM_LOCAL_SIZE"] = str(local_size)
            try:
                self.comm = p2pcomm.Communicator(group=self.group, device=device)
            finally:
                del os.environ["P2PCOMM_LOCAL_SIZE"]
            want = [ranks[i:i + local_size] for i in range(0, len(ranks), local_size)]
            assert self.comm.nodes == [[ranks.index(r) for r in node] for node in want]

    def same_bits(self, t: torch.Tensor) -> bool:
        """True when every member holds the same bytes (a checksum of each is compared)."""
        data = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        mine = (zlib.crc32(data), len(data))
        got = [None] * len(self.ranks)
        dist.all_gather_object(got, mine, group=self.group)
        return all(g == got[0] for g in got)


@pytest.fixture(scope="module")
def node_layouts(group):
    made = [Nodes(name, local, ranks, "cpu") for name, local, ranks in layouts(dist.get_world_size())]
    yield made
    for n in made:
        if n.comm is not None:
            n.comm.close()


def each_layout(node_layouts):
    for n in node_layouts:
        if n.member:
            yield n


MODES = ["staged", "symmetric_inplace", "plain_inplace", "symmetric_to_poisoned"]


def reduce_in_mode(comm, mode, x: torch.Tensor, op: str) -> torch.Tensor:
    """One all-reduce of x with the buffers placed as mode says; x is left alone."""
    if mode == "staged":
        orig = x.clone()
        out = comm.all_reduce(x, op=op)
        assert torch.equal(x, orig), "input was modified"
        return out
    if mode == "plain_inplace":
        plain = poison(torch.empty_like(x)).copy_(x)
        return comm.all_reduce_(plain, op=op)
    sym = comm.empty(x.numel(), x.dtype)
    sym.copy_(x)
    if mode == "symmetric_inplace":
        assert comm.all_reduce_(sym, op=op) is sym
        return sym.clone()
    res = poison(torch.empty_like(x))
    comm._reduce(sym, res, op, "auto")
    assert torch.equal(sym, x), "symmetric input was modified"
    return res


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_every_op_matches_torch_across_nodes(node_layouts, n, dtype):
    for k, nodes in enumerate(node_layouts):
        if not nodes.member:
            continue
        comm, w, r = nodes.comm, nodes.comm.world_size, nodes.comm.rank
        for i, op in enumerate(OPS):
            if n == SIZES[-1] and i % len(node_layouts) != k:
                continue  # the largest size: the layouts of one run share the ops (time)
            seed = zlib.crc32(f"{nodes.name}{n}{dtype}{op}".encode()) % 100_000
            inputs = [rank_input(seed, q, n, dtype, op) for q in range(w)]
            want = reference(inputs, op, dtype)
            scale = None
            if op in ("sum", "avg"):
                scale = torch.stack([x.double().abs() for x in inputs]).sum(0) / (w if op == "avg" else 1)
            mode = MODES[(i + SIZES.index(n)) % len(MODES)]  # every mode meets every op and size
            out = reduce_in_mode(comm, mode, inputs[r], op)
            try:
                assert_matches(out, want, dtype, op, scale)
            except AssertionError as e:
                raise AssertionError(f"{nodes.name} {op} ({mode}): {e}") from None
            assert nodes.same_bits(out), f"{nodes.name} {op} ({mode}): ranks differ"


def test_back_to_back_calls_without_sync_across_nodes(node_layouts):
    for nodes in each_layout(node_layouts):
        comm, w, r = nodes.comm, nodes.comm.world_size, nodes.comm.rank
        n = 3000
        sym = comm.empty(n, torch.float32)
        outs = []
        for i in range(100):
            x = torch.full((n,), float(i * w + r)) + torch.arange(n)
            if i % 2:
                sym.copy_(x)
                outs.append(comm.all_reduce(sym))
            else:
                outs.append(comm.all_reduce(x))
        for i, out in enumerate(outs):
            want = sum(float(i * w + q) for q in range(w)) + w * torch.arange(n, dtype=torch.float64)
            assert torch.equal(out.double(), want), f"{nodes.name}: call {i} wrong"


def still_works(comm):
    out = comm.all_reduce(torch.ones(3) * (comm.rank + 1))
    assert torch.equal(out, torch.ones(3) * sum(range(1, comm.world_size + 1)))


def test_bad_input_raises_on_every_rank_of_every_node(node_layouts):
    for nodes in each_layout(node_layouts):
        comm, w, r = nodes.comm, nodes.comm.world_size, nodes.comm.rank
        last = w - 1  # on the last node
        x = torch.zeros(4, 4)
        if r == last:
            x = x.t()
        with pytest.raises(p2pcomm.InvalidArgumentError if r == last else p2pcomm.MismatchError,
                           match="contiguous" if r == last else f"rank {last}"):
            comm.all_reduce(x)
        with pytest.raises(p2pcomm.UnsupportedError, match="unknown reduce op"):
            comm.all_reduce(torch.ones(2), op="xor")
        node = comm.node
        with pytest.raises(p2pcomm.MismatchError, match="disagree"):
            comm.all_reduce(torch.ones(10 + node))  # each node agrees inside; the nodes differ
        with pytest.raises(p2pcomm.MismatchError, match="disagree"):
            comm.all_reduce(torch.ones(10, dtype=torch.float32 if node == 0 else torch.float64))
        with pytest.raises(p2pcomm.MismatchError, match="disagree"):
            comm.all_reduce(torch.ones(10), op="sum" if node == 0 else "max")
        still_works(comm)


def test_oversize_tensor_raises_capacity_error_on_every_rank(group, monkeypatch):
    monkeypatch.setenv("P2PCOMM_STAGING_BYTES", str(64 << 10))
    monkeypatch.setenv("P2PCOMM_LOCAL_SIZE", "1")
    with p2pcomm.Communicator(group, device="cpu") as comm:
        n = (64 << 10) if comm.rank == 0 else 16
        with pytest.raises(p2pcomm.CapacityError if comm.rank == 0 else p2pcomm.MismatchError):
            comm.all_reduce(torch.ones(n))
        big = comm.empty(64 << 10)  # across nodes, results pass through staging: symmetric inputs too
        with pytest.raises(p2pcomm.CapacityError, match="staging"):
            comm.all_reduce_(big)
        still_works(comm)


def test_uneven_nodes_are_unsupported_on_every_rank(group, monkeypatch):
    w = dist.get_world_size()
    monkeypatch.setenv("P2PCOMM_LOCAL_SIZE", str(w - 1))  # nodes of w-1 ranks and of 1
    with p2pcomm.Communicator(group, device="cpu") as comm:
        if w == 2:
            still_works(comm)  # two nodes of one rank each: even
            return
        with pytest.raises(p2pcomm.UnsupportedError, match="same number of ranks on every node"):
            comm.all_reduce(torch.ones(4))
        comm.barrier()
