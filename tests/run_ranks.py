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
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "python"))
from ports import free_port  # noqa: E402

QUIET_S = 30  # longest stretch without a line on the console
GRACE_S = 60  # how long the others may take to fail once one rank failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tests/run_ranks.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    p.add_argument("--log-dir", default="build/logs", help="where rank<r>.log files go (default build/logs)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before every rank is ended (default 1800)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of python for every rank, after --")
    a = p.parse_args(argv)
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if a.nproc < 1 or not args:
        p.error("need -n >= 1 and a command after --")
    logs = pathlib.Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    port = os.environ.get("MASTER_PORT") or str(free_port())
    procs, files = [], []
    for r in range(a.nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.nproc), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(a.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   PYTHONUNBUFFERED="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        f = open(logs / f"rank{r}.log", "wb")
        files.append(f)
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
    sys.exit(main())
