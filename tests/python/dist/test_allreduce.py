"""All-reduce on every rank against torch's own reduction of all ranks' data."""

import zlib

import pytest
import torch
import torch.distributed as dist

import p2pcomm
from conftest import DEVICES, same_on_all_ranks

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = ["sum", "prod", "min", "max", "avg"]
SIZES = [1, 7, 4097, (1 << 20) + 3]


def rank_input(seed: int, rank: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """Rank `rank`'s input, reproducible on every rank (for the reference)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        # float64 draws only for float64: they are several times slower than float32 ones
        x = torch.randn(n, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        if op == "prod":  # keep products of W factors in range
            x = x.sign() * (0.5 + x.abs().clamp(max=1.5))
        return x.to(dtype)
    hi = 4 if op == "prod" else 1000
    return torch.randint(-hi, hi + 1, (n,), generator=g, dtype=dtype)


def widen(inputs, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's input, one row each, in float64 (floats) or int64 (integers)."""
    return torch.stack([x.to(torch.float64 if dtype.is_floating_point else torch.int64) for x in inputs])


def reduce_rows(wide: torch.Tensor, op: str, dtype: torch.dtype) -> torch.Tensor:
    """The reduction of widen()'s rows, exact for integers."""
    if op == "sum":
        return wide.sum(0)
    if op == "prod":
        return wide.prod(0)
    if op == "min":
        return wide.amin(0)
    if op == "max":
        return wide.amax(0)
    total = wide.sum(0)
    if dtype.is_floating_point:
        return total / wide.shape[0]
    return torch.div(total, wide.shape[0], rounding_mode="floor")


def reference(inputs, op: str, dtype: torch.dtype) -> torch.Tensor:
    """Reduce in float64 (floats) or exactly (integers), in rank order."""
    return reduce_rows(widen(inputs, dtype), op, dtype)


class Expected:
    """What a reduction must give, against which several results are checked: the float64 reference (exact for
    integers, min and max), else the bound on each element's error. A result with the same bits as one that
    passed passes without the arithmetic, so each check reads each element at most twice."""

    def __init__(self, want: torch.Tensor, dtype: torch.dtype, op: str, scale=None):
        self.dtype, self.want = dtype, want
        self.exact = not dtype.is_floating_point or op in ("min", "max")  # no arithmetic: bit for bit
        if self.exact:
            self.want = want if not dtype.is_floating_point else want.to(dtype)
        else:
            # `scale` bounds the magnitude of partial results (the sum of |inputs|), since cancellation can
            # make the final value much smaller than the rounding error of the partial sums. One rounding of
            # the fp32/fp64 accumulation to dtype, plus fp32 accumulation error.
            tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
            self.bound = tol * ((want.abs() if scale is None else scale) + 1e-3)
        self.passed = None

    def misses(self, got: torch.Tensor) -> torch.Tensor:
        """Where got misses (a NaN or an infinity always does)."""
        got = got.cpu()
        if self.exact:
            return (got.to(torch.int64) if not self.dtype.is_floating_point else got) != self.want
        return ~(got.to(torch.float64, copy=True).sub_(self.want).abs_() <= self.bound)

    def check(self, got: torch.Tensor) -> None:
        got = got.cpu()
        assert got.dtype == self.dtype and got.shape == self.want.shape, (got.dtype, tuple(got.shape))
        if self.passed is not None and torch.equal(got, self.passed):
            return
        bad = self.misses(got).sum().item()
        if bad:
            worst = "" if self.exact else f"; worst {(got.to(torch.float64) - self.want).abs().max().item():.3g}"
            raise AssertionError(f"{bad} of {got.numel()} elements off{worst}")
        self.passed = got.clone()


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, op: str, scale=None):
    """Compare with the float64 reference (see Expected)."""
    Expected(want, dtype, op, scale).check(got)


def poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-0x5A5A)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_every_op_matches_torch(comms, device, n, dtype):
    comm = comms(device)
    w, r = comm.world_size, comm.rank
    drawn = {}  # every rank's inputs: one draw for the products (kept in range), one for the other ops
    for op in OPS:
        kind = "prod" if op == "prod" else "other"
        if kind not in drawn:
            seed = zlib.crc32(f"{n}{dtype}{kind}".encode()) % 100_000
            inputs = [rank_input(seed, q, n, dtype, op) for q in range(w)]
            wide = widen(inputs, dtype)
            drawn[kind] = inputs, wide, wide.abs().sum(0) if dtype.is_floating_point else None
        inputs, wide, abs_sum = drawn[kind]
        scale = {"sum": abs_sum, "avg": None if abs_sum is None else abs_sum / w}.get(op)
        expected = Expected(reduce_rows(wide, op, dtype), dtype, op, scale)
        mine = inputs[r].to(device)
        # Out of place on a plain tensor: staged.
        out = comm.all_reduce(mine, op=op)
        expected.check(out)
        assert torch.equal(mine.cpu(), inputs[r]), "input was modified"
        assert same_on_all_ranks(out)
        # In place on symmetric memory: zero copy.
        sym = comm.empty(n, dtype)
        sym.copy_(mine)
        assert comm.all_reduce_(sym, op=op) is sym
        expected.check(sym)
        # In place on a plain tensor, output poisoned nowhere else to hide in.
        plain = mine.clone()
        comm.all_reduce_(plain, op=op)
        expected.check(plain)
        # Out of place from symmetric memory into a poisoned tensor.
        sym.copy_(mine)
        res = poison(torch.empty_like(mine))
        comm._reduce(sym, res, op, "auto")
        expected.check(res)
        assert torch.equal(sym.cpu(), inputs[r]), "symmetric input was modified"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", p2pcomm.ALGORITHMS)
def test_every_algorithm(comms, device, algorithm):
    comm = comms(device)
    for n in (1, 7, 4097, 300_001):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            inputs = [rank_input(n + 7, q, n, dtype, "sum") for q in range(comm.world_size)]
            want = reference(inputs, "sum", dtype)
            scale = torch.stack([x.double().abs() for x in inputs]).sum(0)
            out = comm.all_reduce(inputs[comm.rank].to(device), algorithm=algorithm)
            assert_matches(out, want, dtype, "sum", scale)
            assert same_on_all_ranks(out)


@pytest.mark.parametrize("device", DEVICES)
def test_back_to_back_calls_without_sync(comms, device):
    comm = comms(device)
    w, r = comm.world_size, comm.rank
    n = 1000
    outs = []
    sym = comm.empty(n, torch.float32)
    for i in range(200):
        x = torch.full((n,), float(i * w + r), device=device) + torch.arange(n, device=device)
        if i % 2:
            sym.copy_(x)
            outs.append(comm.all_reduce(sym))
        else:
            outs.append(comm.all_reduce(x))
    for i, out in enumerate(outs):
        want = sum(float(i * w + q) for q in range(w)) + w * torch.arange(n, dtype=torch.float64)
        assert torch.equal(out.cpu().double(), want), f"call {i} wrong"


@pytest.mark.parametrize("device", DEVICES)
def test_zero_elements(comms, device):
    comm = comms(device)
    out = comm.all_reduce(torch.empty(0, device=device))
    assert out.numel() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_multidimensional_tensor_keeps_shape(comms, device):
    comm = comms(device)
    x = torch.arange(24, dtype=torch.float32, device=device).reshape(2, 3, 4) * (comm.rank + 1)
    out = comm.all_reduce(x, op=p2pcomm.ReduceOp.MAX)
    assert out.shape == (2, 3, 4)
    assert torch.equal(out.cpu(), torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) * comm.world_size)
    out = comm.all_reduce(x, op=dist.ReduceOp.SUM)
    assert torch.equal(out.cpu(), torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) * sum(range(1, comm.world_size + 1)))


def test_tcp_bootstrap_alongside_torch(comms):
    # A second communicator through torchrun's environment alone.
    with p2pcomm.Communicator(device="cpu", bootstrap="tcp") as comm:
        assert comm.rank == dist.get_rank() and comm.world_size == dist.get_world_size()
        out = comm.all_reduce(torch.ones(5) * comm.rank)
        assert torch.equal(out, torch.ones(5) * sum(range(comm.world_size)))


def test_register_graph_buffers_is_a_collective_no_op_on_cpu(comms):
    comm = comms("cpu")
    assert comm.register_graph_buffers() == 0
    out = comm.all_reduce(torch.ones(5))
    assert torch.equal(out, torch.full((5,), float(comm.world_size)))
