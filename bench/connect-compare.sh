#!/usr/bin/env bash
# Connect cost (issue 7): what it takes to connect to a peer and complete a
# first 8-byte RDMA READ, minus a steady READ's latency. Today: raw verbs
# only; krcore's qconnect (warm and cold) joins in run_krcore below once
# the library has it, in the same VM boot, so that ratios come from one run.
#   bench/connect-compare.sh [REPEATS]         (default 3)
#   bench/connect-compare.sh --report REPEATS  (the table again, no new runs)
# Builds bench/connect.c (cc, linked -libverbs; no cargo needed for the raw
# half), boots the Soft-RoCE VM once (or uses this machine's RDMA device
# when /sys/class/infiniband is not empty, CT_DEVICE, default rxe0), brings
# up rxe with 10 emulated nodes and, REPEATS times: starts the server
# (bench/connect -s) on GID index 1 (10.77.0.1), waits (bounded) for its
# "listening" line, and runs the client (bench/connect -c) from GID index 2:
# ROUNDS connections, each create QP + INIT + (QPN, PSN, GID, addr, rkey)
# exchange over TCP, the server creating and connecting its own QP, + RTR
# + RTS + first READ, then READS steady READs on one established QP.
# Results: target/bench/connect/raw-N.txt (client), server-N.txt (server)
# and table.md: median and min-max over the repeats of each run's medians.
#
# Environment:
#   KRCORE_BENCH_ROUNDS   connections per run (connect -n, default 50)
#   KRCORE_BENCH_READS    timed steady READs per run (connect -r, default 1000)
#   KRCORE_BENCH_PORT     the server's TCP port (default 18777)
#   KRCORE_BENCH_READY_S  how long to wait for the server to listen (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
report_only=0
if [[ "${1:-}" == --report ]]; then report_only=1; shift; fi
repeats="${1:-3}"
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || { echo "connect-compare: REPEATS must be a positive integer" >&2; exit 2; }
out=target/bench/connect
# Not target/bench/connect: that is the results directory.
bin=target/bench/bin/connect
rounds="${KRCORE_BENCH_ROUNDS:-50}"
reads="${KRCORE_BENCH_READS:-1000}"
port="${KRCORE_BENCH_PORT:-18777}"
ready_s="${KRCORE_BENCH_READY_S:-60}"
server_gid=1
client_gid=2

# Waits until the server's log ($1) has its "listening" line, the server
# (pid $2) is gone, or $ready_s seconds have passed. Prints the address.
wait_listening() {
    local log="$1" pid="$2" deadline=$((SECONDS + ready_s)) addr
    while ((SECONDS < deadline)); do
        addr="$(sed -n 's/^connect: server listening on \([0-9.]*\):.*/\1/p' "$log")"
        if [[ -n "$addr" ]]; then echo "$addr"; return 0; fi
        kill -0 "$pid" 2>/dev/null || { echo "connect-compare: the server exited before listening:" >&2; cat "$log" >&2; return 1; }
        sleep 0.05
    done
    echo "connect-compare: the server did not listen within ${ready_s} s:" >&2
    cat "$log" >&2
    kill "$pid" 2>/dev/null || true
    return 1
}

# Raw verbs: one server, one client, repeat $1.
run_raw() {
    local i="$1" spid addr crc=0 src=0
    "$bin" -s -g "$server_gid" -p "$port" >"$out/server-$i.txt" 2>&1 &
    spid=$!
    addr="$(wait_listening "$out/server-$i.txt" "$spid")" || return 1
    "$bin" -c "$addr" -g "$client_gid" -p "$port" -n "$rounds" -r "$reads" \
        >"$out/raw-$i.txt" || crc=$?
    wait "$spid" || src=$?
    cat "$out/raw-$i.txt"
    if ((crc || src)); then
        echo "connect-compare: repeat $i failed (client exit $crc, server exit $src); server output:" >&2
        cat "$out/server-$i.txt" >&2
        return 1
    fi
}

