"""Merge the proxy traces of one host's ranks into one timeline (a diagnostic).

    P2PCOMM_PROXY_TRACE=/tmp/tr torchrun --nproc_per_node=2 -m p2pcomm.bench nodes --device cuda --local-size 1 --sizes 4K
    python tools/proxy_timeline.py /tmp/tr [EVENTS]

Each process that ran a proxy writes PREFIX.<pid> as its services close: wall-clock nanoseconds of each trigger
popped (p), its put and its signal handed to the transport (u, s) and finished (d), with its FIFO, position, type
bits (1 put, 2 signal, 4 flush), channel and bytes,
and the moments the library marked (m: a launch of the all-reduce across nodes, UCX progress that found
something arriving or completing, a staged entry taken in, the staged copies' completion advancing; for MoE
across nodes, the host's work of a call on the caller's thread or in a host function, and each barrier).
ExpertParallel writes its process's file as it closes too. This prints the last
EVENTS (default 80) before the last launch's calls ended, in µs from the first shown, with the gap to the
previous event and the file (r0, r1, ... in pid order) each came from.
"""
import glob
import sys


def main(prefix: str, count: int) -> None:
    files = sorted(glob.glob(prefix + ".*"), key=lambda f: int(f.rsplit(".", 1)[1]))
    if not files:
        sys.exit(f"no {prefix}.<pid> files: run with P2PCOMM_PROXY_TRACE={prefix}")
    events = []
    for i, name in enumerate(files):
        with open(name) as f:
            for line in f:
                ns, rest = line.split(" ", 1)
                events.append((int(ns), i, rest.strip()))
    events.sort()
    launches = [ns for ns, _, what in events if what == "m launch"]
    if launches:  # the traced calls, not whatever the process did after them
        end = launches[-1] + 2_000_000
        events = [e for e in events if e[0] <= end]
    shown = events[-count:]
    first = prev = shown[0][0]
    for ns, i, what in shown:
        print(f"{(ns - first) / 1e3:10.1f} +{(ns - prev) / 1e3:8.1f}  r{i}  {what}")
        prev = ns


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 80)
