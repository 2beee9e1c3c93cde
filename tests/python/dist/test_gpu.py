"""GPU-only behaviour: CUDA graphs, torch.compile, subgroups, a rank that
never arrives, bad GPU inputs. Skips without GPUs (see conftest)."""

import time

import pytest
import torch
import torch.distributed as dist

import p2pcomm
from conftest import GPU_ONLY, same_on_all_ranks
from p2pcomm.communicator import local_cuda_index
from test_gpu_matrix import make_input

pytestmark = GPU_ONLY


def expected_sum(fill, w, n, dtype=torch.float32):
    return sum(fill(q) for q in range(w)).to(dtype)


def captured(step):
    """Run step() once on a side stream (kernels compile outside capture),
    then capture it into a CUDA graph; returns (graph, what it returned
    during capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def replay_checked(comm, graph, x, out, seed):
    """Fill x with this rank's part of fresh random data, replay graph (an
    all-reduce of x into out) and check out against the float64 sum of every
    rank's part; returns that sum and the error scale."""
    n, w = x.numel(), comm.world_size
    parts = [torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + q))
             for q in range(w)]
    x.copy_(parts[comm.rank])
    out.fill_(float("nan"))
    graph.replay()
    want = torch.stack(parts).double().sum(0)
    scale = torch.stack(parts).double().abs().sum(0) + 1e-3
    assert ((out.double() - want).abs() <= 1e-5 * scale).all(), f"replay (seed {seed}) wrong"
    return want, scale


@pytest.mark.parametrize("algorithm", ["auto", "oneshot", "twoshot", "ring", "recursive_doubling", "oneshot_ll", "twoshot_ll",
                                       "oneshot_push", "twoshot_push", "oneshot_ll128", "oneshot_lamport",
                                       "twoshot_lamport"])
def test_cuda_graph_replays_with_new_inputs(comms, algorithm):
    comm = comms("cuda")
    w, r = comm.world_size, comm.rank
    n = 70_001
    static_in = torch.empty(n, device="cuda")
    registered = comm.empty(n)

    def step():
        out = comm.all_reduce(static_in, algorithm=algorithm)
        comm.all_reduce_(registered, algorithm=algorithm)
        return out

    graph, static_out = captured(step)
    for i in range(100):
        g = torch.Generator(device="cuda").manual_seed(1000 * i + r)
        fresh = torch.randn(n, device="cuda", generator=g)
        static_in.copy_(fresh)
        registered.copy_(fresh)
        static_out.fill_(float("nan"))
        graph.replay()
        parts = [torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1000 * i + q))
                 for q in range(w)]
        want = torch.stack(parts).double().sum(0)
        scale = torch.stack(parts).double().abs().sum(0) + 1e-3
        for got in (static_out, registered):
            assert ((got.double() - want).abs() <= 1e-5 * scale).all(), f"replay {i} wrong"
    assert same_on_all_ranks(static_out)


def test_register_graph_buffers_then_replays_read_in_place(comms):
    """Two-shot calls captured on unregistered inputs (one of them allocated
    inside the graph) stage on replay until register_graph_buffers readies
    their slots; then they read the inputs in place. Results must be right
    before and after, on fresh data every replay."""
    comm = comms("cuda")
    comm.register_graph_buffers()  # what earlier tests captured on this communicator
    w, r = comm.world_size, comm.rank
    n = 1_000_003
    static_in = torch.empty(n, device="cuda")

    def step():
        first = comm.all_reduce(static_in, algorithm="twoshot")
        return first, comm.all_reduce(first * 0.5, algorithm="twoshot")

    graph, (first, second) = captured(step)

    def replay_and_check(i):
        parts = [torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(77 * i + q))
                 for q in range(w)]
        static_in.copy_(parts[r])
        first.fill_(float("nan"))
        second.fill_(float("nan"))
        graph.replay()
        want = torch.stack(parts).double().sum(0)
        scale = torch.stack(parts).double().abs().sum(0) + 1e-3
        assert ((first.double() - want).abs() <= 1e-5 * scale).all(), f"replay {i}: first all-reduce wrong"
        assert ((second.double() - 0.5 * w * want).abs() <= 1e-5 * w * scale).all(), f"replay {i}: second wrong"
        assert same_on_all_ranks(second)

    replay_and_check(0)
    assert comm.register_graph_buffers() == 2
    assert comm.register_graph_buffers() == 0  # nothing new captured
    for i in range(1, 21):
        replay_and_check(i)
    comm.check()


