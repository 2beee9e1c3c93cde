"""All-reduce across simulated nodes (P2PCOMM_LOCAL_SIZE): the hierarchical algorithm on every op, dtype and
size of the single-node matrix, against a float64 reference, every element, bit-identical on every rank; bad
input on every rank; on GPUs also CUDA graphs. Two ranks run 2 nodes x 1; four run 2 nodes x 2 and, on ranks
0-2, 3 nodes x 1 (at the largest size those two share out the ops, for time). CPU ranks always; GPUs with
P2PCOMM_TEST_GPU=1 (one GPU per rank). Failures of a rank: tests/python/test_nodes_failures.py."""

import importlib.util
import os
import zlib

import pytest
import torch
import torch.distributed as dist

import p2pcomm
from conftest import DEVICES, GPU_ONLY
from p2pcomm.communicator import local_cuda_index
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
        self.name, self.ranks, self.device = name, ranks, device
        self.group = dist.new_group(ranks)  # every rank makes every group, in the same order
        self.member = dist.get_rank() in ranks
        self.comm = None
        if self.member:
            if device == "cuda":
                torch.cuda.set_device(local_cuda_index())
                device = torch.device("cuda", torch.cuda.current_device())
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

    def settle(self):
        """GPU errors are seen asynchronously: wait for the stream, then ask."""
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.comm.check()


@pytest.fixture(scope="module")
def layouts_on(group):
    made = {}

    def get(device):
        if device not in made:
            made[device] = [Nodes(name, local, ranks, device) for name, local, ranks in layouts(dist.get_world_size())]
        return made[device]

    yield get
    for layouts_ in made.values():
        for n in layouts_:
            if n.comm is not None:
                n.comm.close()


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_every_op_matches_torch_across_nodes(layouts_on, device, n, dtype):
    node_layouts = layouts_on(device)
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
            out = reduce_in_mode(comm, mode, inputs[r].to(device), op)
            nodes.settle()
            try:
                assert_matches(out, want, dtype, op, scale)
            except AssertionError as e:
                raise AssertionError(f"{nodes.name} {op} ({mode}): {e}") from None
            assert nodes.same_bits(out), f"{nodes.name} {op} ({mode}): ranks differ"


@pytest.mark.parametrize("device", DEVICES)
def test_back_to_back_calls_without_sync_across_nodes(layouts_on, device):
    for nodes in layouts_on(device):
        if not nodes.member:
            continue
        comm, w, r = nodes.comm, nodes.comm.world_size, nodes.comm.rank
        n = 3000
        sym = comm.empty(n, torch.float32)
        outs = []
        for i in range(100):
            x = torch.full((n,), float(i * w + r), device=device) + torch.arange(n, device=device)
            if i % 2:
                sym.copy_(x)
                outs.append(comm.all_reduce(sym))
            else:
                outs.append(comm.all_reduce(x))
        nodes.settle()
        for i, out in enumerate(outs):
            want = sum(float(i * w + q) for q in range(w)) + w * torch.arange(n, dtype=torch.float64)
            assert torch.equal(out.cpu().double(), want), f"{nodes.name}: call {i} wrong"


def still_works(comm, device="cpu"):
    out = comm.all_reduce(torch.ones(3, device=device) * (comm.rank + 1))
    assert torch.equal(out.cpu(), torch.ones(3) * sum(range(1, comm.world_size + 1)))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_raises_on_every_rank_of_every_node(layouts_on, device):
    for nodes in layouts_on(device):
        if not nodes.member:
            continue
        comm, w, r = nodes.comm, nodes.comm.world_size, nodes.comm.rank
        last = w - 1  # on the last node
        x = torch.zeros(4, 4, device=device)
        if r == last:
            x = x.t()
        with pytest.raises(p2pcomm.InvalidArgumentError if r == last else p2pcomm.MismatchError,
                           match="contiguous" if r == last else f"rank {last}"):
            comm.all_reduce(x)
            nodes.settle()
        nodes.settle()  # the rejecting rank has nothing more to hear
        with pytest.raises(p2pcomm.UnsupportedError, match="unknown reduce op"):
            comm.all_reduce(torch.ones(2, device=device), op="xor")
        node = comm.node
        for bad in (lambda: torch.ones(10 + node, device=device),  # each node agrees inside; the nodes differ
                    lambda: torch.ones(10, dtype=torch.float32 if node == 0 else torch.float64, device=device)):
            with pytest.raises(p2pcomm.MismatchError, match="disagree"):
                comm.all_reduce(bad())
                nodes.settle()
        with pytest.raises(p2pcomm.MismatchError, match="disagree"):
            comm.all_reduce(torch.ones(10, device=device), op="sum" if node == 0 else "max")
            nodes.settle()
        still_works(comm, device)
        nodes.settle()


@GPU_ONLY
def test_cuda_graph_replays_across_nodes(layouts_on):
    """No host work per call: an all-reduce across nodes captured once replays with new data."""
    for nodes in layouts_on("cuda"):
        if not nodes.member:
            continue
        comm, w, r = nodes.comm, nodes.comm.world_size, nodes.comm.rank
        for dtype, n in ((torch.float32, (1 << 20) + 3), (torch.bfloat16, 4097)):
            x = torch.zeros(n, dtype=dtype, device="cuda")
            comm.all_reduce(x)  # the first call across nodes sets up (outside capture)
            torch.cuda.synchronize()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                comm.all_reduce_(x)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                comm.all_reduce_(x)
            for seed in range(3):
                inputs = [rank_input(seed + 17, q, n, dtype, "sum") for q in range(w)]
                x.copy_(inputs[r])
                graph.replay()
                nodes.settle()
                scale = torch.stack([v.double().abs() for v in inputs]).sum(0)
                assert_matches(x, reference(inputs, "sum", dtype), dtype, "sum", scale)
                assert nodes.same_bits(x), f"{nodes.name}: replay {seed}: ranks differ"
            del graph


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
