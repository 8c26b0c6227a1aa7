#!/usr/bin/env python3
"""The cold path's breakdown from bench/coldpath.sh's logs (issue 19).

    python3 bench/coldpath_report.py target/bench/coldpath LABEL...

For each library LABEL, reads the `mark <µs> <thread>: <step>` lines of libkrcore's
KRCORE_LOG=debug timeline (and the benchmark's own "app: round: ..."
stamps) in LABEL/client-N.err (the cold client and its children) and
LABEL/server-N.err (the qbind server). One child = one round: from its ibv_create_qp(
KRCORE_VQP) to its first READ's completion, with the server's marks in
that span. A child that ran a qconnect before its round (the untimed
prewarm) is kind=cold (library started), the others kind=first (the
round's qconnect is the process's first extended verb). Prints, per kind,
the named spans' medians (min-max) over the children, a column per
library, then the whole timeline of each library's median child (by
total)."""
import glob
import os
import re
import statistics
import sys
from collections import defaultdict

MARK = re.compile(r"^krcore\[(\d+)\] debug: mark (\d+) ([^:]*): (.*)$")


def marks(path):
    by_pid = defaultdict(list)
    with open(path, errors="replace") as f:
        for line in f:
            m = MARK.match(line.rstrip("\n"))
            if m:
                by_pid[int(m[1])].append((int(m[2]), m[3], m[4]))
    for v in by_pid.values():
        v.sort(key=lambda x: x[0])
    return by_pid


# (label, indent, (role, regex) from, (role, regex) to): "c" the client
# child, "s" the server; `to` is the first match at or after `from`.
SPANS = [
    ("total: create -> first READ completed", 0, ("c", r"^round: ibv_create_qp"), ("c", r"^round: READ completed")),
    ("ibv_create_qp(KRCORE_VQP)", 1, ("c", r"^round: ibv_create_qp"), ("c", r"^round: qconnect called")),
    ("qconnect", 1, ("c", r"^round: qconnect called"), ("c", r"^round: READ post called")),
    ("runtime start", 2, ("c", r"^runtime: start$"), ("c", r"^runtime: started")),
    ("device borrowed (query device/port/GIDs)", 3, ("c", r"^runtime: start$"), ("c", r"^runtime: device borrowed")),
    ("service: UD CQ + QP to RTS", 3, ("c", r"^runtime: device borrowed"), ("c", r"^service: UD CQ and QP")),
    ("service: UD buffers registered (before: with the link CQs, SRQ, MR table)", 3, ("c", r"^service: UD CQ and QP"), ("c", r"^service: UD buffers")),
    ("service: link CQs and SRQ made", 3, ("c", r"^service: UD buffers registered"), ("c", r"^service: link CQs and SRQ made")),
    ("service: MR table registered", 3, ("c", r"^service: link CQs and SRQ made"), ("c", r"^service: MR table registered")),
    ("service: warm pool (4 x create + INIT)", 3, ("c", r"^service: UD buffers"), ("c", r"^service: warm pool filled")),
    ("runtime: receive buffers, header arena, scratch, probe registered", 3, ("c", r"^service: warm pool filled"), ("c", r"^runtime: receive buffers")),
    # Since the lazy start the pool fills on the progress thread: no
    # "warm pool filled" mark, the buffers follow the service at once.
    ("service ready -> receive buffers registered (before the lazy start: with the warm pool)", 3,
     ("c", r"^service: (MR table registered|UD buffers, link)"), ("c", r"^runtime: receive buffers")),
    ("runtime: SRQ receives posted, handlers", 3, ("c", r"^runtime: receive buffers"), ("c", r"^runtime: started")),
    ("meta-server bootstrap", 2, ("c", r"^meta: connecting"), ("c", r"^meta: connected")),
    ("TCP connect", 3, ("c", r"^meta: connecting"), ("c", r"^meta: TCP connected")),
    ("CQ, RC QP (INIT), buffers", 3, ("c", r"^meta: TCP connected"), ("c", r"^meta: CQ, QP")),
    ("hello/welcome over TCP (server makes its QP)", 3, ("c", r"^meta: CQ, QP"), ("c", r"^meta: welcome received")),
    ("RTR + RTS", 3, ("c", r"^meta: welcome received"), ("c", r"^meta: QP RTR")),
    ("table header READ", 3, ("c", r"^meta: QP RTR"), ("c", r"^meta: table header READ")),
    ("lookup (one READ of the meta table)", 2, ("c", r"^meta: lookup \(READ\)"), ("c", r"^meta: lookup done")),
    ("link handshake", 2, ("c", r"^link: connecting"), ("c", r"^link: RTR \+ RTS")),
    ("the connecting lock", 3, ("c", r"^link: connecting"), ("c", r"^link: the connecting lock taken")),
    ("take a warm QP", 3, ("c", r"^link: the connecting lock taken"), ("c", r"^link: warm QP taken")),
    ("request posted (UD, AH made)", 3, ("c", r"^link: warm QP taken"), ("c", r"^link: request \d+ sent")),
    ("request on the wire, server thread woken", 3, ("c", r"^link: request \d+ sent"), ("s", r"^link: request \d+ received")),
    ("server: take a warm QP", 3, ("s", r"^link: request \d+ received"), ("s", r"^link: warm QP taken")),
    ("server: RTR (before: RTR + RTS)", 3, ("s", r"^link: warm QP taken"), ("s", r"^link: RT")),
    ("server: reply posted", 3, ("s", r"^link: RT"), ("s", r"^link: reply \d+ sent")),
    ("server: RTS, after the reply", 3, ("s", r"^link: reply \d+ sent"), ("s", r"^link: RTS$")),
    ("reply on the wire, client service thread", 3, ("s", r"^link: reply \d+ sent"), ("c", r"^link: reply \d+ received")),
    ("reply handed to the waiting thread", 3, ("c", r"^link: reply \d+ received"), ("c", r"^link: reply \d+ taken")),
    ("client: RTR + RTS", 3, ("c", r"^link: reply \d+ taken"), ("c", r"^link: RTR \+ RTS")),
    ("first READ: post (the peer's MR table)", 1, ("c", r"^round: READ post called"), ("c", r"^round: READ posted")),
    ("1st control READ (before: the MR table header; after: the rkey's slots)", 2, ("c", r"^control READ: \d+ bytes"), ("c", r"^control READ: completed")),
    ("2nd control READ (before: the rkey's slots)", 2, ("c", r"^control READ: completed"), ("c", r"^control READ: completed")),
    ("first READ: completion", 1, ("c", r"^round: READ posted"), ("c", r"^round: READ completed")),
]


