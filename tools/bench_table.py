"""Turn a p2pcomm.bench CSV into the compact markdown table of docs/BENCHMARKS.md:
one row per size, the baseline's latency, and p2pcomm's best (symmetric and
staged) with its algorithm and speedup. Usage: bench_table.py FILE.csv [graph]"""

import csv
import io
import sys


def main(path, mode="eager"):
    lines = [line for line in open(path) if not line.startswith("#")]
    rows = list(csv.DictReader(io.StringIO("".join(lines))))
    sizes = sorted({int(r["size_bytes"]) for r in rows})

    def best(size, impl, algo=None):
        cand = [r for r in rows if int(r["size_bytes"]) == size and r["impl"] == impl and r["mode"] == mode
                and r["status"] == "ok" and r["latency_us"] and (algo is None or r["algorithm"] == algo)]
        return min(cand, key=lambda r: float(r["latency_us"])) if cand else None

    impls = sorted({r["impl"] for r in rows})
    base = "nccl" if "nccl" in impls else "gloo"
    others = [i for i in ("torch-symm",) if i in impls]
    head = (["size", f"{base} µs"] + [f"{o} best µs" for o in others]
            + ["p2pcomm auto µs", "vs " + base, "staged auto µs", "vs " + base, "p2pcomm best µs (algo)", "busBW GB/s"])
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for s in sizes:
        b = best(s, base)
        p = best(s, "p2pcomm", "auto")
        st = best(s, "p2pcomm-staged", "auto")
        top = best(s, "p2pcomm")
        if not (b and p):
            continue
        label = f"{s >> 20} MiB" if s >= 1 << 20 else f"{s >> 10} KiB"
        cells = [label, f"{float(b['latency_us']):.1f}"]
        for o in others:
            r = best(s, o)
            cells.append(f"{float(r['latency_us']):.1f}" if r else "n/a")
        bl = float(b["latency_us"])
        cells += [f"{float(p['latency_us']):.1f}", f"{bl / float(p['latency_us']):.2f}x"]
        cells += [f"{float(st['latency_us']):.1f}", f"{bl / float(st['latency_us']):.2f}x"] if st else ["n/a", ""]
        cells += [f"{float(top['latency_us']):.1f} ({top['algorithm']})", f"{float(top['busbw_gbps']):.0f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(*sys.argv[1:])
