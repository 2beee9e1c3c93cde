"""Failure modes that need their own processes: a killed rank, a world-size
mismatch at rendezvous, use from a forked child. CPU backend, TCP bootstrap."""

import os
import subprocess
import textwrap
import time

import pytest
import jobs
from ports import free_port

torch = pytest.importorskip("torch")
import p2pcomm  # noqa: E402


def launch(script: str, world: int, env_per_rank=None, timeout=60):
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), P2PCOMM_TIMEOUT_MS="4000",
                   P2PCOMM_JOB_TOKEN="%x" % port)
        env.update((env_per_rank or {}).get(r, {}))
        procs.append(jobs.start(textwrap.dedent(script), env))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n<<killed by the test: hung>>"
        outs.append((p.returncode, out))
    return outs


def test_killed_rank_makes_survivors_raise_naming_it():
    script = """
        import os, time, torch, p2pcomm
        comm = p2pcomm.Communicator(device="cpu", bootstrap="tcp")
        comm.all_reduce(torch.ones(8))
        if comm.rank == 2:
            os._exit(0)          # dies without a word
        start = time.monotonic()
        try:
            for _ in range(3):
                comm.all_reduce(torch.ones(1 << 16))
        except p2pcomm.PeerTimeoutError as e:
            print("RAISED", round(time.monotonic() - start, 2), e)
        try:
            comm.all_reduce(torch.ones(8))
        except p2pcomm.P2PCommError as e:
            print("AFTER", type(e).__name__)
    """
    start = time.monotonic()
    outs = launch(script, 3)
    assert time.monotonic() - start < 30
    for rank in (0, 1):
        rc, out = outs[rank]
        assert rc == 0, out
        assert "RAISED" in out and "rank 2" in out, out
        raised_after = float(out.split("RAISED", 1)[1].split()[0])
        assert raised_after < 5.0, out  # within P2PCOMM_TIMEOUT_MS (4 s), usually at once
        assert "AFTER PeerTimeoutError" in out, out


def test_world_size_mismatch_at_rendezvous_is_an_error():
    script = """
        import p2pcomm
        try:
            p2pcomm.Communicator(device="cpu", bootstrap="tcp")
            print("NO ERROR")
        except p2pcomm.BootstrapError as e:
            print("BOOTSTRAP", e)
    """
    outs = launch(script, 2, env_per_rank={1: {"WORLD_SIZE": "3"}}, timeout=30)
    for rc, out in outs:
        assert "BOOTSTRAP" in out, out
    assert any("world size" in out for _, out in outs), outs


def test_forked_child_raises_instead_of_hanging():
    script = """
        import os, torch, p2pcomm
        comm = p2pcomm.Communicator(device="cpu", bootstrap="tcp")
        pid = os.fork()
        if pid == 0:
            try:
                comm.all_reduce(torch.ones(2))
                os._exit(1)
            except p2pcomm.ForkError:
                os._exit(42)
        _, status = os.waitpid(pid, 0)
        print("CHILD", os.waitstatus_to_exitcode(status))
        print("PARENT", comm.all_reduce(torch.ones(2)).tolist())
    """
    outs = launch(script, 2, timeout=60)
    for rc, out in outs:
        assert rc == 0, out
        assert "CHILD 42" in out, out
        assert "PARENT [2.0, 2.0]" in out, out


def test_library_reports_its_abi_and_error_codes():
    lib = p2pcomm._lib.lib()
    assert lib.p2p_abi_version() == p2pcomm._lib.ABI_VERSION
    # An unknown handle is a state error with a message, not a crash.
    with pytest.raises(p2pcomm.StateError, match="not open"):
        p2pcomm._lib.check(lib.p2p_barrier(12345))


NEEDS_UCX = pytest.mark.skipif(__import__("importlib").util.find_spec("libucx") is None,
                               reason="UCX not installed (pip install libucx-cu13)")


@NEEDS_UCX
def test_peer_killed_mid_put_makes_survivors_raise_naming_it():
    """Three CPU ranks, each a node of its own: rank 2 dies while the others stream port-channel puts to it."""
    script = """
        import os, time, torch, p2pcomm
        comm = p2pcomm.Communicator(device="cpu", bootstrap="tcp")
        buf = comm.empty(8 << 20, dtype=torch.uint8)
        port = comm.port_channels(buf)
        comm.barrier()
        if comm.rank == 2:
            time.sleep(0.2)
            os._exit(0)          # dies without a word, mid-stream
        start = time.monotonic()
        try:
            for _ in range(200):
                port.put(2, 0, 0, 8 << 20)
                port.flush(2)
            print("NO ERROR")
        except p2pcomm.PeerTimeoutError as e:
            print("RAISED", round(time.monotonic() - start, 2), e)
    """
    outs = launch(script, 3, env_per_rank={r: {"P2PCOMM_LOCAL_SIZE": "1"} for r in range(3)}, timeout=60)
    for rank in (0, 1):
        rc, out = outs[rank]
        assert "RAISED" in out and "rank 2" in out, out
        assert float(out.split("RAISED", 1)[1].split()[0]) < 6.0, out  # within P2PCOMM_TIMEOUT_MS (4 s)


@pytest.mark.parametrize("where", ["environment", "os.environ"])
def test_ucx_absent_is_unsupported_on_every_rank(where):
    """P2PCOMM_UCX_LIB names no library: in the environment the process starts with, or set by the script in
    os.environ before the first communicator (the library reads the environment as it is then, not as the
    process started)."""
    script = """
        import os
        if "@SET@":
            os.environ["P2PCOMM_UCX_LIB"] = "/nonexistent/libucp.so.0"
        import torch, p2pcomm
        comm = p2pcomm.Communicator(device="cpu", bootstrap="tcp")
        try:
            comm.port_channels(comm.empty(64, dtype=torch.uint8))
            print("NO ERROR")
        except p2pcomm.UnsupportedError as e:
            print("UNSUPPORTED", e)
        print("STILL", comm.all_reduce(torch.ones(2)).tolist())
    """.replace("@SET@", "yes" if where == "os.environ" else "")
    env = {"P2PCOMM_LOCAL_SIZE": "2"}
    if where == "environment":
        env["P2PCOMM_UCX_LIB"] = "/nonexistent/libucp.so.0"
    outs = launch(script, 2, env_per_rank={0: env, 1: env}, timeout=60)
    for rc, out in outs:
        assert rc == 0, out
        assert "UNSUPPORTED" in out and "libucx" in out and "/nonexistent/libucp.so.0" in out, out
        assert "STILL [2.0, 2.0]" in out, out