def find(events, role, rx, after):
    for t, r, _thread, what in events:
        if t >= after and r == role and re.search(rx, what):
            return t
    return None


def spans(events):
    out = {}
    for label, _, (ra, xa), (rb, xb) in SPANS:
        a = find(events, ra, xa, 0)
        if a is None:
            continue
        # The same step at both ends: from its first time to its second.
        b = find(events, rb, xb, a + 1 if (ra, xa) == (rb, xb) else a)
        if b is not None:
            out[label] = b - a
    return out


def runs_of(d):
    """{kind: [(pid, merged events)]} of the runs in directory d."""
    runs = {"cold": [], "first": []}
    for cpath in sorted(glob.glob(f"{d}/client-*.err")):
        client = marks(cpath)
        server = marks(cpath.replace("/client-", "/server-"))
        srv = [(t, "s", th, w) for evs in server.values() for (t, th, w) in evs]
        npath = cpath.replace("/client-", "/node-")
        if os.path.exists(npath):
            srv += [(t, "n", th, w) for evs in marks(npath).values() for (t, th, w) in evs]
        for pid, evs in client.items():
            ce = [(t, "c", th, w) for t, th, w in evs]
            start = find(ce, "c", r"^round: ibv_create_qp", 0)
            end = find(ce, "c", r"^round: READ completed", 0)
            if start is None or end is None:
                continue
            kind = "cold" if any(t < start and w.startswith("qconnect: start") for t, _, w in evs) else "first"
            mine = [e for e in ce if start <= e[0] <= end]
            theirs = [e for e in srv if start <= e[0] <= end]
            runs[kind].append((pid, sorted(mine + theirs, key=lambda e: e[0])))
    return runs


TITLES = {
    "cold": "First contact with a new peer, library already started (kind=cold)",
    "first": "First extended verb of a fresh process (kind=first)",
}
TOTAL = SPANS[0][0]


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "target/bench/coldpath"
    labels = sys.argv[2:] or ["now"]
    runs = {label: runs_of(f"{d}/{label}") for label in labels}
    for kind in ("first", "cold"):
        per = {label: [spans(evs) for _, evs in runs[label][kind]] for label in labels}
        if not any(per.values()):
            continue
        counts = ", ".join(f"{label} {len(per[label])}" for label in labels)
        print(f"### {TITLES[kind]} (processes: {counts})\n")
        print("| span | " + " | ".join(f"{label}: µs, median (min–max)" for label in labels) + " |")
        print("| --- |" + " ---: |" * len(labels))
        for label_, indent, _a, _b in SPANS:
            cells = []
            for label in labels:
                v = [p[label_] for p in per[label] if label_ in p]
                cells.append(f"{statistics.median(v):.0f} ({min(v)}–{max(v)})" if v else "–")
            if all(c == "–" for c in cells):
                continue
            print(f"| {'&nbsp;&nbsp;' * indent}{label_} | " + " | ".join(cells) + " |")
        print()
        for label in labels:
            if not per[label]:
                continue
            totals = sorted((p.get(TOTAL, 0), i) for i, p in enumerate(per[label]))
            pid, evs = runs[label][kind][totals[len(totals) // 2][1]]
            t0 = evs[0][0]
            print(f"Timeline of {label}'s median process (pid {pid}; c = client, s = server, n = agent; µs since its ibv_create_qp):\n")
            print("| t | Δ | who | thread | step |\n| ---: | ---: | --- | --- | --- |")
            prev = t0
            for t, r, th, w in evs:
                print(f"| {t - t0} | {t - prev} | {r} | {th} | {w} |")
                prev = t
            print()


if __name__ == "__main__":
    main()
