"""ExpertParallel dispatch/combine on every rank against a float64 reference
built from every rank's inputs (each rank regenerates them from seeds), and
combine bit for bit against a torch emulation of its documented rounding."""

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

import p2pcomm
from conftest import DEVICES, GPU_ONLY, local_cuda_index, same_on_all_ranks


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor  # [T, H] dtype, CPU
    idx: torch.Tensor  # [T, K] int64, CPU
    w: torch.Tensor  # [T, K] float32, CPU


def make_inputs(seed, rank, T, H, E, K, dtype, routing="random", minus_one=0.0) -> Inputs:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32).to(dtype)
    if routing == "random":  # distinct experts per token, like a real top-k
        idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K] if T else torch.empty(0, K, dtype=torch.long)
    elif routing == "duplicates":  # any expert, repeats allowed
        idx = torch.randint(0, E, (T, K), generator=g)
    elif routing == "one_expert":  # every k of every token on expert E-1
        idx = torch.full((T, K), E - 1, dtype=torch.long)
    else:
        raise ValueError(routing)
    if minus_one:
        drop = torch.rand(T, K, generator=g) < minus_one
        drop[: T // 4] = True  # some tokens with no expert at all
        idx = torch.where(drop, -1, idx)
    w = torch.rand(T, K, generator=g, dtype=torch.float32) + 0.1
    return Inputs(x, idx, w)


@dataclasses.dataclass
class Rows:
    """The rows a rank receives, in the documented order: (local expert, source rank, token, k) ascending."""
    local_expert: torch.Tensor  # [R] int64
    src: torch.Tensor  # [R] int64
    token: torch.Tensor  # [R] int64
    k: torch.Tensor  # [R] int64

    def __len__(self) -> int:
        return self.src.numel()

    def gather(self, per_source) -> torch.Tensor:
        """Row i is per_source[src[i]][token[i]]: the sources' tensors (first dimension T) in the rows' order."""
        starts = torch.tensor([0] + [t.shape[0] for t in per_source]).cumsum(0)[:-1]
        return torch.cat(list(per_source))[starts[self.src] + self.token]


def reference_dispatch(inputs, rank, W, E, K) -> Rows:
    """Rows received by `rank`: every (source, token, k) whose expert lives on `rank`, sorted by
    (local expert, source, token, k)."""
    L = E // W
    cols = []
    for s, inp in enumerate(inputs):
        t, k = torch.nonzero((inp.idx >= 0) & (torch.div(inp.idx, L, rounding_mode="floor") == rank), as_tuple=True)
        cols.append(torch.stack([inp.idx[t, k] % L, torch.full_like(t, s), t, k]))
    keys = torch.cat(cols, dim=1) if cols else torch.empty(4, 0, dtype=torch.long)
    order = torch.arange(keys.shape[1])
    for field in (3, 2, 1, 0):  # stable sorts from the last key to the first: lexicographic order
        order = order[torch.sort(keys[field, order], stable=True).indices]
    return Rows(*keys[:, order])


def expert_fn(x: torch.Tensor, local_expert: torch.Tensor, src_rank: torch.Tensor) -> torch.Tensor:
    """A per-row 'expert' the reference can recompute: two correctly rounded ops."""
    scale = (1.0 + local_expert.float() / 8).unsqueeze(1)
    shift = (src_rank.float() * 0.125).unsqueeze(1)
    return (x.float() * scale + shift).to(x.dtype)


def reference_combine(inputs, rank, W, E, K, dtype):
    """The float64 weighted sum over k of the experts' outputs for `rank`'s tokens, and the sum of the
    terms' magnitudes (the scale of the rounding bound)."""
    L = E // W
    inp = inputs[rank]
    T, H = inp.x.shape
    y = torch.zeros(T, H, dtype=torch.float64)
    scale = torch.zeros(T, H, dtype=torch.float64)
    src = torch.full((T,), rank)
    for k in range(K):
        e = inp.idx[:, k]
        out = expert_fn(inp.x, e.remainder(L), src).double()
        term = torch.where((e >= 0).unsqueeze(1), inp.w[:, k].double().unsqueeze(1) * out, 0.0)
        y += term
        scale += term.abs()
    return y, scale


def check_dispatch(recv, inputs, rank, W, E, K, dtype, capturable=False):
    rows = reference_dispatch(inputs, rank, W, E, K)
    L = E // W
    R = len(rows)
    assert recv.num_rows.dtype == torch.int32 and recv.num_rows.shape == (1,)
    assert int(recv.num_rows.item()) == R
    if capturable:
        assert recv.x.shape[0] >= R and recv.capturable
    else:
        assert recv.x.shape[0] == R
    assert recv.expert_counts.dtype == torch.int32
    assert torch.equal(recv.expert_counts.cpu(), torch.bincount(rows.local_expert, minlength=L).to(torch.int32))
    if R == 0:
        return
    assert torch.equal(recv.local_expert[:R].cpu(), rows.local_expert.to(torch.int32))
    assert torch.equal(recv.src_rank[:R].cpu(), rows.src.to(torch.int32))
    assert torch.equal(recv.src_token[:R].cpu().to(torch.int32), rows.token.to(torch.int32))
    want_w = rows.gather([inp.w for inp in inputs])[torch.arange(R), rows.k]
    assert torch.equal(recv.weight[:R].cpu(), want_w), "weights differ"
    got = recv.x[:R].cpu()
    assert got.dtype == dtype
    want_x = rows.gather([inp.x for inp in inputs])
    assert torch.equal(got.view(torch.uint8), want_x.contiguous().view(torch.uint8)), "token rows differ"


def emulate_combine(inputs, rank, W, E, K, dtype, combine_dtype=torch.float32, expert=None) -> torch.Tensor:
    """combine's documented rounding, op by op in torch on the CPU: on each
    expert rank d, a float32 partial from +0 adding fl32(w * out) for k
    ascending (those whose expert is on d), rounded once to combine_dtype;
    then on this rank the float32 sum from +0 of the partials of the ranks
    the token went to, d ascending, rounded once to dtype. ``expert``
    (default expert_fn) is called with (x, local expert, source rank,
    source token)."""
    L = E // W
    inp = inputs[rank]
    T, H = inp.x.shape
    dest = torch.where(inp.idx >= 0, torch.div(inp.idx, L, rounding_mode="floor"), -1)  # [T, K]
    src = torch.full((T,), rank, dtype=torch.int32)
    tokens = torch.arange(T, dtype=torch.int32)
    y = torch.zeros(T, H, dtype=torch.float32)
    for d in range(W):
        partial = torch.zeros(T, H, dtype=torch.float32)
        for k in range(K):
            local = inp.idx[:, k].remainder(L)
            out = (expert(inp.x, local, src, tokens) if expert else expert_fn(inp.x, local, src)).float()
            on_d = (dest[:, k] == d).unsqueeze(1)
            partial = torch.where(on_d, partial + out * inp.w[:, k:k + 1], partial)
        sent = (dest == d).any(dim=1).unsqueeze(1)
        y = torch.where(sent, y + partial.to(combine_dtype).float(), y)
    return y.to(dtype)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    differ = got.contiguous().view(-1).view(torch.uint8).view(-1, got.element_size()) != \
        want.contiguous().view(-1).view(torch.uint8).view(-1, want.element_size())
    bad = int(differ.any(dim=1).sum())
    assert bad == 0, f"{what}: {bad} of {got.numel()} elements differ from the emulation"


def check_combine(y, inputs, rank, W, E, K, dtype, combine_dtype=torch.float32):
    """Every element within the documented bound of the float64 reference
    (see ExpertParallel: partials rounded to combine_dtype add up to
    eps(combine_dtype)/2 * sum |w * out|)."""
    want, scale = reference_combine(inputs, rank, W, E, K, dtype)
    y = y.cpu()
    assert y.dtype == dtype and y.shape == want.shape
    eps = torch.finfo(dtype).eps
    transit = torch.finfo(combine_dtype).eps if combine_dtype != torch.float32 else 0.0
    bound = eps * want.abs() + (4 * (K + W) * torch.finfo(torch.float32).eps + transit) * scale + 1e-30
    err = (y.double() - want).abs()
    bad = (err > bound).sum().item()
    assert bad == 0, f"{bad} of {y.numel()} elements off; worst {err.max().item():.3g}"
    none = (inputs[rank].idx < 0).all(dim=1)
    assert torch.equal(y[none], torch.zeros_like(y[none])), "token with no expert is not zero"


def experts_for(E: int, W: int) -> int:
    """E rounded up to a multiple of the world size, so that every case runs
    on odd worlds too (E=8 is 9 experts on 3 ranks)."""
    return -(-E // W) * W


def run_round(ep, inputs, rank, device, capturable=False):
    inp = inputs[rank]
    recv = ep.dispatch(inp.x.to(device), inp.idx.to(device), inp.w.to(device), capturable=capturable)
    out = expert_fn(recv.x, recv.local_expert, recv.src_rank)
    return recv, out, ep.combine(out, recv)


CASES = [  # (E, K, H, T_max, dtype, routing, minus_one)
    (8, 1, 64, 16, torch.float32, "random", 0.0),
    (16, 8, 128, 32, torch.bfloat16, "random", 0.2),
    (8, 8, 64, 16, torch.float32, "duplicates", 0.1),
    (256, 8, 256, 64, torch.bfloat16, "random", 0.0),
    (64, 4, 96, 24, torch.float16, "one_expert", 0.0),
    (8, 12, 64, 16, torch.bfloat16, "duplicates", 0.1),  # > 8 pairs of one token on a rank
    (32, 4, 64, 300, torch.bfloat16, "random", 0.1),  # more tokens than threads in a block
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}_K{c[1]}_{str(c[4])[6:]}_{c[5]}")
def test_dispatch_combine_match_reference(comms, device, case):
    E, K, H, Tm, dtype, routing, minus_one = case
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    E = experts_for(E, W)
    # Rank 1 sends nothing; the others send between 1 and T_max tokens.
    sizes = [0 if q == 1 else (Tm if q == 0 else 1 + (5 * q) % Tm) for q in range(W)]
    inputs = [make_inputs(E + K, q, sizes[q], H, E, K, dtype, routing, minus_one) for q in range(W)]
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype)
    recv, out, y = run_round(ep, inputs, r, device)
    check_dispatch(recv, inputs, r, W, E, K, dtype)
    check_combine(y, inputs, r, W, E, K, dtype)
    assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype), "combine")
    # Again, with new data: bit-identical to a fresh computation, and stable run to run.
    recv2, _, y2 = run_round(ep, inputs, r, device)
    assert torch.equal(recv2.x.cpu().view(torch.uint8), recv.x.cpu().view(torch.uint8))
    assert torch.equal(y2.cpu().view(torch.uint8), y.cpu().view(torch.uint8)), "combine not bit-identical"
    # Two dispatches in a row, then a combine of the second; two combines of one dispatch.
    other = [make_inputs(E + K + 1, q, sizes[q], H, E, K, dtype, routing, minus_one) for q in range(W)]
    ep.dispatch(inputs[r].x.to(device), inputs[r].idx.to(device), inputs[r].w.to(device))
    recv3, out3, y3 = run_round(ep, other, r, device)
    check_dispatch(recv3, other, r, W, E, K, dtype)
    check_combine(y3, other, r, W, E, K, dtype)
    check_combine(ep.combine(out3, recv3), other, r, W, E, K, dtype)


