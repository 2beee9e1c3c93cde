"""Channel benchmarks: ``python -m p2pcomm.bench p2p`` under torchrun, 2 ranks per pair measured.

    torchrun --nproc_per_node=2 -m p2pcomm.bench p2p [--sections fifo,memory,ucx] [--out DIR]

- fifo: a kernel's trigger through the proxy and back (``PortChannel.flush`` on a
  channel with nothing to move): p50/p99 microseconds; and triggers per second
  when 8 warps per block push zero-byte puts into 1, 2, 4 or 8 FIFOs (one
  port-channel set each).
- memory: ``MemoryChannel.put`` over NVLink, both ranks pushing at once, next
  to the copy engine (a copy into the peer's memory mapped over CUDA IPC, what
  cudaMemcpyPeer does) and to ``PortChannel.put`` on the copy engine.
- ucx: the ranks as two simulated nodes of --local-size ranks each
  (P2PCOMM_LOCAL_SIZE; default half the ranks), so port channels between
  them go through UCX, GPU buffers: one-way latency of an 8-byte
  putWithSignal (half a ping-pong, rank 0 and its partner: the rank with the
  same local index in the other node) and bandwidth from each rank of the
  first node to its partner, every pair at once, next to ``ucx_perftest``
  (from the libucx wheel) with host and with GPU memory on the same
  transports (UCX_TLS, default tcp: the network path, not shared memory);
  with more than one pair, perftest's host-memory bandwidth also with every
  pair at once, as the PortChannel rows run.

Rank 0 prints the tables; --out also writes them as markdown.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import time
from typing import Optional

import torch
import torch.distributed as dist

from .harness import Timer, fmt_bytes, md_table, parse_bytes, slowest_median

SOURCE = r"""
#include "channel.cuh"
extern "C" __global__ void mc_put(const MemoryChannel* ch, int peer, unsigned long long bytes) {
  ch[peer].put(0, 0, bytes, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
}
extern "C" __global__ void pc_put(const PortChannel* ch, int peer, unsigned long long bytes) {
  if (threadIdx.x == 0 && blockIdx.x == 0) { const PortChannel c = ch[peer]; c.put(0, 0, bytes); c.flush(); }
}
// The loops below copy their handle out of the array first (channel.cuh says why).
extern "C" __global__ void pc_send(const PortChannel* ch, int peer, unsigned long long bytes, int reps) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const PortChannel c = ch[peer];
  for (int r = 0; r < reps; ++r) c.put(0, 0, bytes);
  c.signal();
  c.flush();
}
extern "C" __global__ void pc_recv(const PortChannel* ch, int peer) {
  if (threadIdx.x == 0 && blockIdx.x == 0) ch[peer].wait();
}
extern "C" __global__ void pc_pingpong(const PortChannel* ch, int peer, int first, int iters,
                                       unsigned long long* samples) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const PortChannel c = ch[peer];
  for (int i = 0; i < iters; ++i) {
    const unsigned long long t0 = global_timer_ns();
    if (first) { c.putWithSignal(0, 0, 8); if (!c.wait()) return; }
    else { if (!c.wait()) return; c.putWithSignal(0, 0, 8); }
    samples[i] = global_timer_ns() - t0;
  }
}
extern "C" __global__ void fifo_latency(const PortChannel* ch, int peer, int iters, unsigned long long* samples) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const PortChannel c = ch[peer];
  for (int i = 0; i < iters; ++i) {
    const unsigned long long t0 = global_timer_ns();
    if (!c.flush()) return;
    samples[i] = global_timer_ns() - t0;
  }
}
// Lane 0 of each warp pushes iters zero-byte puts into its block's FIFO (set blockIdx % nsets),
// then the block's first thread flushes once all have.
extern "C" __global__ void fifo_rate(const unsigned long long* sets, int nsets, int peer, int iters) {
  const PortChannel c = reinterpret_cast<const PortChannel*>(sets[blockIdx.x % nsets])[peer];
  if ((threadIdx.x & 31) == 0)
    for (int i = 0; i < iters; ++i) c.put(0, 0, 0);
  __syncthreads();
  if (threadIdx.x == 0) c.flush();
}
"""

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


class Bench:
    def __init__(self, args):
        from .. import Communicator, Kernel

        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.peer = (self.rank + 1) % self.world
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.comm = Communicator(group=dist.group.WORLD, device=self.device)
        self.kernels = {n: Kernel(SOURCE, n, comm=self.comm) for n in
                        ("mc_put", "pc_put", "pc_send", "pc_recv", "pc_pingpong", "fifo_latency", "fifo_rate")}
        self.out: list[str] = []

    def say(self, text: str = "") -> None:
        if self.rank == 0:
            print(text, flush=True)
            self.out.append(text)

    def timed(self, fn, iters: int) -> float:
        """Microseconds per call of fn (the slowest rank's median of 5 repetitions of iters calls)."""
        fn()
        torch.cuda.synchronize()
        timer = Timer(self.device, None, 5)
        return slowest_median([timer.run(fn, iters) * 1e6 / iters for _ in range(5)], None)

    # -- fifo ------------------------------------------------------------------------------------------

    def fifo(self) -> None:
        comm, k = self.comm, self.kernels
        buf = comm.empty(1 << 20, dtype=torch.uint8)
        samples = torch.zeros(20000, dtype=torch.int64, device=self.device)
        sets = [comm.port_channels(buf)]
        k["fifo_latency"](1, 32, sets[0], self.peer, samples.numel(), samples)
        torch.cuda.synchronize()
        lat = samples.double().div(1e3).sort().values
        p50, p99 = lat[lat.numel() // 2].item(), lat[lat.numel() * 99 // 100].item()
        self.say(f"\nFIFO round trip (trigger -> proxy -> completion seen by the GPU), rank 0, {samples.numel()} flushes: "
                 f"p50 {p50:.2f} us, p99 {p99:.2f} us")
        rows = []
        iters, warps = 2000, 8
        while len(sets) < 8:
            sets.append(comm.port_channels(buf))
        for n in (1, 2, 4, 8):
            ptrs = torch.tensor([s.data_ptr() for s in sets[:n]], dtype=torch.int64, device=self.device)
            us = self.timed(lambda: k["fifo_rate"](n, 32 * warps, ptrs, n, self.peer, iters), 1)
            rows.append([n, f"{n * warps * iters / us:.2f}"])
        self.say(md_table(["FIFOs", "M triggers/s"], rows, numeric=(0, 1)))
        torch.cuda.synchronize()
        dist.barrier()
        for s in sets:
            s.close()

    # -- memory ----------------------------------------------------------------------------------------

    def memory(self) -> None:
        comm, k = self.comm, self.kernels
        top = max(self.args.sizes)
        src = comm.empty(top, dtype=torch.uint8)
        src.random_(0, 256)
        mem, port = comm.memory_channels(src), comm.port_channels(src)
        peer_view = comm.peer_tensor(src, self.peer)
        local = torch.empty(top, dtype=torch.uint8, device=self.device).random_(0, 256)
        rows = []
        for size in self.args.sizes:
            iters = max(3, min(200, (256 << 20) // size))
            t_mc = self.timed(lambda: k["mc_put"](self.args.blocks, 512, mem, self.peer, size), iters)
            t_ce = self.timed(lambda: peer_view[:size].copy_(local[:size]), iters)
            t_pc = self.timed(lambda: k["pc_put"](1, 32, port, self.peer, size), iters)
            gbs = lambda us: f"{size / us / 1e3:.1f}"  # noqa: E731
            rows.append([fmt_bytes(size), f"{t_mc:.1f}", gbs(t_mc), f"{t_ce:.1f}", gbs(t_ce), f"{t_pc:.1f}", gbs(t_pc)])
        self.say(f"\nPut to the next rank, all ranks at once, GB/s per GPU "
                 f"(MemoryChannel on {self.args.blocks} blocks of 512 threads):")
        self.say(md_table(["size", "MemoryChannel us", "GB/s", "copy engine us", "GB/s", "PortChannel (CE) us", "GB/s"],
                          rows, numeric=range(1, 7)))
        torch.cuda.synchronize()
        dist.barrier()
        mem.close()
        port.close()

    # -- ucx -------------------------------------------------------------------------------------------

    def ucx(self) -> None:
        from .. import Communicator

        local = self.args.local_size or self.world // 2
        if local < 1 or self.world != 2 * local:
            self.say(f"\nucx section skipped: it runs two simulated nodes of {local or 'N'} ranks each, so it needs "
                     f"{2 * local if local else 'an even number of'} ranks, not {self.world}")
            return
        os.environ.setdefault("UCX_TLS", "tcp,cuda_copy,self")
        os.environ["P2PCOMM_LOCAL_SIZE"] = str(local)
        comm = Communicator(group=dist.group.WORLD, device=self.device)
        del os.environ["P2PCOMM_LOCAL_SIZE"]
        k = {n: type(v)(v.source, v.name, comm=comm) for n, v in self.kernels.items()}
        top = max(self.args.sizes)
        buf = comm.empty(top, dtype=torch.uint8)
        buf.random_(0, 256)
        chans = comm.port_channels(buf)
        partner = (self.rank + local) % self.world  # same local index, other node
        sender = self.rank < local
        # One-way latency: half an 8-byte ping-pong between rank 0 and its partner.
        samples = torch.zeros(2000, dtype=torch.int64, device=self.device)
        dist.barrier()
        if self.rank % local == 0:
            k["pc_pingpong"](1, 32, chans, partner, int(self.rank == 0), samples.numel(), samples)
        torch.cuda.synchronize()
        lat = samples[10:].double().div(2e3).median().item()
        dist.barrier()
        rows = []
        for size in self.args.sizes:
            reps = max(2, min(100, (64 << 20) // size))

            def step():
                if sender:
                    k["pc_send"](1, 32, chans, partner, size, reps)
                else:
                    k["pc_recv"](1, 32, chans, partner)

            us = self.timed(step, 1)  # the slowest rank's
            rows.append([fmt_bytes(size), f"{size * reps / us / 1e3:.2f}"])
            if local > 1:
                rows[-1].append(f"{local * size * reps / us / 1e3:.2f}")
        perf = self.perftest() if self.args.perftest else {}
        crowd = self.perftest_every_pair(local) if self.args.perftest and local > 1 else {}

        def ratio(ours: str, theirs: str) -> str:
            return f"{100 * float(ours) / float(theirs):.0f}%" if theirs != "n/a" and float(theirs) > 0 else "n/a"

        for row in rows:
            host, gpu = perf.get(row[0], ["n/a", "n/a"])
            row += [host, ratio(row[1], host), gpu]
            if local > 1:
                row += [crowd.get(row[0], "n/a"), ratio(row[1], crowd.get(row[0], "n/a"))]
        tls = os.environ["UCX_TLS"]
        host_lat = perf.get("lat_host")
        vs_host = f" ({lat / float(host_lat):.1f}x host)" if host_lat and float(host_lat) > 0 else ""
        stripes = os.environ.get("P2PCOMM_UCX_STRIPES", "unset, the default")
        self.say(f"\nPortChannel over UCX between two simulated nodes of {local} (UCX_TLS={tls}; GPU buffers;"
                 f" P2PCOMM_UCX_STRIPES {stripes}),"
                 f" rank r -> r + {local}, every pair at once: 8-byte putWithSignal one way {lat:.1f} us{vs_host}"
                 f" (rank 0, median of half ping-pongs); ucx_perftest ucp_put_lat 8 B: host"
                 f" {perf.get('lat_host', 'n/a')} us, GPU {perf.get('lat_cuda', 'n/a')} us")
        head = ["size", "PortChannel GB/s"] + (["all pairs GB/s"] if local > 1 else [])
        head += ["ucx_perftest host GB/s", "PortChannel / host", "ucx_perftest GPU GB/s"]
        if local > 1:
            # The same pairs at once, as the PortChannel rows run: they share the host's transport.
            head += ["ucx_perftest host, every pair at once, GB/s per pair", "PortChannel / that"]
        self.say(md_table(head, rows, numeric=range(1, len(head))))
        if self.args.out and self.rank == 0:
            sizes = self.args.sizes
            series = {"PortChannel (GPU buffers, staged)": [r[1] for r in rows],
                      "ucx_perftest ucp_put_bw, host memory": [perf.get(fmt_bytes(z), ["n/a"])[0] for z in sizes],
                      "ucx_perftest ucp_put_bw, GPU memory": [perf.get(fmt_bytes(z), ["n/a", "n/a"])[1] for z in sizes]}
            title = f"PortChannel over UCX ({tls}, P2PCOMM_UCX_STRIPES {stripes}), {torch.cuda.get_device_name()}"
            plot_bandwidth(os.path.join(self.args.out, "p2p_ucx.png"), title, sizes, series)
        torch.cuda.synchronize()
        dist.barrier()
        chans.close()
        comm.close()

    def perftest(self) -> dict:
        """ucx_perftest's put bandwidth and latency between ranks 0 (server) and 1 (client), on host
        and GPU memory, with this process's UCX_TLS; {} where the wheel's binary is absent."""
        found = self.perftest_binary()
        if found is None or self.world < 2:
            return {}
        exe, env = found
        got: dict = {}
        port = 13000 + int(time.time()) % 2000
        for mem in ("host", "cuda"):
            tls = env["UCX_TLS"] if mem == "cuda" else ",".join(t for t in env["UCX_TLS"].split(",") if "cuda" not in t)
            for test, size in [("ucp_put_lat", 8)] + [("ucp_put_bw", s) for s in self.args.sizes]:
                port += 1
                extra = ["-m", "cuda"] if mem == "cuda" else []
                iters = str(max(10, min(2000, (256 << 20) // size)))
                res = self.perftest_pair(exe, dict(env, UCX_TLS=tls), port, ["-t", test, "-s", str(size), "-n", iters]
                                         + extra)
                if res is None:
                    continue
                if test == "ucp_put_lat":
                    got[f"lat_{mem}"] = f"{res[0]:.1f}"
                else:
                    got.setdefault(fmt_bytes(size), ["n/a", "n/a"])[0 if mem == "host" else 1] = f"{res[1] / 1e3:.2f}"
        return got

    def perftest_every_pair(self, local: int) -> dict:
        """ucx_perftest's host-memory put bandwidth with every pair of the ucx section (rank r < local serving,
        r + local the client) running at once: the slowest pair's GB/s per size (the PortChannel rows report the
        slowest rank's time too), {} without the binary."""
        found = self.perftest_binary()
        if found is None:
            return {}
        exe, env = found
        env["UCX_TLS"] = ",".join(t for t in env["UCX_TLS"].split(",") if "cuda" not in t)
        got: dict = {}
        base = 15000 + int(time.time()) % 2000
        for i, size in enumerate(self.args.sizes):
            port = base + i * self.world + self.rank % local
            iters = str(max(10, min(2000, (256 << 20) // size)))
            args = ["-t", "ucp_put_bw", "-s", str(size), "-n", iters]
            mbs = torch.full((self.world,), -1.0, dtype=torch.float64)
            out = self.perftest_run(exe, env, port, args, "server" if self.rank < local else "client")
            for line in (out or "").splitlines():
                if line.startswith("Final:"):
                    mbs[self.rank] = float(line.split()[6])
            dist.all_reduce(mbs, op=dist.ReduceOp.MAX)
            pairs = mbs[local:]
            if (pairs > 0).all():
                got[fmt_bytes(size)] = f"{pairs.min().item() / 1e3:.2f}"
        return got

    def perftest_binary(self) -> Optional[tuple]:
        """(path, environment) of the libucx wheel's ucx_perftest where every rank has it, else None."""
        spec = importlib.util.find_spec("libucx")
        exe = os.path.join(os.path.dirname(spec.origin), "bin", "ucx_perftest") if spec else ""
        have = torch.tensor([int(os.path.exists(exe))])
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if not have.item():
            return None
        return exe, dict(os.environ, LD_LIBRARY_PATH=os.path.join(os.path.dirname(exe), "..", "lib"))

    def perftest_run(self, exe, env, port, args, role: Optional[str]) -> Optional[str]:
        """One ucx_perftest run with every rank at once: a "server" listens on port, a "client" connects to it
        and gets the output, other ranks (None) only keep step."""
        if role == "server":
            proc = subprocess.Popen([exe, "-p", str(port)], env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        dist.barrier()
        out = None
        if role == "client":
            try:
                out = subprocess.run([exe, "127.0.0.1", "-p", str(port), *args], env=env, capture_output=True,
                                     text=True, timeout=120).stdout
            except subprocess.TimeoutExpired:
                out = ""
        dist.barrier()
        if role == "server":
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return out

    def perftest_pair(self, exe, env, port, args) -> Optional[tuple]:
        """(p50 latency us, overall MB/s) of one ucx_perftest run between ranks 0 (server) and 1 (client)."""
        role = {0: "server", 1: "client"}.get(self.rank)
        out = self.perftest_run(exe, env, port, args, role)
        parsed = torch.full((2,), -1.0, dtype=torch.float64)
        for line in (out or "").splitlines():
            if line.startswith("Final:"):
                f = line.split()
                parsed[0], parsed[1] = float(f[2]), float(f[6])
        dist.broadcast(parsed, src=1)
        return None if parsed[0] < 0 else (parsed[0].item(), parsed[1].item())


def plot_bandwidth(path: str, title: str, sizes: list[int], series: dict[str, list[str]]) -> Optional[str]:
    """GB/s against size, one line per series (values as the tables print them; "n/a" skipped); the path, or
    None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"no plot: matplotlib unavailable ({e})")
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in series.items():
        points = [(z, float(v)) for z, v in zip(sizes, values) if v != "n/a"]
        if points:
            ax.plot(*zip(*points), "-o", markersize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("put size (bytes)")
    ax.set_ylabel("GB/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m p2pcomm.bench p2p", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="fifo,memory,ucx", help="comma-separated: fifo, memory, ucx")
    p.add_argument("--sizes", type=lambda s: [parse_bytes(x) for x in s.split(",") if x], default=SIZES,
                   help="comma-separated sizes, e.g. 4K,1M,256M (default 4 KiB .. 256 MiB)")
    p.add_argument("--blocks", type=int, default=32, help="MemoryChannel kernel blocks (default 32)")
    p.add_argument("--local-size", type=int, default=None,
                   help="ucx: ranks per simulated node; the job is two nodes (default half the ranks)")
    p.add_argument("--perftest", action=argparse.BooleanOptionalAction, default=True,
                   help="run ucx_perftest beside the UCX rows (default on)")
    p.add_argument("--out", default=None, help="directory for p2p.md and p2p_ucx.png (default: print only)")
    return p


def run(args) -> int:
    """The benchmarks for parser()'s args."""
    if not torch.cuda.is_available():
        print("p2p benchmarks need GPUs (port channels on CPU ranks are covered by the tests)")
        return 2
    from ..communicator import local_cuda_index
    torch.cuda.set_device(local_cuda_index())  # ranks may share GPUs (P2PCOMM_SHARE_GPUS=1, under MPS)
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # control only: every exchange here is of CPU tensors
    b = Bench(args)
    b.say(f"p2pcomm p2p benchmarks: {b.world} ranks, {torch.cuda.get_device_name()}, host {socket.gethostname()}")
    for section in args.sections.split(","):
        getattr(b, section.strip())()
    if args.out and b.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "p2p.md"), "w") as f:
            f.write("\n".join(b.out) + "\n")
    dist.barrier()
    b.comm.close()
    return 0

