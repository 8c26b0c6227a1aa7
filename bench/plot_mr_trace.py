#!/usr/bin/env python3
"""Plot docs/mr-trace.csv (written by `cargo bench --bench mr_trace`) into
docs/mr-trace.png: hit ratio against cache size, one panel per trace, MRE and
LRU. Needs matplotlib (`pip install matplotlib`); CI does not run this.

usage: python3 bench/plot_mr_trace.py [CSV] [PNG]
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = [
    ("httpd", "size-diverse (HTTPD-like)"),
    ("uniform", "uniform (same size, uniform popularity)"),
]
POLICIES = [("LRU", "tab:blue", "o"), ("MRE", "tab:red", "s")]


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "mr-trace.csv")
    dst = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "docs", "mr-trace.png")
    with open(src, newline="") as f:
        rows = list(csv.DictReader(f))

    fig, axes = plt.subplots(1, len(TRACES), figsize=(11, 4.2))
    for ax, (trace, title) in zip(axes, TRACES):
        for policy, color, marker in POLICIES:
            pts = sorted(
                (int(r["cache_pages"]), 100.0 * float(r["hit_ratio"]))
                for r in rows
                if r["trace"] == trace and r["policy"] == policy
            )
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, color=color, marker=marker, label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache size (4 KiB pages)")
        ax.set_ylabel("hit ratio (%)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("Registration cache: MRE vs LRU (bench/mr_trace.rs)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
