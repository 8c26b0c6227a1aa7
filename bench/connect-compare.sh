#!/usr/bin/env bash
# Connect cost (issue 7): what it takes to connect to a peer and complete a
# first 8-byte RDMA READ, minus a steady READ's latency, with raw verbs and
# with krcore's qconnect (warm and cold), alternating in one VM boot so
# that the ratios come from one run.
#   bench/connect-compare.sh [REPEATS]         (default 3)
#   bench/connect-compare.sh --report REPEATS  (the table again, no new runs)
# Builds bench/connect.c twice (cc): target/bench/bin/connect linked
# -libverbs (raw) and target/bench/bin/connect-krcore (-DKRCORE) linked
# against a snapshot of target/release/libkrcore.so (copied, with
# krcore-meta, to target/bench/krcore-lib, so that a cargo build during the
# run cannot change the library under it; its sha256 goes to
# target/bench/connect/krcore-lib.txt). The library is not built here: run
# `cargo build --release` first (the script refuses a missing library and
# warns when src/ is newer). Then boots the Soft-RoCE VM once (or uses this
# machine's RDMA device when /sys/class/infiniband is not empty, CT_DEVICE,
# default rxe0), brings up rxe with 10 emulated nodes and, REPEATS times,
# raw and krcore in alternating order (raw first in odd repeats):
#   raw: starts the server (bench/connect -s) on GID index 1 (10.77.0.1),
#     waits (bounded) for its "listening" line, and runs the client
#     (bench/connect -c) from GID index 2: ROUNDS connections, each create
#     QP + INIT + (QPN, PSN, GID, addr, rkey) exchange over TCP, the server
#     creating and connecting its own QP, + RTR + RTS + first READ, then
#     READS steady READs on one established QP; then COLD_ROUNDS fresh
#     client processes (connect -m fresh), each timed from its spawn to
#     its first READ's completion (device, PD, CQ, MR, TCP, connection).
#   krcore: starts krcore-meta --listen <GID 1's IPv4>:META_PORT (waits for
#     "serving on"), the qbind server (connect-krcore -s, GID index 1,
#     KRCORE_GID_INDEX=1), then from GID index 2 (KRCORE_GID_INDEX=2) the
#     warm client (ROUNDS VQPs create + qconnect + first READ over a live
#     link, READS steady READs on a VQP) and the cold client (COLD_ROUNDS
#     fresh processes of each kind, see bench/connect.c), then, when the
#     snapshot has krcore-node, the same cold client again with the host's
#     agent running (KRCORE_NODE; the run without it has KRCORE_NODE=off),
#     then stops the servers.
# Results in target/bench/connect: raw-N.txt, raw-fresh-N.txt, server-N.txt, krcore-warm-N.txt,
# krcore-cold-N.txt, krcore-agent-N.txt, krcore-server-N.txt, meta-N.txt, node-N.txt, and table.md (by
# bench/connect_report.py): medians and min-max over the repeats of each
# run's medians, the ratios raw/krcore per repeat (connect cost) and
# krcore/raw (steady READ).
#
# Environment:
#   KRCORE_BENCH_ROUNDS       connections per run, raw and krcore warm
#                             (connect -n, default 50)
#   KRCORE_BENCH_COLD_ROUNDS  cold processes of each kind per run (default 20)
#   KRCORE_BENCH_READS        timed steady READs per run (connect -r, default 1000)
#   KRCORE_BENCH_PORT         the raw server's TCP port and the krcore
#                             server's qbind port (default 18777)
#   KRCORE_BENCH_META_PORT    krcore-meta's TCP port (default 18790)
#   KRCORE_BENCH_READY_S      how long to wait for a server to be ready (default 60)
#   KRCORE_BENCH_DGRAM        KRCORE_DGRAM of the cold clients (default: the
#                             library's): 0 measures first contact waiting
#                             for the link, 1 on the datagram tier
#   KRCORE_BENCH_LINK_AFTER   KRCORE_LINK_AFTER of the cold clients (default:
#                             the library's)
set -euo pipefail
cd "$(dirname "$0")/.."
report_only=0
if [[ "${1:-}" == --report ]]; then report_only=1; shift; fi
repeats="${1:-3}"
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || { echo "connect-compare: REPEATS must be a positive integer" >&2; exit 2; }
out=target/bench/connect
# Not target/bench/connect: that is the results directory.
bin=target/bench/bin/connect
kbin=target/bench/bin/connect-krcore
# The snapshot of the library (and krcore-meta) the krcore half runs on.
klib=target/bench/krcore-lib
rounds="${KRCORE_BENCH_ROUNDS:-50}"
cold_rounds="${KRCORE_BENCH_COLD_ROUNDS:-20}"
reads="${KRCORE_BENCH_READS:-1000}"
port="${KRCORE_BENCH_PORT:-18777}"
meta_port="${KRCORE_BENCH_META_PORT:-18790}"
ready_s="${KRCORE_BENCH_READY_S:-60}"
dgram="${KRCORE_BENCH_DGRAM:-}"
link_after="${KRCORE_BENCH_LINK_AFTER:-}"
server_gid=1
client_gid=2