def test_register_graph_buffers_skips_inputs_freed_since_capture(comms):
    """A captured input that one rank freed before register_graph_buffers
    (graph deleted, memory back to CUDA) is skipped on every rank, without
    an error; the next capture registers and replays as usual."""
    comm = comms("cuda")
    comm.register_graph_buffers()  # what earlier tests captured on this communicator
    r = comm.rank
    n = 5 << 20  # 20 MiB: a segment of its own, which empty_cache gives back to CUDA

    def capture():
        x = torch.empty(n, device="cuda")
        graph, out = captured(lambda: comm.all_reduce(x, algorithm="twoshot"))
        return x, graph, out

    x, graph, out = capture()
    torch.cuda.synchronize()
    if r == 0:
        del x, graph, out
        torch.cuda.empty_cache()
    assert comm.register_graph_buffers() == 0
    x, graph, out = capture()
    assert comm.register_graph_buffers() == 1
    for i in range(3):
        replay_checked(comm, graph, x, out, 91 * i)
    comm.check()


def test_graph_buffers_stay_private_to_their_graphs(comms):
    """register_graph_buffers lets a graph's replays read its inputs in
    place; calls outside the graph on that memory must still stage it, since
    each rank's tensor there is its own (here: slices at offsets that differ
    by rank, the rest of the input poisoned)."""
    comm = comms("cuda")
    comm.register_graph_buffers()  # what earlier tests captured on this communicator
    w, r = comm.world_size, comm.rank
    n = 1 << 20
    x = torch.empty(n, device="cuda")
    graph, out = captured(lambda: comm.all_reduce(x, algorithm="twoshot"))
    assert comm.register_graph_buffers() == 1
    m = n - 1000 * w
    want = w * torch.arange(m, device="cuda", dtype=torch.float64) + sum(range(w))
    for algorithm in ("twoshot", "oneshot"):
        x.fill_(float("nan"))
        mine = x[1000 * r: 1000 * r + m]
        mine.copy_(torch.arange(m, device="cuda", dtype=torch.float32) + r)
        got = comm.all_reduce(mine, algorithm=algorithm)
        assert torch.equal(got.double(), want), f"{algorithm} on a slice of a graph's input read a peer's memory"
        torch.cuda.synchronize()
        dist.barrier()  # peers done with this x before it is poisoned again
    replay_checked(comm, graph, x, out, 5)  # after the eager calls
    comm.check()


def test_torch_compile_fullgraph(comms):
    comm = comms("cuda")

    @torch.compile(fullgraph=True)
    def step(x):
        y = comm.all_reduce(x * 2)
        return y + 1

    x = torch.full((1024,), float(comm.rank + 1), device="cuda")
    out = step(x)
    w = comm.world_size
    assert torch.equal(out, torch.full_like(x, 2 * w * (w + 1) / 2 + 1))


def test_registered_buffer_from_caching_allocator(comms):
    comm = comms("cuda")
    big = torch.empty(3 << 20, device="cuda")  # one caching-allocator block
    views = [big[: 1 << 20], big[1 << 20: 2 << 20]]
    for v in views:
        comm.register_buffer(v)
    for k, v in enumerate(views):
        v.fill_(comm.rank + k)
        comm.all_reduce_(v)
        assert torch.equal(v, torch.full_like(v, sum(q + k for q in range(comm.world_size))))
    for v in views:
        comm.deregister_buffer(v)


def test_in_place_reads_that_disagree_raise(comms):
    """Peers read a registered input in place, at its offset in their own
    counterpart of the buffer: ranks whose inputs sit at other offsets, or
    of which one passes a registered tensor and another an unregistered one,
    raise MismatchError on every rank instead of reading the wrong bytes, and
    the communicator stays usable."""
    comm = comms("cuda")
    w, r = comm.world_size, comm.rank
    k = 100_000
    buf, other = comm.empty(k + 1024 * w), comm.empty(k)
    cases = {"offsets differ": lambda: buf[1024 * r: 1024 * r + k],
             "registered on rank 0 only": lambda: buf[:k] if r == 0 else torch.empty(k, device="cuda"),
             "buffers differ": lambda: buf[:k] if r == 0 else other}
    for name, make in cases.items():
        x = make()
        x.fill_(1.0)
        with pytest.raises(p2pcomm.MismatchError, match="disagree"):
            comm.all_reduce(x, algorithm="twoshot")
            torch.cuda.synchronize()
            comm.check()
        torch.cuda.synchronize()
        comm.check()
        out = comm.all_reduce(torch.ones(300_000, device="cuda"))
        assert torch.equal(out, torch.full_like(out, float(w))), f"after {name}"
    x = buf[1024: 1024 + k]  # the same offset on every rank: read in place, right
    x.copy_(torch.arange(k, device="cuda", dtype=torch.float32) + r)
    got = comm.all_reduce(x, algorithm="twoshot")
    assert torch.equal(got.double(), w * torch.arange(k, device="cuda", dtype=torch.float64) + sum(range(w)))
    torch.cuda.synchronize()
    comm.check()


