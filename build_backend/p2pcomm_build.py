"""p2pcomm_build is the in-tree PEP 517/660 build backend of p2pcomm.

It needs only the standard library and works offline. The wheel holds the
pure-Python package from python/p2pcomm plus libp2pcomm.so, the Go c-shared
library that the package loads with ctypes. The library comes from, in order:

1. P2PCOMM_PREBUILT_LIB=/path/to/libp2pcomm.so (must exist);
2. build/libp2pcomm.so in the source tree, when it is newer than every Go and
   kernel source, when P2PCOMM_USE_PREBUILT=1, or when Go is not installed;
3. go build -buildmode=c-shared ./golib/capi.

The library is a Go c-shared object: it does not link libpython, so one wheel
serves every CPython 3 on the platform (tag py3-none-<platform>), and it opens
CUDA, NVRTC and Open MPI at run time, so it loads where they are absent.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

__all__ = [
    "BackendError",
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

LIB_NAME = "libp2pcomm.so"
PACKAGE = "p2pcomm"

# Hooks run with the project root as cwd (PEP 517), but locating the root from
# this file also works when tests import the module from elsewhere.
SOURCE_ROOT = Path(__file__).resolve().parent.parent

# Roots shipped in the sdist; anything else in the tree (build/, .git, tests
# output) stays out.
SDIST_ROOTS = (
    "go.mod", "go.sum", "golib", "native", "python", "build_backend",
    "pyproject.toml", "README.md", "Makefile", "LICENSE",
)
# Generated files that may sit next to the sources after an editable install.
GENERATED = {"libp2pcomm.so", "libp2pcomm.h"}

# Zip entries get a fixed time so that two builds of one tree are identical.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


class BackendError(RuntimeError):
    """BackendError is a build failure with a message meant for the user."""


def _note(message: str) -> None:
    print(f"p2pcomm_build: {message}", file=sys.stderr, flush=True)


# --- project metadata -------------------------------------------------------

def _load_toml(path: Path) -> dict:
    try:
        import tomllib as toml  # Python >= 3.11
    except ImportError:
        try:
            import tomli as toml  # type: ignore[no-redef]
        except ImportError:
            try:
                from pip._vendor import tomli as toml  # type: ignore[no-redef]
            except ImportError:
                raise BackendError(
                    "reading pyproject.toml needs Python >= 3.11, or the tomli package"
                ) from None
    with path.open("rb") as f:
        return toml.load(f)


def _project(root: Path) -> dict:
    project = _load_toml(root / "pyproject.toml").get("project")
    if not project or "name" not in project or "version" not in project:
        raise BackendError("pyproject.toml needs a [project] table with name and version")
    if project.get("dynamic"):
        raise BackendError(f"p2pcomm_build does not support dynamic fields: {project['dynamic']}")
    return project


def _dist_name(project: dict) -> str:
    """_dist_name is the name as it appears in file names (PEP 427 escaping)."""
    return re.sub(r"[-_.]+", "_", project["name"]).lower()


def _dist_info(project: dict) -> str:
    return f"{_dist_name(project)}-{project['version']}.dist-info"


def _readme(root: Path, project: dict) -> tuple[str, str] | None:
    readme = project.get("readme")
    if readme is None:
        return None
    if isinstance(readme, dict):
        if "text" in readme:
            return readme["text"], readme.get("content-type", "text/plain")
        readme, content_type = readme["file"], readme.get("content-type")
    else:
        content_type = None
    path = root / readme
    if not path.is_file():
        _note(f"readme {readme} not found; the package gets no long description")
        return None
    if content_type is None:
        content_type = "text/markdown" if path.suffix.lower() == ".md" else "text/plain"
    return path.read_text(encoding="utf-8"), content_type


def _metadata(root: Path, project: dict) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {project['version']}",
    ]
    if "description" in project:
        lines.append(f"Summary: {project['description']}")
    if "requires-python" in project:
        lines.append(f"Requires-Python: {project['requires-python']}")
    license_ = project.get("license")
    if isinstance(license_, dict) and "text" in license_:
        lines.append(f"License: {license_['text']}")
    elif isinstance(license_, str):
        lines.append(f"License: {license_}")
    for classifier in project.get("classifiers", []):
        lines.append(f"Classifier: {classifier}")
    for label, url in project.get("urls", {}).items():
        lines.append(f"Project-URL: {label}, {url}")
    for requirement in project.get("dependencies", []):
        lines.append(f"Requires-Dist: {requirement}")
    for extra, requirements in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        for requirement in requirements:
            spec, _, marker = requirement.partition(";")
            wanted = f'extra == "{extra}"'
            marker = f"({marker.strip()}) and {wanted}" if marker.strip() else wanted
            lines.append(f"Requires-Dist: {spec.strip()}; {marker}")
    readme = _readme(root, project)
    if readme is not None:
        text, content_type = readme
        lines.append(f"Description-Content-Type: {content_type}")
        return "\n".join(lines) + "\n\n" + text
    return "\n".join(lines) + "\n"


def _entry_points(project: dict) -> str | None:
    groups = {}
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    if project.get("gui-scripts"):
        groups["gui_scripts"] = project["gui-scripts"]
    groups.update(project.get("entry-points", {}))
    if not groups:
        return None
    out = []
    for group, entries in groups.items():
        out.append(f"[{group}]")
        out.extend(f"{name} = {target}" for name, target in entries.items())
        out.append("")
    return "\n".join(out)


def platform_tag() -> str:
    """platform_tag is this machine's wheel platform tag, e.g. linux_x86_64."""
    return re.sub(r"[-.]", "_", sysconfig.get_platform())


