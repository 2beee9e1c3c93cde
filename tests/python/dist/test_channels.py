"""Channels: port channels from the host (CPU ranks, simulated nodes over UCX)
and, on GPUs, memory and port channels in users' own kernels (the README's
all-gather), inside a node and across simulated nodes, in CUDA graphs."""

import importlib.util

import pytest
import torch
import torch.distributed as dist

import p2pcomm
from conftest import GPU_ONLY
from p2pcomm.communicator import local_cuda_index

HAVE_UCX = importlib.util.find_spec("libucx") is not None
NEEDS_UCX = pytest.mark.skipif(not HAVE_UCX, reason="UCX not installed (pip install libucx-cu13)")

POISON = 0xA5


def slice_data(rank: int, nbytes: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).to(device)


@pytest.fixture
def node_comm(group, monkeypatch):
    """A communicator whose every rank is a node of its own (P2PCOMM_LOCAL_SIZE=1)."""
    made = []

    def make(device, local_size=1):
        monkeypatch.setenv("P2PCOMM_LOCAL_SIZE", str(local_size))
        if device == "cuda":
            torch.cuda.set_device(local_cuda_index())
        comm = p2pcomm.Communicator(group=group, device=device)
        monkeypatch.delenv("P2PCOMM_LOCAL_SIZE")
        made.append(comm)
        return comm

    yield make
    for c in made:
        c.close()


def gather_through_host_port_channels(comm, buf, chunk, seed):
    """Every rank puts its chunk into every peer's copy of buf from the host, then checks what arrived."""
    w, r = comm.world_size, comm.rank
    buf.fill_(POISON)
    buf[r * chunk:(r + 1) * chunk] = slice_data(r, chunk, seed)
    with comm.port_channels(buf) as port:
        for peer in range(w):
            if peer != r:
                port.put(peer, r * chunk, r * chunk, chunk)
                port.signal(peer)
        for peer in range(w):
            if peer != r:
                port.flush(peer)
        for peer in range(w):
            if peer != r:
                port.wait(peer)
        for q in range(w):
            got, want = buf[q * chunk:(q + 1) * chunk], slice_data(q, chunk, seed)
            assert torch.equal(got, want), f"rank {r}: chunk of rank {q} differs at byte " \
                f"{int((got != want).nonzero()[0])}"
        dist.barrier()  # nobody closes (a collective) while a peer still waits


@NEEDS_UCX
@pytest.mark.parametrize("chunk", [1, 4096 + 8, 3 << 20])
def test_port_channels_on_host_memory_across_simulated_nodes(node_comm, chunk):
    comm = node_comm("cpu")
    assert comm.nodes == [[q] for q in range(comm.world_size)]
    buf = comm.empty(comm.world_size * chunk, dtype=torch.uint8)
    for seed in range(2):
        gather_through_host_port_channels(comm, buf, chunk, seed)


@NEEDS_UCX
def test_random_puts_land_byte_for_byte(node_comm):
    """Random ranges of random data, several puts per signal, every byte of the peer's copy checked."""
    comm = node_comm("cpu")
    w, r, n = comm.world_size, comm.rank, 1 << 16
    buf = comm.empty(2 * n, dtype=torch.uint8)  # [0, n): source, [n, 2n): what the left neighbour puts
    buf.fill_(POISON)
    buf[:n] = slice_data(r, n, 7)
    right, left = (r + 1) % w, (r - 1) % w
    g = torch.Generator().manual_seed(11)  # the same cuts on every rank
    cuts = sorted(set(torch.randint(0, n, (40,), generator=g).tolist()) | {0, n})
    with comm.port_channels(buf) as port:
        for a, b in zip(cuts, cuts[1:]):
            port.put(right, n + a, a, b - a)
        port.signal(right)
        port.flush(right)
        port.wait(left)
        assert torch.equal(buf[n:], slice_data(left, n, 7))
        dist.barrier()


