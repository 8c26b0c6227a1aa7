#!/usr/bin/env python3
"""The table of bench/elastic-compare.sh: elastic bootstrap and serverless
fetch, raw verbs vs krcore (and krcore + agent when it ran).

    python3 bench/elastic_report.py OUT_DIR REPEATS

Reads, for each repeat R, mode M (raw, krcore, agent) and N, the summary
line "burst ..." of OUT_DIR/burst-M-nN-R.txt and "serial ..." of
OUT_DIR/serverless-M-R.txt (bench/elastic_launch.c prints them) and prints
markdown: each figure as the median over the repeats with its min-max, and
the ratios computed per repeat (raw and krcore of the same repeat, in the
same VM boot), summarised the same way. A run that failed (no summary
line) shows as "failed" and is left out of the medians.
"""
import json
import re
import statistics as st
import sys
from pathlib import Path

from kvlines import last_line

MODES = [("raw", "raw verbs"), ("krcore", "krcore"), ("agent", "krcore + agent"),
         ("agent-b", "krcore + agent, library B")]
ALL_SERVED_TARGET = 5.0  # issue 21: at N = 32, all served >= 5x sooner than raw


def spread(v, fmt="{:.1f}"):
    if not v:
        return "failed | –"
    return f"{fmt.format(st.median(v))} | {fmt.format(min(v))} – {fmt.format(max(v))}"


def ratio_cell(v):
    if not v:
        return "– | –"
    return f"{st.median(v):.2f}x | {min(v):.2f}x – {max(v):.2f}x"


def tier_wrs(d):
    """The work requests each client of a burst posted on the datagram
    tier (its counters at exit, dgram_wrs), median over the clients; None
    without stats."""
    v = []
    for f in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            c = json.loads(f.read_text()).get("counters", {})
        except (OSError, ValueError):
            continue
        if "dgram_wrs" in c:
            v.append(c["dgram_wrs"])
    return st.median(v) if v else None


def meta_failures(d):
    """Failed connections to the meta server, summed over a burst's
    clients (their counters at exit, meta_connect_failures); None without
    stats."""
    tot, seen = 0, False
    for f in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            c = json.loads(f.read_text()).get("counters", {})
        except (OSError, ValueError):
            continue
        seen = True
        tot += c.get("meta_connect_failures", 0)
    return tot if seen else None


