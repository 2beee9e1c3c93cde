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
