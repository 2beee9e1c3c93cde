"""all_reduce_residual_rmsnorm on every rank, on both backends.

What is checked, element by element, on outputs poisoned first:
- residual_out bit for bit against comm.all_reduce(x) (the library's sum)
  plus residual, added in float32 and rounded once (rmsnorm.reference);
- residual_out against the float64 sum of every rank's x and the residual,
  within half a unit in the last place of the dtype (relative to the sum of
  magnitudes, plus float32 accumulation);
- normed against a float64 RMSNorm of residual_out times weight: within half
  a unit in the last place of the result plus 1e-4 relative (float32
  arithmetic), plus the dtype's smallest subnormal;
- with the same residual on every rank, both outputs bit-identical on all.
"""

import time
import zlib

import pytest
import torch
import torch.distributed as dist

import p2pcomm
from conftest import DEVICES, GPU_ONLY, same_on_all_ranks
from p2pcomm.communicator import local_cuda_index
from p2pcomm.rmsnorm import reference

DTYPES = [torch.bfloat16, torch.float16]
CPU_SHAPES = [(1, 4096), (7, 16384), (513, 64)]
GPU_SHAPES = [(t, h) for t in (1, 7, 128, 513) for h in (4096, 8192, 16384)]
EPS = 1e-6


def rank_data(seed, rank, rows, hidden, dtype, device, same_residual=False):
    """(x, residual) of rank `rank`, reproducible on every rank; weight is
    shared. Inputs are scaled like activations of a TP layer (x ~ N(0, 1),
    residual ~ N(0, 4))."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
    gr = torch.Generator().manual_seed(seed * 1000 + (0 if same_residual else rank) + 500)
    residual = 2 * torch.randn(rows, hidden, generator=gr, dtype=torch.float64)
    return x.to(dtype).to(device), residual.to(dtype).to(device)


def weight_for(seed, hidden, dtype, device):
    g = torch.Generator().manual_seed(seed + 7)
    return (1 + 0.2 * torch.randn(hidden, generator=g, dtype=torch.float64)).to(dtype).to(device)


def bits(t):
    return t.contiguous().view(torch.int16)


def check_result(comm, x, residual, weight, normed, residual_out, seed, same_residual=False, rounded_once=True):
    """Every element of (normed, residual_out) against the library's
    all-reduce and float64 (see the module doc); rounded_once: the
    all-reduce's sum is checked against float64 too."""
    dtype = x.dtype
    rows, hidden = x.numel() // x.shape[-1], x.shape[-1]
    summed = comm.all_reduce(x)
    _, want_out = reference(summed, residual, weight, EPS)
    assert torch.equal(bits(residual_out), bits(want_out)), \
        f"{(bits(residual_out) != bits(want_out)).sum().item()} residual_out elements differ from all_reduce + residual"
    fi = torch.finfo(dtype)
    if rounded_once:  # the sum itself against float64 (every rank's inputs, rebuilt here)
        dev = x.device
        xs = torch.stack([rank_data(seed, q, rows, hidden, dtype, dev, same_residual)[0].double()
                          for q in range(comm.world_size)])
        exact = xs.sum(0).view(x.shape) + residual.double()
        scale = xs.abs().sum(0).view(x.shape) + residual.double().abs()
        err = (residual_out.double() - exact).abs()
        bad = (err > (fi.eps + 1e-5) * scale + fi.tiny).sum().item()  # two roundings of the dtype's
        assert bad == 0, f"{bad} residual_out elements off the float64 sum; worst {err.max().item():.3g}"
    v = residual_out.double()
    ref = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    err = (normed.double() - ref).abs()
    bound = (fi.eps / 2 + 1e-4) * ref.abs() + fi.tiny * fi.eps
    bad = (err > bound).sum().item()
    assert bad == 0, f"{bad} of {normed.numel()} normed elements off; worst {(err / (ref.abs() + 1e-30)).max().item():.3g}"
    assert torch.isfinite(normed).all() and torch.isfinite(residual_out).all()


