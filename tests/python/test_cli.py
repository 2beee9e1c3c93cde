"""Every command line of the package answers --help with its usage and does nothing else."""

import json
import os
import tempfile

import pytest

pytest.importorskip("torch")

import jobs  # noqa: E402

COMMANDS = [["p2pcomm.demo"], ["p2pcomm.bench"], ["p2pcomm.bench", "allreduce"], ["p2pcomm.bench", "moe"],
            ["p2pcomm.bench", "p2p"], ["p2pcomm.bench", "rmsnorm"], ["p2pcomm.bench", "nodes"], ["p2pcomm.tune"],
            ["p2pcomm.precompile"]]


# Runs each command as `python -m MODULE ARGS --help` would (runpy, as __main__), in an empty folder of its
# own, all in one process forked with torch imported: each would import torch, which costs seconds of CPU.
DRIVER = """
import contextlib, io, json, os, runpy, sys
root, got = ROOT, {}
for i, command in enumerate(COMMANDS):
    cwd = os.path.join(root, str(i))
    os.mkdir(cwd)
    os.chdir(cwd)
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [command[0], *command[1:], "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(command[0], run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    got[" ".join(command)] = (code, out.getvalue(), err.getvalue(), os.listdir(cwd))
print(json.dumps(got))
"""


@pytest.fixture(scope="module")
def answers():
    """Every command's --help: name -> (return code, stdout, stderr, files left in its folder)."""
    with tempfile.TemporaryDirectory() as root:
        code = f"ROOT, COMMANDS = {root!r}, {COMMANDS!r}\n" + DRIVER
        proc = jobs.run(code, dict(os.environ), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_prints_usage_and_writes_nothing(command, answers):
    code, out, err, files = answers[" ".join(command)]
    assert code == 0, err
    assert "usage:" in out, out
    assert files == [], "--help wrote files"
