"""The package offers its interpreter's libucx wheel to the library's UCX search (P2PCOMM_UCX_DIRS)."""

import importlib.util
import os
import pathlib

import pytest

from p2pcomm import _lib


def wheel_lib_dir() -> str:
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.origin:
        pytest.skip("no libucx wheel in this interpreter (pip install libucx-cu13)")
    return str(pathlib.Path(spec.origin).parent / "lib")


def test_wheel_folder_added_once(monkeypatch):
    lib_dir = wheel_lib_dir()
    assert (pathlib.Path(lib_dir) / "libucp.so.0").exists()
    monkeypatch.setenv("P2PCOMM_UCX_DIRS", "")  # recorded, so the test's own value is undone after it
    monkeypatch.delenv("P2PCOMM_UCX_DIRS")
    _lib._offer_ucx_wheel()
    _lib._offer_ucx_wheel()
    assert os.environ["P2PCOMM_UCX_DIRS"] == lib_dir


def test_users_folders_kept_first(monkeypatch):
    lib_dir = wheel_lib_dir()
    monkeypatch.setenv("P2PCOMM_UCX_DIRS", "/opt/ucx/lib")
    _lib._offer_ucx_wheel()
    assert os.environ["P2PCOMM_UCX_DIRS"].split(os.pathsep) == ["/opt/ucx/lib", lib_dir]


def test_no_wheel_leaves_the_setting_alone(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("P2PCOMM_UCX_DIRS", "/opt/ucx/lib")
    _lib._offer_ucx_wheel()
    assert os.environ["P2PCOMM_UCX_DIRS"] == "/opt/ucx/lib"


def test_a_failing_lookup_leaves_the_setting_alone(monkeypatch):
    def broken(name):
        raise ValueError(f"{name}.__spec__ is None")

    monkeypatch.setattr(importlib.util, "find_spec", broken)
    monkeypatch.setenv("P2PCOMM_UCX_DIRS", "/opt/ucx/lib")
    _lib._offer_ucx_wheel()
    assert os.environ["P2PCOMM_UCX_DIRS"] == "/opt/ucx/lib"