def run_case(comm, device, rows, hidden, dtype, algorithm, seed):
    r = comm.rank
    x, residual = rank_data(seed, r, rows, hidden, dtype, device)
    weight = weight_for(seed, hidden, dtype, device)
    x0, res0 = x.clone(), residual.clone()
    # New outputs.
    normed, out = comm.all_reduce_residual_rmsnorm(x, residual, weight, EPS, algorithm=algorithm)
    check_result(comm, x, residual, weight, normed, out, seed)
    assert torch.equal(x, x0) and torch.equal(residual, res0), "inputs were modified"
    # Into given outputs, poisoned first.
    normed_out = torch.full_like(x, float("nan"))
    residual_out = torch.full_like(x, float("nan"))
    res = comm.all_reduce_residual_rmsnorm(x, residual, weight, EPS, residual_out=residual_out,
                                           normed_out=normed_out, algorithm=algorithm)
    assert res.normed is normed_out and res.residual is residual_out
    assert torch.equal(bits(normed_out), bits(normed)) and torch.equal(bits(residual_out), bits(out))
    # In place: residual_out into residual.
    inplace = residual.clone()
    res = comm.all_reduce_residual_rmsnorm(x, inplace, weight, EPS, residual_out=inplace, algorithm=algorithm)
    assert res.residual is inplace
    assert torch.equal(bits(inplace), bits(out)) and torch.equal(bits(res.normed), bits(normed))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_cpu_matches_reference(comms, shape, dtype):
    run_case(comms("cpu"), "cpu", *shape, dtype, "auto", zlib.crc32(f"{shape}{dtype}".encode()) % 10_000)


