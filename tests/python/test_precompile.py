"""`python -m p2pcomm.precompile` builds kernels into the cache a communicator's first calls read: a second run
finds them there; a file that does not exist fails with its name and changes nothing. Needs NVRTC (torch's
CUDA wheels), no GPU."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def precompile(cache: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), P2PCOMM_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "p2pcomm.precompile", *args], env=env, text=True,
                          capture_output=True, timeout=300)


def test_precompile_fills_the_kernel_cache(tmp_path):
    first = precompile(tmp_path, "--arch", "90", "--files", "copy.cu")
    if first.returncode != 0 and "NVRTC" in first.stderr:
        pytest.skip(f"NVRTC not found: {first.stderr.strip()[-200:]}")
    assert first.returncode == 0, first.stderr
    assert "1 kernel file for sm_90" in first.stdout and "(1 built, 0 already there)" in first.stdout, first.stdout
    assert "copy.cu for sm_90" in first.stderr, first.stderr
    entries = list(tmp_path.glob("*.cubin"))
    assert len(entries) == 1, entries
    again = precompile(tmp_path, "--arch", "90", "--files", "copy.cu")
    assert again.returncode == 0 and "(0 built, 1 already there)" in again.stdout, (again.stdout, again.stderr)
    bad = precompile(tmp_path, "--arch", "90", "--files", "nope.cu")
    assert bad.returncode == 1 and 'InvalidArgumentError: precompile: no kernel file "nope.cu"' in bad.stderr, bad.stderr
    assert list(tmp_path.glob("*.cubin")) == entries
