#!/usr/bin/env python3
"""The table of bench/connect-compare.sh: raw verbs vs krcore's qconnect.

    python3 bench/connect_report.py OUT_DIR REPEATS

Reads, for each repeat N, OUT_DIR/raw-N.txt, raw-fresh-N.txt,
krcore-warm-N.txt and krcore-cold-N.txt (their summary lines of medians, see bench/connect.c) and
prints markdown: each figure as the median over the repeats with its
min-max, and the ratios computed per repeat (raw and krcore of the same
repeat, in the same VM boot), then summarised the same way.
"""
import statistics as st
import sys
from pathlib import Path

from kvlines import last_line

WARM_TARGET = 100.0  # issue 7: warm at least 100x cheaper than verbs
READ_TARGET = 1.2    # issue 7: a VQP's READ latency at most 1.2x raw


def summary(path, prefix):
    d = last_line(path, prefix)
    if d is None:
        sys.exit(f"connect-compare: {path} has no line '{prefix}...' (missing, or did the run fail?)")
    return d


def header(path):
    return last_line(path, "# connect ") or {}


def spread(v, fmt="{:.1f}"):
    return f"{fmt.format(st.median(v))} | {fmt.format(min(v))} – {fmt.format(max(v))}"


def ratio(a, b):
    return a / b if b > 0 else float("inf")


def fmt_ratio(v):
    if any(x == float("inf") for x in v):
        return "n/a (krcore's figure ≤ 0 in some repeat: below the steady READ's noise)"
    return f"{st.median(v):.1f}x | {min(v):.1f}x – {max(v):.1f}x"