@GPU_ONLY
@pytest.mark.parametrize("count_kernel", [True, False])
def test_slots_and_ranks_with_and_without_count_kernel(comms, monkeypatch, count_kernel):
    """The send kernel's slots and pair ranks start from the earlier blocks'
    counts, which moe_dispatch_count leaves for large batches and each send
    block counts itself for small ones: both ways on batches large enough
    for every block to have tokens before it, skewed and with -1 ids, eager
    and capturable, against the reference, with the kernel launched or not
    as asked."""
    monkeypatch.delenv("P2PCOMM_MOE_COUNT_PAIRS", raising=False)  # it would override the constant
    monkeypatch.setattr(p2pcomm.moe, "_COUNT_KERNEL_MIN_PAIRS", 0 if count_kernel else 1 << 40)
    comm = comms("cuda")
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 16 * W, 8, 64, 700, torch.bfloat16
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype)
    launched = []  # the kernels golib/moe launched (its trace)
    sizes = [Tm if q == 0 else (0 if q == 1 else 1 + (97 * q) % Tm) for q in range(W)]
    for seed, routing, capturable in ((61, "random", False), (62, "duplicates", True), (63, "one_expert", False)):
        inputs = [make_inputs(seed, q, sizes[q], H, E, K, dtype, routing, 0.1) for q in range(W)]
        recv, out, y = run_round(ep, inputs, r, "cuda", capturable=capturable)
        launched += [step["name"] for step in ep._trace()]
        check_dispatch(recv, inputs, r, W, E, K, dtype, capturable=capturable)
        check_combine(y, inputs, r, W, E, K, dtype)
        assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype), "combine")
    assert ("moe_dispatch_count" in launched) == (count_kernel and sizes[r] > 0), launched
    comm.check()


@GPU_ONLY
def test_ranks_passing_different_num_sms(comms):
    """Ranks that pass different num_sms all run the smallest grid: a
    rank's expand and reduce wait for the middle flags of as many blocks of
    each peer's send kernel as its own grid has, so with unequal grids one
    rank would wait for blocks that never run and another read rows before
    they were all written."""
    comm = comms("cuda")
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 4 * W, 4, 128, 300, torch.bfloat16
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype,
                                num_sms=3 + 2 * r)
    assert ep._blocks == 3
    for seed, capturable in ((81, False), (82, True)):
        inputs = [make_inputs(seed, q, Tm - 37 * q, H, E, K, dtype, "random", 0.1) for q in range(W)]
        recv, out, y = run_round(ep, inputs, r, "cuda", capturable=capturable)
        check_dispatch(recv, inputs, r, W, E, K, dtype, capturable=capturable)
        check_combine(y, inputs, r, W, E, K, dtype)
    comm.check()


@GPU_ONLY
def test_send_kernel_shared_memory_near_48k(comms, monkeypatch):
    """A send kernel with just under 48 KiB of dynamic shared memory (4096
    expert counters and 1023 x 8 ids), which with its static shared memory
    is more than a block gets without opting in: the launcher opts in, and
    dispatch and combine match the reference."""
    monkeypatch.delenv("P2PCOMM_MOE_COUNT_PAIRS", raising=False)
    comm = comms("cuda")
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 4096 - 4096 % W, 8, 64, 1023, torch.bfloat16  # 4095 on 3, 5 or 7 ranks
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype)
    inputs = [make_inputs(71, q, Tm, H, E, K, dtype, "random", 0.1) for q in range(W)]
    recv, out, y = run_round(ep, inputs, r, "cuda")
    shared = {step["name"]: step["shared"] for step in ep._trace()}  # golib/moe's launches
    check_dispatch(recv, inputs, r, W, E, K, dtype)
    check_combine(y, inputs, r, W, E, K, dtype)
    assert shared["moe_dispatch_send"] == 4 * (E + Tm * K) and 47 << 10 < 4 * (E + Tm * K) <= 48 << 10, shared
    assert "moe_dispatch_count" not in shared, shared
    comm.check()


TRANSITS = ["float32", "dtype"]  # combine_dtype: float32, or the ep's own dtype


