#!/usr/bin/env python3
"""The tables of bench/vqp-scale.sh: physical QPs and memory for N
application RC QPs, transparent VQPs against plain RC QPs.

    python3 bench/vqp_scale_report.py OUT_DIR REPEATS "SIZES" "MODES"

Reads OUT_DIR/MODE-N-R.txt (the `scale`, `scale_qps` and `scale_kern`
lines of bench/vqp_scale.c; MODE-N-R.txt.rc holds the exit status) and
prints markdown: each figure the median over the repeats (min-max when
there are several), the ratios virt/plain computed per repeat (same VM
boot) and summarised the same way, and the cost of one more application
QP between the smallest and the largest N.
"""
import statistics as st
import sys
from pathlib import Path

from kvlines import parse


def load(path):
    """{'node1': scale line, 'node2': ..., 'qps': {who: line}, 'kern': line}
    or None when the run is missing or failed."""
    if not path.exists():
        return None
    rc = path.with_name(path.name + ".rc")
    if rc.exists() and rc.read_text().strip() not in ("", "0"):
        return None
    d = {"qps": {}}
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("scale "):
            v = parse(line)
            d[f"node{int(v['node'])}"] = v
        elif line.startswith("scale_qps "):
            v = parse(line)
            d["qps"][v["who"]] = v
        elif line.startswith("scale_kern "):
            d["kern"] = parse(line)
    if not all(k in d for k in ("node1", "node2", "kern")) or "node1" not in d["qps"]:
        return None
    return d


def fig(d, what):
    """One figure of a run."""
    if what == "qps1":
        return d["qps"]["node1"]["qps"]
    if what == "qps2":
        return d["qps"]["node2"]["qps"]
    if what == "lib1":
        return d["qps"]["node1"]["lib"]
    if what == "meta":
        return d["qps"]["meta"]["qps"]
    if what == "rss1":
        return d["node1"]["rss_delta_B"]
    if what == "rss2":
        return d["node2"]["rss_delta_B"]
    if what == "virt1":
        return d["node1"]["virt_delta_B"]
    if what == "kern":
        return d["kern"]["kern_delta_B"]
    if what == "free":
        return -d["kern"]["memfree_delta_B"]
    if what == "time":
        return max(d["node1"]["total_us"], d["node2"]["total_us"]) / 1e3
    if what == "vqps":
        return d["node1"]["app_qps_virtual"]
    if what == "links":
        return d["node1"]["stat_links"]
    raise KeyError(what)


def summary(v, fmt):
    v = [x for x in v if isinstance(x, float)]
    if not v:
        return "–"
    m = fmt(st.median(v))
    if len(v) == 1 or min(v) == max(v):
        return m
    return f"{m} ({fmt(min(v))} – {fmt(max(v))})"


def kib(x):
    return f"{x / 1024:,.0f}"


def mib(x):
    return f"{x / 1048576:,.1f}"


def plain_num(x):
    return f"{x:,.0f}"


def ms(x):
    return f"{x:,.0f}"


def ratio(x):
    return f"{x:.2f}x"


