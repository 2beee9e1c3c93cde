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
from conftest import DEVICES, GPU_ONLY, same_on_all_ranks
from p2pcomm.communicator import local_cuda_index
from test_allreduce import DTYPES, OPS, SIZES, Expected, assert_matches, poison, rank_input, reference

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
        """True when every member holds the same bytes."""
        return same_on_all_ranks(t, self.group)

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


def bad_elements(got: torch.Tensor, want: torch.Tensor, dtype, op: str, scale=None) -> torch.Tensor:
    """Indices where got misses the reference by assert_matches's own criterion."""
    return Expected(want, dtype, op, scale).misses(got).nonzero().flatten()


def gpu_place(i: int, n: int, dtype, local_size: int, nodes: int) -> str:
    """Where allreduce_hier.cu handles element i: shard (local index), part (owning node), block, chunk."""
    size = torch.tensor([], dtype=dtype).element_size()
    pack = 16 // size
    acc = 8 if dtype in (torch.float64, torch.int64) else 4
    chunk = (256 << 10) // acc

    def cut(count, parts):
        step = -(-count // parts)
        return -(-step // pack) * pack

    shard_size = cut(n, local_size)
    shard = min(i // shard_size, local_size - 1)
    lo, hi = shard * shard_size, min((shard + 1) * shard_size, n)
    part_size = cut(hi - lo, nodes)
    part = (i - lo) // part_size
    k = (i - lo - part * part_size) // chunk
    return f"shard {shard} [{lo}, {hi}), part {part} (node {part}'s), block {k % 8}, chunk {k // 8} of the block"


def describe_bad(nodes, got, want, dtype, op, scale, limit=8) -> str:
    """The first mismatches with their indices, values and GPU placement, and the rank and node that saw them."""
    bad = bad_elements(got, want, dtype, op, scale)
    comm = nodes.comm
    local = len(comm.nodes[0])
    lines = [f"rank {comm.rank} (node {comm.node}) of {nodes.name}: {bad.numel()} of {got.numel()} elements wrong"]
    flat = got.cpu()
    for i in bad[:limit].tolist():
        lines.append(f"  [{i}] got {flat[i].item()!r} want {want[i].item()!r}; "
                     f"{gpu_place(i, got.numel(), dtype, local, len(comm.nodes))}")
    return "\n".join(lines)


def differing_ranks(nodes, t: torch.Tensor) -> str:
    """Which members' results differ from the first member's, and where the first difference lies."""
    mine = t.detach().cpu().contiguous()
    got = [None] * len(nodes.ranks)
    dist.all_gather_object(got, mine, group=nodes.group)
    out = []
    for q, other in enumerate(got):
        diff = (other.view(torch.uint8) != got[0].view(torch.uint8)).nonzero().flatten()
        if diff.numel():
            first = diff[0].item() // other.element_size()
            out.append(f"rank {q} differs from rank 0 first at [{first}]: {other[first].item()!r} vs {got[0][first].item()!r}")
    return "; ".join(out)


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
                detail = describe_bad(nodes, out, want, dtype, op, scale)
                raise AssertionError(f"{nodes.name} {op} ({mode}): {e}\n{detail}") from None
            if not nodes.same_bits(out):
                raise AssertionError(f"{nodes.name} {op} ({mode}): ranks differ: {differing_ranks(nodes, out)}")


@pytest.mark.parametrize("device", DEVICES)
def test_back_to_back_calls_without_sync_across_nodes(layouts_on, device):
    # Small calls skip the results' trip on GPUs (slots by call parity);
    # every fourth call is large enough for the two-trip pipeline, so the
    # two kinds also follow each other without a sync.
    for nodes in layouts_on(device):
        if not nodes.member:
            continue
        comm, w, r = nodes.comm, nodes.comm.world_size, nodes.comm.rank
        syms = {n: comm.empty(n, torch.float32) for n in (3000, 600_000)}
        outs = []
        for i in range(100):
            n = 600_000 if i % 4 == 3 else 3000
            sym = syms[n]
            x = torch.full((n,), float(i * w + r), device=device) + torch.arange(n, device=device)
            if i % 2:
                sym.copy_(x)
                outs.append(comm.all_reduce(sym))
            else:
                outs.append(comm.all_reduce(x))
        nodes.settle()
        for i, out in enumerate(outs):
            n = out.numel()
            want = sum(float(i * w + q) for q in range(w)) + w * torch.arange(n, dtype=torch.float64)
            if not torch.equal(out.cpu().double(), want):
                raise AssertionError(f"{nodes.name}: call {i} wrong\n{describe_bad(nodes, out, want, torch.float32, 'max')}")


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
def test_net_rails_agree_or_raise_on_every_rank(group, monkeypatch):
    """P2PCOMM_NET_RAILS: a bad count on one rank raises on every rank at the first call across nodes; counts that
    differ between ranks settle on the fewest (each rail connects the same rail of every rank)."""
    r, w = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(local_cuda_index())
    monkeypatch.setenv("P2PCOMM_LOCAL_SIZE", "1")
    for counts, ok in (({0: "3"}, False), ({0: "8", w - 1: "2"}, True), ({}, True)):
        if counts:
            monkeypatch.setenv("P2PCOMM_NET_RAILS", counts.get(r, "1"))
        else:
            monkeypatch.delenv("P2PCOMM_NET_RAILS", raising=False)  # the default
        with p2pcomm.Communicator(group, device="cuda") as comm:
            x = torch.randn(300_001, device="cuda", generator=torch.Generator("cuda").manual_seed(r))
            if not ok:
                with pytest.raises(p2pcomm.InvalidArgumentError, match="P2PCOMM_NET_RAILS=3"):
                    comm.all_reduce(x)
                continue
            want = torch.zeros(x.numel(), dtype=torch.float64)
            for q in range(w):
                want += torch.randn(x.numel(), device="cuda", generator=torch.Generator("cuda").manual_seed(q)).cpu().double()
            got = comm.all_reduce(x)
            torch.cuda.synchronize()
            comm.check()
            assert torch.allclose(got.cpu().double(), want, rtol=1e-5, atol=1e-5 * w)


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
                want = reference(inputs, "sum", dtype)
                try:
                    assert_matches(x, want, dtype, "sum", scale)
                except AssertionError as e:
                    detail = describe_bad(nodes, x, want, dtype, "sum", scale)
                    raise AssertionError(f"{nodes.name}: replay {seed}: {e}\n{detail}") from None
                if not nodes.same_bits(x):
                    raise AssertionError(f"{nodes.name}: replay {seed}: ranks differ: {differing_ranks(nodes, x)}")
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