def wheel_tag() -> str:
    return f"py3-none-{platform_tag()}"


def _dist_info_files(root: Path, project: dict) -> dict[str, bytes]:
    """_dist_info_files maps file names inside .dist-info (RECORD excepted) to contents."""
    files = {
        "METADATA": _metadata(root, project).encode(),
        "WHEEL": (
            "Wheel-Version: 1.0\n"
            "Generator: p2pcomm_build\n"
            "Root-Is-Purelib: false\n"
            f"Tag: {wheel_tag()}\n"
        ).encode(),
        "top_level.txt": f"{PACKAGE}\n".encode(),
    }
    entry_points = _entry_points(project)
    if entry_points is not None:
        files["entry_points.txt"] = entry_points.encode()
    return files


# --- the native library -----------------------------------------------------

def _native_sources(root: Path) -> list[Path]:
    """_native_sources lists every file whose change calls for a new library."""
    sources = [p for ext in ("*.go", "*.h", "*.c") for p in (root / "golib").rglob(ext)]
    sources += [p for p in (root / "native" / "kernels").rglob("*") if p.is_file()]
    sources += [p for p in (root / "go.mod", root / "go.sum") if p.is_file()]
    return sources


def _is_fresh(lib: Path, root: Path) -> bool:
    built = lib.stat().st_mtime
    return all(src.stat().st_mtime <= built for src in _native_sources(root))


def go_build(root: Path, out_dir: Path) -> Path:
    """go_build builds golib/capi into out_dir/libp2pcomm.so and returns its path."""
    go = shutil.which("go")
    if go is None:
        raise BackendError("go is not on PATH")
    out = out_dir / LIB_NAME
    cmd = [go, "build", "-buildmode=c-shared", "-trimpath", "-o", str(out), "./golib/capi"]
    _note("running go " + " ".join(cmd[1:]))
    env = dict(os.environ, CGO_ENABLED="1")
    done = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        output = done.stdout.decode(errors="replace")[-4000:]
        raise BackendError(f"go build failed (exit {done.returncode}):\n{output}")
    return out


def resolve_library(root: Path, scratch: Path) -> Path:
    """resolve_library finds or builds libp2pcomm.so; scratch holds a fresh build."""
    prebuilt = os.environ.get("P2PCOMM_PREBUILT_LIB")
    if prebuilt:
        path = Path(prebuilt)
        if not path.is_file():
            raise BackendError(f"P2PCOMM_PREBUILT_LIB={prebuilt} is not a file")
        _note(f"using P2PCOMM_PREBUILT_LIB={prebuilt}")
        return path

    local = root / "build" / LIB_NAME
    have_go = shutil.which("go") is not None
    if local.is_file():
        if os.environ.get("P2PCOMM_USE_PREBUILT") == "1":
            _note(f"using {local} (P2PCOMM_USE_PREBUILT=1)")
            return local
        if _is_fresh(local, root):
            _note(f"using {local} (newer than every Go and kernel source)")
            return local
        if not have_go:
            # Copies to machines without Go often get new mtimes on the sources.
            _note(f"go is not on PATH: using {local}, which may be older than the sources")
            return local
    elif os.environ.get("P2PCOMM_USE_PREBUILT") == "1":
        raise BackendError(f"P2PCOMM_USE_PREBUILT=1 but {local} does not exist")

    if not have_go:
        raise BackendError(
            "cannot build libp2pcomm.so: go is not on PATH. Install Go >= 1.24 "
            "(https://go.dev/dl/), or set P2PCOMM_PREBUILT_LIB=/path/to/libp2pcomm.so "
            "built elsewhere with `go build -buildmode=c-shared -o build/libp2pcomm.so ./golib/capi`"
        )
    return go_build(root, scratch)


# --- archives ---------------------------------------------------------------

def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _package_files(root: Path) -> dict[str, Path]:
    """_package_files maps wheel paths to the package's source files."""
    src = root / "python" / PACKAGE
    if not (src / "__init__.py").is_file():
        raise BackendError(f"{src / '__init__.py'} not found: the Python package is missing")
    files = {}
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if not path.is_file() or _skipped(rel):
            continue
        if len(rel.parts) == 1 and rel.name in GENERATED:
            continue
        files[f"{PACKAGE}/{rel.as_posix()}"] = path
    return files


