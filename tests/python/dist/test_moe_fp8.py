"""fp8 dispatch (ExpertParallel(..., dispatch_dtype=torch.float8_e4m3fn)): float8 rows and their float32
scales, one per 128 columns, arrive bit for bit in the documented row order, eager and captured in a CUDA
graph; combine of bf16 expert outputs after it matches the reference; bad input raises on every rank."""

import pytest
import torch

import p2pcomm
from conftest import DEVICES, GPU_ONLY
from test_moe import (Inputs, assert_same_bits, check_combine, emulate_combine, expert_fn, make_inputs,
                      reference_dispatch)

FP8 = torch.float8_e4m3fn
BLOCK = 128


def quantize(x: torch.Tensor) -> tuple:
    """DeepSeek-style: x [T, H] as float8 rows with a float32 scale per 128 columns (amax / 448)."""
    T, H = x.shape
    blocks = x.float().view(T, H // BLOCK, BLOCK)
    scales = (blocks.abs().amax(dim=2) / 448.0).clamp(min=1e-8)
    q = (blocks / scales.unsqueeze(2)).to(FP8).view(T, H)
    return q, scales.contiguous()


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    return (q.float() * scales.repeat_interleave(BLOCK, dim=1)).to(dtype)


def fp8_inputs(seed, W, sizes, H, E, K, dtype, routing="random", minus_one=0.0):
    """Per rank: (q, scales) and Inputs whose x is what the experts see (q dequantized)."""
    quant, deq = [], []
    for q in range(W):
        inp = make_inputs(seed, q, sizes[q], H, E, K, dtype, routing, minus_one)
        x8, s = quantize(inp.x)
        quant.append((x8, s))
        deq.append(Inputs(dequantize(x8, s, dtype), inp.idx, inp.w))
    return quant, deq


def check_fp8_rows(recv, quant, deq, rank, W, E, K, capturable=False):
    """Metadata as in bf16 dispatch; every received row's float8 bytes and scale bits its source's."""
    rows = reference_dispatch(deq, rank, W, E, K)
    R = len(rows)
    assert int(recv.num_rows.item()) == R
    assert recv.x.dtype == FP8 and recv.scales.dtype == torch.float32
    assert recv.x.shape[0] == recv.scales.shape[0] and recv.scales.shape[1] == recv.x.shape[1] // BLOCK
    assert recv.x.shape[0] == R or (capturable and recv.x.shape[0] >= R)
    L = E // W
    assert torch.equal(recv.expert_counts.cpu(), torch.bincount(rows.local_expert, minlength=L).to(torch.int32))
    if R == 0:
        return
    assert torch.equal(recv.local_expert[:R].cpu(), rows.local_expert.to(torch.int32))
    assert torch.equal(recv.src_rank[:R].cpu(), rows.src.to(torch.int32))
    assert torch.equal(recv.src_token[:R].cpu(), rows.token.to(torch.int32))
    want_x = rows.gather([x8 for x8, _ in quant])
    want_s = rows.gather([sc for _, sc in quant])
    assert torch.equal(recv.x[:R].cpu().view(torch.uint8), want_x.view(torch.uint8)), "fp8 rows differ"
    assert torch.equal(recv.scales[:R].cpu().view(torch.int32), want_s.view(torch.int32)), "scales differ"


def expert_of(recv, dtype):
    """The experts' view of an fp8 dispatch: rows dequantized, then expert_fn."""
    return expert_fn(dequantize(recv.x, recv.scales, dtype), recv.local_expert, recv.src_rank)


CASES = [  # (E, K, H, T_max, routing, minus_one)
    (8, 1, 512, 16, "random", 0.0),
    (16, 8, 1024, 32, "random", 0.2),
    (8, 8, 512, 16, "duplicates", 0.1),
    (32, 4, 7168, 300, "random", 0.1),  # DeepSeek's hidden; more tokens than threads in a block
]


@GPU_ONLY
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}_K{c[1]}_H{c[2]}_{c[4]}")
def test_fp8_dispatch_rows_and_scales_then_combine(comms, case):
    E, K, H, Tm, routing, minus_one = case
    comm = comms("cuda")
    W, r = comm.world_size, comm.rank
    E = -(-E // W) * W
    dtype = torch.bfloat16
    sizes = [0 if q == 1 else (Tm if q == 0 else 1 + (5 * q) % Tm) for q in range(W)]
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype,
                                dispatch_dtype=FP8)
    for seed in (11, 12):  # twice: the second round reuses the buffers with other data
        quant, deq = fp8_inputs(seed, W, sizes, H, E, K, dtype, routing, minus_one)
        x8, s = quant[r]
        recv = ep.dispatch(x8.cuda(), deq[r].idx.cuda(), deq[r].w.cuda(), scales=s.cuda())
        check_fp8_rows(recv, quant, deq, r, W, E, K)
        y = ep.combine(expert_of(recv, dtype), recv)
        check_combine(y, deq, r, W, E, K, dtype)
        assert_same_bits(y, emulate_combine(deq, r, W, E, K, dtype), "combine after fp8 dispatch")
    comm.check()