def transit_dtype(transit: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if transit == "float32" else dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transit", TRANSITS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}_K{c[1]}_{str(c[4])[6:]}_{c[5]}")
def test_combine_transit_matches_emulation(comms, device, transit, case):
    """Each combine transit gives the emulation's exact bits, in eager and
    capturable mode, within the documented bound; tokens whose experts all
    live on one rank get the same bits in both transits."""
    E, K, H, Tm, dtype, routing, minus_one = case
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    E = experts_for(E, W)
    combine_dtype = transit_dtype(transit, dtype)
    sizes = [Tm - (3 * q) % Tm for q in range(W)]
    inputs = [make_inputs(E + 3 * K, q, sizes[q], H, E, K, dtype, routing, minus_one) for q in range(W)]
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype,
                                combine_dtype=combine_dtype)
    assert ep.combine_dtype == combine_dtype
    want = emulate_combine(inputs, r, W, E, K, dtype, combine_dtype)
    for capturable in (False, True):
        _, _, y = run_round(ep, inputs, r, device, capturable=capturable)
        assert_same_bits(y, want, f"combine_dtype={combine_dtype}, capturable={capturable}")
        check_combine(y, inputs, r, W, E, K, dtype, combine_dtype)
    exact = emulate_combine(inputs, r, W, E, K, dtype, torch.float32)
    L = E // W
    idx = inputs[r].idx
    dest = torch.where(idx >= 0, torch.div(idx, L, rounding_mode="floor"), -1)
    first = dest.max(dim=1, keepdim=True).values
    one_rank = ((dest == first) | (dest < 0)).all(dim=1)
    assert_same_bits(want[one_rank], exact[one_rank], "tokens on one expert rank")
    if combine_dtype != torch.float32 and routing == "random" and W > 1 and K > 1:
        assert not torch.equal(want, exact), "a rounded transit should change some token split across ranks"


@GPU_ONLY
@pytest.mark.parametrize("knob", ["auto", "1", "0"])
@pytest.mark.parametrize("transit", TRANSITS)
def test_self_local_combine(comms, monkeypatch, knob, transit):
    """A world of 2 with topk <= 8 may combine self-local: the send kernel
    pushes only the peer's partials and moe_combine_reduce_self sums this
    rank's own rows itself; by default for partials in the ep's dtype and
    batches from _SELF_LOCAL_MIN_TOKENS, with P2PCOMM_MOE_SELF_LOCAL=1
    always, =0 never; topk > 8 and other worlds never. Either way the
    emulation's bits, eager and capturable: a token's own pairs from 0 to 8
    (both register layouts), tokens with no expert, a rank with no tokens,
    batches split into row pieces (few tokens) and not, rows that are not
    whole passes."""
    if knob == "auto":
        monkeypatch.delenv("P2PCOMM_MOE_SELF_LOCAL", raising=False)
    else:
        monkeypatch.setenv("P2PCOMM_MOE_SELF_LOCAL", knob)
    comm = comms("cuda")
    W, r = comm.world_size, comm.rank
    dtype = torch.bfloat16
    combine_dtype = transit_dtype(transit, dtype)
    big = p2pcomm.ExpertParallel(comm, num_experts=2 * W, hidden=64, max_tokens_per_rank=4,
                                 topk=2)._self_local_min_tokens  # golib/moe's threshold
    # (num_sms 2: 32 warps, so 300 tokens take one warp per row; 40 tokens on the full grid are cut.)
    for K, E, H, Tm, routing, sms in ((8, 4 * W, 200, 40, "duplicates", None), (3, 16 * W, 7168, 300, "random", 2),
                                      (3, 16 * W, 7168, 300, "random", None), (8, 16 * W, 64, big, "random", None),
                                      (12, 4 * W, 64, 16, "duplicates", None)):
        ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype,
                                    combine_dtype=combine_dtype, num_sms=sms)
        launched = []  # the kernels golib/moe launched (its trace)
        sizes = [Tm if q == 0 else (0 if q == 1 else 1 + (7 * q) % Tm) for q in range(W)]
        for seed, capturable in ((71, False), (72, True)):
            inputs = [make_inputs(seed + K, q, sizes[q], H, E, K, dtype, routing, 0.15) for q in range(W)]
            _, _, y = run_round(ep, inputs, r, "cuda", capturable=capturable)
            launched += [step["name"] for step in ep._trace()]
            assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype, combine_dtype),
                             f"K={K} H={H} T={sizes[r]} capturable={capturable}")
        T = sizes[r]
        self_local = W == 2 and K <= 8 and (knob == "1" or (knob == "auto" and transit == "dtype" and T >= big))
        want = "moe_combine_reduce_self" if self_local else "moe_combine_reduce"
        if T:
            assert want in launched and ({"moe_combine_reduce_self", "moe_combine_reduce"} - {want}).isdisjoint(
                launched), (K, T, launched)
    comm.check()


def nonfinite_expert(x, local_expert, src_rank, src_token):
    """expert_fn, then NaN, +inf and -inf planted in some rows at columns
    that follow the (token, expert) pair, so that tokens get NaN from one
    expert, inf from another, inf - inf, or nothing special."""
    out = expert_fn(x, local_expert, src_rank)
    H = out.shape[1]
    t, e = src_token.long(), local_expert.long()
    cols = torch.arange(H, device=out.device)
    for value, rows, col in ((float("nan"), (t % 5 == 1) & (e % 2 == 0), (3 * t) % H),
                             (float("inf"), t % 3 == 0, (t + e) % H),
                             (float("-inf"), t % 4 == 2, (t + 2 * e) % H)):
        hit = rows.unsqueeze(1) & (cols.unsqueeze(0) == col.unsqueeze(1))
        out = torch.where(hit, torch.tensor(value, dtype=out.dtype, device=out.device), out)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transit", TRANSITS)
@pytest.mark.parametrize("capturable", [False, True])
def test_combine_of_nonfinite_expert_outputs(comms, device, transit, capturable):
    """NaN and inf in expert outputs propagate as the documented sums say:
    NaN exactly where the emulation has NaN (NaN payloads aside), every
    other element, inf and -inf included, the emulation's exact bits."""
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    E, K, H, Tm = 8 * W, 8, 256, 40
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        combine_dtype = transit_dtype(transit, dtype)
        inputs = [make_inputs(71, q, Tm - 2 * q, H, E, K, dtype, "duplicates", 0.1) for q in range(W)]
        ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype,
                                    combine_dtype=combine_dtype)
        inp = inputs[r]
        recv = ep.dispatch(inp.x.to(device), inp.idx.to(device), inp.w.to(device), capturable=capturable)
        y = ep.combine(nonfinite_expert(recv.x, recv.local_expert, recv.src_rank, recv.src_token), recv).cpu()
        want = emulate_combine(inputs, r, W, E, K, dtype, combine_dtype, expert=nonfinite_expert)
        nan = torch.isnan(want)
        assert nan.any() and torch.isinf(want).any(), "the test should produce NaN and inf"
        assert torch.equal(torch.isnan(y), nan), f"{dtype}: NaN in different places"
        assert_same_bits(y[~nan], want[~nan], f"{dtype} combine_dtype={combine_dtype}, finite and inf")
        ep.close()


