#!/usr/bin/env python3
"""The table of bench/vqp-compare.sh: virtual QPs against raw verbs.

    python3 bench/vqp_report.py OUT_DIR REPEATS

Reads, for each repeat N, OUT_DIR/dp-{raw,krcore}-N.txt (datapath_summary),
mesh-raw-N-R.txt and mesh-krcore-{ordered,natural}-N-R.txt (mesh_summary,
qps_summary; .rc holds the exit status), mem-{raw,krcore}-N.txt
(mem_summary) and hw-dp-N.txt (rxe counters), and prints markdown: each
figure as the median over the repeats with its min-max, and the ratios
computed per repeat (krcore and raw of the same repeat, same VM boot),
then summarised the same way.
"""
import re
import statistics as st
import sys
from pathlib import Path

from kvlines import last_line

READ_LAT_TARGET = 1.2   # issue 7: READ latency krcore/raw at most 1.2x
READ_TPUT_TARGET = 0.9  # issue 7: READ throughput krcore/raw at least 0.9x


def need(path, prefix):
    d = last_line(path, prefix)
    if d is None:
        sys.exit(f"vqp-compare: {path} has no line '{prefix}...' (did the run fail?)")
    return d


def num(v):
    return isinstance(v, float)


def spread(v, fmt="{:.1f}"):
    v = [x for x in v if num(x)]
    if not v:
        return "– | –"
    return f"{fmt.format(st.median(v))} | {fmt.format(min(v))} – {fmt.format(max(v))}"


def ratios(a, b):
    """a[i] / b[i] per repeat, where both are numbers."""
    return [x / y for x, y in zip(a, b) if num(x) and num(y) and y > 0]


def fmt_ratio(v, fmt="{:.2f}x"):
    if not v:
        return "– | –"
    return f"{fmt.format(st.median(v))} | {fmt.format(min(v))} – {fmt.format(max(v))}"


def verdict(v, ok):
    if not v:
        return "not measured"
    med = st.median(v)
    every = all(ok(x) for x in v)
    if ok(med) and every:
        return "met (every repeat)"
    if ok(med):
        return "met by the median, not in every repeat"
    return "**not met**"


def kib(v):
    return f"{v / 1024:.1f}"