@GPU_ONLY
@pytest.mark.parametrize("where", ["plain", "buffer"])
@pytest.mark.parametrize("tokens", ["full", "uneven"])
def test_fp8_dispatch_captured_in_a_graph(comms, tokens, where):
    """Capturable fp8 dispatch + dequantize + expert + combine captured once, replayed with new rows, scales
    and routing (in plain tensors, or built in ep.get_dispatch_buffer(): no copy in the graph); the received
    rows and scales are poisoned before each replay."""
    comm = comms("cuda")
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 8 * W, 4, 512, 16, torch.bfloat16
    sizes = [Tm if tokens == "full" else (Tm - 3, 0, Tm, 5)[q % 4] for q in range(W)]
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype,
                                capturable=True, dispatch_dtype=FP8)
    rounds = [fp8_inputs(200 + i, W, sizes, H, E, K, dtype, "random", 0.25) for i in range(3)]
    if where == "buffer":
        static_x, static_s = ep.get_dispatch_buffer(sizes[r])
    else:
        static_x = torch.zeros(sizes[r], H, dtype=FP8, device="cuda")
        static_s = torch.zeros(sizes[r], H // BLOCK, dtype=torch.float32, device="cuda")
    static_idx = torch.zeros(sizes[r], K, dtype=torch.int64, device="cuda")
    static_w = torch.zeros(sizes[r], K, dtype=torch.float32, device="cuda")

    def load(rnd):
        quant, deq = rnd
        static_x.copy_(quant[r][0])
        static_s.copy_(quant[r][1])
        static_idx.copy_(deq[r].idx)
        static_w.copy_(deq[r].w)

    def step():
        recv = ep.dispatch(static_x, static_idx, static_w, scales=static_s)
        return recv, ep.combine(expert_of(recv, dtype), recv)

    load(rounds[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    ep._trace()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv, y = step()
    assert recv.x.shape == (W * Tm * K, H) and recv.scales.shape == (W * Tm * K, H // BLOCK)
    staged = [step["name"] for step in ep._trace() if step["name"] == "stage"]
    assert staged == (["stage"] if where == "plain" and sizes[r] else []), staged
    for quant, deq in rounds[1:] + rounds[:1]:
        load((quant, deq))
        recv.x.view(torch.uint8).fill_(0x7F)  # NaN in e4m3
        recv.scales.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_fp8_rows(recv, quant, deq, r, W, E, K, capturable=True)
        check_combine(y, deq, r, W, E, K, dtype)
        assert_same_bits(y, emulate_combine(deq, r, W, E, K, dtype), "captured combine after fp8 dispatch")
    comm.check()


@GPU_ONLY
@pytest.mark.parametrize("capturable", [False, True], ids=["eager", "capturable"])
def test_fp8_dispatch_from_its_buffer(comms, capturable):
    """Rows and scales built in ep.get_dispatch_buffer() (nothing to copy), the rows alone or the scales alone
    there (the other copied), both as views elsewhere inside the buffer (copied out first), and plain tensors,
    each rank in its own order, so that ranks differ in every round (and one has no tokens): rows and scales
    arrive bit for bit and combine matches; what was built in place is unchanged, and golib/moe copies only
    when something was not in place."""
    comm = comms("cuda")
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 4 * W, 4, 512, 24, torch.bfloat16
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype,
                                dispatch_dtype=FP8)
    rows, scales = ep.get_dispatch_buffer()
    assert rows.shape == (Tm, H) and rows.dtype == FP8
    assert scales.shape == (Tm, H // BLOCK) and scales.dtype == torch.float32
    assert [t.shape[0] for t in ep.get_dispatch_buffer(0)] == [0, 0]
    with pytest.raises(p2pcomm.InvalidArgumentError, match="num_tokens"):
        ep.get_dispatch_buffer(Tm + 1)
    sizes = [0 if q == W - 1 else Tm - 2 - 3 * q for q in range(W)]  # "inside" never starts at the buffer
    wheres = ("both", "rows", "scales", "inside", "plain")
    for i in range(len(wheres)):
        where, T = wheres[(i + r) % len(wheres)], sizes[r]
        quant, deq = fp8_inputs(300 + i, W, sizes, H, E, K, dtype, "random", 0.1)
        x8, s = quant[r]
        x, sc = x8.cuda(), s.cuda()
        if where in ("both", "rows"):
            x = ep.get_dispatch_buffer(T)[0].copy_(x8)
        if where in ("both", "scales"):
            sc = ep.get_dispatch_buffer(T)[1].copy_(s)
        if where == "inside":  # views that end at the buffer's last row: copied out first
            all_x, all_s = ep.get_dispatch_buffer()
            all_x.view(torch.uint8).fill_(0x7F)
            all_s.fill_(float("nan"))
            x, sc = all_x[Tm - T:].copy_(x8), all_s[Tm - T:].copy_(s)
        ep._trace()
        recv = ep.dispatch(x, deq[r].idx.cuda(), deq[r].w.cuda(), scales=sc, capturable=capturable)
        staged = [step["name"] for step in ep._trace() if step["name"] == "stage"]
        check_fp8_rows(recv, quant, deq, r, W, E, K, capturable=capturable)
        y = ep.combine(expert_of(recv, dtype), recv)
        check_combine(y, deq, r, W, E, K, dtype)
        assert staged == ([] if where == "both" or T == 0 else ["stage"]), (where, staged)
        if where == "both":
            assert torch.equal(x.cpu().view(torch.uint8), x8.view(torch.uint8)), "dispatch changed x"
            assert torch.equal(sc.cpu().view(torch.int32), s.view(torch.int32)), "dispatch changed the scales"
    comm.check()


@GPU_ONLY
def test_fp8_bad_inputs_raise_on_every_rank(comms):
    comm = comms("cuda")
    W, r = comm.world_size, comm.rank
    E, K, H, Tm, dtype = 2 * W, 2, 512, 8, torch.bfloat16
    ep = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype,
                                dispatch_dtype=FP8)
    quant, deq = fp8_inputs(5, W, [4] * W, H, E, K, dtype)
    x8, s = quant[r][0].cuda(), quant[r][1].cuda()
    idx, w = deq[r].idx.cuda(), deq[r].w.cuda()
    cases = [  # (x, scales on rank 1, error on rank 1, message)
        (deq[r].x.cuda(), s, p2pcomm.UnsupportedError, "x has dtype"),
        (x8, None, p2pcomm.InvalidArgumentError, "scales must be a torch.Tensor"),
        (x8, s[:, :2].contiguous(), p2pcomm.InvalidArgumentError, "scales has shape"),
        (x8, s.double(), p2pcomm.UnsupportedError, "scales has dtype"),
        (x8, s.cpu(), p2pcomm.InvalidArgumentError, "scales is on"),
    ]
    for bad_x, bad_s, error, message in cases:
        if r == 1:
            with pytest.raises(error, match=message):
                ep.dispatch(bad_x, idx, w, scales=bad_s)
        else:
            with pytest.raises(p2pcomm.MismatchError, match="rank 1"):
                ep.dispatch(x8, idx, w, scales=s)
    recv = ep.dispatch(x8, idx, w, scales=s)  # usable after all that
    check_fp8_rows(recv, quant, deq, r, W, E, K)
    # A bf16 ep refuses scales, on every rank.
    plain = p2pcomm.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens_per_rank=Tm, topk=K, dtype=dtype)
    if r == 0:
        with pytest.raises(p2pcomm.InvalidArgumentError, match="scales are for fp8 dispatch"):
            plain.dispatch(deq[r].x.cuda(), idx, w, scales=s)
    else:
        with pytest.raises(p2pcomm.MismatchError, match="rank 0"):
            plain.dispatch(deq[r].x.cuda(), idx, w)
    comm.check()


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_construction_checks(comms, device):
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    args = dict(num_experts=2 * W, max_tokens_per_rank=4, topk=2)
    if device == "cpu":
        with pytest.raises(p2pcomm.UnsupportedError, match="fp8 dispatch runs on the GPU kernels"):
            p2pcomm.ExpertParallel(comm, hidden=512, dispatch_dtype=FP8, **args)
        return
    # Scales rows of 16-byte multiples: hidden a multiple of 512 (128 is not enough).
    with pytest.raises(p2pcomm.UnsupportedError, match="multiple of 512"):
        p2pcomm.ExpertParallel(comm, hidden=640, dispatch_dtype=FP8, **args)
    with pytest.raises(p2pcomm.UnsupportedError, match="multiple of 128"):
        p2pcomm.ExpertParallel(comm, hidden=520, dispatch_dtype=FP8, **args)
    for value, error, message in [(torch.float16, p2pcomm.UnsupportedError, "dispatch_dtype torch.float16"),
                                  ("fp8", p2pcomm.InvalidArgumentError, "dispatch_dtype must be a torch.dtype")]:
        if r == 1:
            with pytest.raises(error, match=message):
                p2pcomm.ExpertParallel(comm, hidden=512, dispatch_dtype=value, **args)
        else:
            with pytest.raises(p2pcomm.MismatchError, match="rank 1"):
                p2pcomm.ExpertParallel(comm, hidden=512, dispatch_dtype=FP8, **args)
    # Ranks that disagree on fp8 raise naming the field.
    with pytest.raises(ValueError, match="dispatch_fp8"):
        p2pcomm.ExpertParallel(comm, hidden=512, dispatch_dtype=FP8 if r == 0 else None, **args)
    ep = p2pcomm.ExpertParallel(comm, hidden=512, dispatch_dtype=FP8, **args)
    assert ep.dispatch_dtype == FP8 and "dispatch_dtype" in repr(ep)
