"""python -m p2pcomm.bench [allreduce|moe|p2p|rmsnorm|nodes] [options]: runs one benchmark
(allreduce when no subcommand is named); each answers --help."""

from __future__ import annotations

import importlib
import sys
from typing import Optional

COMMANDS = ("allreduce", "moe", "p2p", "rmsnorm", "nodes")


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and not argv[0].startswith("-") else "allreduce"
    if command not in COMMANDS:
        print(f"unknown subcommand {command!r}: use {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    bench = importlib.import_module(f"{__package__}.{command}")
    return bench.run(bench.parser().parse_args(argv)) or 0


if __name__ == "__main__":
    sys.exit(main())