# ---------------------------------------------------------------------------
# THE KRCORE CONFIGURATION GOES HERE (issue 7), once libkrcore.so has
# qconnect/qbind. Not written yet, on purpose: nothing below measures krcore
# and no krcore figure is produced. What it is to do, repeat $1, in the same
# VM boot right after run_raw (the order alternating between repeats):
#   - start krcore-meta on 10.77.0.1, a qbind server (GID index 1) under
#     KRCORE_META, and a client (KRCORE_GID_INDEX=2) that times, per round,
#     qconnect start -> first 8-byte READ completed (checked), and a steady
#     8-byte READ on a VQP (median of 1000), printing the same summary keys
#     as bench/connect (connect_*_us, steady_read_us, connect_minus_read_us);
#   - warm: a live link to the server process (DCCache filled, link up):
#     qconnect is pure software; target: connect_minus_read at least 100x
#     below raw verbs' (issue 7);
#   - cold: first contact (DCCache empty, no link): meta-server lookup +
#     UD link handshake + the warm pool's two modifies per side;
#   - files: krcore-warm-$1.txt and krcore-cold-$1.txt next to raw-$1.txt,
#     and report_table gains the ratios against raw-$1.txt of the same repeat.
# Also: build the library (cargo build --release) before booting the VM.
# ---------------------------------------------------------------------------
run_krcore() {
    :   # intentionally empty until the library has qconnect
}

report_table() {
    python3 - "$out" "$repeats" <<'EOF'
import statistics as st
import sys
from pathlib import Path

out, repeats = Path(sys.argv[1]), int(sys.argv[2])
runs = []
for i in range(1, repeats + 1):
    p = out / f"raw-{i}.txt"
    if not p.exists():
        sys.exit(f"connect-compare: {p} is missing")
    summ = [l for l in p.read_text().splitlines() if l.startswith("connect_raw_us=")]
    if not summ:
        sys.exit(f"connect-compare: {p} has no summary line (did the run fail?)")
    runs.append({k: float(v) for k, v in (kv.split("=", 1) for kv in summ[-1].split())})

for r in runs:
    r["connect_over_read"] = r["connect_minus_read_us"] / r["steady_read_us"]

def row(key, label):
    v = [r[key] for r in runs]
    return f"| {label} | {st.median(v):.1f} | {min(v):.1f} – {max(v):.1f} |"

n = int(runs[0]["rounds"])
print(f"## Connect cost, raw verbs ({repeats} repeat(s), each the median of {n} connections)\n")
print("| microseconds | median over repeats | min – max |")
print("| --- | ---: | ---: |")
print(row("connect_raw_us", "connect + first 8 B READ (`connect_raw_us`)"))
print(row("steady_read_us", "steady 8 B READ (`steady_read_us`, median of the run's READs)"))
print(row("connect_minus_read_us", "**connect cost** (`connect_minus_read_us`)"))
v = [r["connect_over_read"] for r in runs]
print(f"| connect cost / steady READ (ratio, per repeat) | {st.median(v):.0f}x | {min(v):.0f}x – {max(v):.0f}x |")
print()
print("Phases of a connection (medians of each run's per-round values):\n")
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
    print(row(key, label))
print()
print("krcore `qconnect` (warm, cold): not measured yet; the library has no "
      "qconnect (issue 7). See run_krcore in bench/connect-compare.sh.")
EOF
}

if [[ "${KRCORE_IN_VM:-}" == 1 ]]; then
    # Inside the VM (or on a host with an RDMA device): the measuring loop.
    if [[ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        bash scripts/rxe-up.sh 10
    fi
    for i in $(seq 1 "$repeats"); do
        echo "== run $i/$repeats: raw verbs ($(date +%T))"
        run_raw "$i"
        run_krcore "$i"
    done
    echo "== done ($(date +%T))"
    exit 0
fi

if ((!report_only)); then
    for tool in cc python3; do
        command -v "$tool" >/dev/null || { echo "connect-compare: $tool not found (scripts/install-deps.sh)" >&2; exit 2; }
    done
    mkdir -p "$(dirname "$bin")"
    cc -O2 -std=gnu11 -Wall -Wextra -Werror bench/connect.c -libverbs -o "$bin"
    rm -rf "$out" && mkdir -p "$out"
    if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        KRCORE_IN_VM=1 bash "$0" "$repeats"
    else
        scripts/vm-run.sh "$out" env KRCORE_IN_VM=1 \
            KRCORE_BENCH_ROUNDS="$rounds" KRCORE_BENCH_READS="$reads" \
            KRCORE_BENCH_PORT="$port" KRCORE_BENCH_READY_S="$ready_s" \
            bash bench/connect-compare.sh "$repeats"
    fi
fi

report_table | tee "$out/table.md"