me=connect-compare
source bench/vm-helpers.sh

wait_listening() {
    wait_ready "$1" "$2" 's/^connect: server listening on \([0-9.]*\):.*/\1/p'
}

# Raw verbs, repeat $1: one server; the client's rounds in one process,
# then COLD_ROUNDS fresh client processes (-m fresh), one after the other.
run_raw() {
    local i="$1" spid addr crc=0 frc=0 src=0
    "$bin" -s -g "$server_gid" -p "$port" -k $((1 + cold_rounds)) >"$out/server-$i.txt" 2>&1 &
    spid=$!
    addr="$(wait_listening "$out/server-$i.txt" "$spid")" || return 1
    "$bin" -c "$addr" -g "$client_gid" -p "$port" -n "$rounds" -r "$reads" \
        >"$out/raw-$i.txt" || crc=$?
    if ((!crc)); then
        "$bin" -c "$addr" -m fresh -g "$client_gid" -p "$port" -n "$cold_rounds" \
            >"$out/raw-fresh-$i.txt" || frc=$?
    else
        kill -TERM "$spid" 2>/dev/null || true
    fi
    wait "$spid" || src=$?
    cat "$out/raw-$i.txt"
    grep -v '^fresh [0-9]' "$out/raw-fresh-$i.txt" 2>/dev/null || true
    if ((crc || frc || src)); then
        echo "connect-compare: repeat $i failed (client exit $crc, fresh clients exit $frc, server exit $src); server output:" >&2
        cat "$out/server-$i.txt" >&2
        return 1
    fi
}

# krcore, repeat $1: krcore-meta and the qbind server on GID index 1, the
# warm client then the cold client on GID index 2, each process with
# KRCORE_GID_INDEX of its node and KRCORE_META; then both servers stop
# (SIGTERM). Output: krcore-warm-$1.txt, krcore-cold-$1.txt,
# krcore-server-$1.txt, meta-$1.txt.
run_krcore() {
    local i="$1" mpid spid spid2 mip addr addr2 wrc=0 crc=0 src=0 mrc=0
    mip="$(gid_ipv4 "$server_gid")" || return 1
    "$klib/krcore-meta" --listen "$mip:$meta_port" >"$out/meta-$i.txt" 2>&1 &
    mpid=$!
    wait_ready "$out/meta-$i.txt" "$mpid" '/serving on/p' >/dev/null || return 1
    export KRCORE_META="$mip:$meta_port"
    KRCORE_GID_INDEX="$server_gid" "$kbin" -s -g "$server_gid" -p "$port" \
        >"$out/krcore-server-$i.txt" 2>&1 &
    spid=$!
    addr="$(wait_ready "$out/krcore-server-$i.txt" "$spid" 's/^connect: server bound on \([0-9.]*\) .*/\1/p')" \
        || { kill "$mpid"; wait "$mpid" || true; return 1; }
    # A second qbind server (GID index 3, PORT + 2): the process a cold
    # client of kind "peer" has used before its round's first contact.
    KRCORE_GID_INDEX=3 "$kbin" -s -g 3 -p $((port + 2)) >"$out/krcore-server2-$i.txt" 2>&1 &
    spid2=$!
    addr2="$(wait_ready "$out/krcore-server2-$i.txt" "$spid2" 's/^connect: server bound on \([0-9.]*\) .*/\1/p')" \
        || { kill "$spid" "$mpid"; wait "$spid" "$mpid" || true; return 1; }
    KRCORE_GID_INDEX="$client_gid" "$kbin" -c "$addr" -m warm -g "$client_gid" \
        -p "$port" -n "$rounds" -r "$reads" >"$out/krcore-warm-$i.txt" || wrc=$?
    if ((!wrc)); then
        env ${dgram:+KRCORE_DGRAM="$dgram"} ${link_after:+KRCORE_LINK_AFTER="$link_after"} KRCORE_NODE=off KRCORE_GID_INDEX="$client_gid" "$kbin" -c "$addr" -m cold -b "$addr2" -g "$client_gid" \
            -p "$port" -n "$cold_rounds" -r "$reads" >"$out/krcore-cold-$i.txt" || crc=$?
    fi
    if ((!wrc && !crc)) && [[ -x "$klib/krcore-node" ]]; then
        # The same fresh processes attached to the host's agent.
        local npid sock=/tmp/connect-compare-node.sock
        "$klib/krcore-node" --meta "$KRCORE_META" --socket "$sock" >"$out/node-$i.txt" 2>&1 &
        npid=$!
        if wait_ready "$out/node-$i.txt" "$npid" '/serving at/p' >/dev/null; then
            env ${dgram:+KRCORE_DGRAM="$dgram"} ${link_after:+KRCORE_LINK_AFTER="$link_after"} KRCORE_NODE="$sock" KRCORE_GID_INDEX="$client_gid" "$kbin" -c "$addr" -m cold -b "$addr2" -g "$client_gid" \
                -p "$port" -n "$cold_rounds" -r "$reads" >"$out/krcore-agent-$i.txt" || crc=$?
        else
            crc=1
        fi
        kill -TERM "$npid" 2>/dev/null || true
        wait "$npid" || true
    fi
    kill -TERM "$spid" "$spid2" 2>/dev/null || true
    wait "$spid2" || true
    wait "$spid" || src=$?
    kill -TERM "$mpid" 2>/dev/null || true
    wait "$mpid" || mrc=$?
    unset KRCORE_META
    grep -v -e '^round ' -e '^cold ' "$out/krcore-warm-$i.txt" "$out/krcore-cold-$i.txt" "$out/krcore-agent-$i.txt" 2>/dev/null || true
    if ((wrc || crc || src)); then
        echo "connect-compare: krcore repeat $i failed (warm client exit $wrc, cold client exit $crc, server exit $src, krcore-meta exit $mrc); server and meta output:" >&2
        cat "$out/krcore-server-$i.txt" "$out/meta-$i.txt" >&2
        return 1
    fi
}

