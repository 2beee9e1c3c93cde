"""Which GPU a rank takes under torchrun, with and without shared GPUs."""

import pytest

torch = pytest.importorskip("torch")
from p2pcomm.communicator import local_cuda_index  # noqa: E402


@pytest.mark.parametrize("share, want", [(None, 5), ("0", 5), ("1", 1)])
def test_local_rank_picks_the_gpu(monkeypatch, share, want):
    monkeypatch.setenv("LOCAL_RANK", "5")
    if share is None:
        monkeypatch.delenv("P2PCOMM_SHARE_GPUS", raising=False)
    else:
        monkeypatch.setenv("P2PCOMM_SHARE_GPUS", share)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert local_cuda_index() == want


def test_without_local_rank_the_current_device(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("P2PCOMM_SHARE_GPUS", "1")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert local_cuda_index() == 3