@pytest.mark.parametrize("device", DEVICES)
def test_int32_ids_and_all_to_one_expert(comms, device):
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    E, K, H, Tm = 4 * W, 2, 64, 8
    inputs = [make_inputs(7, q, Tm, H, E, K, torch.bfloat16, "one_expert") for q in range(W)]
    for inp in inputs:  # k=1 sends nowhere: only expert E-1, on the last rank, gets work
        inp.idx[:, 1] = -1
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K)
    inp = inputs[r]
    recv = ep.dispatch(inp.x.to(device), inp.idx.to(torch.int32).to(device), inp.w.to(device))
    check_dispatch(recv, inputs, r, W, E, K, torch.bfloat16)
    assert recv.x.shape[0] == (W * Tm if r == W - 1 else 0)
    y = ep.combine(expert_fn(recv.x, recv.local_expert, recv.src_rank), recv)
    check_combine(y, inputs, r, W, E, K, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("staging", ["in_kernel", "in_line", "capturable"])
def test_dispatch_from_its_buffer(comms, device, staging, monkeypatch):
    """x built in ep.get_dispatch_buffer() (no staging copy), x a view at
    another offset inside that buffer (copied out first), and a plain x
    again, each rank in its own order, so that in every round some ranks
    copy x and others do not (and one has no tokens): each round matches
    the reference, rows and combine. Eager GPU calls have the send kernel
    copy x into the staging buffer, or (up to a size, and for rows it
    cannot copy) copy it on the caller's stream: both, whatever the size
    here; capturable ones on a side stream, where the ranks that copy post
    their staged flags after it."""
    capturable = staging == "capturable"
    monkeypatch.setattr(p2pcomm.moe, "_EAGER_KERNEL_STAGE_BYTES", None if staging == "in_kernel" else -1)
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 4 * W, 4, 128, 24, torch.bfloat16
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype)
    side_copies = []  # per staging copy: whether it ran on the side stream (golib/moe's trace)
    with pytest.raises(p2pcomm.InvalidArgumentError, match="num_tokens"):
        ep.get_dispatch_buffer(Tm + 1)
    assert ep.get_dispatch_buffer().shape == (Tm, H) and ep.get_dispatch_buffer(0).shape == (0, H)
    sizes = [0 if q == W - 1 else Tm - 3 * q for q in range(W)]
    wheres = ("buffer", "inside", "plain", "buffer")
    for i, seed in enumerate((31, 32, 33, 34)):
        where = wheres[(i + r) % len(wheres)]
        inputs = [make_inputs(seed, q, sizes[q], H, E, K, dtype, "random", 0.1) for q in range(W)]
        inp, T = inputs[r], sizes[r]
        if where == "buffer":
            x = ep.get_dispatch_buffer(T)
            x.copy_(inp.x.to(device))
        elif where == "inside":
            buf = ep.get_dispatch_buffer()
            buf.fill_(float("nan"))
            x = buf[Tm - T:]  # overlaps the rows it is staged into (for T > Tm / 2)
            x.copy_(inp.x.to(device))
        else:
            x = inp.x.to(device)
        recv = ep.dispatch(x, inp.idx.to(device), inp.w.to(device), capturable=capturable)
        check_dispatch(recv, inputs, r, W, E, K, dtype, capturable=capturable)
        y = ep.combine(expert_fn(recv.x, recv.local_expert, recv.src_rank), recv)
        check_combine(y, inputs, r, W, E, K, dtype)
        if where == "buffer":
            assert torch.equal(x.cpu().view(torch.uint8), inp.x.view(torch.uint8)), "dispatch changed x"
        if ep.uses_kernels:
            side_copies += [step["side"] if step["name"] == "stage" else "kernel" for step in ep._trace()
                            if step["name"] in ("stage", "stage in moe_dispatch_send")]
    if ep.uses_kernels and sizes[r]:  # copies of "plain", and of "inside" unless x is the whole buffer
        side = "kernel" if staging == "in_kernel" else capturable
        assert side_copies == [side] * (1 + (sizes[r] < Tm)), side_copies


@GPU_ONLY
def test_eager_dispatch_of_misaligned_rows(comms, monkeypatch):
    """The send kernel copies x into the staging buffer by 16-byte packs;
    an x that starts off that alignment (a view one element into a
    buffer) is copied on the stream instead, with the same results."""
    monkeypatch.setattr(p2pcomm.moe, "_EAGER_KERNEL_STAGE_BYTES", 1 << 62)
    comm = comms("cuda")
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 4 * W, 4, 128, 24, torch.bfloat16
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype)
    for seed, offset in ((41, 1), (42, 0)):
        inputs = [make_inputs(seed, q, Tm - q, H, E, K, dtype, "random", 0.1) for q in range(W)]
        inp = inputs[r]
        flat = torch.empty(inp.x.numel() + 8, dtype=dtype, device="cuda")
        x = flat[offset:offset + inp.x.numel()].view(inp.x.shape)
        x.copy_(inp.x.cuda())
        assert (x.data_ptr() % 16 != 0) == (offset == 1)
        recv = ep.dispatch(x, inp.idx.cuda(), inp.w.cuda())
        check_dispatch(recv, inputs, r, W, E, K, dtype)
        check_combine(ep.combine(expert_fn(recv.x, recv.local_expert, recv.src_rank), recv), inputs, r, W, E, K, dtype)
        staged = [step["name"] for step in ep._trace() if step["name"].startswith("stage")]
        assert staged == ["stage" if offset else "stage in moe_dispatch_send"], staged
    comm.check()


def capture_step(ep, static_x, first, rank):
    """Captures dispatch of static_x (and static routing), expert_fn and
    combine in one CUDA graph, warmed up first on a side stream with round
    `first` loaded. Returns (graph, load, recv, y): load(inputs) copies a
    round's inputs of this rank into the static tensors before a replay."""
    T, K = static_x.shape[0], ep.topk
    static_idx = torch.zeros(T, K, dtype=torch.int64, device=static_x.device)
    static_w = torch.zeros(T, K, dtype=torch.float32, device=static_x.device)

    def step():
        recv = ep.dispatch(static_x, static_idx, static_w)
        return recv, ep.combine(expert_fn(recv.x, recv.local_expert, recv.src_rank), recv)

    def load(inputs):
        static_x.copy_(inputs[rank].x)
        static_idx.copy_(inputs[rank].idx)
        static_w.copy_(inputs[rank].w)

    load(first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up (allocations, sort workspace) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv, y = step()
    return graph, load, recv, y


def replays(graph, load, recv, rounds):
    """Replays the graph once per round with that round loaded, recv.x poisoned with NaN first (rows a
    replay's dispatch does not write show up), and yields the round once the replay finished."""
    for inputs in rounds:
        load(inputs)
        recv.x.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        yield inputs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transit", TRANSITS)
@pytest.mark.parametrize("tokens", ["full", "uneven"])
def test_capturable_mode(comms, device, transit, tokens):
    """Capturable dispatch + expert + combine against the reference and the
    combine emulation's bits; on GPU captured once and replayed with new
    routing and data, recv.x poisoned before each replay. "uneven": ranks
    dispatch different numbers of tokens, one of them none (on GPU fixed by
    the captured shapes)."""
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 8 * W, 4, 64, 16, torch.bfloat16
    sizes = [Tm if tokens == "full" else (Tm - 3, 0, Tm, 5)[q % 4] for q in range(W)]
    combine_dtype = transit_dtype(transit, dtype)
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype,
                                capturable=True, combine_dtype=combine_dtype)
    rounds = [[make_inputs(100 + i, q, sizes[q], H, E, K, dtype, "random", 0.25) for q in range(W)]
              for i in range(3)]

    def check_round(recv, y, inputs):
        check_dispatch(recv, inputs, r, W, E, K, dtype, capturable=True)
        check_combine(y, inputs, r, W, E, K, dtype, combine_dtype)
        assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype, combine_dtype), "capturable combine")

    if device == "cpu":
        for inputs in rounds:
            recv, out, y = run_round(ep, inputs, r, device, capturable=True)
            assert recv.capturable and recv.x.shape == (W * Tm * K, H)
            check_round(recv, y, inputs)
        return
    # CUDA: capture dispatch + expert + combine once, replay with new routing copied in.
    static_x = torch.zeros(sizes[r], H, dtype=dtype, device=device)
    graph, load, recv, y = capture_step(ep, static_x, rounds[0], r)
    for inputs in replays(graph, load, recv, rounds[1:] + rounds[:1]):
        assert recv.x.shape == (W * Tm * K, H)
        check_round(recv, y, inputs)
    comm.check()


@GPU_ONLY
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_capturable_staging(comms, layout):
    """A captured dispatch of a plain x (contiguous, or a transposed view)
    stages it into xs on a side stream behind moe_stage_gate. Replayed with
    new routing and data, xs poisoned before every replay, it gives the
    reference's rows and the emulation's combine bits, with one copy per
    call on the side stream."""
    comm = comms("cuda")
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 8 * W, 4, 256, 40, torch.bfloat16
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype,
                                capturable=True)
    rounds = [[make_inputs(140 + i, q, Tm, H, E, K, dtype, "random", 0.25) for q in range(W)] for i in range(3)]
    device = torch.device("cuda", torch.cuda.current_device())
    static_x = (torch.zeros(H, Tm, dtype=dtype, device=device).t() if layout == "strided"
                else torch.zeros(Tm, H, dtype=dtype, device=device))
    graph, load, recv, y = capture_step(ep, static_x, rounds[0], r)
    # Per staging copy, whether it ran on the side stream (golib/moe's trace): warm-up and capture.
    side_copies = [step["side"] for step in ep._trace() if step["name"] == "stage"]
    for inputs in rounds[1:] + rounds[:1]:
        load(inputs)
        # No peer reads this rank's xs now: each pulled it before its combine, which this rank's
        # finished graph waited for.
        ep._xs.fill_(float("nan"))
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        check_dispatch(recv, inputs, r, W, E, K, dtype, capturable=True)
        assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype), "combine")
    assert side_copies == [True, True], side_copies  # warm-up and capture
    comm.check()