report_table() {
    python3 bench/connect_report.py "$out" "$repeats"
}

if [[ "${KRCORE_IN_VM:-}" == 1 ]]; then
    # Inside the VM (or on a host with an RDMA device): the measuring loop.
    if [[ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        bash scripts/rxe-up.sh 10
    fi
    for i in $(seq 1 "$repeats"); do
        if ((i % 2)); then
            echo "== run $i/$repeats: raw verbs ($(date +%T))"
            run_raw "$i"
            echo "== run $i/$repeats: krcore ($(date +%T))"
            run_krcore "$i"
        else
            echo "== run $i/$repeats: krcore ($(date +%T))"
            run_krcore "$i"
            echo "== run $i/$repeats: raw verbs ($(date +%T))"
            run_raw "$i"
        fi
    done
    echo "== done ($(date +%T))"
    exit 0
fi

if ((!report_only)); then
    host_preflight
    build_pair bench/connect.c "$bin" "$kbin" "$klib"
    rm -rf "$out" && mkdir -p "$out"
    {
        echo "library: target/release/libkrcore.so, copied $(date -u +%FT%TZ)"
        echo "built: $(date -u -r target/release/libkrcore.so +%FT%TZ)"
        (cd "$klib" && sha256sum libkrcore.so krcore-meta)
        echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?'), uncommitted changes in src/: $(git --no-optional-locks status --porcelain -- src 2>/dev/null | wc -l) file(s)"
        echo "host load average before the run: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPU(s) (other VMs on this host skew both halves)"
    } >"$out/krcore-lib.txt"
    if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        KRCORE_IN_VM=1 bash "$0" "$repeats"
    else
        scripts/vm-run.sh "$out" env KRCORE_IN_VM=1 \
            KRCORE_BENCH_ROUNDS="$rounds" KRCORE_BENCH_READS="$reads" \
            KRCORE_BENCH_COLD_ROUNDS="$cold_rounds" \
            KRCORE_BENCH_PORT="$port" KRCORE_BENCH_META_PORT="$meta_port" \
            KRCORE_BENCH_READY_S="$ready_s" KRCORE_BENCH_DGRAM="$dgram" \
            KRCORE_BENCH_LINK_AFTER="$link_after" \
            bash bench/connect-compare.sh "$repeats"
    fi
fi

report_table | tee "$out/table.md"