def test_too_big_to_stage_on_some_ranks_fails_together(group, monkeypatch):
    """A tensor larger than the staging buffer can only be read in place:
    when rank 0 registered it and the others did not, they raise
    CapacityError and rank 0 MismatchError, no rank waits for a peer, and
    all stay usable; when no rank can stage it, each raises CapacityError."""
    monkeypatch.setenv("P2PCOMM_STAGING_BYTES", str(1 << 20))
    torch.cuda.set_device(local_cuda_index())
    with p2pcomm.Communicator(group, device=torch.cuda.current_device()) as comm:
        w, r = comm.world_size, comm.rank
        n = 1 << 19  # 2 MiB of float32, twice the staging capacity
        big = comm.empty(n)  # collective: every rank allocates it, rank 0 alone uses it
        x = big if r == 0 else torch.empty(n, device="cuda")
        x.fill_(1.0)
        # One-shot: reading in place, it needs no scratch (two-shot's is as big as staging).
        with pytest.raises(p2pcomm.MismatchError if r == 0 else p2pcomm.CapacityError):
            comm.all_reduce(x, algorithm="oneshot")
            torch.cuda.synchronize()
            comm.check()
        for _ in range(2):
            torch.cuda.synchronize()
            comm.check()
            out = comm.all_reduce(torch.ones(1000, device="cuda"))
            assert torch.equal(out, torch.full_like(out, float(w)))
            with pytest.raises(p2pcomm.CapacityError, match="staging capacity"):
                comm.all_reduce(torch.ones(n, device="cuda"), algorithm="twoshot")


