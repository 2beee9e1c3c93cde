"""Run one command as N ranks of a local job and show one progress stream.

    python tests/run_ranks.py -n 4 [--log-dir DIR] [--timeout S] -- -m pytest -q tests/python/dist

Each rank is `python ARGS...` with the environment torchrun would give it
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
and OMP_NUM_THREADS=1 unless set: ranks that share a few cores would
otherwise each spin a thread per core in torch's parallel loops).
Rank 0's output is printed as it comes; every rank's output goes to
DIR/rank<r>.log, and a rank that fails has its log printed at the end. When a
rank fails, the others get a grace period to fail on their own (they raise
naming it) before they are ended; the whole job is bounded by --timeout.
Nothing is silent for long: after 30 s without output from rank 0 a line
says which ranks are still running.

When ARGS are `-m MODULE ...` or `SCRIPT.py ...`, the ranks are forked from
this process after it has imported --preload (torch and pytest by default),
so each rank starts in a fraction of a second instead of importing them again:
on a few cores those imports are a good part of a short job's CPU time.
Nothing that touches a GPU or loads p2pcomm's library runs before the fork.
--no-fork starts every rank as a fresh interpreter instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import runpy
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "python"))
from jobs import run_as_python  # noqa: E402
from ports import free_port  # noqa: E402

QUIET_S = 30  # longest stretch without a line on the console
GRACE_S = 60  # how long the others may take to fail once one rank failed
PRELOAD = "torch,pytest"  # torch.compile's modules too would cost more here than they save in the ranks


class Forked:
    """A rank forked from this process, polled like a subprocess.Popen."""

    def __init__(self, pid: int, stdout=None):
        self.pid, self.stdout, self.returncode = pid, stdout, None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self):
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def cuda_loaded() -> bool:
    """True when the CUDA driver library is mapped into this process."""
    with open("/proc/self/maps") as maps:
        return any("libcuda.so" in line for line in maps)


def forkable(args) -> bool:
    """True for `-m MODULE ...` and `SCRIPT.py ...`: what a forked rank can run as python would."""
    return (len(args) >= 2 and args[0] == "-m") or (bool(args) and args[0].endswith(".py"))


def fork_rank(args, env: dict, out_fd: int) -> Forked:
    """Forks a rank that runs args with env, its stdout and stderr on out_fd, in a session of its own."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return Forked(pid)
    # The rank never returns into the launcher's loop.
    os.setsid()

    def run():
        # sys.path starts with this launcher's two (tests/python, then its own folder); python ARGS would
        # start with the working directory (-m) or the script's folder instead.
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0:2] = [os.getcwd()]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0:2] = [str(pathlib.Path(args[0]).resolve().parent)]
            runpy.run_path(args[0], run_name="__main__")

    run_as_python(out_fd, env, run)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tests/run_ranks.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    p.add_argument("--log-dir", default="build/logs", help="where rank<r>.log files go (default build/logs)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before every rank is ended (default 1800)")
    p.add_argument("--preload", default=PRELOAD,
                   help=f"modules imported once before the ranks are forked (default {PRELOAD})")
    p.add_argument("--no-fork", action="store_true", help="start every rank as a fresh interpreter")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of python for every rank, after --")
    a = p.parse_args(argv)
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if a.nproc < 1 or not args:
        p.error("need -n >= 1 and a command after --")
    logs = pathlib.Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    port = os.environ.get("MASTER_PORT") or str(free_port())
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported here, for forked ranks
    fork = not a.no_fork and forkable(args)
    if fork:
        for name in filter(None, a.preload.split(",")):
            importlib.import_module(name)
        if cuda_loaded():
            print("run_ranks: the CUDA driver was loaded while importing --preload; ranks start as fresh "
                  "interpreters (a forked child cannot use CUDA that its parent set up)", flush=True)
            fork = False
    procs, files = [], []
    for r in range(a.nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.nproc), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(a.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   PYTHONUNBUFFERED="1")
        f = open(logs / f"rank{r}.log", "wb")
        files.append(f)
        if fork:
            if r == 0:
                read_end, write_end = os.pipe()
                procs.append(fork_rank(args, env, write_end))
                os.close(write_end)
                procs[0].stdout = os.fdopen(read_end, "rb", buffering=0)
            else:
                procs.append(fork_rank(args, env, f.fileno()))
            continue
        procs.append(subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE if r == 0 else f,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    last = [time.monotonic()]

    def echo_rank0():
        # Bytes as they come, not lines: pytest's progress dots share a line.
        fd = procs[0].stdout.fileno()
        for chunk in iter(lambda: os.read(fd, 65536), b""):
            files[0].write(chunk)
            files[0].flush()
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            last[0] = time.monotonic()

    reader = threading.Thread(target=echo_rank0, daemon=True)
    reader.start()
    start, failed_at = time.monotonic(), None
    while True:
        codes = [q.poll() for q in procs]
        now = time.monotonic()
        if all(c is not None for c in codes):
            break
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        late = failed_at is not None and now - failed_at > GRACE_S
        if late or now - start > a.timeout:
            why = "a rank failed" if late else f"the job ran past {a.timeout:.0f} s"
            print(f"\nrun_ranks: {why}; ending ranks {[r for r, c in enumerate(codes) if c is None]}", flush=True)
            for q, c in zip(procs, codes):
                if c is None:
                    os.killpg(q.pid, signal.SIGKILL)  # this rank's own process group, by its pid
            for q in procs:
                q.wait()
            break
        if now - last[0] > QUIET_S:
            running = [r for r, c in enumerate(codes) if c is None]
            print(f"[{now - start:.0f} s: ranks {running} still running]", flush=True)
            last[0] = now
        time.sleep(0.2)
    reader.join(timeout=5)
    for f in files:
        f.close()
    codes = [q.returncode for q in procs]
    bad = [r for r, c in enumerate(codes) if c != 0]
    for r in bad:
        if r == 0:
            continue
        print(f"\n===== rank {r} exited with {codes[r]}; its output ({logs / f'rank{r}.log'}) =====", flush=True)
        sys.stdout.buffer.write((logs / f"rank{r}.log").read_bytes()[-200_000:])
    if bad:
        print(f"\nrun_ranks: ranks {bad} failed (exit codes {[codes[r] for r in bad]})", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # without the teardown of the modules imported for the ranks (seconds, for nothing)