@NEEDS_UCX
def test_port_channel_bad_input_raises_on_every_rank(node_comm):
    comm = node_comm("cpu")
    r = comm.rank
    buf = comm.empty(4096, dtype=torch.uint8)
    # Sizes that differ across ranks: every rank learns it.
    with pytest.raises(p2pcomm.MismatchError):
        comm.port_channels(buf[: 4096 - 16 * r])
    # Not from comm.empty nor registered.
    with pytest.raises(p2pcomm.InvalidArgumentError):
        comm.port_channels(torch.empty(64, dtype=torch.uint8))
    with comm.port_channels(buf) as port:
        with pytest.raises(p2pcomm.InvalidArgumentError, match="itself"):
            port.put(r, 0, 0, 8)
        with pytest.raises(p2pcomm.InvalidArgumentError):
            port.put((r + 1) % comm.world_size, 4000, 0, 4096)  # past the peer's end
        dist.barrier()
    gather_through_host_port_channels(comm, buf, 4096 // comm.world_size // 16 * 16, 3)  # still usable


# -- GPU: users' kernels ---------------------------------------------------------------------------

ALL_GATHER = r"""
#include "channel.cuh"
// Block b trades chunks with rank b: this rank's chunk into b's copy of out, then a signal,
// then a wait until b's chunk has landed here.
extern "C" __global__ void all_gather(const MemoryChannel* ch, int rank, unsigned long long chunk) {
  const int peer = blockIdx.x;
  if (peer == rank) return;
  ch[peer].put(rank * chunk, rank * chunk, chunk, threadIdx.x, blockDim.x);
  __syncthreads();  // every thread's stores before the signal
  if (threadIdx.x == 0) { ch[peer].signal(); ch[peer].wait(); }
}
// The same through the proxy: one thread per peer.
extern "C" __global__ void all_gather_port(const PortChannel* ch, int rank, int world, unsigned long long chunk) {
  const int peer = threadIdx.x;
  if (peer >= world || peer == rank) return;
  ch[peer].putWithSignalAndFlush(rank * chunk, rank * chunk, chunk);
  ch[peer].wait();
}
// LL packets: this rank's chunk as 16-byte lines into b's packet area (after the data), which b
// unpacks into its copy of out; no semaphore.
extern "C" __global__ void all_gather_ll(const MemoryChannel* ch, int rank, int world, unsigned long long chunk,
                                         unsigned flag) {
  const int peer = blockIdx.x;
  if (peer == rank) return;
  const unsigned long long lines = world * chunk;  // the packet area starts after the data
  ch[peer].putPackets(lines + 2 * rank * chunk, rank * chunk, chunk, threadIdx.x, blockDim.x, flag);
  ch[peer].unpackPackets(peer * chunk, lines + 2 * peer * chunk, chunk, threadIdx.x, blockDim.x, flag);
}
"""


def check_gathered(out, world, chunk, seed, device):
    for q in range(world):
        got = out[q * chunk:(q + 1) * chunk]
        want = slice_data(q, chunk, seed, device)
        assert torch.equal(got, want), f"chunk of rank {q} differs at byte {int((got != want).nonzero()[0])}"


@GPU_ONLY
@pytest.mark.parametrize("kind", ["memory", "port", "ll"])
def test_readme_all_gather_within_a_node(comms, kind):
    comm = comms("cuda")
    w, r, chunk = comm.world_size, comm.rank, 1 << 20
    out = comm.empty(3 * w * chunk, dtype=torch.uint8)  # data, then LL lines (2 bytes of line per data byte)
    kernel = p2pcomm.Kernel(ALL_GATHER, {"memory": "all_gather", "port": "all_gather_port", "ll": "all_gather_ll"}[kind])
    chans = comm.port_channels(out) if kind == "port" else comm.memory_channels(out)
    try:
        for seed in range(3):
            out.fill_(POISON)
            out[r * chunk:(r + 1) * chunk] = slice_data(r, chunk, seed, "cuda")
            comm.stream_barrier()  # every rank poisoned its copy before any peer writes into it
            if kind == "memory":
                kernel(w, 512, chans, r, chunk)
            elif kind == "port":
                kernel(1, 32, chans, r, w, chunk)
            else:
                kernel(w, 512, chans, r, w, chunk, seed + 1)
            torch.cuda.synchronize()
            comm.check()
            check_gathered(out[:w * chunk], w, chunk, seed, "cuda")
            comm.stream_barrier()
    finally:
        torch.cuda.synchronize()
        chans.close()


@GPU_ONLY
@pytest.mark.parametrize("kind", ["memory", "port"])
def test_readme_all_gather_replays_in_a_cuda_graph(comms, kind):
    comm = comms("cuda")
    w, r, chunk = comm.world_size, comm.rank, 256 << 10
    out = comm.empty(w * chunk, dtype=torch.uint8)
    kernel = p2pcomm.Kernel(ALL_GATHER, "all_gather" if kind == "memory" else "all_gather_port")
    chans = comm.port_channels(out) if kind == "port" else comm.memory_channels(out)
    launch = (lambda: kernel(w, 512, chans, r, chunk)) if kind == "memory" else (lambda: kernel(1, 32, chans, r, w, chunk))
    launch()  # compiled and loaded outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.stream_barrier()
        launch()
    for seed in range(3):
        out.fill_(POISON)
        out[r * chunk:(r + 1) * chunk] = slice_data(r, chunk, 10 + seed, "cuda")
        graph.replay()
        torch.cuda.synchronize()
        comm.check()
        check_gathered(out, w, chunk, 10 + seed, "cuda")
    comm.stream_barrier()
    torch.cuda.synchronize()
    chans.close()


def gather_with_port_kernel(comm, kernel, chunk, seeds):
    """The README's port-channel all-gather of chunk random bytes per rank into a fresh comm.empty, once per
    seed, every byte checked."""
    w, r = comm.world_size, comm.rank
    out = comm.empty(w * chunk, dtype=torch.uint8)
    with comm.port_channels(out) as chans:
        for seed in seeds:
            out.fill_(POISON)
            out[r * chunk:(r + 1) * chunk] = slice_data(r, chunk, seed, "cuda")
            comm.barrier()
            kernel(1, 32, chans, r, w, chunk)
            torch.cuda.synchronize()
            comm.check()
            check_gathered(out, w, chunk, seed, "cuda")
            comm.barrier()


@GPU_ONLY
@NEEDS_UCX
@pytest.mark.parametrize("stripes", ["1", "3"])
def test_striped_puts_land_before_their_signal(node_comm, monkeypatch, stripes):
    """P2PCOMM_UCX_STRIPES: a large staged chunk's data travels split over that many UCX workers and still lands
    whole, before the signal behind it."""
    monkeypatch.setenv("P2PCOMM_UCX_STRIPES", stripes)
    comm = node_comm("cuda")
    kernel = p2pcomm.Kernel(ALL_GATHER, "all_gather_port", comm=comm)
    for chunk in ((256 << 10) + 3, (3 << 20) + 1):  # a share's rounding, a chunk's tail
        gather_with_port_kernel(comm, kernel, chunk, range(3))


@GPU_ONLY
@NEEDS_UCX
def test_bad_stripe_count_raises_on_every_rank(node_comm, monkeypatch):
    """A P2PCOMM_UCX_STRIPES out of range on one rank: every rank raises naming it, and may try again."""
    r = dist.get_rank()
    monkeypatch.setenv("P2PCOMM_UCX_STRIPES", "9" if r == 0 else "2")
    comm = node_comm("cuda")
    buf = comm.empty(1 << 20, dtype=torch.uint8)
    with pytest.raises(p2pcomm.InvalidArgumentError, match='rank 0: P2PCOMM_UCX_STRIPES="9": want 1 to 8'):
        comm.port_channels(buf)
    monkeypatch.setenv("P2PCOMM_UCX_STRIPES", "2")
    kernel = p2pcomm.Kernel(ALL_GATHER, "all_gather_port", comm=comm)
    gather_with_port_kernel(comm, kernel, 512 << 10, [7])


@GPU_ONLY
@NEEDS_UCX
def test_readme_all_gather_across_simulated_nodes(node_comm):
    """Every rank a node of its own: port channels reach the others only through UCX."""
    comm = node_comm("cuda")
    w, r = comm.world_size, comm.rank
    assert comm.nodes == [[q] for q in range(w)]
    with comm.memory_channels(comm.empty(64, dtype=torch.uint8)) as mem:  # no IPC across nodes
        with pytest.raises(p2pcomm.InvalidArgumentError, match="another node"):
            mem.handle((r + 1) % w)
    kernel = p2pcomm.Kernel(ALL_GATHER, "all_gather_port", comm=comm)  # another communicator shares the GPU
    # Up to 64 bytes the kernel copies a put into the FIFO (inline), at any alignment; beyond, the proxy stages it.
    for chunk in (1, 8, 61, 64, 65, 64 << 10, 5 << 20):
        gather_with_port_kernel(comm, kernel, chunk, range(2))
