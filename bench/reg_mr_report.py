#!/usr/bin/env python3
"""The table of bench/reg-mr-compare.sh.

    python3 bench/reg_mr_report.py OUTDIR REPEATS

Reads OUTDIR/{plain,miss,hit,off}-N.txt (bench/reg_mr output, N = 1..REPEATS),
OUTDIR/order.txt and OUTDIR/strace-hit.txt / strace-hit-out.txt when present,
and prints Markdown on stdout:

- per size, the median over repeats of each run's median us per
  ibv_reg_mr + ibv_dereg_mr pair, per configuration;
- miss/plain, hit/plain and off/plain computed per repeat (each run against
  the plain run of the same repeat), with their median and min-max over the
  repeats. Whatever the distribution, the median of the per-repeat ratio lies
  between the smallest and largest of R independent repeats with probability
  1 - 2^(1-R) (94 % for 5, 98 % for 7): the verdicts below use that interval;
- whether every timed pair was what its configuration says (hits, misses and
  evictions from krcore's counters);
- the calling thread's system calls during the hit pairs run under strace;
- the least-squares fit T = a*pages + b of real registrations.
"""
import re
import statistics as st
import sys
from collections import Counter
from pathlib import Path

CONFIGS = ("plain", "miss", "hit", "off")
NAMES = {
    "plain": "plain libibverbs",
    "miss": "krcore, miss",
    "hit": "krcore, hit",
    "off": "krcore, cache off",
}
MISS_TARGET = 1.1


def human(n):
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"


def parse_run(path):
    """(header key=value dict, {size: row dict}) of one reg_mr output."""
    header, cols, rows = {}, None, {}
    for line in path.read_text().splitlines():
        if line.startswith("# reg_mr "):
            header = dict(kv.split("=", 1) for kv in line[2:].split() if "=" in kv)
        elif line.startswith("# size "):
            cols = line[2:].split()
        elif line.strip() and not line.startswith("#"):
            if cols is None:
                raise SystemExit(f"{path}: data before the column header")
            row = {k: float(x) for k, x in zip(cols, line.split())}
            rows[int(row["size"])] = row
    return header, rows


def us(header, key):
    v = header.get(key, "")
    return float(v[:-2]) if v.endswith("us") else None


def spread(vals):
    """'median (min-max)' of per-repeat values."""
    if not vals:
        return "-"
    m = st.median(vals)
    if len(vals) == 1:
        return fmt(m)
    return f"{fmt(m)} ({fmt(min(vals))}–{fmt(max(vals))})"


def fmt(x):
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 0.1:
        return f"{x:.3f}"
    return f"{x:.4f}"


def syscalls(trace, out):
    """Per size: (pairs, calling-thread syscall Counter, other-thread Counter,
    hits, misses) of the strace run of the hit configuration."""
    line_re = re.compile(r"^(?:\[pid\s+)?(\d+)\]?\s+(.*)$")
    mark_re = re.compile(r'write\(2, "reg_mr-mark (begin|end) (\d+) (\d+)\\n"')
    result, cur, main = {}, None, None
    for raw in trace.read_text(errors="replace").splitlines():
        m = line_re.match(raw)
        pid, rest = (int(m.group(1)), m.group(2)) if m else (None, raw)
        mk = mark_re.search(rest)
        if mk:
            what, size, pairs = mk.group(1), int(mk.group(2)), int(mk.group(3))
            if what == "begin":
                main = pid
                cur = result.setdefault(size, [pairs, Counter(), Counter(), None, None])
            else:
                cur = None
            continue
        if cur is None or rest.startswith(("+++", "<...")):
            continue
        name = "signal " + rest.split()[1] if rest.startswith("---") else rest.split("(", 1)[0]
        (cur[1] if pid == main else cur[2])[name] += 1
    if out.exists():
        _, rows = parse_run(out)
        for size, r in rows.items():
            if size in result:
                result[size][3], result[size][4] = int(r["hits"]), int(r["misses"])
    return result