# torch.compile's cost is per rank: each one traces and compiles the same
# graphs, so on a small machine the compiled tests dominate a many-rank CPU
# run. They run at up to this many CPU ranks (make test: 2 and 3, an even
# and an odd world), where the same graphs and custom ops are compiled and
# checked.
COMPILE_MAX_CPU_RANKS = 3


def skip_compile_past_max_ranks(world_size, device):
    if device == "cpu" and world_size > COMPILE_MAX_CPU_RANKS:
        pytest.skip(f"torch.compile on CPU ranks runs at up to {COMPILE_MAX_CPU_RANKS} ranks: each rank compiles")


def pow2_expert(x, local_expert, src_rank, src_token=None):
    """An expert whose every product is exact (a power of two, signed by the
    source rank), so compiled code, fused or not, gives the emulation's bits."""
    scale = torch.where(local_expert % 2 == 0, 2.0, 0.5) * torch.where(src_rank % 2 == 0, 1.0, -1.0)
    return x * scale.to(x.dtype).unsqueeze(1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("capturable", [False, True])
def test_torch_compile_fullgraph(comms, device, capturable):
    """dispatch, experts and combine in one torch.compile(fullgraph=True)
    function (the custom ops p2pcomm::moe_dispatch / moe_combine; inductor on
    GPU, aot_eager on CPU), rounds of new routing and token counts: rows and
    metadata as the reference, combine the emulation's bits. A compiled
    result combines outside compiled code and the other way round; an older
    result raises StateError in compiled code too (eager, one rank's: the
    others raise MismatchError, nobody waits), and the ep stays usable."""
    comm = comms(device)
    skip_compile_past_max_ranks(comm.world_size, device)
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 4 * W, 4, 128, 24, torch.bfloat16
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype)
    backend = "inductor" if device == "cuda" else "aot_eager"
    torch.compiler.reset()  # each ep compiles anew: the earlier cases' graphs would count to the recompile limit

    @torch.compile(fullgraph=True, backend=backend)
    def step(x, idx, w):
        recv = ep.dispatch(x, idx, w, capturable=capturable)
        return recv, ep.combine(pow2_expert(recv.x, recv.local_expert, recv.src_rank), recv)

    @torch.compile(fullgraph=True, backend=backend)
    def compiled_dispatch(x, idx, w):
        return ep.dispatch(x, idx, w, capturable=capturable)

    @torch.compile(fullgraph=True, backend=backend)
    def compiled_combine(out, recv):
        return ep.combine(out, recv)

    @torch.compile(fullgraph=True, backend=backend)
    def compiled_expert(recv):  # a plain result's views, first read in compiled code
        return pow2_expert(recv.x, recv.local_expert, recv.src_rank)

    def on(inputs):
        inp = inputs[r]
        return inp.x.to(device), inp.idx.to(device), inp.w.to(device)

    def check(recv, y, inputs, what):
        check_dispatch(recv, inputs, r, W, E, K, dtype, capturable=capturable)
        assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype, expert=pow2_expert), what)

    for i, sizes in enumerate(([Tm - q for q in range(W)], [0 if q == 1 else 5 + q for q in range(W)],
                               [Tm] * W)):
        inputs = [make_inputs(300 + i, q, sizes[q], H, E, K, dtype, "random", 0.2) for q in range(W)]
        recv, y = step(*on(inputs))
        assert recv._from_op, "made by the custom op"
        check(recv, y, inputs, f"compiled round {i}")
    recv = compiled_dispatch(*on(inputs))  # combined outside compiled code
    assert recv._from_op
    check(recv, ep.combine(pow2_expert(recv.x, recv.local_expert, recv.src_rank), recv), inputs, "eager combine")
    recv = ep.dispatch(*on(inputs), capturable=capturable)  # combined inside
    out = compiled_expert(recv)
    check(recv, compiled_combine(out, recv), inputs, "compiled combine")
    newer = [make_inputs(310, q, Tm - 2 * q, H, E, K, dtype, "random", 0.2) for q in range(W)]
    recv2, _ = step(*on(newer))
    out2 = pow2_expert(recv2.x, recv2.local_expert, recv2.src_rank)
    with pytest.raises(p2pcomm.StateError, match="latest"):  # every rank: nothing waits
        compiled_combine(out, recv)
    if not capturable:  # rank 1 alone: it raises StateError and the others MismatchError, together
        if r == 1:
            with pytest.raises(p2pcomm.StateError, match="latest"):
                compiled_combine(out, recv)
        else:
            with pytest.raises(p2pcomm.MismatchError, match="rank 1"):
                compiled_combine(out2, recv2)
    check(recv2, compiled_combine(out2, recv2), newer, "compiled combine after a stale one")
    check(recv2, ep.combine(out2, recv2), newer, "and outside compiled code")
    if device == "cuda":
        comm.check()


def _graph_tree_ep(comms):
    """The reduce-overhead tests' capturable ep on the GPU, torch.compile's
    caches reset (each test compiles anew), and its shape: W, r, E, K, H,
    T_max, dtype."""
    comm = comms("cuda")
    W, E, K, H, Tm, dtype = comm.world_size, 4 * comm.world_size, 4, 128, 24, torch.bfloat16
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype,
                                capturable=True)
    torch.compiler.reset()
    return comm, ep, (W, comm.rank, E, K, H, Tm, dtype)


@GPU_ONLY
def test_reduce_overhead_step(comms):
    """A whole step, capturable dispatch, experts and combine, in one
    torch.compile(mode="reduce-overhead") function, and dispatch and combine
    as two such functions: CUDA-graph trees warm up, record and then replay
    them, each round with new routing and data; every round checked."""
    comm, ep, (W, r, E, K, H, Tm, dtype) = _graph_tree_ep(comms)

    @torch.compile(fullgraph=True, mode="reduce-overhead")
    def step(x, idx, w):
        recv = ep.dispatch(x, idx, w)
        return recv, ep.combine(pow2_expert(recv.x, recv.local_expert, recv.src_rank), recv)

    @torch.compile(fullgraph=True, mode="reduce-overhead")
    def dispatch(x, idx, w):
        return ep.dispatch(x, idx, w)

    @torch.compile(fullgraph=True, mode="reduce-overhead")
    def combine(out, recv):
        return ep.combine(out, recv)

    def rounds(seed):
        for i in range(5):  # warm-up, recording, replays
            yield i, [make_inputs(seed + i, q, Tm, H, E, K, dtype, "random", 0.2) for q in range(W)]

    # One set of inputs that the graphs read in place, refilled each round (as a model's step would).
    x, idx, w = (torch.empty(Tm, H, dtype=dtype, device="cuda"), torch.empty(Tm, K, dtype=torch.long, device="cuda"),
                 torch.empty(Tm, K, dtype=torch.float32, device="cuda"))
    for t in (x, idx, w):
        torch._dynamo.mark_static_address(t)

    def refill(inputs):
        for buf, t in zip((x, idx, w), (inputs[r].x, inputs[r].idx, inputs[r].w)):
            buf.copy_(t)
        torch.compiler.cudagraph_mark_step_begin()  # the previous round's outputs are done with

    for i, inputs in rounds(500):
        refill(inputs)
        recv, y = step(x, idx, w)
        check_dispatch(recv, inputs, r, W, E, K, dtype, capturable=True)
        assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype, expert=pow2_expert), f"step, round {i}")
    for i, inputs in rounds(510):
        refill(inputs)
        recv = dispatch(x, idx, w)
        check_dispatch(recv, inputs, r, W, E, K, dtype, capturable=True)
        y = combine(pow2_expert(recv.x, recv.local_expert, recv.src_rank), recv)
        assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype, expert=pow2_expert), f"pair, round {i}")
    comm.check()