def main():
    out, repeats = Path(sys.argv[1]), int(sys.argv[2])
    raw, warm, cold, first, warm_h, cold_h = [], [], [], [], [], []
    raw_fresh, kr_fresh, peer, agent = [], [], [], []
    for i in range(1, repeats + 1):
        raw.append(summary(out / f"raw-{i}.txt", "connect_raw_us="))
        raw_fresh.append(summary(out / f"raw-fresh-{i}.txt", "fresh_process "))
        kr_fresh.append(summary(out / f"krcore-cold-{i}.txt", "fresh_process "))
        peer.append(last_line(out / f"krcore-cold-{i}.txt", "new_peer "))
        warm.append(summary(out / f"krcore-warm-{i}.txt", "connect_krcore_us="))
        cold.append(summary(out / f"krcore-cold-{i}.txt", "connect_krcore_us="))
        first.append(summary(out / f"krcore-cold-{i}.txt", "first_verb "))
        warm_h.append(header(out / f"krcore-warm-{i}.txt"))
        cold_h.append(header(out / f"krcore-cold-{i}.txt"))
        agent_file = out / f"krcore-agent-{i}.txt"
        if agent_file.exists():
            agent.append({"cold": summary(agent_file, "connect_krcore_us="), "first": summary(agent_file, "first_verb "),
                          "fresh": summary(agent_file, "fresh_process "), "peer": last_line(agent_file, "new_peer ")})

    n_raw, n_warm, n_cold = int(raw[0]["rounds"]), int(warm[0]["rounds"]), int(cold[0]["rounds"])
    # The connect cost: minus the round's own second READ (same QP, same
    # moment); the separate steady phase's READ is shown too.
    cmr = "connect_minus_read2_us"
    old = "connect_minus_read_us"
    print(f"## Connect cost: raw verbs vs krcore ({repeats} repeat(s) in one VM boot, "
          f"raw and krcore alternating; each run the median of {n_raw} raw connections, "
          f"{n_warm} warm krcore connections, {n_cold} cold processes of each kind)\n")
    print("Connect cost = (connect start → first 8 B READ completed) − a steady 8 B READ: "
          "per round, the round's own second READ on the same QP right after its first "
          "(the median over rounds of the difference); the second table row of each kind "
          "subtracts instead the median READ of a separate steady phase (1000 READs after the rounds). "
          "raw: create QP + INIT + TCP exchange (server creates and connects its QP) + RTR + RTS. "
          "krcore: `ibv_create_qp(KRCORE_VQP)` + `qconnect`. The server's buffer address and rkey "
          "are learned once per process, outside the timed part (a real program learns them once).\n")
    print("| microseconds | median over repeats | min – max |")
    print("| --- | ---: | ---: |")
    print(f"| raw verbs: connect + first READ (`connect_raw_us`) | {spread([r['connect_raw_us'] for r in raw])} |")
    print(f"| raw verbs: **connect cost** | {spread([r[cmr] for r in raw])} |")
    print(f"| raw verbs: connect cost against the steady phase's READ | {spread([r[old] for r in raw])} |")
    print(f"| krcore warm (live link, DCCache hit): connect + first READ | {spread([r['connect_krcore_us'] for r in warm])} |")
    print(f"| krcore warm: **connect cost** | {spread([r[cmr] for r in warm])} |")
    print(f"| krcore warm: connect cost against the steady phase's READ | {spread([r[old] for r in warm])} |")
    print(f"| krcore cold (fresh process, library up; lookup + link handshake): connect + first READ | {spread([r['connect_krcore_us'] for r in cold])} |")
    # A cold round's first and second READs both go on the datagram tier
    # (no link yet): its connect cost subtracts the steady READ of an RC
    # link instead, or the tier's own latency would be taken off it.
    print(f"| krcore cold: connect cost against the round's second READ (also on the datagram tier: understated) | {spread([r[cmr] for r in cold])} |")
    print(f"| krcore cold: **connect cost** (against the steady READ of a link) | {spread([r[old] for r in cold])} |")
    print(f"| krcore cold, first extended verb of the process (+ runtime start + meta bootstrap): **connect cost** | {spread([r[old] for r in first])} |")
    if all(peer):
        print(f"| krcore first contact with a new peer, in a process that has used another peer (library and code warm): **connect cost** | {spread([p[old] for p in peer])} |")
    print()
    rw = [ratio(r[cmr], w[cmr]) for r, w in zip(raw, warm)]
    rc = [ratio(r[cmr], c[old]) for r, c in zip(raw, cold)]
    rf = [ratio(r[cmr], f[old]) for r, f in zip(raw, first)]
    ok = "met" if all(x >= WARM_TARGET for x in rw) else "**not met**"
    print("| connect cost, raw / krcore (per repeat) | median | min – max | target |")
    print("| --- | ---: | ---: | --- |")
    print(f"| warm | {fmt_ratio(rw)} | ≥ {WARM_TARGET:.0f}x: {ok} |")
    rwo = [ratio(r[old], w[old]) for r, w in zip(raw, warm)]
    print(f"| warm, against the steady phase's READ | {fmt_ratio(rwo)} | (reported) |")
    print(f"| cold | {fmt_ratio(rc)} | (reported) |")
    print(f"| cold, first verb of the process | {fmt_ratio(rf)} | (reported) |")
    if all(peer):
        rp = [ratio(r[cmr], p[old]) for r, p in zip(raw, peer)]
        ok = "met" if all(x >= 10 for x in rp) else "**not met**"
        print(f"| first contact with a new peer, process warm | {fmt_ratio(rp)} | ≥ 10x (issue 19): {ok} |")
    if len(agent) == repeats:
        print()
        print("With the host's agent (`krcore-node`, `KRCORE_NODE`): the same fresh processes, attached; "
              "lookups through the agent, no meta-server connection of their own:\n")
        print("| with the agent | connect cost, µs: median over repeats | min – max | raw / krcore: median | min – max |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for key, label in (("cold", "cold (fresh process, library up)"), ("first", "first extended verb of the process")):
            print(f"| {label} | {spread([a[key][old] for a in agent])} | {fmt_ratio([ratio(r[cmr], a[key][old]) for r, a in zip(raw, agent)])} |")
        if all(a["peer"] for a in agent):
            print(f"| first contact with a new peer, process warm | {spread([a['peer'][old] for a in agent])} | "
                  f"{fmt_ratio([ratio(r[cmr], a['peer'][old]) for r, a in zip(raw, agent)])} |")
    print()
    ex = "exec_to_read_us"
    print("What a user sees of a **new process** (each a fresh process, spawned one after the other: "
          "from `posix_spawn` to its first 8 B READ completed, loading the libraries, opening the device, "
          "PD, CQ, MR and the connection included; raw: RC QP over a TCP exchange; krcore: "
          "the process's first extended verb, `qconnect`):\n")
    print("| spawn → first READ completed (µs) | median over repeats | min – max |")
    print("| --- | ---: | ---: |")
    print(f"| raw verbs, new process | {spread([r[ex] for r in raw_fresh])} |")
    print(f"| krcore, new process | {spread([k[ex] for k in kr_fresh])} |")
    print(f"| raw / krcore (per repeat; target ≥ 1x) | {fmt_ratio([ratio(r[ex], k[ex]) for r, k in zip(raw_fresh, kr_fresh)])} |")
    if len(agent) == repeats:
        print(f"| krcore with the agent, new process | {spread([a['fresh'][ex] for a in agent])} |")
        print(f"| raw / krcore with the agent (per repeat) | {fmt_ratio([ratio(r[ex], a['fresh'][ex]) for r, a in zip(raw_fresh, agent)])} |")
    print()
    sr = [ratio(w["steady_read_us"], r["steady_read_us"]) for r, w in zip(raw, warm)]
    ok = "met" if all(x <= READ_TARGET for x in sr) else "**not met**"
    print("| steady 8 B READ (data path) | median over repeats | min – max |")
    print("| --- | ---: | ---: |")
    print(f"| raw RC QP (µs) | {spread([r['steady_read_us'] for r in raw])} |")
    print(f"| krcore VQP (µs, warm run's control VQP) | {spread([w['steady_read_us'] for w in warm])} |")
    print(f"| krcore VQP (µs, cold run's control VQP) | {spread([c['steady_read_us'] for c in cold])} |")
    print(f"| krcore / raw (per repeat; target ≤ {READ_TARGET}x: {ok}) | {fmt_ratio(sr)} |")
    v = [r[cmr] / r["steady_read_us"] for r in raw]
    print(f"| raw connect cost / raw steady READ | {spread(v, '{:.0f}x')} |")
    print()

    print("krcore phases (medians of each run's per-round values):\n")
    print("| phase (µs) | warm: median over repeats | min – max | cold: median over repeats | min – max | cold, first verb: median | min – max |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for key, label in (
        ("create_us", "`ibv_create_qp(KRCORE_VQP)`"),
        ("qconnect_us", "`qconnect`"),
        ("post_us", "first READ: `ibv_post_send` (pre-checks, peer MR table on a miss)"),
        ("poll_us", "first READ: completion"),
        ("first_read_us", "first READ (post + completion)"),
        ("from_qconnect_us", "`qconnect` start → READ completed"),
        ("destroy_us", "`ibv_destroy_qp` (not in the total)"),
    ):
        print(f"| {label} | {spread([w[key] for w in warm])} | {spread([c[key] for c in cold])} | {spread([f[key] for f in first])} |")
    print(f"| cold child's untimed prewarm (runtime start + meta bootstrap + a lookup) | – | – | {spread([c['prewarm_us'] for c in cold])} | – | – |")
    if all(peer):
        for key, label in (("qconnect_us", "`qconnect`"), ("post_us", "first READ: `ibv_post_send`"), ("poll_us", "first READ: completion")):
            print(f"| new peer, process warm: {label} | – | – | {spread([p[key] for p in peer])} | – | – |")
    fc = [h["first_contact_us"] for h in warm_h + cold_h if "first_contact_us" in h]
    if fc:
        print(f"| control VQP's `qconnect` (the client's first contact, untimed) | {spread(fc)} | | | | |")
    print()

    print("Raw verbs phases (medians of each run's per-round values):\n")
    print("| phase | median over repeats | min – max |")
    print("| --- | ---: | ---: |")
    for key, label in (
        ("create_us", "client `ibv_create_qp`"),
        ("init_us", "client INIT"),
        ("exchange_us", "exchange (TCP round trip + server's work)"),
        ("srv_create_us", "exchange: server `ibv_create_qp`"),
        ("srv_init_us", "exchange: server INIT"),
        ("srv_rtr_us", "exchange: server RTR"),
        ("srv_rts_us", "exchange: server RTS"),
        ("wire_us", "exchange: the rest (TCP round trip, scheduling)"),
        ("rtr_us", "client RTR"),
        ("rts_us", "client RTS"),
        ("first_read_us", "first READ (post + completion)"),
        ("destroy_us", "client `ibv_destroy_qp` (not in the total)"),
    ):
        print(f"| {label} | {spread([r[key] for r in raw])} |")
    lib = out / "krcore-lib.txt"
    if lib.exists():
        print()
        print("Library measured:\n")
        print("```")
        print(lib.read_text().rstrip())
        print("```")


if __name__ == "__main__":
    main()