def main():
    out, repeats = Path(sys.argv[1]), int(sys.argv[2])
    runs = {}  # cfg -> repeat -> {size: row}
    headers = {}
    for cfg in CONFIGS:
        for i in range(1, repeats + 1):
            p = out / f"{cfg}-{i}.txt"
            if p.exists():
                h, rows = parse_run(p)
                headers.setdefault(cfg, []).append(h)
                runs.setdefault(cfg, {})[i] = rows
    if "plain" not in runs:
        raise SystemExit(f"no plain runs in {out}")
    cfgs = [c for c in CONFIGS if c in runs]
    sizes = sorted(set.intersection(*(set(r) for c in cfgs for r in runs[c].values())))

    def per_repeat(cfg, size, key="pair_med_us"):
        return [runs[cfg][i][size][key] for i in sorted(runs[cfg]) if size in runs[cfg][i]]

    def med(cfg, size, key="pair_med_us"):
        return st.median(per_repeat(cfg, size, key))

    def ratios(cfg, size):
        return [runs[cfg][i][size]["pair_med_us"] / runs["plain"][i][size]["pair_med_us"]
                for i in sorted(runs[cfg]) if i in runs["plain"]]

    n_rep = len(runs["plain"])
    conf = 1 - 2 ** (1 - n_rep) if n_rep > 1 else 0
    allh = [h for hs in headers.values() for h in hs]
    clock = [us(h, "clock_gettime") for h in allh if us(h, "clock_gettime") is not None]
    timer = [us(h, "timer_cost") for h in allh if us(h, "timer_cost") is not None]
    h0 = allh[0]
    pairs = int(runs["plain"][min(runs["plain"])][sizes[0]]["pairs"])
    print(f"`ibv_reg_mr` + `ibv_dereg_mr`, us per pair. {n_rep} repeat(s) in one boot, "
          f"each repeat one run per configuration in a rotating order; a run does, per size, "
          f"{pairs} timed pairs cycling through a pool of distinct pre-faulted buffers "
          f"(the same sequence in every configuration) and reports their median; the table "
          f"gives the median of those over the repeats. Ratios are computed per repeat "
          f"against that repeat's plain run: median (min–max over repeats)"
          + (f"; the median ratio lies within min–max with {conf:.0%} confidence." if n_rep > 1 else ".")
          + f"\nTimer: {h0.get('timer', '?')} (cost {st.median(timer) if timer else float('nan'):.3f} us per read; "
          f"clock_gettime here {st.median(clock) if clock else float('nan'):.2f} us). Access {h0.get('access', '?')}.\n")
    order = out / "order.txt"
    if order.exists():
        print("Order per repeat: " + "; ".join(
            " ".join(l.split()[1:]) for l in order.read_text().splitlines() if l.strip()) + "\n")

    head = ["size", "pages", "pool"] + [NAMES[c] for c in cfgs]
    align = ["---:"] * len(head)
    for c in ("miss", "hit", "off"):
        if c in cfgs:
            head.append(f"{c}/plain")
            align.append("---:")
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join(align) + " |")
    for s in sizes:
        r0 = runs["plain"][min(runs["plain"])][s]
        cells = [human(s), str(int(r0["pages"])), str(int(r0["pool"]))]
        cells += [fmt(med(c, s)) for c in cfgs]
        cells += [spread(ratios(c, s)) for c in ("miss", "hit", "off") if c in cfgs]
        print("| " + " | ".join(cells) + " |")

    # Each run's pairs were what the configuration says.
    problems = []
    expect = {
        "hit": lambda r: r["hits"] == r["pairs"] and r["misses"] == 0,
        "miss": lambda r: r["misses"] == r["pairs"] and r["hits"] == 0 and r["evictions"] == r["pairs"],
        "off": lambda r: r["hits"] <= 0 and r["misses"] <= 0,
        "plain": lambda r: r["hits"] == -1,
    }
    for c in cfgs:
        for i, rows in sorted(runs[c].items()):
            for s, r in sorted(rows.items()):
                if not expect[c](r):
                    problems.append(f"{c}-{i} at {human(s)}: hits {int(r['hits'])}, misses "
                                    f"{int(r['misses'])}, evictions {int(r['evictions'])} "
                                    f"in {int(r['pairs'])} pairs")
        modes = {int(r["mode"]) for rows in runs[c].values() for r in rows.values()}
        if c in ("hit", "miss") and modes != {1}:
            problems.append(f"{c}: mr_cache_mode {sorted(modes)}, not 1 (caching)")
    if problems:
        print("\nWARNING: timed pairs that were not what their configuration says:\n")
        for p in problems:
            print(f"- {p}")
    else:
        checked = [c for c in ("miss", "hit") if c in cfgs]
        if checked:
            print("\nChecked from krcore's counters in every run: "
                  + ("every miss pair was a miss with one eviction (a real deregistration)"
                     if "miss" in checked else "")
                  + ("; " if len(checked) == 2 else "")
                  + ("every hit pair was a hit" if "hit" in checked else "") + ".")

    print("\nMedian us of the registration and the deregistration alone, and the mean pair "
          "(median over repeats):\n")
    print("| size | " + " | ".join(f"{c}: reg | {c}: dereg | {c}: mean pair" for c in cfgs) + " |")
    print("| ---: | " + " | ".join("---: | ---: | ---:" for _ in cfgs) + " |")
    for s in sizes:
        print(f"| {human(s)} | " + " | ".join(
            f"{fmt(med(c, s, 'reg_med_us'))} | {fmt(med(c, s, 'dereg_med_us'))} | "
            f"{fmt(med(c, s, 'pair_mean_us'))}" for c in cfgs) + " |")

    print()
    if "miss" in cfgs:
        print(f"Target: a miss costs at most {MISS_TARGET}x a plain registration of the same size "
              f"(verdict from the min–max of the per-repeat ratios, {n_rep} repeat(s)):\n")
        for s in sizes:
            rs = ratios("miss", s)
            lo, hi = min(rs), max(rs)
            if n_rep < 2:
                verdict = "one repeat: no spread, no verdict"
            elif hi <= MISS_TARGET:
                verdict = "met"
            elif lo > MISS_TARGET:
                verdict = "NOT MET"
            else:
                verdict = f"undecided (the spread straddles {MISS_TARGET})"
            print(f"- {human(s)}: miss/plain {spread(rs)}: {verdict}")
        print()
    one = 1 << 20
    if "hit" in cfgs and one in sizes:
        rs = ratios("hit", one)
        inv = [1 / r for r in rs]
        print(f"1 MiB: hit/plain {spread(rs)}, i.e. a hit is {spread(inv)}x cheaper than a plain "
              f"libibverbs registration of pre-faulted memory"
              + (f"; against krcore with the cache off: {spread([o / h for o, h in zip(per_repeat('off', one), per_repeat('hit', one))])}x"
                 if "off" in cfgs else "") + ".")

    for prefix, how in (("inter", "evicted regions deregistered by the background thread in batches, the default"),
                        ("inter0", "KRCORE_MR_DEREG_BATCH=0: the eviction's deregistration on the calling thread")):
        inter = {}  # size -> [(plain, krcore, ratio of medians, median step ratio, misses, evictions, pairs)]
        for i in range(1, repeats + 1):
            p = out / f"{prefix}-{i}.txt"
            for line in (p.read_text().splitlines() if p.exists() else []):
                f = line.split()
                if f and f[0] == "I":
                    inter.setdefault(int(f[1]), []).append(
                        (float(f[5]), float(f[6]), float(f[7]), float(f[8]), int(f[10]), int(f[11]), int(f[4])))
        if not inter:
            continue
        print()
        print(f"Miss vs plain side by side in one process ({how}; reg_mr -I: each step one plain libibverbs "
              "pair on the real PD and one krcore pair, a miss with one eviction, on krcore's PD, same buffer, "
              "order alternating), us per pair, median over repeats; ratios per repeat: median (min–max):")
        print()
        print("| size | plain libibverbs | krcore, miss | miss/plain (ratio of medians) | median of per-step ratios | target 1.1x |")
        print("| ---: | ---: | ---: | ---: | ---: | --- |")
        for size in sorted(inter):
            rows = inter[size]
            bad = [r for r in rows if r[4] != r[6] or r[5] != r[6]]
            ratios_ = [r[2] for r in rows]
            verdict = "met" if max(ratios_) <= 1.1 else "NOT MET" if min(ratios_) > 1.1 else "undecided"
            print(f"| {human(size)} | {fmt(st.median(r[0] for r in rows))} | "
                  f"{fmt(st.median(r[1] for r in rows))} | {spread(ratios_)} | "
                  f"{spread([r[3] for r in rows])} | {verdict}"
                  + (" (WARNING: not every krcore pair was a miss with one eviction)" if bad else "") + " |")

    trace = out / "strace-hit.txt"
    if trace.exists():
        res = syscalls(trace, out / "strace-hit-out.txt")
        print()
        if not res:
            print("WARNING: strace-hit.txt has no reg_mr markers: no system-call count.")
        for s, (n, mine, other, hits, misses) in sorted(res.items()):
            k = sum(mine.values())
            what = (" (" + ", ".join(f"{name} {c}" for name, c in mine.most_common()) + ")") if k else ""
            hit_note = (f"; {hits}/{n} were hits" if hits is not None else "")
            if hits is not None and hits != n:
                hit_note += " — WARNING: not all hits"
            oth = sum(other.values())
            print(f"syscalls in {n} hit pairs at {human(s)}: {k}{what} (the calling thread, under "
                  f"strace -f{hit_note}); other threads meanwhile: {oth}"
                  + (" (" + ", ".join(f"{name} {c}" for name, c in other.most_common()) + ")" if oth else ""))

    real = [c for c in ("plain", "off", "miss") if c in cfgs]
    if len(sizes) >= 2 and real:
        def fit(cfg, key, relative=False):
            """Least squares T = a*pages + b over the sizes; relative=True weighs
            each size by 1/T^2 (minimises relative errors, so small sizes count)."""
            xs = [runs["plain"][min(runs["plain"])][s]["pages"] for s in sizes]
            ys = [med(cfg, s, key) for s in sizes]
            ws = [1 / y ** 2 if relative else 1.0 for y in ys]
            sw = sum(ws)
            mx = sum(w * x for w, x in zip(ws, xs)) / sw
            my = sum(w * y for w, y in zip(ws, ys)) / sw
            a = (sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys))
                 / sum(w * (x - mx) ** 2 for w, x in zip(ws, xs)))
            b = my - a * mx
            worst = max(abs(a * x + b - y) / y for x, y in zip(xs, ys))
            return a, b, worst

        print("\nFit over the sizes, T = a*pages + b (us), real registrations "
              "(least squares; 'relative': weighted by 1/T^2):\n")
        print("| what | a (us/page) | b (us) | worst relative residual | relative: a | b | worst |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for cfg in real:
            for key, what in (("reg_med_us", "ibv_reg_mr"), ("dereg_med_us", "ibv_dereg_mr"),
                              ("pair_med_us", "reg + dereg")):
                a, b, w = fit(cfg, key)
                ra, rb, rw = fit(cfg, key, relative=True)
                print(f"| {NAMES[cfg]}: {what} | {a:.4f} | {b:.1f} | {w:.0%} | {ra:.4f} | {rb:.1f} | {rw:.0%} |")
        a, b, _ = fit("plain", "reg_med_us")
        print(f"\nFor the trace simulation (least-squares ibv_reg_mr cost of plain libibverbs here):\n"
              f"    KRCORE_REG_A_US={a:.4f} KRCORE_REG_B_US={b:.1f} cargo bench --bench mr_trace")


if __name__ == "__main__":
    main()