@GPU_ONLY
def test_reduce_overhead_combine_of_plain_dispatch(comms):
    """Under mode="reduce-overhead" a plain dispatch's rows reach a compiled
    combine as a copy once CUDA-graph trees record (they copy non-static
    inputs; marking recv.x static does not stop it, 4 x H200, torch 2.11):
    the copy is refused with StateError on every rank, nothing waits, and
    the ep stays usable."""
    comm, ep, (W, r, E, K, H, Tm, dtype) = _graph_tree_ep(comms)

    @torch.compile(fullgraph=True, mode="reduce-overhead")
    def combine(out, recv):
        return ep.combine(out, recv)

    def plain_dispatch(seed):
        inputs = [make_inputs(seed, q, Tm - q, H, E, K, dtype, "random", 0.2) for q in range(W)]
        return inputs, ep.dispatch(*(t.cuda() for t in (inputs[r].x, inputs[r].idx, inputs[r].w)))

    with pytest.raises(p2pcomm.StateError, match="latest"):
        for i in range(3):  # the warm-up reads recv.x in place (and must be right); recording copies it
            inputs, recv = plain_dispatch(520 + i)
            torch.compiler.cudagraph_mark_step_begin()
            y = combine(pow2_expert(recv.x, recv.local_expert, recv.src_rank), recv)
            assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype, expert=pow2_expert), "warm-up")
    for i in range(2):
        inputs, recv = plain_dispatch(530 + i)
        y = ep.combine(pow2_expert(recv.x, recv.local_expert, recv.src_rank), recv)
        assert_same_bits(y, emulate_combine(inputs, r, W, E, K, dtype, expert=pow2_expert), f"plain round {i} after")
    comm.check()


_INDUCTOR_CPU = None


def inductor_cpu_problem():
    """Why inductor cannot compile for the CPU on some rank (it needs a C++
    compiler and Python's headers), or None; every rank gets the same answer,
    so all of them skip or run together."""
    global _INDUCTOR_CPU
    if _INDUCTOR_CPU is None:
        try:
            f = torch.compile(lambda t: t * 2 + 1, backend="inductor", fullgraph=True)
            why = None if torch.equal(f(torch.ones(3)), torch.full((3,), 3.0)) else "a wrong result"
        except Exception as e:  # noqa: BLE001 - the reason to skip
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        failed = torch.tensor([int(why is not None)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        _INDUCTOR_CPU = why or ("it failed on another rank" if failed.item() else "")
    return _INDUCTOR_CPU or None


@pytest.mark.parametrize("capturable", [False, True])
def test_compiled_rounds_keep_program_order(comms, capturable):
    """Two dispatch/combine rounds in one inductor graph (two micro-batches)
    run in program order: declared pure, inductor moved the second dispatch
    ahead of the first combine in eager mode's graph (the capturable one kept
    its order by chance), which then raised StateError. CPU backend: the
    order is decided by the graph, whatever the device."""
    skip_compile_past_max_ranks(dist.get_world_size(), "cpu")
    problem = inductor_cpu_problem()
    if problem:
        pytest.skip(f"inductor cannot compile for the CPU here: {problem}")
    comm = comms("cpu")
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 4 * W, 2, 32, 8, torch.float32
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype)
    torch.compiler.reset()
    a, b = (make_inputs(400 + i, r, Tm - r % 3, H, E, K, dtype, "random", 0.1) for i in range(2))

    def two(x1, i1, w1, x2, i2, w2):
        r1 = ep.dispatch(x1, i1, w1, capturable=capturable)
        y1 = ep.combine(pow2_expert(r1.x, r1.local_expert, r1.src_rank), r1)
        r2 = ep.dispatch(x2, i2, w2, capturable=capturable)
        y2 = ep.combine(pow2_expert(r2.x, r2.local_expert, r2.src_rank) * 4, r2)
        return y1, y2

    args = (a.x, a.idx, a.w, b.x, b.idx, b.w)
    want = two(*args)
    got = torch.compile(two, fullgraph=True, backend="inductor")(*args)
    for g, w_ in zip(got, want):
        assert_same_bits(g, w_, "compiled rounds against plain calls")


class MoeLayer(torch.nn.Module):
    def __init__(self, ep):
        super().__init__()
        self.ep = ep

    def forward(self, x, idx, w):
        recv = self.ep.dispatch(x, idx, w)
        return self.ep.combine(pow2_expert(recv.x, recv.local_expert, recv.src_rank), recv)


@pytest.mark.parametrize("how", ["argument", "module"])
def test_one_compiled_function_serves_many_eps(comms, how):
    """Ten eps (one per layer) through one compiled function, or ten
    compiled layers sharing one forward: one graph, not one per ep (an int
    id in the graph recompiled per ep until torch.compile's limit, 8, and
    failed under fullgraph), and each call runs its own ep (the eps' call
    counts). aot_eager: dynamo's guards decide this. Settings that would
    make the ep a constant of the shared graph are refused."""
    comm = comms("cpu")
    skip_compile_past_max_ranks(comm.world_size, "cpu")
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 4 * W, 2, 32, 8, torch.float32
    eps = [p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype)
           for _ in range(10)]
    torch.compiler.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    inp = make_inputs(410, r, Tm, H, E, K, dtype, "random")
    shared = torch.compile(lambda ep, x, idx, w: MoeLayer(ep)(x, idx, w), fullgraph=True, backend="aot_eager")
    layers = [torch.compile(MoeLayer(ep), fullgraph=True, backend="aot_eager") for ep in eps]
    for n, ep in enumerate(eps):
        want = MoeLayer(ep)(inp.x, inp.idx, inp.w)
        got = shared(ep, inp.x, inp.idx, inp.w) if how == "argument" else layers[n](inp.x, inp.idx, inp.w)
        assert_same_bits(got, want, f"ep {n}")
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert [ep._seq for ep in eps] == [2] * len(eps), "each ep: one plain and one compiled dispatch"
    # Freezing makes the (static) ep tensors constants of the graph: refused at trace time, on every rank.
    torch.compiler.reset()
    frozen = torch.compile(MoeLayer(eps[0]), fullgraph=True, backend="aot_eager")
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        with pytest.raises(Exception, match="freezing: that makes the ep.s tensors constants"):
            frozen(inp.x, inp.idx, inp.w)
    assert_same_bits(layers[0](inp.x, inp.idx, inp.w), MoeLayer(eps[0])(inp.x, inp.idx, inp.w), "after")


@pytest.mark.parametrize("device", DEVICES)
def test_results_identical_on_repeat_and_across_modes(comms, device):
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 4 * W, 3, 80, 12, torch.float32
    inputs = [make_inputs(55, q, Tm - q, H, E, K, dtype, "duplicates", 0.1) for q in range(W)]
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype)
    ys = [run_round(ep, inputs, r, device, capturable=c)[2].cpu() for c in (False, True, False, True)]
    for y in ys[1:]:
        assert torch.equal(y.view(torch.int32), ys[0].view(torch.int32))
    check_combine(ys[0], inputs, r, W, E, K, dtype)
    # The same tokens from every rank, through experts blind to the source: same bytes everywhere.
    same = make_inputs(56, 0, Tm, H, E, K, dtype, "random")
    recv = ep.dispatch(same.x.to(device), same.idx.to(device), same.w.to(device))
    y = ep.combine(expert_fn(recv.x, recv.local_expert, torch.zeros_like(recv.src_rank)), recv)
    assert same_on_all_ranks(y)


