"""Build p2pcomm's GPU kernels ahead of a job, into the kernel cache that its
first calls read (P2PCOMM_CACHE_DIR, else ~/.cache/p2pcomm)::

    python -m p2pcomm.precompile                # for this machine's GPU
    python -m p2pcomm.precompile --arch 90      # for sm_90, on any machine with NVRTC

Without it, each kernel file compiles at its first use: minutes on a small
host, and a rank still compiling while its peers wait for it can outlast
P2PCOMM_TIMEOUT_MS. Builds use P2PCOMM_NVRTC_OPTIONS as communicators do.
Needs NVRTC (torch's CUDA wheels bring it), no GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from typing import Optional


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m p2pcomm.precompile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=None,
                   help="SM version to build for, e.g. 90 (default: this machine's first GPU)")
    p.add_argument("--files", default="",
                   help="comma-separated kernel files of native/kernels (default: all of them)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    import torch  # its CUDA wheels carry NVRTC, which the library finds once torch has mapped them

    from . import _lib
    from .errors import P2PCommError
    arch = args.arch
    if arch is None:
        if not torch.cuda.is_available():
            print("no GPU here: say which architecture to build for, e.g. --arch 90", file=sys.stderr)
            return 2
        major, minor = torch.cuda.get_device_capability(0)
        arch = 10 * major + minor
    report = ctypes.create_string_buffer(1 << 16)
    start = time.monotonic()
    print(f"building p2pcomm's kernels for sm_{arch} (several minutes on a small host when nothing is cached)",
          file=sys.stderr, flush=True)
    try:
        _lib.check(_lib.lib().p2p_precompile(arch, args.files.encode(), 1, report, len(report)))
    except P2PCommError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    built = json.loads(report.value)["built"]
    fresh = sum(not b["cached"] for b in built)
    files = "file" if len(built) == 1 else "files"
    print(f"{len(built)} kernel {files} for sm_{arch} in {json.loads(report.value)['cache_dir']} ({fresh} built, "
          f"{len(built) - fresh} already there) in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
