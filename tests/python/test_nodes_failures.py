"""All-reduce across simulated nodes when a rank of the other node fails: killed (gone at once) or stopped
(alive, silent). Every survivor, on either node, raises PeerTimeoutError naming that rank within about
P2PCOMM_TIMEOUT_MS, and its communicator stays broken. CPU ranks, 2 nodes x 2, TCP bootstrap."""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("torch")

NEEDS_UCX = pytest.mark.skipif(importlib.util.find_spec("libucx") is None and not os.environ.get("P2PCOMM_UCX_LIB"),
                               reason="UCX not installed (pip install libucx-cu13)")
TIMEOUT_MS = 3000
VICTIM = 2  # on the second node

SCRIPT = """
    import os, signal, time, torch, p2pcomm
    comm = p2pcomm.Communicator(device="cpu", bootstrap="tcp")
    assert comm.nodes == [[0, 1], [2, 3]], comm.nodes
    x = torch.arange(1 << 16, dtype=torch.float32)
    assert torch.equal(comm.all_reduce(x), 4 * x)
    comm.barrier()
    if comm.rank == {victim}:
        if "{how}" == "killed":
            os._exit(0)                          # dies without a word
        os.kill(os.getpid(), signal.SIGSTOP)     # alive and silent until the test ends it
    start = time.monotonic()
    try:
        for _ in range(5):
            comm.all_reduce(x)
        print("NO ERROR")
    except p2pcomm.PeerTimeoutError as e:
        print("RAISED", round(time.monotonic() - start, 2), e)
    try:
        comm.all_reduce(x)
    except p2pcomm.P2PCommError as e:
        print("AFTER", type(e).__name__)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(how: str, world: int = 4):
    """Runs SCRIPT on world ranks; returns the survivors' (return code, output); ends the victim."""
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), P2PCOMM_TIMEOUT_MS=str(TIMEOUT_MS), P2PCOMM_JOB_TOKEN="%x" % port,
                   P2PCOMM_LOCAL_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(SCRIPT.format(victim=VICTIM, how=how))],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = {}
    try:
        for r, p in enumerate(procs):
            if r == VICTIM:
                continue
            try:
                out, _ = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out += "\n<<killed by the test: hung>>"
            outs[r] = (p.returncode, out)
    finally:
        procs[VICTIM].kill()
        procs[VICTIM].communicate()
    return outs


@NEEDS_UCX
@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_failed_rank_of_the_other_node_is_named_by_every_survivor(how):
    outs = run_job(how)
    for rank, (rc, out) in outs.items():
        assert rc == 0, out
        assert "RAISED" in out and f"rank {VICTIM} " in out, out
        raised_after = float(out.split("RAISED", 1)[1].split()[0])
        assert raised_after < TIMEOUT_MS / 1000 + 1.5, out  # the timeout, and a little to hear whom peers blame
        assert "AFTER PeerTimeoutError" in out, out