def main():
    out = Path(sys.argv[1])
    repeats = int(sys.argv[2])
    sizes = [int(s) for s in sys.argv[3].split()]
    modes = sys.argv[4].split()
    runs = {(m, n): [load(out / f"{m}-{n}-{i}.txt") for i in range(1, repeats + 1)]
            for m in modes for n in sizes}

    print(f"Figures: median over {repeats} repeat(s) (min – max when they differ). "
          "Kernel QPs: `rdma resource show qp` lines whose creating thread belongs "
          "to the process, the library's own QPs included, all N connected. "
          "RSS and mapped (VmSize): the node-1 process, after connecting minus "
          "before creating the QPs (device, PD, CQ and buffers already there). "
          "Kernel memory: machine-wide VmallocUsed + SUnreclaim delta over the "
          "same span (both processes and krcore-meta). Time: create + INIT + "
          "exchange + RTR/RTS + one checked SEND each way on every QP, the "
          "slower process.\n")
    print("| N | mode | kernel QPs node 1 | kernel QPs node 2 | of which the library's (node 1) "
          "| krcore-meta's QPs | links (node 1) | RSS Δ node 1, KiB | RSS Δ node 2, KiB "
          "| mapped Δ node 1, KiB | kernel mem Δ (machine), KiB | time, ms | runs ok |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    notes = []
    for n in sizes:
        for m in modes:
            ok = [d for d in runs[(m, n)] if d]
            if not ok:
                print(f"| {n} | {m} | – | – | – | – | – | – | – | – | – | – | 0 of {repeats} |")
                continue
            for d in ok:
                virt = d["node1"]["app_qps_virtual"]
                if virt not in (0, n) or (virt == n) != m.startswith("virt"):
                    notes.append(f"{m} N={n}: {virt:.0f} of {n} application QPNs virtual")
            links = [fig(d, "links") for d in ok if fig(d, "links") >= 0]
            cells = [
                summary([fig(d, "qps1") for d in ok], plain_num),
                summary([fig(d, "qps2") for d in ok], plain_num),
                summary([fig(d, "lib1") for d in ok], plain_num),
                summary([fig(d, "meta") for d in ok], plain_num),
                summary(links, plain_num) if links else "–",
                summary([fig(d, "rss1") for d in ok], kib),
                summary([fig(d, "rss2") for d in ok], kib),
                summary([fig(d, "virt1") for d in ok], kib),
                summary([fig(d, "kern") for d in ok], kib),
                summary([fig(d, "time") for d in ok], ms),
            ]
            print(f"| {n} | {m} | " + " | ".join(cells) + f" | {len(ok)} of {repeats} |")
    if notes:
        print("\nUnexpected: " + "; ".join(notes) + ".")

    for vm in [m for m in modes if m.startswith("virt")]:
        if "plain" not in modes:
            break
        print(f"\n{vm} / plain, per repeat (same boot), median (min – max):\n")
        print("| N | kernel QPs node 1 | kernel QPs node 2 | RSS Δ node 1 | mapped Δ node 1 "
              "| kernel mem Δ | time |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for n in sizes:
            pairs = [(v, p) for v, p in zip(runs[(vm, n)], runs[("plain", n)]) if v and p]
            cells = []
            for what in ("qps1", "qps2", "rss1", "virt1", "kern", "time"):
                r = [fig(v, what) / fig(p, what) for v, p in pairs if fig(p, what) > 0]
                cells.append(summary(r, ratio) if r else "– (plain: 0)")
            print(f"| {n} | " + " | ".join(cells) + " |")

    print("\nWhere the time and the resident memory go (node 1; ms, KiB; median):\n")
    print("| N | mode | create + INIT | exchange | RTR + RTS | messages | teardown (untimed above) "
          "| RssAnon Δ | RssFile Δ | RssShmem Δ |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in sizes:
        for m in modes:
            ok = [d for d in runs[(m, n)] if d]
            if not ok:
                continue
            cells = [summary([d["node1"][k] / 1e3 for d in ok], ms)
                     for k in ("create_us", "exchange_us", "connect_us", "msgs_us", "teardown_us")]
            cells += [summary([d["node1"].get(k, "–") for d in ok], kib)
                      for k in ("anon_delta_B", "file_delta_B", "shmem_delta_B")]
            print(f"| {n} | {m} | " + " | ".join(cells) + " |")

    if len(sizes) >= 2:
        lo, hi = min(sizes), max(sizes)
        print(f"\nOne more application QP (node 1; (figure at N={hi} − figure at N={lo}) / "
              f"{hi - lo}, per repeat, median), bytes:\n")
        print("| mode | kernel QPs per app QP | RSS | mapped | kernel mem (machine: both ends) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for m in modes:
            pairs = [(a, b) for a, b in zip(runs[(m, hi)], runs[(m, lo)]) if a and b]
            cells = []
            for what, f in (("qps1", lambda x: f"{x:.3f}"), ("rss1", plain_num),
                            ("virt1", plain_num), ("kern", plain_num)):
                cells.append(summary([(fig(a, what) - fig(b, what)) / (hi - lo)
                                      for a, b in pairs], f))
            print(f"| {m} | " + " | ".join(cells) + " |")

    metas = sorted({fig(d, "meta") for rs in runs.values() for d in rs if d})
    others = sorted({(d["qps"]["kernel"]["qps"], d["qps"]["other-user"]["qps"])
                     for rs in runs.values() for d in rs if d})
    print(f"\nkrcore-meta's own kernel QPs during the runs: {', '.join(f'{x:.0f}' for x in metas)}; "
          "(kernel-owned, other user) QPs: "
          + ", ".join(f"({a:.0f}, {b:.0f})" for a, b in others) + ".")


if __name__ == "__main__":
    main()