def _skipped(rel: Path) -> bool:
    return any(part == "__pycache__" or part.startswith(".") for part in rel.parts) or rel.suffix in (
        ".pyc", ".pyo",
    )


def _zip_info(name: str, executable: bool) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=ZIP_EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = ((0o755 if executable else 0o644) | 0o100000) << 16
    return info


def _write_wheel(wheel_directory: str, root: Path, project: dict, contents: dict[str, bytes]) -> str:
    """_write_wheel writes contents plus .dist-info and RECORD; returns the file name."""
    dist_info = _dist_info(project)
    entries = dict(sorted(contents.items()))
    for name, data in _dist_info_files(root, project).items():
        entries[f"{dist_info}/{name}"] = data

    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for name, data in entries.items():
        writer.writerow([name, _record_hash(data), len(data)])
    writer.writerow([f"{dist_info}/RECORD", "", ""])
    entries[f"{dist_info}/RECORD"] = record.getvalue().encode()

    filename = f"{_dist_name(project)}-{project['version']}-{wheel_tag()}.whl"
    target = Path(wheel_directory) / filename
    tmp = target.with_suffix(".whl.part")
    with zipfile.ZipFile(tmp, "w") as whl:
        for name, data in entries.items():
            whl.writestr(_zip_info(name, name.endswith(".so")), data)
    os.replace(tmp, target)
    _note(f"wrote {target}")
    return filename


# --- PEP 517 / 660 hooks ----------------------------------------------------

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    project = _project(SOURCE_ROOT)
    dist_info = Path(metadata_directory) / _dist_info(project)
    dist_info.mkdir(parents=True, exist_ok=True)
    for name, data in _dist_info_files(SOURCE_ROOT, project).items():
        (dist_info / name).write_bytes(data)
    return dist_info.name


prepare_metadata_for_build_editable = prepare_metadata_for_build_wheel


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    project = _project(SOURCE_ROOT)
    contents = {name: path.read_bytes() for name, path in _package_files(SOURCE_ROOT).items()}
    with tempfile.TemporaryDirectory(prefix="p2pcomm-build-") as scratch:
        lib = resolve_library(SOURCE_ROOT, Path(scratch))
        contents[f"{PACKAGE}/{LIB_NAME}"] = lib.read_bytes()
    return _write_wheel(wheel_directory, SOURCE_ROOT, project, contents)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """build_editable puts the library next to the sources and ships a .pth to them."""
    project = _project(SOURCE_ROOT)
    _package_files(SOURCE_ROOT)  # fails early when the package is missing
    target = SOURCE_ROOT / "python" / PACKAGE / LIB_NAME
    with tempfile.TemporaryDirectory(prefix="p2pcomm-build-") as scratch:
        lib = resolve_library(SOURCE_ROOT, Path(scratch))
        if lib.resolve() != target.resolve():
            tmp = target.with_name(LIB_NAME + ".part")
            shutil.copyfile(lib, tmp)
            os.chmod(tmp, 0o755)
            # Replace rather than overwrite: a running process may have the old one mapped.
            os.replace(tmp, target)
    _note(f"editable install: library at {target}")
    pth = f"{os.fspath(SOURCE_ROOT / 'python')}\n".encode()
    contents = {f"__editable__.{_dist_name(project)}-{project['version']}.pth": pth}
    return _write_wheel(wheel_directory, SOURCE_ROOT, project, contents)


def _sdist_files(root: Path) -> list[Path]:
    files = []
    for name in SDIST_ROOTS:
        top = root / name
        if top.is_file():
            files.append(top)
        elif top.is_dir():
            for path in sorted(top.rglob("*")):
                rel = path.relative_to(top)
                if path.is_file() and not _skipped(rel) and path.name not in GENERATED:
                    files.append(path)
    return files


def build_sdist(sdist_directory, config_settings=None):
    project = _project(SOURCE_ROOT)
    base = f"{_dist_name(project)}-{project['version']}"
    filename = f"{base}.tar.gz"
    target = Path(sdist_directory) / filename
    mtime = int(os.environ.get("SOURCE_DATE_EPOCH", time.time()))

    def add(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
        info = tarfile.TarInfo(f"{base}/{name}")
        info.size, info.mode, info.mtime = len(data), mode, mtime
        tar.addfile(info, io.BytesIO(data))

    tmp = target.with_suffix(".gz.part")
    with tarfile.open(tmp, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        add(tar, "PKG-INFO", _metadata(SOURCE_ROOT, project).encode(), 0o644)
        for path in _sdist_files(SOURCE_ROOT):
            mode = 0o755 if os.access(path, os.X_OK) else 0o644
            add(tar, path.relative_to(SOURCE_ROOT).as_posix(), path.read_bytes(), mode)
    os.replace(tmp, target)
    _note(f"wrote {target}")
    return filename