def still_works(ep, comm, device):
    W = comm.world_size
    inputs = [make_inputs(3, q, 4, ep.hidden, ep.num_experts, ep.topk, ep.dtype) for q in range(W)]
    recv, out, y = run_round(ep, inputs, comm.rank, device)
    check_combine(y, inputs, comm.rank, W, ep.num_experts, ep.topk, ep.dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_rank_late_to_construction(group, monkeypatch, device):
    """A rank that constructs its ExpertParallel after its peers' bound
    (P2PCOMM_TIMEOUT_MS; here still compiling kernels, say) only delays
    them: the construction agrees on the host, so no rank times out, and
    the ep works on every rank. (Agreeing by a GPU all-reduce, the early
    ranks raised PeerTimeoutError while the late one went on and waited in
    the first allocation for the group's timeout.)"""
    if device == "cuda":
        torch.cuda.set_device(local_cuda_index())
    where = torch.cuda.current_device() if device == "cuda" else "cpu"
    # The all-reduce's kernels built first under the run's bound: ranks compiling at once (8 sharing
    # two GPUs) came more than the 1 s below apart to that first all-reduce.
    warm = p2pcomm.Communicator(group, device=where)
    warm.all_reduce(torch.ones(4, dtype=torch.int64, device=device))
    if device == "cuda":
        torch.cuda.synchronize()
    warm.check()
    dist.barrier()  # no peer still reads its buffers
    warm.close()
    monkeypatch.setenv("P2PCOMM_TIMEOUT_MS", "1000")
    comm = p2pcomm.Communicator(group, device=where)
    W, r = comm.world_size, comm.rank
    comm.all_reduce(torch.ones(4, dtype=torch.int64, device=device))  # loaded from the cache
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    if r == 1:
        time.sleep(2.5)
    ep = p2pcomm.ExpertParallel(comm, num_experts=2 * W, hidden=64, max_tokens_per_rank=8, topk=2)
    still_works(ep, comm, device)
    comm.check()
    dist.barrier()
    comm.close()


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_on_every_rank(comms, device):
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    E, K, H, Tm = 2 * W, 2, 64, 8
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K)
    good = make_inputs(9, r, 4, H, E, K, torch.bfloat16)
    x, idx, w = good.x.to(device), good.idx.to(device), good.w.to(device)
    big = make_inputs(9, r, Tm + 1, H, E, K, torch.bfloat16)
    bad_id = idx.clone()
    bad_id[2, 1] = E
    neg_id = idx.clone()
    neg_id[0, 0] = -2
    cases = [  # (args on rank 1, error on rank 1, message)
        ((big.x.to(device), big.idx.to(device), big.w.to(device)), p2pcomm.InvalidArgumentError, "max_tokens"),
        ((x, bad_id, w), p2pcomm.InvalidArgumentError, r"topk_idx\[2, 1\] = "),
        ((x, neg_id, w), p2pcomm.InvalidArgumentError, r"topk_idx\[0, 0\] = -2"),
        ((x, idx.float(), w), p2pcomm.UnsupportedError, "topk_idx has dtype"),
        ((x, idx, w.double()), p2pcomm.UnsupportedError, "topk_weights has dtype"),
        ((x.float(), idx, w), p2pcomm.UnsupportedError, "x has dtype"),
        ((x, idx[:, :1].contiguous(), w), p2pcomm.InvalidArgumentError, "topk_idx has shape"),
        ((x[:, :32], idx, w), p2pcomm.InvalidArgumentError, "x has shape"),
        ((x.cpu() if device != "cpu" else x.to("meta"), idx, w), p2pcomm.InvalidArgumentError, "x is on"),
    ]
    for args, error, message in cases:
        if r == 1:
            with pytest.raises(error, match=message):
                ep.dispatch(*args)
        else:
            with pytest.raises(p2pcomm.MismatchError, match="rank 1"):
                ep.dispatch(x, idx, w)
        assert isinstance(error("x"), (ValueError, TypeError))
    still_works(ep, comm, device)
    # Every rank wrong at once: each raises its own error.
    with pytest.raises(p2pcomm.InvalidArgumentError, match="topk_idx"):
        ep.dispatch(x, bad_id, w)
    # combine with the wrong number of rows, on rank 0 only.
    recv = ep.dispatch(x, idx, w)
    out = recv.x.clone()
    if r == 0:
        with pytest.raises(p2pcomm.InvalidArgumentError, match="expert_out has shape"):
            ep.combine(torch.zeros(out.shape[0] + 1, H, dtype=out.dtype, device=device), recv)
    else:
        with pytest.raises(p2pcomm.MismatchError, match="rank 0"):
            ep.combine(out, recv)
    still_works(ep, comm, device)


@pytest.mark.parametrize("device", DEVICES)
def test_construction_checks(comms, device):
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    with pytest.raises(ValueError, match="divisible"):
        p2pcomm.ExpertParallel(comm, num_experts=W + 1, hidden=8, max_tokens_per_rank=4, topk=1)
    for field, kw in [("hidden", dict(hidden=64 + 8 * r)), ("topk", dict(topk=1 + (r == 1))),
                      ("max_tokens_per_rank", dict(max_tokens_per_rank=4 + r)),
                      ("dtype", dict(dtype=torch.float32 if r else torch.bfloat16)),
                      ("combine_dtype", dict(combine_dtype=torch.bfloat16 if r else torch.float32)),
                      ("capturable", dict(capturable=r == 0))]:
        args = dict(num_experts=2 * W, hidden=64, max_tokens_per_rank=4, topk=2)
        args.update(kw)
        with pytest.raises(ValueError, match=field):
            p2pcomm.ExpertParallel(comm, **args)
    for field, value, error, message in [
            ("dtype", torch.int32, p2pcomm.UnsupportedError, "dtype"),
            ("combine_dtype", torch.float16, p2pcomm.UnsupportedError, "combine_dtype torch.float16 is not supported"),
            ("combine_dtype", torch.float64, p2pcomm.UnsupportedError, "combine_dtype"),
            ("combine_dtype", "bfloat16", p2pcomm.InvalidArgumentError, "combine_dtype must be a torch.dtype"),
            ("num_sms", 0, p2pcomm.InvalidArgumentError, "num_sms must be a positive int or None, got 0"),
            ("num_sms", True, p2pcomm.InvalidArgumentError, "num_sms must be a positive int or None, got True")]:
        bad = dict(num_experts=2 * W, hidden=64, max_tokens_per_rank=4, topk=2)  # bfloat16
        if r == 1:
            bad[field] = value
            with pytest.raises(error, match=message):
                p2pcomm.ExpertParallel(comm, **bad)
        else:
            with pytest.raises(p2pcomm.MismatchError, match="rank 1"):
                p2pcomm.ExpertParallel(comm, **bad)
    # None is the default transit, float32; a float32 ep's own dtype is float32 too.
    assert p2pcomm.ExpertParallel(comm, num_experts=2 * W, hidden=64, max_tokens_per_rank=4, topk=2,
                                  combine_dtype=None).combine_dtype == torch.float32
    # And a good one still works after all that.
    still_works(p2pcomm.ExpertParallel(comm, num_experts=2 * W, hidden=64, max_tokens_per_rank=4, topk=2), comm,
                device)


@pytest.mark.parametrize("device", DEVICES)
def test_stale_dispatch_result_raises_state_error(comms, device):
    """combine needs the latest dispatch's result: an older one raises
    StateError (eager: the other ranks raise MismatchError), and every rank
    stays usable; a dispatch that every rank rejected moves no data and
    leaves the latest result valid."""
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    E, K, H, Tm = 2 * W, 2, 64, 8
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K)
    first = [make_inputs(21, q, Tm, H, E, K, torch.bfloat16) for q in range(W)]
    second = [make_inputs(22, q, Tm - 1, H, E, K, torch.bfloat16) for q in range(W)]
    old, old_out, _ = run_round(ep, first, r, device)
    new, new_out, y = run_round(ep, second, r, device)
    # One rank passes the stale result.
    if r == 1:
        with pytest.raises(p2pcomm.StateError, match=r"dispatch #1 .* dispatch #2"):
            ep.combine(old_out, old)
    else:
        with pytest.raises(p2pcomm.MismatchError, match="rank 1"):
            ep.combine(new_out, new)
    # Every rank does: each raises StateError.
    with pytest.raises(p2pcomm.StateError, match="latest"):
        ep.combine(old_out, old)
    # The latest result still combines to the same bits, again and again.
    assert_same_bits(ep.combine(new_out, new), y.cpu(), "combine after a rejected one")
    # A dispatch rejected by one rank moves nothing: the latest result stays valid. The rejected
    # calls carry other routing and rows, so data that moved would change the combine's bits.
    # Rank 0's bad expert id is found on the device (GPU: the send kernels skip their writes);
    # rank 1's wrong weights dtype on the host (it takes part in the barriers only).
    inp = make_inputs(23, r, Tm, H, E, K, torch.bfloat16)
    bad_idx = inp.idx.clone()
    bad_idx[0, 0] = E
    for bad_rank, error, args in ((0, p2pcomm.InvalidArgumentError, (inp.x, bad_idx, inp.w)),
                                  (1, p2pcomm.UnsupportedError, (inp.x, inp.idx, inp.w.double()))):
        if r == bad_rank:
            with pytest.raises(error, match="topk_"):
                ep.dispatch(*(a.to(device) for a in args))
        else:
            with pytest.raises(p2pcomm.MismatchError, match=f"rank {bad_rank}"):
                ep.dispatch(inp.x.to(device), inp.idx.to(device), inp.w.to(device))
        assert_same_bits(ep.combine(new_out, new), y.cpu(), f"combine after a dispatch rank {bad_rank} rejected")
    still_works(ep, comm, device)