def main():
    out, repeats = Path(sys.argv[1]), int(sys.argv[2])
    ns = sorted({int(m.group(1)) for p in out.glob("burst-*-n*-*.txt")
                 if (m := re.match(r"burst-\w+-n(\d+)-\d+\.txt", p.name))})
    present = [(m, label) for m, label in MODES
               if any(out.glob(f"burst-{m}-n*-*.txt")) or any(out.glob(f"serverless-{m}-*.txt"))]
    burst = {}  # (mode, n) -> [summary or None per repeat]
    for m, _ in present:
        for n in ns:
            burst[m, n] = [last_line(out / f"burst-{m}-n{n}-{r}.txt", "burst ")
                           for r in range(1, repeats + 1)]
    serial = {m: [last_line(out / f"serverless-{m}-{r}.txt", "serial ")
                  for r in range(1, repeats + 1)] for m, _ in present}

    lib = out / "lib.txt"
    params = ""
    if lib.exists():
        for line in lib.read_text().splitlines():
            if line.startswith("NS="):
                params = line
    print(f"## Elastic bootstrap and serverless fetch: raw verbs vs krcore "
          f"({repeats} repeat(s) in one VM boot, modes alternating)\n")
    if "agent" not in [m for m, _ in present]:
        print("The \"krcore + agent\" mode did not run (no `krcore-node` in the library "
              "snapshot).\n")
    if params:
        print(f"Parameters: `{params}`.\n")
    print("**Elastic bootstrap** (paper §5.3.1): N new `kv_client` processes started "
          "at once against a running `kv_server` with a loaded table (forked first, each "
          "waiting before its `exec`, then all released at one instant, their start). "
          "*first GET*: the start to a process's first GET (one READ of a bucket) "
          "completed and checked, median and max over the N; *all served*: the "
          "start to the last process's first GET; *GETs/s*: all N together after every "
          "one was served (each then does the same number of checked GETs; from the go to "
          "the last one's end). Each figure: median over the repeats | min – max.\n")
    print("| N | mode | first GET, median (ms) | min – max | first GET, max (ms) | min – max "
          "| all served (ms) | min – max | GETs/s | min – max | start → connected, median (ms) | min – max |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in ns:
        for m, label in present:
            rows = [r for r in burst[m, n] if r]
            nfail = repeats - len(rows)
            tag = f"{label}" + (f" ({nfail} failed)" if nfail else "")
            print(f"| {n} | {tag} | {spread([r['first_med_ms'] for r in rows])} "
                  f"| {spread([r['first_max_ms'] for r in rows])} "
                  f"| {spread([r['all_served_ms'] for r in rows])} "
                  f"| {spread([r['get_ops_s'] for r in rows], '{:.0f}')} "
                  f"| {spread([r['connected_med_ms'] for r in rows])} |")
    print()

    print("Where the first GET's time goes: medians over the N processes of the instant "
          "each reached, from its start (ms; then the median over the repeats). *main*: "
          "loader and constructors; *set-up*: device, PD, CQ, MR; *path*: raw, the server's "
          "QP address received over TCP (the server created and connected a QP for it), "
          "krcore, `qconnect` returned; *connected*: raw, RTR + RTS done, krcore, the "
          "HELLO's answer (the table's address) received; *first GET*: its READ done. "
          "*tier*: krcore, the work requests a client posted on the datagram tier before its "
          "link was up (its counters at exit; median over the clients, then over the "
          "repeats; of the HELLO, the first GET and the GETs after the go). *meta failures*: "
          "krcore, connections to krcore-meta that failed (timed out) and were tried again, "
          "summed over the N clients, per repeat (failed runs included).\n")
    print("| N | mode | main | set-up | path | connected | first GET | tier | meta failures |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in ns:
        for m, label in present:
            rows = [r for r in burst[m, n] if r]
            med = lambda k: f"{st.median([r[k] for r in rows]):.1f}" if rows and k in rows[0] else "–"
            tiers = [t for r in range(1, repeats + 1)
                     if (t := tier_wrs(out / f"stats-{m}-n{n}-{r}")) is not None]
            tier = f"{st.median(tiers):.0f}" if tiers else "–"
            mf = [meta_failures(out / f"stats-{m}-n{n}-{r}") for r in range(1, repeats + 1)]
            mfs = ", ".join(str(x) for x in mf if x is not None) or "–"
            print(f"| {n} | {label} | {med('main_med_ms')} | {med('setup_med_ms')} | "
                  f"{med('path_med_ms')} | {med('connected_med_ms')} | {med('first_med_ms')} | {tier} | {mfs} |")
    print()

    print("Where the CPU goes: the CPU time (user + system, all threads) a process had used "
          "at each instant above, median over the N (ms; then the median over the repeats), "
          "and the N processes' CPU time at their first GET summed (s): what the burst asked "
          "of the machine's two CPUs.\n")
    print("| N | mode | main | set-up | path | connected | first GET | sum at first GET (s) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in ns:
        for m, label in present:
            rows = [r for r in burst[m, n] if r and "cpu_sum_ms" in r]
            if not rows:
                continue
            med = lambda k: f"{st.median([r[k] for r in rows]):.1f}" if k in rows[0] else "–"
            print(f"| {n} | {label} | {med('cpu_main_med_ms')} | {med('cpu_setup_med_ms')} | "
                  f"{med('cpu_path_med_ms')} | {med('cpu_connected_med_ms')} | {med('cpu_med_ms')} "
                  f"| {st.median([r['cpu_sum_ms'] for r in rows]) / 1e3:.2f} |")
    print()

    others = [(m, label) for m, label in present if m != "raw"]
    if "raw" in [m for m, _ in present] and others:
        print("Ratios per repeat (raw and krcore of the same repeat), median | min – max. "
              "Times: raw / krcore (above 1: krcore sooner). GETs/s: krcore / raw "
              "(above 1: krcore more).\n")
        print("| N | vs | first GET median, raw / krcore | min – max | all served, raw / krcore "
              "| min – max | GETs/s, krcore / raw | min – max | goal |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for n in ns:
            for m, label in others:
                pairs = [(a, b) for a, b in zip(burst["raw", n], burst[m, n]) if a and b]
                fm = [a["first_med_ms"] / b["first_med_ms"] for a, b in pairs if b["first_med_ms"] > 0]
                al = [a["all_served_ms"] / b["all_served_ms"] for a, b in pairs if b["all_served_ms"] > 0]
                tp = [b["get_ops_s"] / a["get_ops_s"] for a, b in pairs if a["get_ops_s"] > 0]
                goal = ""
                if n == 32:
                    ok = "met" if al and all(x >= ALL_SERVED_TARGET for x in al) else "**not met**"
                    goal = f"all served ≥ {ALL_SERVED_TARGET:.0f}x (issue 21, with the agent): {ok}"
                print(f"| {n} | {label} | {ratio_cell(fm)} | {ratio_cell(al)} | {ratio_cell(tp)} | {goal} |")
        print()

    print("**Serverless fetch** (paper §5.3.2): a fresh process that connects, READs the "
          "server's 64 KiB object, checks it byte for byte and exits, one after the other; "
          "its start (just before `posix_spawn`) to the data verified; *CPU*: the CPU time "
          "the process used in all (user + system, all threads, at its exit). Per repeat the "
          "median of its processes; then median over the repeats | min – max.\n")
    print("| mode | start → data (ms) | min – max | start → `main` (ms) | min – max "
          "| start → connected (ms) | min – max | CPU (ms) | min – max |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for m, label in present:
        rows = [r for r in serial[m] if r]
        nfail = repeats - len(rows)
        tag = label + (f" ({nfail} failed)" if nfail else "")
        cpu = [r["cpu_med_ms"] for r in rows if "cpu_med_ms" in r]
        print(f"| {tag} | {spread([r['exec_to_data_med_ms'] for r in rows])} "
              f"| {spread([r['main_med_ms'] for r in rows])} "
              f"| {spread([r['connected_med_ms'] for r in rows])} "
              f"| {spread(cpu) if cpu else '– | –'} |")
    for m, label in others:
        if "raw" not in serial:
            break
        pairs = [(a, b) for a, b in zip(serial["raw"], serial[m]) if a and b]
        rr = [a["exec_to_data_med_ms"] / b["exec_to_data_med_ms"] for a, b in pairs
              if b["exec_to_data_med_ms"] > 0]
        cell = ratio_cell(rr).split(" | ")
        print(f"| raw / {label} (per repeat; above 1: krcore sooner) | {cell[0]} | {cell[1]} | | | | | | |")
    print()
    fails = []
    for f in sorted(out.glob("*.err")):
        text = f.read_text(errors="replace")
        summary = [l for l in text.splitlines() if re.search(r"children failed|did not finish|FAILED", l)]
        if not summary:
            continue
        errs = {}
        # Concurrent clients' messages may be interleaved on the shared
        # stderr (before kv_client wrote each in one piece): split on
        # every "kv_client: " and keep the whole messages.
        for m in re.findall(r"kv_client: ((?:(?!kv_client: ).)+?\))(?=kv_client: |\n|$)", text):
            k = re.sub(r"key \d+", "key K", m.strip())
            errs[k] = errs.get(k, 0) + 1
        fails.append((f.stem, summary[-1].replace("elastic_launch: ", ""), errs))
    if fails:
        print("**Runs that failed** (left out of the figures above; their clients' errors, "
              "with how many clients gave each):\n")
        for name, summ, errs in fails:
            print(f"- `{name}`: {summ}" + "".join(f"; {n} x `{e}`" for e, n in
                                                   sorted(errs.items(), key=lambda x: -x[1])))
        print()
    hl = out / "host-load.txt"
    if hl.exists():
        loads = [float(l.split()[1]) for l in hl.read_text().splitlines() if len(l.split()) > 1]
        if loads:
            print(f"Host load average (1 min) during the run, sampled every 5 s: "
                  f"{min(loads):.2f} – {max(loads):.2f} (median {st.median(loads):.2f}) on a "
                  f"host whose CPUs run the VM's two emulated ones: other work on the host "
                  f"slows both modes.\n")
    if lib.exists():
        print("Library measured:\n")
        print("```")
        print(lib.read_text().rstrip())
        print("```")


if __name__ == "__main__":
    main()
