"""Tests of the in-tree build backend (build_backend/p2pcomm_build.py) and of the wheel it makes.

They run on CPU without torchrun. The ones that package the real tree need build/libp2pcomm.so
(`make lib`) and skip without it; the backend's choices are tested on a small fake tree.
"""

import base64
import csv
import hashlib
import importlib.util
import io
import itertools
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKEND = ROOT / "build_backend" / "p2pcomm_build.py"
BUILT_LIB = ROOT / "build" / "libp2pcomm.so"
PACKAGE_SRC = ROOT / "python" / "p2pcomm"
BACKEND_ENV = ("P2PCOMM_PREBUILT_LIB", "P2PCOMM_USE_PREBUILT")

_module_ids = itertools.count()


def load_backend(path: Path):
    """load_backend imports a copy of the backend; it takes its source root from its own path."""
    spec = importlib.util.spec_from_file_location(f"p2pcomm_build_{next(_module_ids)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_platform() -> str:
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def project_version() -> str:
    tomllib = pytest.importorskip("tomllib")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def elf_needed(path: Path) -> list:
    """elf_needed returns the DT_NEEDED entries of a 64-bit little-endian ELF file."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for section in sections:
        if section[1] != 6:  # SHT_DYNAMIC
            continue
        strtab_offset = sections[section[6]][4]
        for tag, value in struct.iter_unpack("<qQ", data[section[4] : section[4] + section[5]]):
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                start = strtab_offset + value
                needed.append(data[start : data.index(b"\0", start)].decode())
    return needed


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


@pytest.fixture(autouse=True)
def clean_backend_env(monkeypatch):
    for name in BACKEND_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def built_lib() -> Path:
    if not BUILT_LIB.is_file():
        pytest.skip(f"{BUILT_LIB} not built: run `make lib` "
                    "(go build -buildmode=c-shared -o build/libp2pcomm.so ./golib/capi)")
    return BUILT_LIB


@pytest.fixture(scope="module")
def wheel(built_lib, tmp_path_factory) -> Path:
    """wheel is the real tree packaged by the backend with the prebuilt library."""
    out = tmp_path_factory.mktemp("wheel")
    with pytest.MonkeyPatch.context() as mp:
        for name in BACKEND_ENV:
            mp.delenv(name, raising=False)
        mp.setenv("P2PCOMM_PREBUILT_LIB", str(built_lib))
        name = load_backend(BACKEND).build_wheel(str(out))
    return out / name


def test_wheel_name_has_py3_none_platform_tag(wheel):
    want = f"p2pcomm-{project_version()}-py3-none-{expected_platform()}.whl"
    assert wheel.name == want, f"build_wheel() wrote {wheel.name}, want {want}"
    assert wheel.is_file()


def test_wheel_record_lists_every_file_with_its_hash(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(whl.read(record_name).decode())))
        listed = {row[0]: row for row in rows}
        assert sorted(listed) == sorted(names), "RECORD and the zip list different files"
        assert len(rows) == len(names), "RECORD lists a file twice"
        assert listed[record_name][1:] == ["", ""], f"RECORD's own row: {listed[record_name]}"
        for name in names:
            if name == record_name:
                continue
            data = whl.read(name)
            got = listed[name][1:]
            want = [record_hash(data), str(len(data))]
            assert got == want, f"RECORD row of {name}: got {got}, want {want}"


def test_wheel_holds_package_and_library(wheel, built_lib):
    version = project_version()
    want_py = sorted(
        "p2pcomm/" + p.relative_to(PACKAGE_SRC).as_posix()
        for p in PACKAGE_SRC.rglob("*.py")
        if "__pycache__" not in p.parts
    )
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        got_py = sorted(n for n in names if n.endswith(".py"))
        assert got_py == want_py, f"python files: got {got_py}, want {want_py}"
        assert "p2pcomm/__init__.py" in names
        assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
        assert whl.read("p2pcomm/libp2pcomm.so") == built_lib.read_bytes()
        mode = whl.getinfo("p2pcomm/libp2pcomm.so").external_attr >> 16
        assert mode & 0o111, f"libp2pcomm.so mode {oct(mode)} is not executable"
        wheel_meta = whl.read(f"p2pcomm-{version}.dist-info/WHEEL").decode().splitlines()
        metadata = whl.read(f"p2pcomm-{version}.dist-info/METADATA").decode().splitlines()
    assert "Root-Is-Purelib: false" in wheel_meta, wheel_meta
    assert f"Tag: py3-none-{expected_platform()}" in wheel_meta, wheel_meta
    for line in ("Name: p2pcomm", f"Version: {version}", "Requires-Python: >=3.9"):
        assert line in metadata, f"METADATA lacks {line!r}: {metadata[:12]}"


def test_library_does_not_link_libpython(built_lib):
    needed = elf_needed(built_lib)
    assert "libc.so.6" in needed, f"DT_NEEDED {needed}: want libc.so.6 (is the ELF reader broken?)"
    assert not [n for n in needed if n.startswith("libpython")], f"DT_NEEDED {needed} links libpython"
    if shutil.which("readelf"):
        out = subprocess.run(["readelf", "-d", str(built_lib)], capture_output=True, text=True, check=True)
        from_readelf = [line.split("[", 1)[1].split("]", 1)[0] for line in out.stdout.splitlines()
                        if "(NEEDED)" in line]
        assert needed == from_readelf, f"elf_needed {needed}, readelf {from_readelf}"


def test_pip_install_target_has_package_layout(built_lib, tmp_path):
    target = tmp_path / "site"
    env = dict(os.environ, P2PCOMM_PREBUILT_LIB=str(built_lib), PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
           "--target", str(target), str(ROOT)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    pkg = target / "p2pcomm"
    assert (pkg / "libp2pcomm.so").read_bytes() == built_lib.read_bytes()
    for src in PACKAGE_SRC.rglob("*.py"):
        if "__pycache__" not in src.parts:
            rel = src.relative_to(PACKAGE_SRC)
            assert (pkg / rel).read_bytes() == src.read_bytes(), f"{rel} missing or different"
    dist_info = target / f"p2pcomm-{project_version()}.dist-info"
    assert (dist_info / "METADATA").is_file() and (dist_info / "RECORD").is_file()


def test_go_build_for_real(tmp_path):
    if shutil.which("go") is None:
        pytest.skip("go is not on PATH")
    if not list((ROOT / "golib" / "capi").glob("*.go")):
        pytest.skip("golib/capi has no Go files yet")
    lib = load_backend(BACKEND).go_build(ROOT, tmp_path)
    needed = elf_needed(lib)
    assert lib == tmp_path / "libp2pcomm.so"
    assert "libc.so.6" in needed and not [n for n in needed if n.startswith("libpython")], needed


# --- the backend's choices, on a fake tree ----------------------------------

FAKE_GO = """#!/bin/sh
# Writes its arguments where -o points, standing in for a real build.
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
echo "$@" > "$out"
"""


@pytest.fixture
def fake_tree(tmp_path, monkeypatch):
    """fake_tree is a source tree with the real backend and pyproject, and PATH with only a fake go."""
    root = tmp_path / "src"
    for rel in ("pyproject.toml", "build_backend/p2pcomm_build.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, root / rel)
    files = {
        "python/p2pcomm/__init__.py": '"""p2pcomm."""\n',
        "python/p2pcomm/__pycache__/__init__.cpython-311.pyc": "",
        "golib/capi/capi.go": "package main\n",
        "native/kernels/allreduce.cu": "// kernel\n",
        "go.mod": "module example.com/fake\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    return root, bin_dir


def add_tool(bin_dir: Path, name: str, script: str) -> None:
    tool = bin_dir / name
    tool.write_text(script)
    tool.chmod(0o755)


def set_mtime(path: Path, seconds: int) -> None:
    os.utime(path, (seconds, seconds))


@pytest.mark.parametrize(
    "name, lib_age, have_go, use_prebuilt, want",
    [
        ("fresh build/ lib is used", "newer", True, None, "build"),
        ("stale build/ lib is rebuilt", "older", True, None, "go"),
        ("P2PCOMM_USE_PREBUILT=1 keeps a stale lib", "older", True, "1", "build"),
        ("no go: a stale lib is used", "older", False, None, "build"),
        ("no lib: go builds", None, True, None, "go"),
    ],
)
def test_resolve_library_choice(fake_tree, monkeypatch, capsys, tmp_path, name, lib_age, have_go,
                                use_prebuilt, want):
    root, bin_dir = fake_tree
    if have_go:
        add_tool(bin_dir, "go", FAKE_GO)
    if use_prebuilt:
        monkeypatch.setenv("P2PCOMM_USE_PREBUILT", use_prebuilt)
    for src in (root / "golib/capi/capi.go", root / "native/kernels/allreduce.cu", root / "go.mod"):
        set_mtime(src, 2_000_000)
    lib = root / "build" / "libp2pcomm.so"
    if lib_age is not None:
        lib.parent.mkdir()
        lib.write_text("prebuilt")
        set_mtime(lib, 3_000_000 if lib_age == "newer" else 1_000_000)
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    got = load_backend(root / "build_backend/p2pcomm_build.py").resolve_library(root, scratch)

    if want == "build":
        assert got == lib, f"{name}: resolve_library() = {got}, want {lib}"
    else:
        assert got == scratch / "libp2pcomm.so", f"{name}: resolve_library() = {got}, want a go build"
        args = got.read_text().split()
        assert args[:3] == ["build", "-buildmode=c-shared", "-trimpath"], f"{name}: go {args}"
        assert args[-1] == "./golib/capi" and "mpi" not in args, f"{name}: go {args}"
    if not have_go:
        assert "go is not on PATH" in capsys.readouterr().err


def test_no_go_and_no_library_raises_clear_error(fake_tree, tmp_path):
    root, _ = fake_tree
    backend = load_backend(root / "build_backend/p2pcomm_build.py")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(backend.BackendError, match=r"Install Go >= 1\.24.*P2PCOMM_PREBUILT_LIB"):
        backend.build_wheel(str(out))
    assert list(out.iterdir()) == [], "a failed build left files behind"


@pytest.mark.parametrize(
    "name, env, want",
    [
        ("missing P2PCOMM_PREBUILT_LIB file", {"P2PCOMM_PREBUILT_LIB": "/nonexistent/libp2pcomm.so"},
         "P2PCOMM_PREBUILT_LIB=/nonexistent/libp2pcomm.so is not a file"),
        ("USE_PREBUILT without build/ lib", {"P2PCOMM_USE_PREBUILT": "1"}, "P2PCOMM_USE_PREBUILT=1 but"),
    ],
)
def test_resolve_library_errors(fake_tree, monkeypatch, tmp_path, name, env, want):
    root, bin_dir = fake_tree
    add_tool(bin_dir, "go", FAKE_GO)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    backend = load_backend(root / "build_backend/p2pcomm_build.py")
    with pytest.raises(backend.BackendError) as caught:
        backend.resolve_library(root, tmp_path)
    assert want in str(caught.value), f"{name}: error {caught.value!r}, want it to contain {want!r}"


def test_build_has_no_tags_where_openmpi_is_installed(fake_tree, tmp_path):
    # One library for every machine: Open MPI is opened at run time, never linked.
    root, bin_dir = fake_tree
    add_tool(bin_dir, "go", FAKE_GO)
    add_tool(bin_dir, "pkg-config", "#!/bin/sh\nexit 0\n")
    lib = load_backend(root / "build_backend/p2pcomm_build.py").resolve_library(root, tmp_path)
    args = lib.read_text().split()
    assert args == ["build", "-buildmode=c-shared", "-trimpath", "-o", str(lib), "./golib/capi"], f"go {args}"


def test_editable_wheel_points_at_sources(fake_tree, monkeypatch, tmp_path):
    root, _ = fake_tree
    prebuilt = tmp_path / "libp2pcomm.so"
    prebuilt.write_bytes(b"\x7fELF fake library")
    monkeypatch.setenv("P2PCOMM_PREBUILT_LIB", str(prebuilt))
    out = tmp_path / "out"
    out.mkdir()
    name = load_backend(root / "build_backend/p2pcomm_build.py").build_editable(str(out))

    assert name == f"p2pcomm-{project_version()}-py3-none-{expected_platform()}.whl"
    assert (root / "python/p2pcomm/libp2pcomm.so").read_bytes() == prebuilt.read_bytes()
    with zipfile.ZipFile(out / name) as whl:
        pth = [n for n in whl.namelist() if n.endswith(".pth")]
        assert len(pth) == 1, whl.namelist()
        assert whl.read(pth[0]).decode().strip() == str(root / "python")
        assert not [n for n in whl.namelist() if n.startswith("p2pcomm/")], "editable wheel copies sources"


def test_sdist_has_sources_and_no_build_outputs(fake_tree, tmp_path):
    root, _ = fake_tree
    (root / "build").mkdir()
    (root / "build/libp2pcomm.so").write_text("built")
    (root / "python/p2pcomm/libp2pcomm.so").write_text("editable copy")
    (root / "python/p2pcomm/libp2pcomm.h").write_text("cgo header")
    out = tmp_path / "out"
    out.mkdir()
    name = load_backend(root / "build_backend/p2pcomm_build.py").build_sdist(str(out))

    base = f"p2pcomm-{project_version()}"
    assert name == f"{base}.tar.gz"
    with tarfile.open(out / name) as tar:
        got = sorted(m.name for m in tar.getmembers())
    want = sorted(f"{base}/{rel}" for rel in (
        "PKG-INFO", "pyproject.toml", "build_backend/p2pcomm_build.py", "python/p2pcomm/__init__.py",
        "golib/capi/capi.go", "native/kernels/allreduce.cu", "go.mod",
    ))
    assert got == want, f"sdist members: got {got}, want {want}"


def test_wheel_ignores_editable_leftovers(fake_tree, monkeypatch, tmp_path):
    root, _ = fake_tree
    (root / "python/p2pcomm/libp2pcomm.so").write_text("stale editable copy")
    (root / "python/p2pcomm/libp2pcomm.h").write_text("cgo header")
    prebuilt = tmp_path / "libp2pcomm.so"
    prebuilt.write_bytes(b"\x7fELF fake library")
    monkeypatch.setenv("P2PCOMM_PREBUILT_LIB", str(prebuilt))
    out = tmp_path / "out"
    out.mkdir()
    name = load_backend(root / "build_backend/p2pcomm_build.py").build_wheel(str(out))

    with zipfile.ZipFile(out / name) as whl:
        got = sorted(n for n in whl.namelist() if n.startswith("p2pcomm/"))
        assert got == ["p2pcomm/__init__.py", "p2pcomm/libp2pcomm.so"], f"package files: {got}"
        assert whl.read("p2pcomm/libp2pcomm.so") == prebuilt.read_bytes()
