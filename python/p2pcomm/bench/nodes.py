"""All-reduce across nodes: ``python -m p2pcomm.bench nodes`` under
torchrun, every rank the same command.

    torchrun --nproc_per_node=4 -m p2pcomm.bench nodes --device cuda --local-size 2 [--sizes 4K,1M,256M] [--out DIR]

The ranks form simulated nodes of --local-size consecutive ranks (P2PCOMM_LOCAL_SIZE; default: half the ranks,
two nodes), so whatever crosses between nodes goes through UCX. UCX_TLS defaults to tcp,self (and cuda_copy on
GPUs): the network path even on one host, which the rows say. Rows, per size:

- p2pcomm: the hierarchical all-reduce (what ``auto`` runs across nodes), in place on ``comm.empty`` memory
  (with --plain, on an ordinary tensor, which goes through the staging area);
  "net GB/s" is what each rank sends between nodes per second (its shard's partials and results).
- gloo (CPU) / nccl-socket (GPU): torch.distributed on the same processes; NCCL with NCCL_P2P_DISABLE=1
  NCCL_SHM_DISABLE=1, so all of its traffic, inside the simulated nodes too, goes over its sockets.
- ucx-ring (GPU, float32): a flat ring all-reduce written with port channels, every rank a node of its own,
  so every hop goes through the proxy and UCX.
- ucx put: a port channel put between the first ranks of nodes 0 and 1 in the same run (host memory on CPU,
  GPU memory on GPU): the ceiling of the inter-node stage.

Rank 0 prints the table; --out also writes it as nodes.md. Results are checked once per size and row.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Callable, Optional

from .harness import md_table, parse_bytes, text_table

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
RING_SOURCE = r"""
#include "channel.cuh"
// A flat ring all-reduce of floats over port channels, one block: rank r puts to r+1 and hears from r-1.
// buf: [data: world chunks][inbox: world-1 chunks][out: world chunks], chunk floats each (a multiple of 4).
// Reduce-scatter: step s puts data chunk r-s into the right neighbour's inbox slot s, then adds the left
// neighbour's chunk r-s-1 from inbox slot s into data; rank r ends with chunk r+1 final. All-gather:
// step s puts out chunk r+1-s into the right neighbour's out. At the end each rank tells its left one it is
// done and waits for its right one: no rank starts the next call while its right neighbour still reads.
extern "C" __global__ void ring_allreduce(const PortChannel* ch, float* buf, int rank, int world,
                                          unsigned long long chunk) {
  const int right = (rank + 1) % world, left = (rank + world - 1) % world;
  const unsigned long long cb = chunk * sizeof(float);
  float* const data = buf;
  float* const inbox = buf + (unsigned long long)world * chunk;
  float* const out = inbox + (unsigned long long)(world - 1) * chunk;
  const unsigned long long out_off = (unsigned long long)(2 * world - 1) * cb;
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  for (int s = 0; s < world - 1; ++s) {
    const int send = (rank - s + world) % world, recv = (rank - s - 1 + world) % world;
    if (threadIdx.x == 0) {
      __threadfence_system();
      ok = ch[right].putWithSignal((unsigned long long)world * cb + s * cb, send * cb, cb) != ~0ull &&
           ch[left].wait();
    }
    __syncthreads();
    if (!ok) return;
    float* const d = data + recv * chunk;
    const float* const in = inbox + (unsigned long long)s * chunk;
    for (unsigned long long i = threadIdx.x; i < chunk; i += blockDim.x) d[i] += in[i];
    __syncthreads();
  }
  const int mine = (rank + 1) % world;
  for (unsigned long long i = threadIdx.x; i < chunk; i += blockDim.x) out[mine * chunk + i] = data[mine * chunk + i];
  __syncthreads();
  for (int s = 0; s < world - 1; ++s) {
    const int send = (rank + 1 - s + world) % world;
    if (threadIdx.x == 0) {
      __threadfence_system();
      ok = ch[right].putWithSignal(out_off + send * cb, out_off + send * cb, cb) != ~0ull && ch[left].wait();
    }
    __syncthreads();
    if (!ok) return;
  }
  if (threadIdx.x == 0) ch[left].signal() != ~0ull && ch[right].wait();
}
// put_bw: size bytes from rank 0 to rank peer, reps times, then a signal the receiver waits for.
extern "C" __global__ void put_bw(const PortChannel* ch, int peer, int sender, unsigned long long size, int reps) {
  if (threadIdx.x != 0) return;
  if (sender) {
    for (int r = 0; r < reps; ++r) ch[peer].put(0, 0, size);
    ch[peer].signal();
    ch[peer].flush();
  } else {
    ch[peer].wait();
  }
}
"""


def label(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


class Bench:
    def __init__(self, args):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.args = torch, dist, args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cuda = args.device == "cuda"
        if self.cuda:
            from ..communicator import local_cuda_index

            torch.cuda.set_device(local_cuda_index())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.local = args.local_size or max(1, self.world // 2)
        self.dtype = getattr(torch, args.dtype)

    def say(self, *a) -> None:
        if self.rank == 0:
            print(*a, flush=True)

    def communicator(self, local_size: int):
        from .. import Communicator

        os.environ["P2PCOMM_LOCAL_SIZE"] = str(local_size)
        try:
            return Communicator(group=self.dist.group.WORLD, device=self.device)
        finally:
            del os.environ["P2PCOMM_LOCAL_SIZE"]

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def seconds(self, fn: Callable[[], object], n: int) -> float:
        """Seconds per call over n back-to-back calls, the slowest rank's."""
        self.sync()
        self.dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        self.sync()
        t = self.torch.tensor([(time.perf_counter() - t0) / n], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.item()

    def measure(self, fn: Callable[[], object]) -> float:
        """Median seconds per call over --reps repetitions of enough calls to fill --rep-ms."""
        fn()
        probe = self.seconds(fn, 2)
        n = max(1, min(self.args.max_iters, int(self.args.rep_ms / 1e3 / max(probe, 1e-6))))
        return statistics.median(self.seconds(fn, n) for _ in range(self.args.reps))

    # -- the rows --------------------------------------------------------------------------------------

    def p2pcomm(self, comm, numel: int) -> tuple:
        if self.args.plain:
            buf = self.torch.empty(numel, dtype=self.dtype, device=self.device)
        else:
            buf = comm.empty(numel, self.dtype)
        buf.fill_(self.rank + 1)
        comm.all_reduce_(buf)
        self.sync()
        comm.check()
        want = self.world * (self.world + 1) / 2
        ok = bool((buf == want).all().item())

        def step():
            comm.all_reduce_(buf, op="max")  # stays finite whatever the repetitions

        t = self.measure(step)
        comm.check()
        return t, ok

    def torch_baseline(self, group, numel: int) -> tuple:
        torch = self.torch
        buf = torch.full((numel,), float(self.rank + 1), dtype=self.dtype, device=self.device)
        self.dist.all_reduce(buf, group=group)
        self.sync()
        ok = bool((buf == self.world * (self.world + 1) / 2).all().item())

        def step():
            self.dist.all_reduce(buf, op=self.dist.ReduceOp.MAX, group=group)

        return self.measure(step), ok

    def ucx_ring(self, ring, kernel, numel: int) -> tuple:
        torch, w = self.torch, self.world
        chunk = (numel + w - 1) // w
        chunk = (chunk + 3) // 4 * 4
        buf = ring.empty((3 * w - 1) * chunk, torch.float32)
        data, out = buf[:w * chunk], buf[(2 * w - 1) * chunk:]
        chans = ring.port_channels(buf)
        try:
            data.fill_(self.rank + 1)
            self.dist.barrier()
            kernel(1, 512, chans, buf, self.rank, w, chunk)
            self.sync()
            ring.check()
            ok = bool((out == w * (w + 1) / 2).all().item())

            def step():
                kernel(1, 512, chans, buf, self.rank, w, chunk)

            t = self.measure(step)
            ring.check()
        finally:
            self.sync()
            self.dist.barrier()
            chans.close()
        return t, ok

    def put_ceiling(self, comm, size: int) -> Optional[float]:
        """GB/s of port channel puts from rank 0 to the first rank of node 1 (the inter-node hop)."""
        torch, peer = self.torch, self.local
        buf = comm.empty(size, torch.uint8)
        chans = comm.port_channels(buf)
        reps = max(2, min(50, (256 << 20) // size))
        try:
            if self.cuda:
                from ..channels import Kernel

                k = Kernel(RING_SOURCE, "put_bw", comm=comm)

                def step():
                    if self.rank in (0, peer):
                        k(1, 32, chans, peer if self.rank == 0 else 0, int(self.rank == 0), size, reps)
            else:
                def step():
                    if self.rank == 0:
                        for _ in range(reps):
                            chans.put(peer, 0, 0, size)
                        chans.signal(peer)
                        chans.flush(peer)
                    elif self.rank == peer:
                        chans.wait(0)

            t = self.measure(step)
        finally:
            self.sync()
            self.dist.barrier()
            chans.close()
        return size * reps / t / 1e9

    # -- the run ---------------------------------------------------------------------------------------

    def run(self) -> int:
        torch, dist, args = self.torch, self.dist, self.args
        if self.world < 2 or self.world % self.local or self.world // self.local < 2:
            self.say(f"need at least two nodes of --local-size {self.local} ranks; have {self.world} ranks")
            return 2
        nodes = self.world // self.local
        comm = self.communicator(self.local)
        base_name = "nccl-socket" if self.cuda else "gloo"
        if self.cuda:
            # NCCL reads these when its communicator starts, at its group's first collective.
            os.environ["NCCL_P2P_DISABLE"], os.environ["NCCL_SHM_DISABLE"] = "1", "1"
            base = dist.new_group(backend="nccl")
        else:
            base = dist.group.WORLD
        ring = kernel = None
        if self.cuda and self.dtype == torch.float32 and not args.no_ring:
            from ..channels import Kernel

            ring = self.communicator(1)
            kernel = Kernel(RING_SOURCE, "ring_allreduce", comm=ring)
        elem = torch.empty(0, dtype=self.dtype).element_size()
        acc = 4 if self.dtype in (torch.float16, torch.bfloat16) else elem
        rows = []
        for size in args.sizes:
            numel = max(1, size // elem)
            t, ok = self.p2pcomm(comm, numel)
            shard = numel / self.local * acc
            net = 2 * (nodes - 1) / nodes * shard / t / 1e9
            row = [label(size), f"{t * 1e6:.1f}", f"{size / t / 1e9:.2f}", f"{net:.2f}", "" if ok else "WRONG"]
            bt, bok = self.torch_baseline(base, numel)
            row += [f"{bt * 1e6:.1f}", f"{bt / t:.2f}x" + ("" if bok else " WRONG")]
            if ring is not None:
                rt, rok = self.ucx_ring(ring, kernel, numel)
                row += [f"{rt * 1e6:.1f}", f"{rt / t:.2f}x" + ("" if rok else " WRONG")]
            ceiling = self.put_ceiling(comm, min(size, 64 << 20)) if args.ceiling else None
            row += [f"{ceiling:.2f}" if ceiling else "n/a"]
            rows.append(row)
            self.say(text_table(self.headers(base_name, ring is not None), [[str(c) for c in row]], numeric=range(len(row))).splitlines()[-1])
        headers = self.headers(base_name, ring is not None)
        tls = os.environ.get("UCX_TLS", "")
        title = (f"all-reduce across {nodes} simulated nodes of {self.local} ({self.world} ranks, {args.device}, "
                 f"{args.dtype}, UCX_TLS={tls}), host {platform.node()}, {time.strftime('%Y-%m-%d')}")
        self.say("\n" + title)
        self.say(text_table(headers, [[str(c) for c in r] for r in rows], numeric=range(len(headers))))
        if args.out and self.rank == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "nodes.md"), "w") as f:
                f.write(f"{title}\n\n{md_table(headers, rows, numeric=range(1, len(headers)))}\n")
        self.sync()
        dist.barrier()
        if ring is not None:
            ring.close()
        comm.close()
        return 0

    @staticmethod
    def headers(base_name: str, ring: bool) -> list:
        h = ["size", "p2pcomm us", "algbw GB/s", "net GB/s", "check", f"{base_name} us", "speedup"]
        if ring:
            h += ["ucx-ring us", "speedup"]
        return h + ["ucx put GB/s"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m p2pcomm.bench nodes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--local-size", type=int, default=0, help="ranks per simulated node (default: half the ranks)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    p.add_argument("--sizes", type=lambda s: [parse_bytes(x) for x in s.split(",") if x], default=None,
                   help="comma-separated payload sizes, e.g. 4K,1M,256M (default 4 KiB .. 256 MiB on GPU, "
                        ".. 64 MiB on CPU)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per row; the median is shown (default 3)")
    p.add_argument("--rep-ms", type=float, default=200.0, help="target milliseconds per repetition (default 200)")
    p.add_argument("--max-iters", type=int, default=1000, help="most calls per repetition (default 1000)")
    p.add_argument("--plain", action="store_true", help="p2pcomm's row on an ordinary tensor, not comm.empty memory")
    p.add_argument("--no-ring", action="store_true", help="leave out the flat ring through UCX (GPU)")
    p.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the port channel put between nodes in the same run (default on)")
    p.add_argument("--out", default=None, help="directory for nodes.md (default: print only)")
    return p


def run(args) -> int:
    import torch
    import torch.distributed as dist

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.sizes is None:
        args.sizes = SIZES if args.device == "cuda" else [s for s in SIZES if s <= 64 << 20]
    os.environ.setdefault("UCX_TLS", "tcp,cuda_copy,self" if args.device == "cuda" else "tcp,self")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    try:
        return Bench(args).run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

