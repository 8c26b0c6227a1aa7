#!/usr/bin/env python3
"""Overhead of LD_PRELOAD=libkrcore.so on perftest, from integration-suite results.

    bench/overhead.py target/integration/results.json [more results.json ...]

Prints a Markdown table of preloaded/baseline ratios measured side by side in
one VM boot (absolute numbers across runs mean nothing under emulation):
t_typical (median latency) for the 2-byte latency tests, target <= 1.03, and
average bandwidth for the 64 KiB bandwidth tests, target >= 0.99. Other
perftest cases are listed for information. With several files (repeats), each
ratio is the median of the per-file ratios, and the spread is shown.
--strict exits 1 if a target is missed.
"""
import argparse
import json
import math
import statistics
import sys

LAT_MAX, BW_MIN = 1.03, 0.99


def collect(paths):
    """case -> {"kind", "size", "metric", "pairs": [(baseline, preloaded), ...]}"""
    rows = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for name, c in doc.get("cases", {}).items():
            if c.get("group") not in ("perftest", "virtualized") or c.get("kind") not in ("lat", "bw"):
                continue
            metric = "t_typical_us" if c["kind"] == "lat" else "bw_avg_MBps"
            b = (c.get("baseline") or {}).get("figures") or {}
            p = (c.get("preloaded") or c.get("virtualized") or {}).get("figures") or {}
            row = rows.setdefault(name, {"kind": c["kind"], "size": c.get("size"),
                                         "metric": metric, "pairs": [],
                                         "virtual": c.get("group") == "virtualized"})
            ok = lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v > 0
            if ok(b.get(metric)) and ok(p.get(metric)):
                row["pairs"].append((b[metric], p[metric]))
    return rows


def target(row):
    # The pass-through targets; the virtual path (KRCORE_VIRTUALIZE) has
    # none: its ratios are reported as measured.
    if row.get("virtual"):
        return "-", None
    if row["kind"] == "lat" and row["size"] == 2:
        return "<= %.2f" % LAT_MAX, lambda r: r <= LAT_MAX
    if row["kind"] == "bw" and row["size"] == 65536:
        return ">= %.2f" % BW_MIN, lambda r: r >= BW_MIN
    return "-", None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="results.json written by tests/integration/suite.py")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    a = ap.parse_args()
    rows = collect(a.results)
    if not rows:
        print("no perftest cases in the given results", file=sys.stderr)
        return 2
    unit = {"t_typical_us": "t_typical us", "bw_avg_MBps": "BW avg MB/s"}
    print(f"Overhead of libkrcore.so under perftest ({len(a.results)} run(s); "
          "ratio = preloaded / baseline, median over runs)\n")
    print("| case | bytes | metric | baseline | preloaded | ratio | spread | target | result |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- | --- | --- |")
    missed = passed = 0
    # Target rows first (latency, then bandwidth), information rows after.
    order = sorted(rows.items(), key=lambda kv: (target(kv[1])[1] is None,
                                                 kv[1]["kind"] != "lat", kv[0]))
    for name, row in order:
        tgt, ok = target(row)
        pairs = row["pairs"]
        if not pairs:
            print(f"| {name} | {row['size']} | {unit[row['metric']]} | - | - | - | - | {tgt} | "
                  f"{'no data' if ok else 'info'} |")
            missed += ok is not None
            continue
        ratios = [p / b for b, p in pairs]
        r = statistics.median(ratios)
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}" if len(ratios) > 1 else "-"
        b = statistics.median(x for x, _ in pairs)
        p = statistics.median(y for _, y in pairs)
        verdict = "info" if ok is None else ("pass" if ok(r) else "MISS")
        if ok is not None:
            missed += verdict == "MISS"
            passed += verdict == "pass"
        print(f"| {name} | {row['size']} | {unit[row['metric']]} | {b:.2f} | {p:.2f} | "
              f"{r:.3f} | {spread} | {tgt} | {verdict} |")
    print(f"\n{passed} within target, {missed} missed (targets: latency ratio <= {LAT_MAX}, "
          f"bandwidth ratio >= {BW_MIN}; emulated rxe is noisy: repeat before trusting a miss)")
    return 1 if a.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
