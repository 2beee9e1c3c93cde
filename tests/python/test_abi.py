"""The numbers Python passes through the C ABI are the Go side's (read from its source)."""

import pathlib
import re

import pytest

pytest.importorskip("torch")
from p2pcomm import communicator  # noqa: E402

GOLIB = pathlib.Path(__file__).resolve().parents[2] / "golib"


def go_consts(path: str, type_name: str) -> dict:
    src = (GOLIB / path).read_text()
    return {name: int(v) for name, v in re.findall(rf"^\s*(\w+)\s+{type_name} = (-?\d+)", src, re.M)}


def test_barrier_calls_match_collective_call():
    calls = go_consts("collective/collective.go", "Call")
    assert calls, "no Call constants found in golib/collective/collective.go"
    assert communicator.BARRIER_STREAM == calls["CallStreamBarrier"]
    assert communicator.BARRIER_MOE_DISPATCH == calls["CallMoeDispatch"]
    assert communicator.BARRIER_MOE_COMBINE == calls["CallMoeCombine"]


def test_algorithms_match_collective_algorithm():
    algos = go_consts("collective/collective.go", "Algorithm")
    names = {re.sub(r"(?<!^)(?=[A-Z])", "_", k).lower(): v for k, v in algos.items()}
    names = {k.replace("one_shot", "oneshot").replace("two_shot", "twoshot").replace("_l_l", "_ll"): v
             for k, v in names.items()}
    for code, name in enumerate(communicator.ALGORITHMS):
        assert names.get(name) == code, f"algorithm {name!r} is {code} in Python, {names.get(name)} in Go"


def test_status_codes_match_status_code():
    from p2pcomm import errors

    codes = go_consts("status/status.go", "Code")
    assert codes, "no Code constants found in golib/status/status.go"
    by_name = {"InvalidArgument": errors.InvalidArgumentError, "Unsupported": errors.UnsupportedError,
               "Capacity": errors.CapacityError, "State": errors.StateError, "Mismatch": errors.MismatchError,
               "Timeout": errors.PeerTimeoutError, "Bootstrap": errors.BootstrapError, "CUDA": errors.CUDAError,
               "Fork": errors.ForkError, "Internal": errors.InternalError,
               "PeerUnavailable": errors.PeerUnavailableError}
    assert set(codes) - {"OK"} == set(by_name), "a status code without its exception, or the other way round"
    for name, cls in by_name.items():
        assert cls.code == codes[name], f"{cls.__name__}.code = {cls.code}, Go's {name} = {codes[name]}"
        assert errors.error_for(codes[name], "x").__class__ is cls


def test_dtype_and_op_codes_match_reduce():
    import torch

    dtypes = go_consts("reduce/reduce.go", "DType")
    want = {"Float32": torch.float32, "Float64": torch.float64, "Float16": torch.float16, "BFloat16": torch.bfloat16,
            "Int32": torch.int32, "Int64": torch.int64}
    assert {communicator._DTYPES[t]: n for n, t in want.items()} == {v: k for k, v in dtypes.items()}
    ops = go_consts("reduce/reduce.go", "Op")
    assert {o.name.capitalize(): o.value for o in communicator.ReduceOp} == ops


def test_moe_eager_calls_cross_the_c_abi_at_most_twice(monkeypatch):
    """An eager MoE dispatch is at most two C calls (the dispatch, which says
    how many rows arrive, then the expand into outputs of that size), an
    eager combine one: every export of the loaded library counted, on a
    world of one (CPU backend, TCP bootstrap)."""
    import socket

    import torch

    import p2pcomm
    from p2pcomm import _lib

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     P2PCOMM_JOB_TOKEN="%x" % port).items():
        monkeypatch.setenv(k, v)
    lib, calls = _lib.lib(), []

    def counting(name, fn):
        def call(*args):
            calls.append(name)
            return fn(*args)
        return call

    for name in _lib._SIGNATURES:
        monkeypatch.setattr(lib, name, counting(name, getattr(lib, name)))
    with p2pcomm.Communicator(device="cpu", bootstrap="tcp") as comm:
        ep = p2pcomm.ExpertParallel(comm, num_experts=4, hidden=16, max_tokens_per_rank=8, topk=2, dtype=torch.float32)
        x, idx, w = torch.randn(8, 16), torch.randint(0, 4, (8, 2)), torch.rand(8, 2)
        for capturable in (False, True):
            calls.clear()
            recv = ep.dispatch(x, idx, w, capturable=capturable)
            assert len(calls) <= 2 and all(c.startswith("p2p_moe_") for c in calls), calls
            calls.clear()
            y = ep.combine(recv.x * 2, recv)
            assert len(calls) <= 2 and all(c.startswith("p2p_moe_") for c in calls), calls
        assert torch.allclose(y, 2 * (w.unsqueeze(2) * x.unsqueeze(1)).sum(1))
        ep.close()
