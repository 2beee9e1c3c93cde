"""What python/p2pcomm/moe.py hands golib/moe besides the arguments: the
thresholds between paths that give the same bits, from the environment and
the tests' hooks. (The kernels' parameter layouts, names and launch plans
are golib/moe's, tested there: go test ./golib/moe.)"""

import pytest

from p2pcomm import moe


def test_count_pairs_knob(monkeypatch):
    """P2PCOMM_MOE_COUNT_PAIRS (A/B runs): unset -> the hook (None: Go's
    default), an integer -> itself, anything else -> a warning and the
    default, never silently."""
    monkeypatch.delenv("P2PCOMM_MOE_COUNT_PAIRS", raising=False)
    assert moe._tuning()["count_kernel_min_pairs"] is None
    monkeypatch.setattr(moe, "_COUNT_KERNEL_MIN_PAIRS", 5)
    assert moe._tuning()["count_kernel_min_pairs"] == 5
    for v, want in (("0", 0), (" 1000000000 ", 1000000000)):
        monkeypatch.setenv("P2PCOMM_MOE_COUNT_PAIRS", v)
        assert moe._tuning()["count_kernel_min_pairs"] == want
    for v in ("1e9", "-1", "8k"):
        monkeypatch.setenv("P2PCOMM_MOE_COUNT_PAIRS", v)
        with pytest.warns(UserWarning, match="P2PCOMM_MOE_COUNT_PAIRS"):
            assert moe._tuning()["count_kernel_min_pairs"] == 5


def test_self_local_knob(monkeypatch):
    """P2PCOMM_MOE_SELF_LOCAL (A/B runs): unset -> "auto", 0 -> "never", 1 ->
    "always", anything else -> a warning and "auto", never silently."""
    monkeypatch.delenv("P2PCOMM_MOE_SELF_LOCAL", raising=False)
    assert moe._tuning()["self_local"] == "auto"
    for v, want in (("0", "never"), (" 1 ", "always"), ("", "auto")):
        monkeypatch.setenv("P2PCOMM_MOE_SELF_LOCAL", v)
        assert moe._tuning()["self_local"] == want
    for v in ("yes", "2", "off"):
        monkeypatch.setenv("P2PCOMM_MOE_SELF_LOCAL", v)
        with pytest.warns(UserWarning, match="P2PCOMM_MOE_SELF_LOCAL"):
            assert moe._tuning()["self_local"] == "auto"


def test_eager_staging_hook(monkeypatch):
    assert moe._tuning()["eager_kernel_stage_bytes"] is None
    monkeypatch.setattr(moe, "_EAGER_KERNEL_STAGE_BYTES", 0)
    assert moe._tuning()["eager_kernel_stage_bytes"] == 0
