"""`python -m p2pcomm.precompile` builds kernels into the cache a communicator's first calls read: a second run
finds them there; a file that does not exist fails with its name and changes nothing. Needs NVRTC (torch's
CUDA wheels), no GPU."""

import os
import pathlib
import subprocess

import pytest

pytest.importorskip("torch")

import jobs  # noqa: E402


def precompile(cache: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m p2pcomm.precompile ARGS` with cache as the kernel cache (in a process forked with torch
    imported: the command imports it too)."""
    code = f"import runpy, sys; sys.argv = {['p2pcomm.precompile', *args]!r}; " \
        "runpy.run_module('p2pcomm.precompile', run_name='__main__', alter_sys=True)"
    return jobs.run(code, dict(os.environ, P2PCOMM_CACHE_DIR=str(cache)), timeout=300)


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