@GPU_ONLY
@pytest.mark.parametrize("algorithm", ["auto", "oneshot_ll", "oneshot_lamport", "twoshot"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_matches_reference(comms, shape, dtype, algorithm):
    run_case(comms("cuda"), "cuda", *shape, dtype, algorithm, zlib.crc32(f"{shape}{dtype}".encode()) % 10_000)
    torch.cuda.synchronize()
    comms("cuda").check()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", ["auto", "oneshot_ll", "oneshot_lamport", "twoshot"])
def test_same_residual_gives_the_same_bits_on_every_rank(comms, device, algorithm):
    """The tensor-parallel case: every rank holds the same residual."""
    comm = comms(device)
    rows, hidden, dtype, seed = 9, 2048, torch.bfloat16, 31
    x, residual = rank_data(seed, comm.rank, rows, hidden, dtype, device, same_residual=True)
    weight = weight_for(seed, hidden, dtype, device)
    normed, out = comm.all_reduce_residual_rmsnorm(x, residual, weight, EPS, algorithm=algorithm)
    check_result(comm, x, residual, weight, normed, out, seed, same_residual=True)
    assert same_on_all_ranks(normed) and same_on_all_ranks(out)


@pytest.mark.parametrize("device", DEVICES)
def test_shapes_at_the_edges(comms, device):
    """No rows (still a collective), leading dimensions of any shape, the
    smallest row, many calls back to back without a sync."""
    comm = comms(device)
    w = torch.ones(64, dtype=torch.float16, device=device)
    normed, out = comm.all_reduce_residual_rmsnorm(torch.empty(0, 64, dtype=torch.float16, device=device),
                                                   torch.empty(0, 64, dtype=torch.float16, device=device), w)
    assert normed.shape == out.shape == (0, 64)
    x, residual = rank_data(3, comm.rank, 6, 64, torch.float16, device)
    normed, out = comm.all_reduce_residual_rmsnorm(x.view(2, 3, 64), residual.view(2, 3, 64), w, EPS)
    assert normed.shape == out.shape == (2, 3, 64)
    check_result(comm, x, residual, w, normed.view(6, 64), out.view(6, 64), 3)
    x, residual = rank_data(4, comm.rank, 3, 8, torch.bfloat16, device)
    w8 = weight_for(4, 8, torch.bfloat16, device)
    normed, out = comm.all_reduce_residual_rmsnorm(x, residual, w8, EPS)
    check_result(comm, x, residual, w8, normed, out, 4)
    results = [comm.all_reduce_residual_rmsnorm(x, residual, w8, 1e-5 * i) for i in range(50)]
    for i, (normed, out) in enumerate(results):
        want_normed, want_out = comm.all_reduce_residual_rmsnorm(x, residual, w8, 1e-5 * i)
        assert torch.equal(bits(normed), bits(want_normed)) and torch.equal(bits(out), bits(want_out)), f"call {i}"


@GPU_ONLY
@pytest.mark.parametrize("in_place", [False, True], ids=["new-outputs", "in-place"])
@pytest.mark.parametrize("algorithm,shape", [("oneshot_ll", (5, 4096)), ("oneshot_lamport", (5, 4096)),
                                             ("twoshot", (300, 8192))], ids=["oneshot_ll", "oneshot_lamport", "twoshot"])
def test_cuda_graph_replays_with_new_data(comms, algorithm, shape, in_place):
    comm = comms("cuda")
    rows, hidden = shape
    dtype = torch.bfloat16
    x = torch.empty(rows, hidden, dtype=dtype, device="cuda")
    residual = torch.empty_like(x)
    weight = torch.empty(hidden, dtype=dtype, device="cuda")

    def step():
        return comm.all_reduce_residual_rmsnorm(x, residual, weight, EPS,
                                                residual_out=residual if in_place else None, algorithm=algorithm)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compiles and loads the kernels outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, out = step()
    for i in range(5):
        seed = 100 + i
        xi, ri = rank_data(seed, comm.rank, rows, hidden, dtype, "cuda")
        x.copy_(xi)
        residual.copy_(ri)
        weight.copy_(weight_for(seed, hidden, dtype, "cuda"))
        normed.fill_(float("nan"))
        if not in_place:
            out.fill_(float("nan"))
        graph.replay()
        check_result(comm, x, ri, weight, normed, out, seed)
        if in_place:
            assert out.data_ptr() == residual.data_ptr()
    torch.cuda.synchronize()
    comm.check()


def compiled_step(comm, backend):
    @torch.compile(fullgraph=True, backend=backend)
    def step(x, residual, inplace, weight):
        normed, out = comm.all_reduce_residual_rmsnorm(x * 2, residual, weight, EPS)
        normed2, _ = comm.all_reduce_residual_rmsnorm(x, inplace, weight, EPS, residual_out=inplace)
        return normed, out, normed2

    return step


def check_compiled(comm, device, backend):
    rows, hidden, dtype, seed = 4, 256, torch.bfloat16, 11
    x, residual = rank_data(seed, comm.rank, rows, hidden, dtype, device)
    weight = weight_for(seed, hidden, dtype, device)
    inplace = residual.clone()
    normed, out, normed2 = compiled_step(comm, backend)(x, residual, inplace, weight)
    want_normed, want_out = comm.all_reduce_residual_rmsnorm(x * 2, residual, weight, EPS)
    want_normed2, want_inplace = comm.all_reduce_residual_rmsnorm(x, residual, weight, EPS)
    assert torch.equal(bits(normed), bits(want_normed)) and torch.equal(bits(out), bits(want_out))
    assert torch.equal(bits(normed2), bits(want_normed2))
    assert torch.equal(bits(inplace), bits(want_inplace)), "in place under torch.compile"


def test_torch_compile_aot_eager_cpu(comms):
    check_compiled(comms("cpu"), "cpu", "aot_eager")


@GPU_ONLY
def test_torch_compile_fullgraph_gpu(comms):
    check_compiled(comms("cuda"), "cuda", "inductor")
    torch.cuda.synchronize()
    comms("cuda").check()


@pytest.mark.parametrize("op", ["all_reduce_residual_rmsnorm", "all_reduce_residual_rmsnorm_"])
def test_opcheck(comms, op):
    comm = comms("cpu")
    x, residual = rank_data(5, comm.rank, 3, 64, torch.bfloat16, "cpu")
    weight = weight_for(5, 64, torch.bfloat16, "cpu")
    torch.library.opcheck(getattr(torch.ops.p2pcomm, op).default, (x, residual, weight, EPS, comm._handle, "auto"))


def test_torch_fallback(group, monkeypatch):
    """The communicator that Communicator(fallback="torch") returns runs the
    same call over torch.distributed with the same rounding points after its
    all-reduce (gloo's or NCCL's, which may round per step) and the same
    checks."""
    def no_peer_access(config, torch_bs):
        raise p2pcomm.PeerUnavailableError("no peer access (simulated)")

    monkeypatch.setattr(p2pcomm.Communicator, "_native_init", staticmethod(no_peer_access))
    with pytest.warns(UserWarning, match="fallback='torch'"):
        comm = p2pcomm.Communicator(group, device="cpu", fallback="torch")
    x, residual = rank_data(21, comm.rank, 5, 128, torch.bfloat16, "cpu")
    weight = weight_for(21, 128, torch.bfloat16, "cpu")
    normed, out = comm.all_reduce_residual_rmsnorm(x, residual, weight, EPS)
    check_result(comm, x, residual, weight, normed, out, 21, rounded_once=False)
    inplace = residual.clone()
    res = comm.all_reduce_residual_rmsnorm(x, inplace, weight, EPS, residual_out=inplace)
    assert res.residual is inplace and torch.equal(bits(inplace), bits(out))
    with pytest.raises(p2pcomm.InvalidArgumentError, match="weight"):
        comm.all_reduce_residual_rmsnorm(x, residual, weight[:64], EPS)
    comm.close()


# -- bad input ----------------------------------------------------------------------------------

def settle(comm, device):
    """GPU errors are seen asynchronously: wait for the stream, then ask."""
    if device == "cuda":
        torch.cuda.synchronize()
        comm.check()


def still_works(comm, device):
    x, residual = rank_data(8, comm.rank, 3, 64, torch.bfloat16, device)
    weight = weight_for(8, 64, torch.bfloat16, device)
    normed, out = comm.all_reduce_residual_rmsnorm(x, residual, weight, EPS)
    check_result(comm, x, residual, weight, normed, out, 8)
    settle(comm, device)


def arguments(device, case):
    """(x, residual, weight, kwargs) of a bad call."""
    bf = dict(dtype=torch.bfloat16, device=device)
    x, r, w = torch.ones(4, 64, **bf), torch.ones(4, 64, **bf), torch.ones(64, **bf)
    kw = {}
    if case == "residual_shape":
        r = torch.ones(4, 72, **bf)
    elif case == "weight_shape":
        w = torch.ones(32, **bf)
    elif case == "float32":
        x, r, w = x.float(), r.float(), w.float()
    elif case == "mixed_dtypes":
        w = w.half()
    elif case == "hidden_too_large":
        x, r, w = torch.ones(2, 16392, **bf), torch.ones(2, 16392, **bf), torch.ones(16392, **bf)
    elif case == "hidden_not_whole_packs":
        x, r, w = torch.ones(4, 12, **bf), torch.ones(4, 12, **bf), torch.ones(12, **bf)
    elif case == "non_contiguous":
        x = torch.ones(64, 4, **bf).t()
    elif case == "negative_eps":
        kw["eps"] = -1.0
    elif case == "eps_beyond_float32":
        kw["eps"] = 1e39
    elif case == "unknown_algorithm":
        kw["algorithm"] = "ring"
    elif case == "unhashable_algorithm":
        kw["algorithm"] = ["twoshot"]
    elif case == "residual_out_overlaps_x":
        kw["residual_out"] = x
    elif case == "in_place_residual_overlaps_weight":
        w = r[0]  # the kernel would write the weight it reads
        kw["residual_out"] = r
    elif case == "normed_out_overlaps_residual_out":
        kw["residual_out"] = kw["normed_out"] = torch.empty(4, 64, **bf)
    elif case == "normed_out_dtype":
        kw["normed_out"] = torch.empty(4, 64, dtype=torch.float16, device=device)
    elif case == "normed_out_non_contiguous":
        kw["normed_out"] = torch.empty(64, 4, **bf).t()
    elif case == "residual_out_shape":
        kw["residual_out"] = torch.empty(4, 72, **bf)
    elif case == "not_a_tensor":
        x = [[1.0] * 64] * 4
    return x, r, w, kw


BAD = {"residual_shape": p2pcomm.InvalidArgumentError, "weight_shape": p2pcomm.InvalidArgumentError,
       "float32": p2pcomm.UnsupportedError, "mixed_dtypes": p2pcomm.InvalidArgumentError,
       "hidden_too_large": p2pcomm.UnsupportedError, "hidden_not_whole_packs": p2pcomm.UnsupportedError,
       "non_contiguous": p2pcomm.InvalidArgumentError, "negative_eps": p2pcomm.InvalidArgumentError,
       "eps_beyond_float32": p2pcomm.InvalidArgumentError, "unhashable_algorithm": p2pcomm.UnsupportedError,
       "unknown_algorithm": p2pcomm.UnsupportedError, "residual_out_overlaps_x": p2pcomm.InvalidArgumentError,
       "in_place_residual_overlaps_weight": p2pcomm.InvalidArgumentError,
       "normed_out_overlaps_residual_out": p2pcomm.InvalidArgumentError,
       "normed_out_dtype": p2pcomm.InvalidArgumentError, "normed_out_non_contiguous": p2pcomm.InvalidArgumentError,
       "residual_out_shape": p2pcomm.InvalidArgumentError, "not_a_tensor": p2pcomm.InvalidArgumentError}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_on_every_rank(comms, device, case):
    comm = comms(device)
    x, r, w, kw = arguments(device, case)
    with pytest.raises(BAD[case]):
        comm.all_reduce_residual_rmsnorm(x, r, w, **kw)
        settle(comm, device)
    settle(comm, device)
    still_works(comm, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["non_contiguous", "hidden_not_whole_packs", "negative_eps", "eps_beyond_float32",
                                  "unhashable_algorithm", "residual_shape"])
def test_bad_input_on_one_rank_fails_everyone(comms, device, case):
    """Rank 1 alone passes bad arguments: it raises their error, every other
    rank MismatchError naming it, and all stay usable."""
    comm = comms(device)
    x, r, w, kw = arguments(device, case if comm.rank == 1 else "good")
    expected = BAD[case] if comm.rank == 1 else p2pcomm.MismatchError
    with pytest.raises(expected, match=None if comm.rank == 1 else "rank 1"):
        comm.all_reduce_residual_rmsnorm(x, r, w, **kw)
        settle(comm, device)
    settle(comm, device)
    still_works(comm, device)


@GPU_ONLY
def test_ranks_that_disagree_on_the_rows_raise(comms):
    """The same element count cut into rows of another length (or another
    eps) on rank 0: every rank raises MismatchError, and all stay usable."""
    comm = comms("cuda")
    for rows, hidden, eps in ((8, 2048, EPS), (4, 4096, 1e-5)):
        if comm.rank != 0:
            rows, hidden, eps = 4, 4096, EPS
        x, r = rank_data(9, comm.rank, rows, hidden, torch.bfloat16, "cuda")
        w = weight_for(9, hidden, torch.bfloat16, "cuda")
        with pytest.raises(p2pcomm.MismatchError, match="disagree"):
            comm.all_reduce_residual_rmsnorm(x, r, w, eps)
            settle(comm, "cuda")
        settle(comm, "cuda")
        still_works(comm, "cuda")


@GPU_ONLY
def test_lamport_mismatch_with_an_all_reduce_leaves_the_areas_free(comms):
    """Rank 0 makes a fused Lamport call while its peers make a Lamport
    all-reduce of more elements: every rank raises MismatchError, and the
    fused and plain Lamport calls after it are right (the all-reduces run on
    the mismatched call's half, whose every sender freed what nobody read)."""
    comm = comms("cuda")
    rows, hidden = 64, 4096
    x, r = rank_data(11, comm.rank, rows, hidden, torch.bfloat16, "cuda")
    w = weight_for(11, hidden, torch.bfloat16, "cuda")
    with pytest.raises(p2pcomm.MismatchError, match="disagree"):
        if comm.rank == 0:
            comm.all_reduce_residual_rmsnorm(x, r, w, EPS, algorithm="oneshot_lamport")
        else:
            comm.all_reduce(torch.ones(rows * hidden + 4096, dtype=torch.bfloat16, device="cuda"),
                            algorithm="oneshot_lamport")
        settle(comm, "cuda")
    settle(comm, "cuda")
    for i in range(3):
        normed, out = comm.all_reduce_residual_rmsnorm(x, r, w, EPS, algorithm="oneshot_lamport")
        check_result(comm, x, r, w, normed, out, 11)
        y = comm.all_reduce(torch.full((rows * hidden + 4096,), float(comm.rank + 1), dtype=torch.bfloat16,
                                       device="cuda"), algorithm="oneshot_lamport")
        assert torch.equal(y, torch.full_like(y, float(sum(range(1, comm.world_size + 1))))), f"round {i}"
    settle(comm, "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_can_follow_and_precede_all_reduce(comms, device):
    """Fused calls between all-reduces of every algorithm (GPU: they share
    the LL buffers, epochs and barrier counters) stay right."""
    comm = comms(device)
    for algorithm in p2pcomm.ALGORITHMS:
        y = comm.all_reduce(torch.full((5000,), float(comm.rank + 1), device=device), algorithm=algorithm)
        assert torch.equal(y.cpu(), torch.full((5000,), float(sum(range(1, comm.world_size + 1)))))
        still_works(comm, device)
    dist.barrier()


@GPU_ONLY
@pytest.mark.parametrize("algorithm,rows", [("oneshot_ll", 4), ("oneshot_lamport", 4), ("twoshot", 300)],
                         ids=["oneshot_ll", "oneshot_lamport", "twoshot"])
def test_rank_that_never_arrives(group, monkeypatch, algorithm, rows):
    """Rank 1 skips a call: the others' kernels give up after
    P2PCOMM_TIMEOUT_MS and raise PeerTimeoutError naming it."""
    monkeypatch.setenv("P2PCOMM_TIMEOUT_MS", "2000")
    torch.cuda.set_device(local_cuda_index())
    comm = p2pcomm.Communicator(group, device=torch.cuda.current_device())
    x, residual = rank_data(12, comm.rank, rows, 8192, torch.bfloat16, "cuda")
    weight = weight_for(12, 8192, torch.bfloat16, "cuda")
    comm.all_reduce_residual_rmsnorm(x, residual, weight, algorithm=algorithm)  # every rank has its kernels loaded
    torch.cuda.synchronize()
    dist.barrier()
    if comm.rank != 1:
        start = time.monotonic()
        comm.all_reduce_residual_rmsnorm(x, residual, weight, algorithm=algorithm)
        torch.cuda.synchronize()
        assert time.monotonic() - start < 20
        with pytest.raises(p2pcomm.PeerTimeoutError, match="rank 1 never arrived"):
            comm.check()
    dist.barrier()
    comm.close()