@pytest.mark.parametrize("device", DEVICES)
def test_stale_dispatch_result_in_capturable_mode(comms, device):
    """Capturable combine checks without any host sync: every rank passing a
    stale result raises StateError before any barrier, so nothing waits;
    the mode comes from the latest dispatch, not from the result passed."""
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    E, K, H, Tm = 2 * W, 2, 64, 8
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, capturable=True)
    first = [make_inputs(31, q, Tm, H, E, K, torch.bfloat16) for q in range(W)]
    second = [make_inputs(32, q, Tm, H, E, K, torch.bfloat16) for q in range(W)]
    old, old_out, _ = run_round(ep, first, r, device, capturable=False)  # an eager result...
    new, new_out, _ = run_round(ep, second, r, device, capturable=True)  # ...then a capturable one
    with pytest.raises(p2pcomm.StateError, match="latest"):
        ep.combine(old_out, old)
    check_combine(ep.combine(new_out, new), second, r, W, E, K, torch.bfloat16)
    if device == "cuda":
        comm.check()


@pytest.mark.parametrize("device", DEVICES)
def test_closed_raises_state_error(comms, device):
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    E, K, H, Tm = 2 * W, 2, 64, 8
    inputs = [make_inputs(41, q, Tm, H, E, K, torch.bfloat16) for q in range(W)]
    for capturable in (False, True):
        ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K,
                                    capturable=capturable)
        recv, out, _ = run_round(ep, inputs, r, device)
        with ep:
            pass  # closes it
        inp = inputs[r]
        with pytest.raises(p2pcomm.StateError, match="closed"):
            ep.dispatch(inp.x.to(device), inp.idx.to(device), inp.w.to(device))
        with pytest.raises(p2pcomm.StateError, match="closed"):
            ep.combine(out, recv)
        ep.close()  # idempotent


@pytest.mark.parametrize("device", DEVICES)
def test_back_to_back_calls_with_skewed_ranks(comms, device):
    """Calls queued without any host sync while one rank lags behind (on GPU
    a sleep kernel before its calls, a different rank each round): each
    capturable call's barriers run inside its kernels, and must keep the
    ranks that run ahead from overwriting buffers the laggard still reads.
    Rounds alternate between x staged by dispatch, after a first dispatch
    whose result is dropped (two in a row), and x built in
    get_dispatch_buffer() (which its contract allows only once the previous
    dispatch's combine is queued); each combines its result twice. Every
    result is checked once all rounds have run. An eager round in between
    changes nothing."""
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 4 * W, 4, 256, 48, torch.bfloat16
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype,
                                capturable=True)
    rounds = [[make_inputs(200 + i, q, Tm - (i + q) % 5, H, E, K, dtype, "random", 0.1) for q in range(W)]
              for i in range(6)]
    decoys = [make_inputs(300 + i, r, Tm, H, E, K, dtype, "one_expert") for i in range(len(rounds))]
    results = []
    for i, inputs in enumerate(rounds):
        if device == "cuda" and r == i % W:
            torch.cuda._sleep(20_000_000)  # ~10 ms: the other ranks queue their calls first
        inp = inputs[r]
        x = inp.x.to(device)
        if i % 2:
            x = ep.get_dispatch_buffer(x.shape[0]).copy_(x)
        else:
            decoy = decoys[i]
            ep.dispatch(decoy.x.to(device), decoy.idx.to(device), decoy.w.to(device))
        recv = ep.dispatch(x, inp.idx.to(device), inp.w.to(device))
        out = expert_fn(recv.x, recv.local_expert, recv.src_rank)
        results.append((recv, ep.combine(out, recv), ep.combine(out, recv)))
        if i == 2:
            still_works(ep, comm, device)  # an eager round among them
    for inputs, (recv, y, again) in zip(rounds, results):
        check_dispatch(recv, inputs, r, W, E, K, dtype, capturable=True)
        check_combine(y, inputs, r, W, E, K, dtype)
        assert torch.equal(y.cpu().view(torch.int16), again.cpu().view(torch.int16))
    if device == "cuda":
        comm.check()


@GPU_ONLY
@pytest.mark.parametrize("capturable, before, call, barrier", [
    (True, "dispatch", "dispatch", "start"), (True, "combine", "dispatch", "middle"),
    (True, "combine", "combine", "start"), (True, "dispatch", "combine", "middle"),
    (False, "combine", "dispatch", "start"), (False, "dispatch", "combine", "start")])
def test_rank_that_never_arrives(group, monkeypatch, capturable, before, call, barrier):
    """When rank 1 never makes a call, every other rank's call gives up
    after P2PCOMM_TIMEOUT_MS and the communicator names rank 1, instead of
    hanging. Capturable calls wait for their peers inside the kernels and
    report it at the next check; a call that follows the other kind (a
    dispatch after a combine, a combine after a dispatch) skips its start
    barrier, so the ranks wait at its middle barrier instead. An eager
    call's start barrier is moe_post_status, and the call itself raises,
    within one timeout: the kernels after that barrier give up at once
    rather than wait a second timeout. When rank 1 then makes that eager call
    late, it passes the start barrier on the words its peers left, but its
    peers' send kernels wrote nothing and posted no middle flag: it raises
    naming one of them instead of passing on metadata nobody wrote."""
    timeout_s = 2.0
    monkeypatch.setenv("P2PCOMM_TIMEOUT_MS", str(int(timeout_s * 1000)))
    torch.cuda.set_device(local_cuda_index())
    comm = p2pcomm.Communicator(group, device=torch.cuda.current_device())
    W, r = comm.world_size, comm.rank
    E, K, H, Tm = 2 * W, 2, 64, 8
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, capturable=capturable)
    inputs = [make_inputs(61, q, Tm, H, E, K, torch.bfloat16) for q in range(W)]
    recv, out, y = run_round(ep, inputs, r, "cuda", capturable=capturable)
    check_combine(y, inputs, r, W, E, K, torch.bfloat16)
    inp = inputs[r]
    if before == "dispatch":
        recv = ep.dispatch(inp.x.cuda(), inp.idx.cuda(), inp.w.cuda())
        out = expert_fn(recv.x, recv.local_expert, recv.src_rank)
    torch.cuda.synchronize()
    dist.barrier()
    if r != 1:
        start = time.monotonic()
        want = f"rank 1 never arrived at the {barrier} barrier of an MoE {call}"
        with pytest.raises(p2pcomm.PeerTimeoutError, match=want):
            if call == "dispatch":
                ep.dispatch(inp.x.cuda(), inp.idx.cuda(), inp.w.cuda())
            else:
                ep.combine(out, recv)
            torch.cuda.synchronize()  # capturable: the kernels give up after the timeout
            comm.check()
        assert time.monotonic() - start < (20 if capturable else 2 * timeout_s)
    dist.barrier()
    if r == 1 and not capturable:
        with pytest.raises(p2pcomm.PeerTimeoutError, match=f"rank [0-9]+ never arrived at the middle barrier of an MoE {call}") as e:
            if call == "dispatch":
                ep.dispatch(inp.x.cuda(), inp.idx.cuda(), inp.w.cuda())
            else:
                ep.combine(out, recv)  # returns once the checks are in; the reduce gives up later
            torch.cuda.synchronize()
            comm.check()
        assert "rank 1 never" not in str(e.value)
    dist.barrier()
    comm.close()
