"""Every command line of the package answers --help with its usage and does nothing else."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

COMMANDS = [["p2pcomm.demo"], ["p2pcomm.bench"], ["p2pcomm.bench", "allreduce"], ["p2pcomm.bench", "moe"],
            ["p2pcomm.bench", "p2p"], ["p2pcomm.bench", "rmsnorm"], ["p2pcomm.bench", "nodes"], ["p2pcomm.tune"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_prints_usage_and_writes_nothing(command, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-m", *command, "--help"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout, out.stdout
    assert list(tmp_path.iterdir()) == [], "--help wrote files"
