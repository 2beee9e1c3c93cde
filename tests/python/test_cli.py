"""Every command line of the package answers --help with its usage and does nothing else."""

import os
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("torch")

COMMANDS = [["p2pcomm.demo"], ["p2pcomm.bench"], ["p2pcomm.bench", "allreduce"], ["p2pcomm.bench", "moe"],
            ["p2pcomm.bench", "p2p"], ["p2pcomm.bench", "rmsnorm"], ["p2pcomm.bench", "nodes"], ["p2pcomm.tune"],
            ["p2pcomm.precompile"]]


@pytest.fixture(scope="module")
def answers():
    """Every command's --help, run at once (each imports torch: seconds apart, much less together), each in
    an empty folder of its own: name -> (return code, stdout, stderr, files left in the folder)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    runs = {}
    with tempfile.TemporaryDirectory() as root:
        for i, command in enumerate(COMMANDS):
            cwd = os.path.join(root, str(i))
            os.mkdir(cwd)
            proc = subprocess.Popen([sys.executable, "-m", *command, "--help"], cwd=cwd, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            runs[" ".join(command)] = (proc, cwd)
        got = {}
        for name, (proc, cwd) in runs.items():
            try:
                out, err = proc.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            got[name] = (proc.returncode, out, err, os.listdir(cwd))
    return got


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_prints_usage_and_writes_nothing(command, answers):
    code, out, err, files = answers[" ".join(command)]
    assert code == 0, err
    assert "usage:" in out, out
    assert files == [], "--help wrote files"