def main():
    out, repeats = Path(sys.argv[1]), int(sys.argv[2])
    R = range(1, repeats + 1)

    # ---- data path -------------------------------------------------------
    raw = [need(out / f"dp-raw-{i}.txt", "datapath_summary ") for i in R]
    kr = [need(out / f"dp-krcore-{i}.txt", "datapath_summary ") for i in R]
    hdr = last_line(out / "dp-raw-1.txt", "# datapath ") or {}
    print(f"## Virtual QPs against raw verbs: data path, full mesh, memory "
          f"({repeats} repeat(s) in one VM boot; the data path raw and krcore taking turns, "
          f"mesh and memory back to back; which goes first alternating by repeat)\n")
    print(f"Data path: one client (GID index 2) and one server (GID index 1) process; "
          f"raw: one RC QP; krcore: a VQP `qconnect`ed to the server's `qbind` VQP. "
          f"READ latency: {int(hdr.get('reads', 0))} signaled 8-byte READs one at a time "
          f"(busy-poll with `sched_yield`), every READ's bytes checked; READ throughput: "
          f"{int(hdr.get('window', 0))} READs outstanding, {int(hdr.get('tput_ops', 0))} "
          f"(8 B) / {int(hdr.get('tput_ops', 0)) // 4} (4 KiB) completed ops per trial, "
          f"median of 3 trials; echo: SEND, the server SENDs it back (krcore: on the "
          f"`src_qp` of `qpop_msgs`), the client waits for both completions, "
          f"{int(hdr.get('echos', 0))} echoes at 8 B and 4 KiB, "
          f"{int(hdr.get('large_echos', 0))} at 64 KiB. Each figure: the median over "
          f"repeats of each run's value, with min – max; ratios per repeat.\n")
    print("| data path | raw: median | min – max | krcore: median | min – max | "
          "krcore / raw: median | min – max | target |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    rows = [
        ("READ 8 B latency, median (µs)", "read_lat_med_us", "lat"),
        ("READ 8 B latency, p99 (µs)", "read_lat_p99_us", None),
        ("READ 8 B latency, p10 (µs)", "read_lat_p10_us", None),
        ("READ 8 B throughput (ops/s)", "tput8_ops_s", "tput"),
        ("READ 4 KiB throughput (ops/s)", "tput4k_ops_s", "tput"),
        ("echo 8 B, median (µs)", "echo8_med_us", None),
        ("echo 8 B, p10 (µs)", "echo8_p10_us", None),
        ("echo 8 B, p99 (µs)", "echo8_p99_us", None),
        ("echo 4 KiB, median (µs)", "echo4k_med_us", None),
        ("echo 4 KiB, p10 (µs)", "echo4k_p10_us", None),
        ("echo 4 KiB, p99 (µs)", "echo4k_p99_us", None),
        ("echo 64 KiB, median (µs)", "echo64k_med_us", None),
        ("echo 64 KiB, p10 (µs)", "echo64k_p10_us", None),
        ("echo 64 KiB, p99 (µs)", "echo64k_p99_us", None),
    ]
    for label, key, target in rows:
        a = [r.get(key) for r in raw]
        b = [k.get(key) for k in kr]
        rr = ratios(b, a)
        fmt = "{:.0f}" if "ops" in key else "{:.1f}"
        if target == "lat":
            t = f"≤ {READ_LAT_TARGET}x: {verdict(rr, lambda x: x <= READ_LAT_TARGET)}"
        elif target == "tput":
            t = f"≥ {READ_TPUT_TARGET}x: {verdict(rr, lambda x: x >= READ_TPUT_TARGET)}"
        else:
            t = ""
        kcol = spread(b, fmt)
        if any(v == "skip" for v in b):
            kcol = "skipped | (EINVAL: messages > 4 KiB not in this library yet)" \
                if not any(num(v) for v in b) else kcol + " (skipped in some repeats)"
        print(f"| {label} | {spread(a, fmt)} | {kcol} | {fmt_ratio(rr)} | {t} |")
    print()
    # First READs on a new QP.
    print("First READs on a freshly connected QP (the first 8-byte READ: "
          "`ibv_post_send`'s own time, and post to completion; krcore's first post "
          "READs the peer's MR table entry), µs:\n")
    print("| first READ | raw: median | min – max | krcore: median | min – max |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, key in (("connect (raw: create + INIT + TCP exchange + RTR + RTS; krcore: "
                        "create + `qconnect`, first of the process)", "connect_us"),
                       ("first READ: `ibv_post_send`", "first_post_us"),
                       ("first READ: post → completion", "first_read_us"),
                       ("second READ: post → completion", "second_read_us")):
        print(f"| {label} | {spread([r.get(key) for r in raw])} | "
              f"{spread([k.get(key) for k in kr])} |")
    print()
    # rxe counters (both clients ran interleaved: one count for the pair).
    hw = {}
    for i in R:
        p = out / f"hw-dp-{i}.txt"
        if p.exists():
            for l in p.read_text().split():
                if "=" in l:
                    k, v = l.split("=", 1)
                    hw[k] = hw.get(k, 0) + int(v)
    if hw:
        print("rxe counters during the data-path runs, raw and krcore together "
              "(sum over repeats): " + ", ".join(f"{k} {v}" for k, v in sorted(hw.items())) + ".\n")

    # ---- mesh -----------------------------------------------------------------
    def meshes(pattern):
        got, failed = [], []
        for i in R:
            r = 1
            while True:
                f = out / pattern.format(i=i, r=r)
                if not f.exists():
                    break
                rc = (f.with_name(f.name + ".rc").read_text().strip()
                      if f.with_name(f.name + ".rc").exists() else "0")
                s = last_line(f, "mesh_summary ")
                q = last_line(f, "qps_summary ")
                if rc == "0" and s:
                    if q:
                        s.update({"qps_" + k: v for k, v in q.items()})
                    s["repeat"] = i
                    got.append(s)
                else:
                    text = f.read_text(errors="replace")
                    err = sorted(set(
                        f"rank {w}: {what}: {why.strip()}" for w, what, why in re.findall(
                            r"mesh worker (\d+): ((?:ibv_post_send|qconnect|a first READ)[^:\n]*): "
                            r"([A-Za-z][A-Za-z0-9 ]*?)(?=datapath|\n|$)", text)))
                    failed.append((i, r, rc, err))
                r += 1
        return got, failed

    mraw, fraw = meshes("mesh-raw-{i}-{r}.txt")
    mord, ford = meshes("mesh-krcore-ordered-{i}-{r}.txt")
    mnat, fnat = meshes("mesh-krcore-natural-{i}-{r}.txt")
    magt, fagt = meshes("mesh-krcore-ordered-agent-{i}-{r}.txt")
    procs = int(mraw[0]["procs"]) if mraw else 0
    print(f"Full mesh: {procs} processes on {procs} emulated nodes (GID indexes 1..{procs}) "
          f"connect all-to-all; per process, from the common \"go\" to \"every peer answered a "
          f"first 8-byte READ\" (checked); wall = first start → last end. Setup before \"go\" "
          f"(untimed): device, PD, CQ, MR, and raw a TCP listener, krcore one `qbind` VQP "
          f"(starts the library's runtime and meta-server bootstrap). raw: per peer an RC QP, "
          f"INIT, (QPN, PSN, GID) over TCP, RTR, RTS, a TCP barrier (the peer's QP must be RTR "
          f"before our READ reaches it). krcore \"ordered\": `qconnect` to the higher ranks, "
          f"each announced to the peer by a 4-byte SEND; a lower rank is `qconnect`ed once its "
          f"announcement arrived (`qpop_msgs`), over the link it made. krcore \"natural\": "
          f"every process `qconnect`s to all others at once.\n")
    agent = bool(magt or fagt)
    print("| mesh (ms) | raw: median | min – max | krcore ordered: median | min – max | "
          "ordered / raw: median | min – max |"
          + (" attached to the agent: median | min – max | attached / raw: median | min – max |" if agent else ""))
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: | ---: | ---: |" if agent else ""))

    def per_repeat(ms, key):
        by = {}
        for m in ms:
            by.setdefault(m["repeat"], []).append(m[key])
        return {i: st.median(v) for i, v in by.items()}

    for label, key in (("wall time of the whole mesh", "wall_us"),
                       ("per process: median", "proc_med_us"),
                       ("per process: slowest", "proc_max_us"),
                       ("setup before \"go\" (untimed), median", "setup_med_us")):
        a = per_repeat(mraw, key)

        def against_raw(ms):
            b = per_repeat(ms, key)
            rr = [b[i] / a[i] for i in R if i in a and i in b and a[i] > 0]
            return f" {spread([v / 1e3 for v in b.values()])} | {fmt_ratio(rr)} |"

        row = f"| {label} | {spread([v / 1e3 for v in a.values()])} |" + against_raw(mord)
        if agent:
            row += against_raw(magt)
        print(row)
    if agent:
        print(f"\nAttached to the agent (every process of the ordered mesh attached to one "
              f"`krcore-node`, the emulated nodes being one host): {len(magt)} of "
              f"{len(magt) + len(fagt)} meshes completed.")
        for i, r, rc, err in fagt:
            print(f"- repeat {i} round {r}: exit {rc}: {'; '.join(err) or 'see the log'}")
    print()
    print("Phases (median over processes, then over runs), ms:\n")
    print("| raw phase | median | min – max | krcore ordered phase | median | min – max |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    rp = [("create_us", "create + INIT × peers"), ("exchange_us", "TCP exchange"),
          ("rtr_rts_us", "RTR + RTS × peers"), ("barrier_us", "TCP barrier"),
          ("read_us", "first READs")]
    kp = [("create_us", "`ibv_create_qp` × peers"), ("qconnect_us", "`qconnect` × peers (sum)"),
          ("qconnect_max_us", "slowest `qconnect`"), ("announce_us", "announcements (SEND)"),
          ("read_us", "first READs (incl. MR-table READs)")]
    for (a, al), (b, bl) in zip(rp, kp):
        print(f"| {al} | {spread([m[a] / 1e3 for m in mraw if a in m])} | {bl} | "
              f"{spread([m[b] / 1e3 for m in mord if b in m])} |")
    print()
    nat_n = len(mnat) + len(fnat)
    line = (f"krcore \"natural\" order (all at once): {len(mnat)} of {nat_n} meshes completed")
    if mnat:
        line += (f"; when they did, wall {spread([m['wall_us'] / 1e3 for m in mnat])} ms, "
                 f"per process median {spread([m['proc_med_us'] / 1e3 for m in mnat])} ms")
    print(line + ".")
    for i, r, rc, err in fnat:
        e = "; ".join(err) or "see the log"
        print(f"- repeat {i} round {r}: exit {rc}: {e}")
    if fnat:
        print("\n  A failed natural mesh is two processes that `qconnect`ed to each other at "
              "the same moment: each side's link handshake crosses the other's, each keeps "
              "the link the peer initiated and drops (destroys) its own, so each side's "
              "kept QP is connected to a QP the peer destroyed; the first post then times "
              "out READing the peer's MR table (ETIMEDOUT).")
    qr = [m.get("qps_rc_rts_med") for m in mraw]
    qo = [m.get("qps_rc_rts_med") for m in mord]
    if any(num(x) for x in qr + qo):
        print(f"\nRC QPs in RTS per process after the mesh (`rdma resource show qp`): raw "
              f"{spread(qr, '{:.0f}')}; krcore ordered {spread(qo, '{:.0f}')} (the links, "
              f"one per peer, plus the meta-server QP).")
    print()

    # ---- memory ---------------------------------------------------------------
    mr = [need(out / f"mem-raw-{i}.txt", "mem_summary ") for i in R]
    mk = [need(out / f"mem-krcore-{i}.txt", "mem_summary ") for i in R]
    print(f"Memory (one measuring process; deltas of VmRSS, VmPin = registered bytes, "
          f"VmSize = mapped, which holds the rxe QP/CQ rings that never show in VmRSS, and "
          f"the machine's kernel memory VmallocUsed + SUnreclaim; read once stable). "
          f"raw: {int(mr[0]['qps'])} RC QPs (depth {int(mr[0]['qp_depth'])}, 1 SGE) "
          f"connected in pairs to each other, one READ each. krcore: "
          f"{int(mk[0]['vqps'])} VQPs (depth {int(mk[0]['vqp_depth'])}) `qconnect`ed to one "
          f"peer over one live link (\"used\": after one READ on each), and "
          f"{int(mk[0]['links'])} links (one new peer process each, with one VQP and one "
          f"READ). Bytes, median over repeats (min – max):\n")
    print("| memory (bytes) | RSS | registered (VmPin) | mapped (VmSize) | kernel (machine-wide) |")
    print("| --- | ---: | ---: | ---: | ---: |")

    def mrow(label, ds, name):
        cells = []
        for f in ("rss", "pin", "virt", "kern"):
            v = [d.get(f"{name}_{f}_B") for d in ds]
            v = [x for x in v if num(x)]
            cells.append(f"{st.median(v):.0f} ({min(v):.0f} – {max(v):.0f})" if v else "–")
        print(f"| {label} | " + " | ".join(cells) + " |")

    mrow("raw: per RC QP (connected, one READ)", mr, "qp_used")
    mrow("raw: per connection (2 QPs, both ends)", mr, "conn")
    mrow("krcore: per VQP (created + `qconnect`)", mk, "vqp")
    mrow("krcore: per VQP (after its first READ)", mk, "vqp_used")
    mrow("krcore: per link (kernel: both ends)", mk, "link")
    mrow("krcore: the runtime (first `qconnect` of the process, first link)", mk, "runtime")
    print()
    lib = out / "krcore-lib.txt"
    if lib.exists():
        print("Library measured:\n")
        print("```")
        print(lib.read_text().rstrip())
        print("```")


if __name__ == "__main__":
    main()
