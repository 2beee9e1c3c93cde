"""Bad input raises a specific exception on every rank and leaves them usable."""

import pytest
import torch
import torch.distributed as dist

import p2pcomm
from conftest import DEVICES


def settle(comm, device):
    """GPU errors are seen asynchronously: wait for the stream, then ask."""
    if device == "cuda":
        torch.cuda.synchronize()
        comm.check()


def still_works(comm, device):
    out = comm.all_reduce(torch.ones(3, device=device) * (comm.rank + 1))
    assert torch.equal(out.cpu(), torch.ones(3) * sum(range(1, comm.world_size + 1)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "make, error",
    [
        (lambda d: torch.zeros(4, 4, device=d).t(), p2pcomm.InvalidArgumentError),
        (lambda d: torch.zeros(4, dtype=torch.complex64, device=d), p2pcomm.UnsupportedError),
        (lambda d: torch.zeros(4, dtype=torch.uint8, device=d), p2pcomm.UnsupportedError),
        (lambda d: torch.zeros(4, device="meta"), p2pcomm.InvalidArgumentError),
    ],
    ids=["non_contiguous", "complex", "uint8", "wrong_device"],
)
def test_bad_tensor_on_every_rank(comms, device, make, error):
    comm = comms(device)
    with pytest.raises(error):
        comm.all_reduce(make(device))
    still_works(comm, device)


@pytest.mark.parametrize("device", DEVICES)
def test_unknown_op_and_algorithm(comms, device):
    comm = comms(device)
    with pytest.raises(p2pcomm.UnsupportedError, match="unknown reduce op"):
        comm.all_reduce(torch.ones(2, device=device), op="xor")
    with pytest.raises(p2pcomm.UnsupportedError, match="unknown algorithm"):
        comm.all_reduce(torch.ones(2, device=device), algorithm="telepathy")
    with pytest.raises(p2pcomm.UnsupportedError, match="unknown algorithm"):
        comm.all_reduce_(torch.ones(2, device=device), algorithm=["ring"])  # unhashable
    still_works(comm, device)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_tensor_on_one_rank_fails_everyone(comms, device):
    comm = comms(device)
    x = torch.zeros(4, 4, device=device)
    if comm.rank == 1:
        x = x.t()
    expected = p2pcomm.InvalidArgumentError if comm.rank == 1 else p2pcomm.MismatchError
    with pytest.raises(expected, match="contiguous" if comm.rank == 1 else "rank 1"):
        comm.all_reduce(x)
        settle(comm, device)
    settle(comm, device)  # the rejecting rank has nothing more to hear
    still_works(comm, device)


@pytest.mark.parametrize("device", DEVICES)
def test_mismatched_sizes_and_dtypes(comms, device):
    comm = comms(device)
    with pytest.raises(p2pcomm.MismatchError, match="disagree"):
        comm.all_reduce(torch.ones(10 + comm.rank, device=device))
        settle(comm, device)
    dtype = torch.float32 if comm.rank == 0 else torch.float64
    with pytest.raises(p2pcomm.MismatchError, match="disagree"):
        comm.all_reduce(torch.ones(10, dtype=dtype, device=device))
        settle(comm, device)
    with pytest.raises(p2pcomm.MismatchError, match="disagree"):
        comm.all_reduce(torch.ones(10, device=device), op="sum" if comm.rank == 0 else "max")
        settle(comm, device)
    still_works(comm, device)


def test_oversize_tensor_raises_capacity_error(group, monkeypatch):
    monkeypatch.setenv("P2PCOMM_STAGING_BYTES", str(64 << 10))
    with p2pcomm.Communicator(group, device="cpu") as comm:
        with pytest.raises(p2pcomm.CapacityError, match="staging capacity"):
            comm.all_reduce(torch.ones(64 << 10))
        # One rank over capacity: the others learn of it.
        n = (64 << 10) if comm.rank == 0 else 16
        with pytest.raises(p2pcomm.CapacityError if comm.rank == 0 else p2pcomm.MismatchError):
            comm.all_reduce(torch.ones(n))
        still_works(comm, "cpu")
        big = comm.empty(64 << 10)  # symmetric memory has no staging limit
        big.fill_(1)
        comm.all_reduce_(big)
        assert torch.equal(big, torch.full_like(big, comm.world_size))


def test_use_after_close(group):
    comm = p2pcomm.Communicator(group, device="cpu")
    comm.close()
    comm.close()  # idempotent
    with pytest.raises(p2pcomm.StateError):
        comm.all_reduce(torch.ones(2))
    with pytest.raises(p2pcomm.StateError):
        comm.barrier()


@pytest.mark.parametrize("ending", ["close", "dropped"])
def test_an_ended_communicator_lets_go_of_its_group(group, ending):
    """Closed, or dropped unclosed, a communicator keeps no reference to the torch group: a group the garbage
    collector frees only as the interpreter exits can abort the process there."""
    import gc

    from p2pcomm.communicator import _TorchBootstrap

    sub = dist.new_group(backend="gloo")
    gc.collect()
    gc.disable()  # what refcounting alone frees
    try:
        comm = p2pcomm.Communicator(sub, device="cpu")
        comm.barrier()
        if ending == "close":
            comm.close()
        del comm
        held = [o for o in gc.get_objects() if isinstance(o, _TorchBootstrap) and o.group is sub]
        assert not held, f"{len(held)} bootstrap(s) still hold the group"
    finally:
        gc.enable()
    dist.destroy_process_group(sub)


def test_barrier_and_context_manager(group):
    with p2pcomm.Communicator(group, device="cpu") as comm:
        for _ in range(50):
            comm.barrier()
    with pytest.raises(p2pcomm.StateError):
        comm.empty(4)
    dist.barrier()


def test_fallback_to_torch_when_peers_are_unreachable(group, monkeypatch):
    def no_peer_access(config, torch_bs):
        raise p2pcomm.PeerUnavailableError("rank 0 (GPU 0) cannot access rank 1 (GPU 1) over P2P")

    monkeypatch.setattr(p2pcomm.Communicator, "_native_init", staticmethod(no_peer_access))
    with pytest.raises(p2pcomm.PeerUnavailableError, match="cannot access"):
        p2pcomm.Communicator(group, device="cpu")
    with pytest.warns(UserWarning, match="fallback='torch'"):
        comm = p2pcomm.Communicator(group, device="cpu", fallback="torch")
    assert isinstance(comm, p2pcomm.TorchFallbackCommunicator)
    w, r = comm.world_size, comm.rank
    x = torch.arange(12, dtype=torch.float32) * (r + 1)
    assert torch.equal(comm.all_reduce(x), torch.arange(12, dtype=torch.float32) * sum(range(1, w + 1)))
    assert torch.equal(x, torch.arange(12, dtype=torch.float32) * (r + 1)), "input was modified"
    y = torch.full((5,), -7 - r, dtype=torch.int64)
    want = torch.div(sum(-7 - q for q in range(w)), w, rounding_mode="floor")
    assert torch.equal(comm.all_reduce_(y, op="avg"), torch.full((5,), int(want), dtype=torch.int64))
    with pytest.raises(p2pcomm.InvalidArgumentError):
        comm.all_reduce_(torch.zeros(4, 4).t())
    with pytest.raises(p2pcomm.UnsupportedError):
        comm.all_reduce(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(p2pcomm.UnsupportedError):
        comm.peer_tensor(x, 0)
    with pytest.raises(p2pcomm.UnsupportedError):
        comm.prepare_kernel("moe_dispatch.cu", "moe_dispatch_send")
    assert comm.host_allgather(bytes([r, 7 * r])) == [bytes([q, 7 * q]) for q in range(w)]
    with pytest.raises(p2pcomm.MismatchError, match="host_allgather"):
        comm.host_allgather(bytes(2 + (r == 1)))
    comm.barrier()
    comm.close()
    with pytest.raises(p2pcomm.StateError):
        comm.all_reduce(x)


def test_can_use_reports_what_all_reduce_accepts(comms):
    comm = comms("cpu")
    assert comm.can_use(torch.ones(4))
    assert not comm.can_use(torch.ones(4, 4).t())
    assert not comm.can_use(torch.ones(4, dtype=torch.uint8))
    assert not comm.can_use(torch.ones(4, device="meta"))


def test_non_tensor_on_one_rank_fails_everyone(comms):
    comm = comms("cpu")
    x = [1.0, 2.0] if comm.rank == 1 else torch.ones(2)
    expected = p2pcomm.InvalidArgumentError if comm.rank == 1 else p2pcomm.MismatchError
    with pytest.raises(expected):
        comm.all_reduce(x)
    still_works(comm, "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_host_allgather_gives_every_rank_every_ranks_bytes(comms, device):
    """host_allgather: each rank's random bytes on every rank, in rank
    order; lengths that differ raise MismatchError on every rank, more than
    the bootstrap's 64 MiB CapacityError, and the communicator works after
    them."""
    comm = comms(device)
    W, r = comm.world_size, comm.rank
    sent = [bytes(torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(70 + q),
                                dtype=torch.uint8).tolist()) for q in range(W)]
    assert comm.host_allgather(sent[r]) == sent
    assert comm.host_allgather(b"") == [b""] * W
    with pytest.raises(p2pcomm.MismatchError, match="host all-gather"):
        comm.host_allgather(bytes(8 + (r == 1)))
    if device == "cpu":  # the check is the host's, the same on either backend
        with pytest.raises(p2pcomm.CapacityError, match="exceeds the limit"):
            comm.host_allgather(bytes((64 << 20) + 1))
    assert comm.host_allgather(sent[r][::-1]) == [s[::-1] for s in sent]
    still_works(comm, device)


def test_setup_failure_of_one_rank_raises_the_cause_on_every_rank(group, monkeypatch):
    """Rank 1 cannot reserve its shared memory: every rank gets that cause as a
    specific error at construction, not a communicator that fails later."""
    if dist.get_rank() == 1:
        monkeypatch.setenv("P2PCOMM_STAGING_BYTES", str(1 << 60))  # more than any tmpfs holds
    want = "reserve" if dist.get_rank() == 1 else "rank 1 could not create shared memory"
    with pytest.raises(p2pcomm.CapacityError, match=want):
        p2pcomm.Communicator(device="cpu", group=group)
    monkeypatch.delenv("P2PCOMM_STAGING_BYTES", raising=False)
    with p2pcomm.Communicator(device="cpu", group=group) as comm:
        still_works(comm, "cpu")
