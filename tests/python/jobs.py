"""Python snippets run as the processes of a local job, each as `python -c CODE` would run it.

Each process is forked from a server that imported torch once (multiprocessing's forkserver), so a test
that starts a dozen ranks does not pay a dozen imports of torch; on a machine of a few cores that import is
most of such a test's CPU time. Nothing that loads p2pcomm's library or touches a GPU runs before the fork:
each process starts Go and CUDA of its own, with the environment it was given.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import subprocess
import sys
import tempfile
import traceback
from typing import NoReturn

_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["torch"])
    return _context


def run_as_python(out_fd: int, env: dict, run, err_fd: int | None = None) -> NoReturn:
    """In a forked child: stdout on out_fd and stderr on err_fd, else on out_fd too (unbuffered, as
    PYTHONUNBUFFERED=1 makes them), env as the whole environment, then run(); exits with the code `python ...`
    would, after the atexit handlers but without tearing down every module (seconds with torch's loaded, for
    nothing)."""
    os.dup2(out_fd, 1)
    os.dup2(out_fd if err_fd is None else err_fd, 2)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    rc = 0
    try:
        run()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException:  # noqa: BLE001 - reported as python would, then the exit code says it
        traceback.print_exc()
        rc = 1
    atexit._run_exitfuncs()
    os._exit(rc)


def _main(code: str, env: dict, out_path: str, err_path: str | None) -> None:
    """The process: stdout into out_path, stderr into err_path (else out_path too), env as its whole
    environment, then code."""
    fd = os.open(out_path, os.O_WRONLY | os.O_APPEND)
    err = None if err_path is None else os.open(err_path, os.O_WRONLY | os.O_APPEND)
    run_as_python(fd, env, lambda: exec(compile(code, "<string>", "exec"), {"__name__": "__main__"}), err)


def _temp_log() -> str:
    fd, path = tempfile.mkstemp(prefix="p2pcomm-job-", suffix=".log")
    os.close(fd)
    return path


class Process:
    """One process of a job, with the parts of subprocess.Popen the tests use; with separate_stderr, communicate
    gives stdout and stderr apart, else both as one."""

    def __init__(self, code: str, env: dict, separate_stderr: bool = False):
        self._out = _temp_log()
        self._err = _temp_log() if separate_stderr else None
        self._proc = _forkserver().Process(target=_main, args=(code, dict(env), self._out, self._err), daemon=False)
        self._proc.start()
        self.pid = self._proc.pid
        self._output = None

    @property
    def returncode(self):
        return self._proc.exitcode

    def poll(self):
        return self._proc.exitcode

    def kill(self):
        if self._proc.exitcode is None:
            self._proc.kill()

    def communicate(self, timeout=None):
        """(stdout, stderr or None) once the process has ended; subprocess.TimeoutExpired if it runs past
        timeout."""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired("python -c", timeout)
        if self._output is None:
            self._output = tuple(None if path is None else _take(path) for path in (self._out, self._err))
        return self._output


def _take(path: str) -> str:
    with open(path, errors="backslashreplace") as f:
        text = f.read()
    os.unlink(path)
    return text


def start(code: str, env: dict, separate_stderr: bool = False) -> Process:
    """Starts code (a script, as for `python -c`) in a process whose environment is exactly env."""
    return Process(code, env, separate_stderr)


def run(code: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Runs code as `python -c code` would, as subprocess.run(..., capture_output=True, text=True) reports it;
    the process is killed if it runs past timeout."""
    proc = start(code, env, separate_stderr=True)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(["python", "-c", code], proc.returncode, out, err)