def test_subgroups_run_side_by_side(group):
    w, r = dist.get_world_size(), dist.get_rank()
    if w < 4 or w % 2:
        pytest.skip("subgroups of pairs need an even world of 4 ranks or more")
    pairs = [dist.new_group([q, q + 1]) for q in range(0, w, 2)]  # every rank makes every group
    mine = pairs[r // 2]
    with p2pcomm.Communicator(mine, device=torch.cuda.current_device()) as pair:
        with p2pcomm.Communicator(group, device=torch.cuda.current_device()) as world:
            assert pair.world_size == 2 and world.world_size == w
            for i in range(20):
                a = pair.all_reduce(torch.full((5000,), float(r + i), device="cuda"))
                b = world.all_reduce(torch.full((5000,), float(r * i), device="cuda"))
                base = (r // 2) * 2
                assert torch.equal(a, torch.full_like(a, float(base + i + base + 1 + i)))
                assert torch.equal(b, torch.full_like(b, float(sum(q * i for q in range(w)))))


def test_bad_gpu_inputs(comms):
    comm = comms("cuda")
    with pytest.raises(p2pcomm.InvalidArgumentError, match="on cpu"):
        comm.all_reduce(torch.ones(4))
    if torch.cuda.device_count() > 1:
        other = (torch.cuda.current_device() + 1) % torch.cuda.device_count()
        with pytest.raises(p2pcomm.InvalidArgumentError, match=f"cuda:{other}"):
            comm.all_reduce(torch.ones(4, device=f"cuda:{other}"))
    with pytest.raises(p2pcomm.CapacityError):
        comm.all_reduce(torch.empty((512 << 20) // 4 + 1, device="cuda"))
    with pytest.raises(p2pcomm.MismatchError, match="disagree"):
        comm.all_reduce(torch.ones(100 + comm.rank, device="cuda"))
        torch.cuda.synchronize()
        comm.check()
    torch.cuda.synchronize()
    comm.check()  # reported once, then the communicator is usable
    out = comm.all_reduce(torch.ones(8, device="cuda"))
    assert torch.equal(out, torch.full_like(out, comm.world_size))


def test_thousand_calls_without_sync(comms):
    """1000 calls back to back, no host sync, cycling through every
    algorithm and sizes that cross the protocol boundaries: buffer halves,
    epochs and flags must never let a call see another call's data."""
    comm = comms("cuda")
    w, r = comm.world_size, comm.rank
    algos = [a for a in p2pcomm.ALGORITHMS]
    sizes = [1000, 20_001, 3, 100_000, 600_000]
    outs = []
    for i in range(1000):
        n = sizes[i % len(sizes)]
        x = torch.arange(n, device="cuda", dtype=torch.float32) + float(i * w + r)
        outs.append(comm.all_reduce(x, algorithm=algos[(i // len(sizes)) % len(algos)]))
    torch.cuda.synchronize()
    comm.check()
    for i, out in enumerate(outs):
        n = out.numel()
        want = w * torch.arange(n, device="cuda", dtype=torch.float64) + sum(float(i * w + q) for q in range(w))
        assert torch.equal(out.double(), want), f"call {i} ({n} elements) wrong"


@pytest.mark.parametrize("sizes", [(1000, 40_000), (0, 8), (8, 0)], ids=["small-vs-medium", "empty-first", "empty-second"])
def test_calls_of_different_sizes_fail_together(comms, sizes):
    """Under auto these pick different LL grids and kernels (oneshot_ll on 16
    blocks against oneshot_lamport on 64), or one rank has nothing to send:
    every rank
    still raises MismatchError, none times out. (Calls so different that one
    rank takes an LL kernel and another a barrier kernel time out instead:
    README, Errors.)"""
    comm = comms("cuda")
    n = sizes[0] if comm.rank == 0 else sizes[1]
    with pytest.raises(p2pcomm.MismatchError, match="disagree"):
        comm.all_reduce(torch.ones(n, device="cuda"))
        torch.cuda.synchronize()
        comm.check()
    torch.cuda.synchronize()
    comm.check()
    out = comm.all_reduce(torch.ones(300_000, device="cuda"))
    assert torch.equal(out, torch.full_like(out, comm.world_size))


@pytest.mark.parametrize("op", ["sum", "max", "MAX", dist.ReduceOp.MAX], ids=["sum", "max", "MAX", "dist-MAX"])
def test_rejected_call_meets_its_peers_kernel(comms, op):
    """Rank 1 passes a strided tensor of 1.5 MiB of bf16, its peers a
    contiguous one: rank 1 raises its own error and every other rank
    MismatchError, none times out, whether auto takes the Lamport two-shot
    there (sum, on two ranks) or the two-shot (max, however spelled): the
    rejected call carries the op, so it runs the peers' kind of kernel."""
    comm = comms("cuda")
    n = 768 * 1024
    x = torch.ones(2 * n, dtype=torch.bfloat16, device="cuda")
    src = x[::2] if comm.rank == 1 else x[:n]
    with pytest.raises(p2pcomm.InvalidArgumentError if comm.rank == 1 else p2pcomm.MismatchError):
        comm.all_reduce(src, op)
        torch.cuda.synchronize()
        comm.check()
    torch.cuda.synchronize()
    comm.check()
    out = comm.all_reduce(x[:n], op)
    assert torch.equal(out, torch.full_like(out, comm.world_size if op == "sum" else 1))


def test_rank_that_never_arrives(group, monkeypatch):
    monkeypatch.setenv("P2PCOMM_TIMEOUT_MS", "2000")
    comm = p2pcomm.Communicator(group, device=torch.cuda.current_device())
    comm.all_reduce(torch.ones(8, device="cuda"))
    torch.cuda.synchronize()
    dist.barrier()
    if comm.rank != 1:
        start = time.monotonic()
        comm.all_reduce(torch.ones(8, device="cuda"))  # rank 1 never comes
        torch.cuda.synchronize()  # the kernel gives up after the timeout
        assert time.monotonic() - start < 20
        with pytest.raises(p2pcomm.PeerTimeoutError, match="rank 1 never arrived"):
            comm.check()
        with pytest.raises(p2pcomm.PeerTimeoutError):
            comm.all_reduce(torch.ones(8, device="cuda"))
    dist.barrier()
    comm.close()


def test_memory_cuda_ipc_cannot_export(comms):
    """torch's expandable segments come from cuMemCreate, which CUDA IPC
    cannot export: register_buffer says so on every rank, register_graph_buffers
    skips such inputs (their replays stage), and every call stays right."""
    comm = comms("cuda")
    comm.register_graph_buffers()  # what earlier tests captured on this communicator
    n = 1 << 20

    def check():  # its tensors and graph are gone when it returns
        # Larger than any cached segment, so that the allocator makes a new
        # (expandable) one rather than reuse a free block of an old one.
        big = max((s["total_size"] for s in torch.cuda.memory_snapshot()), default=0) + 4 * n
        x = torch.empty(big, dtype=torch.uint8, device="cuda")[: 4 * n].view(torch.float32)
        seg = [s for s in torch.cuda.memory_snapshot()
               if s["address"] <= x.data_ptr() < s["address"] + s["total_size"]]
        assert seg and seg[0].get("is_expandable"), "x is not in an expandable segment"
        with pytest.raises(p2pcomm.InvalidArgumentError, match="expandable_segments"):
            comm.register_buffer(x)
        graph, out = captured(lambda: comm.all_reduce(x, algorithm="twoshot"))
        assert comm.register_graph_buffers() == 0
        for i in range(3):
            want, scale = replay_checked(comm, graph, x, out, 13 * i)
            eager = comm.all_reduce(x, algorithm="twoshot")
            assert ((eager.double() - want).abs() <= 1e-5 * scale).all(), f"eager call {i} wrong"
        comm.check()
        torch.cuda.synchronize()

    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:
        check()
    finally:
        # Later tests register tensors: none may land in an expandable segment.
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        torch.cuda.empty_cache()


def test_close_gives_back_the_gpu_memory_it_took(group):
    """Communicators made and closed one after another (an all-reduce and an
    ExpertParallel round each) leave the GPU's free memory where the first left it."""
    torch.cuda.set_device(local_cuda_index())

    def one_round():
        with p2pcomm.Communicator(group=group, device="cuda") as comm:
            w = comm.world_size
            y = comm.all_reduce(torch.full((1 << 16,), comm.rank + 1.0, device="cuda"))
            assert torch.equal(y, torch.full_like(y, w * (w + 1) / 2))
            with p2pcomm.ExpertParallel(comm, num_experts=2 * w, hidden=256, max_tokens_per_rank=32, topk=2,
                                        dtype=torch.bfloat16) as ep:
                idx = torch.randint(0, 2 * w, (32, 2), device="cuda")
                recv = ep.dispatch(torch.randn(32, 256, device="cuda", dtype=torch.bfloat16), idx,
                                   torch.rand(32, 2, device="cuda"))
                ep.combine(recv.x, recv)
            torch.cuda.synchronize()
        torch.cuda.empty_cache()
        dist.barrier()

    one_round()
    free_after_first = torch.cuda.mem_get_info()[0]
    for _ in range(10):
        one_round()
    lost = free_after_first - torch.cuda.mem_get_info()[0]
    assert lost <= 2 << 20, f"10 communicators made and closed took {lost / 2**20:.1f} MiB for good"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32],
                         ids=lambda d: str(d).split(".")[1])
def test_two_shot_in_place_on_registered_buffers(comms, dtype):
    """Two-shot in place on comm.empty memory: peers store each reduced slice
    straight into every rank's buffer (on two ranks at every size, on more up
    to 16 MiB) or gather it by reading (beyond): every op and element right
    against a float64 reduction, the same bits on every rank."""
    comm = comms("cuda")
    w, r = comm.world_size, comm.rank
    sizes = [1, 7, 4097, (1 << 20) + 3, (9 << 20) // dtype.itemsize + 5, (17 << 20) // dtype.itemsize + 5]
    buf = comm.empty(max(sizes), dtype=dtype)
    for si, n in enumerate(sizes):
        for oi, op in enumerate(["sum", "prod", "min", "max", "avg"]):
            parts = [make_input(n, dtype, op, q, si * 8 + oi) for q in range(w)]
            wide = torch.stack([p.double() if dtype.is_floating_point else p.long() for p in parts])
            want = {"sum": lambda: wide.sum(0), "prod": lambda: wide.prod(0), "min": lambda: wide.amin(0),
                    "max": lambda: wide.amax(0),
                    "avg": lambda: wide.sum(0) / w if dtype.is_floating_point
                    else torch.div(wide.sum(0), w, rounding_mode="floor")}[op]()
            buf.fill_(-1)
            x = buf[:n]
            x.copy_(parts[r])
            assert comm.all_reduce_(x, op, algorithm="twoshot") is x
            torch.cuda.synchronize()
            comm.check()
            assert torch.equal(buf[n:], torch.full_like(buf[n:], -1)), f"{op} n={n}: wrote past the tensor"
            if dtype.is_floating_point:
                tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-2)
                scale = wide.abs().sum(0) if op in ("sum", "avg") else wide.abs().prod(0) if op == "prod" else 1.0
                bad = (x.double() - want).abs() > tol * (scale + 1e-3) + want.abs() * (tol if op == "prod" else 0)
                assert not bad.any(), f"{op} n={n}: {int(bad.sum())} of {n} elements wrong"
            else:
                assert torch.equal(x.long(), want), f"{op} n={n}"
            assert same_on_all_ranks(x), f"{op} n={n}: ranks differ"


def check_every_op_at(comm, algorithm, dtype, sizes, seed):
    """Every op at each of sizes with algorithm, in place on comm.empty memory
    and from ordinary tensors: every element against a float64 reduction
    (exact for integers, min and max), nothing written past the output, in
    place and out of place alike, the same bits on every rank."""
    w, r = comm.world_size, comm.rank
    buf = comm.empty(max(sizes) + 64, dtype=dtype)
    for si, n in enumerate(sizes):
        for oi, op in enumerate(["sum", "prod", "min", "max", "avg"]):
            parts = [make_input(n, dtype, op, q, seed + si * 8 + oi) for q in range(w)]
            wide = torch.stack([p.double() if dtype.is_floating_point else p.long() for p in parts])
            want = {"sum": lambda: wide.sum(0), "prod": lambda: wide.prod(0), "min": lambda: wide.amin(0),
                    "max": lambda: wide.amax(0),
                    "avg": lambda: wide.sum(0) / w if dtype.is_floating_point
                    else torch.div(wide.sum(0), w, rounding_mode="floor")}[op]()
            poison = float("nan") if dtype.is_floating_point else -7
            buf.fill_(poison)
            placed = buf[:n]
            placed.copy_(parts[r])
            plain = parts[r].clone()
            out = torch.full_like(plain, poison)
            comm.all_reduce_(placed, op, algorithm=algorithm)
            comm._reduce(plain, out, op, algorithm)
            torch.cuda.synchronize()
            comm.check()
            past = buf[n:].isnan() if dtype.is_floating_point else buf[n:] == poison
            assert past.all(), f"{op} n={n}: wrote past the tensor"
            for got in (placed, out):
                if dtype.is_floating_point and op not in ("min", "max"):
                    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-2)
                    scale = wide.abs().sum(0) if op in ("sum", "avg") else wide.abs().prod(0)
                    bad = (got.double() - want).abs() > tol * (scale + 1e-3) + want.abs() * (tol if op == "prod" else 0)
                    assert not bad.any(), f"{op} n={n}: {int(bad.sum())} of {n} elements wrong"
                else:
                    assert torch.equal(got.double() if dtype.is_floating_point else got.long(), want), f"{op} n={n}"
            assert torch.equal(placed, out), f"{op} n={n}: in place and out of place differ"
            assert same_on_all_ranks(out), f"{op} n={n}: ranks differ"


# The LL kernels run 64 blocks of 512 threads from 64 KiB to 256 KiB, and 128
# above on two ranks (64 on more; fewer on GPUs with fewer SMs or shared
# ones); a thread takes every (threads)th 8-byte line. A slot holds 1 MiB:
# the largest oneshot_ll call, and the largest slice of a twoshot_ll call
# (golib/gpucoll llMaxPayload).
LL_THREADS, LL_MAX = 128 * 512, 1 << 20


@pytest.mark.parametrize("algorithm", ["oneshot_ll", "twoshot_ll"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.int64],
                         ids=lambda d: str(d).split(".")[1])
def test_ll_threads_with_several_lines(comms, algorithm, dtype):
    """The LL kernels where threads have one line or several, at the largest
    call and past what the slots hold (the plain kernels then), every op
    (check_every_op_at)."""
    comm = comms("cuda")
    e = dtype.itemsize
    # Grids go by the call's bytes, a thread's lines by what it sends: the
    # whole input (oneshot_ll) or a slice of it (twoshot_ll).
    per = 1 if algorithm == "oneshot_ll" else comm.world_size
    most = per * LL_MAX
    line = 8 // e if e < 8 else 1
    sizes = sorted({64 * 1024 // e + 1, 256 * 1024 // e, 256 * 1024 // e + 1, per * LL_THREADS * 8 // e,
                    per * LL_THREADS * 8 // e + line, 3 * per * LL_THREADS * 4 // e + 5 * line + 1,
                    most // e - line, most // e, most // e + 1})
    check_every_op_at(comm, algorithm, dtype, sizes, 300)


# LL128 lines carry 120 data bytes, groups of four lines 480, a warp's step;
# the largest call fills two LL slots (golib/gpucoll ll128MaxPayload).
LL128_MAX = 2 * (2 << 20) // 512 * 480


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.int32,
                                   torch.int64], ids=lambda d: str(d).split(".")[1])
def test_ll128_lines_groups_and_tails(comms, dtype):
    """oneshot_ll128 at sizes around its lines, groups, grids (16 blocks to
    64 KiB, 64 to 256 KiB, then 128 on two ranks) and their steps, its
    largest call and one past it (the plain one-shot), every op
    (check_every_op_at)."""
    comm = comms("cuda")
    e = dtype.itemsize
    sizes = sorted({1, 3, 120 // e, 120 // e + 1, 480 // e - 1, 480 // e, 480 // e + 1, 7 * 480 // e + 3,
                    16 * 16 * 480 // e + 5, 64 * 1024 // e + 1, 64 * 16 * 480 // e + 5, 256 * 1024 // e,
                    128 * 16 * 480 // e, 128 * 16 * 480 // e + 5, (1 << 20) // e + 3, LL128_MAX // e,
                    LL128_MAX // e + 1})
    check_every_op_at(comm, "oneshot_ll128", dtype, sizes, 100)


# Lamport areas: 8 MiB per call parity shared by the world's ranks (golib/gpucoll
# lamportHalfBytes). Each block takes an even run of 16-byte vectors, in whole
# warps' worth, and each thread one vector at a time.
# The two-shot splits the input into world slices of whole vectors; a slice
# and its result share one area.
LAMPORT = ["oneshot_lamport", "twoshot_lamport"]


def lamport_max(world, algorithm="oneshot_lamport"):
    area = (8 << 20) // world // 16 * 16
    return area if algorithm == "oneshot_lamport" else area // 32 * world * 16


@pytest.mark.parametrize("algorithm", LAMPORT)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=lambda d: str(d).split(".")[1])
def test_lamport_vectors_grids_and_tails(comms, dtype, algorithm):
    """The Lamport kernels at sizes around their vectors (tails) and slices
    (some empty), the grids' steps (16 blocks to 64 KiB, 64 to 256 KiB, then
    128 on two ranks), runs that end inside a warp's worth, threads with a
    second vector (past 1 MiB on 128 blocks) and more, the largest call and
    one past it (two-shot), every op (the others run LL128 to 1 MiB, two-shot
    above: check_every_op_at)."""
    comm = comms("cuda")
    e, most = dtype.itemsize, lamport_max(comm.world_size, algorithm)
    sizes = sorted({1, 3, 16 // e - 1, 16 // e + 1, 16 * comm.world_size // e + 1, 16 * 512 * 16 * 4 // e + 3,
                    64 * 1024 // e + 1, 64 * 512 * 16 * 4 // e - 1, 256 * 1024 // e + 16 // e,
                    (1 << 20) // e + 16 // e + 1, 3 * (1 << 20) // e + 5, 128 * 512 * 16 * 4 // e + 5, most // e - 1,
                    most // e, most // e + 1})
    check_every_op_at(comm, algorithm, dtype, sizes, 500)


def zeros_of_both_signs(n, dtype, rank, seed):
    """Random values, 30% of them +0 and 30% -0."""
    g = torch.Generator(device="cuda").manual_seed(seed * 16 + rank)
    x = torch.randn(n, device="cuda", generator=g).to(dtype)
    pick = torch.rand(n, device="cuda", generator=g)
    x[pick < 0.3] = 0.0
    x[pick > 0.7] = -0.0
    return x


def randn_of(n, dtype, rank, seed):
    return torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed * 16 + rank)).to(dtype)


def check_sum(parts, got, tol, what):
    want = torch.stack(parts).double().sum(0)
    scale = torch.stack(parts).double().abs().sum(0) + 1e-3
    bad = (got.double() - want).abs() > tol * scale
    assert not bad.any(), f"{what}: {int(bad.sum())} of {got.numel()} elements wrong"
    assert same_on_all_ranks(got), f"{what}: ranks differ"


@pytest.mark.parametrize("algorithm", LAMPORT)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d).split(".")[1])
def test_lamport_inputs_that_look_free(comms, dtype, algorithm):
    """Inputs full of zeros of both signs, among them words equal to the
    free sentinel (0x80000000: -0.0f, or the 16-bit pair +0, -0), still
    arrive: the sums are right (only the sign of a zero may change), the
    same on every rank; and calls of other sizes after them are right too
    (nothing was left behind as if it had arrived)."""
    comm = comms("cuda")
    w, r = comm.world_size, comm.rank
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for n in (8191, 300_001):
        parts = [zeros_of_both_signs(n, dtype, q, n) for q in range(w)]
        out = torch.full_like(parts[r], float("nan"))
        comm._reduce(parts[r], out, "sum", algorithm)
        torch.cuda.synchronize()
        comm.check()
        check_sum(parts, out, tol, f"zeros n={n}")
    for i, n in enumerate((5, 4096, 123_457, 1 << 20, 17)):
        parts = [randn_of(n, dtype, q, 40 + i) for q in range(w)]
        got = comm.all_reduce(parts[r], algorithm=algorithm)
        torch.cuda.synchronize()
        check_sum(parts, got, tol, f"n={n} after the zeros")


@pytest.mark.parametrize("mine,other", [("oneshot_lamport", "oneshot_lamport"), ("oneshot_lamport", "oneshot_ll"),
                                        ("oneshot_lamport", "oneshot_ll128"), ("twoshot_lamport", "twoshot_lamport"),
                                        ("twoshot_lamport", "oneshot_lamport"), ("twoshot_lamport", "oneshot_ll")])
def test_lamport_mismatch_leaves_the_areas_free(comms, mine, other):
    """Rank 0 makes a Lamport call while its peers make another (a longer
    call of the same kind, or the same size on another Lamport kernel, LL or
    LL128): every rank raises MismatchError, and the calls of rank 0's kind
    after it, on both call parities and at the larger size, reduce right (a
    sender frees what nobody read)."""
    comm = comms("cuda")
    w, r = comm.world_size, comm.rank
    n = 200_003
    x = torch.full((n + 4096,), float(r + 1), device="cuda")
    with pytest.raises(p2pcomm.MismatchError, match="disagree"):
        if r == 0:
            comm.all_reduce(x[:n], algorithm=mine)
        else:
            comm.all_reduce(x if other == mine else x[:n], algorithm=other)
        torch.cuda.synchronize()
        comm.check()
    torch.cuda.synchronize()
    comm.check()
    # Then one-shots over the whole area on both parities: a two-shot reads
    # only part of what a peer's one-shot may have left behind.
    calls = [(n + 4096, mine), (n, mine), (n + 4096, mine), (999, mine), (n + 4096, mine),
             (n + 4096, "oneshot_lamport"), (n + 4096, "oneshot_lamport")]
    for i, (k, algorithm) in enumerate(calls):
        parts = [randn_of(k, torch.float32, q, 60 + i) for q in range(w)]
        got = comm.all_reduce(parts[r], algorithm=algorithm)
        torch.cuda.synchronize()
        check_sum(parts, got, 1e-5, f"call {i} ({algorithm}) of {k} after the mismatch")


@pytest.mark.parametrize("k", [100_000, 9 * 2**20 // 4 + 5])
def test_two_shot_in_place_and_out_of_place_do_not_pair(comms, k):
    """One rank reduces a registered tensor in place, its peers the same
    tensor into new ones: peers would store results into the in-place rank's
    buffer while it reads scratch, so every rank raises MismatchError, the
    inputs stay intact, and the communicator stays usable. Both sizes store
    directly (the larger one past the 8 MiB pull limit of other calls)."""
    comm = comms("cuda")
    w, r = comm.world_size, comm.rank
    x = comm.empty(k)
    x.fill_(float(r + 1))
    with pytest.raises(p2pcomm.MismatchError, match="disagree"):
        if r == 0:
            comm.all_reduce_(x, algorithm="twoshot")
        else:
            comm.all_reduce(x, algorithm="twoshot")
        torch.cuda.synchronize()
        comm.check()
    torch.cuda.synchronize()
    comm.check()
    if r != 0:
        assert torch.equal(x, torch.full_like(x, float(r + 1))), "a peer wrote into an out-of-place input"
    x.fill_(float(r + 1))
    comm.all_reduce_(x, algorithm="twoshot")
    assert torch.equal(x, torch.full_like(x, float(w * (w + 1) // 2)))
