#!/usr/bin/env bash
# Where the cold path's time goes (issue 19): krcore's KRCORE_LOG=debug
# timeline ("mark" lines: CLOCK_MONOTONIC µs, process, thread, step) of
# fresh client processes connecting to a qbind server, merged across both
# processes and printed as a breakdown.
#   bench/coldpath.sh [ROUNDS [REPEATS]]   (default 5 rounds, 1 repeat)
#   bench/coldpath.sh --report              (the tables again, no new run)
# Builds bench/connect.c with -DKRCORE against a snapshot of each library
# to compare (KRCORE_COLDPATH_LIBS, "LABEL=DIR ...", each DIR holding a
# libkrcore.so and krcore-meta; default "now=target/release": run `cargo
# build --release` first), boots the Soft-RoCE VM once (or uses this
# machine's RDMA device), brings up rxe with 10 emulated nodes and runs,
# REPEATS times, each library in turn (the order rotating by repeat): it
# starts krcore-meta and the qbind server (connect-krcore -s, GID index 1)
# with KRCORE_LOG=debug, and runs connect-krcore -m cold from GID index 2
# with KRCORE_LOG=debug and KRCORE_BENCH_MARKS=1: 2 x ROUNDS fresh child
# processes, alternating
#   kind=cold   the library already started in the process (an untimed
#               qconnect to an unbound port first): first contact with a
#               new peer (lookup, link handshake, the peer's MR table);
#   kind=first  the round's qconnect is the process's first extended verb
#               (runtime start and meta-server bootstrap too).
# Each child stamps its round's steps (create, qconnect, READ post, READ
# completion) on the same clock. bench/coldpath_report.py then takes, per
# child, the span from its ibv_create_qp(KRCORE_VQP) to its READ's
# completion, with the server's marks in that span, and prints per kind the
# medians (min-max) of the named spans over the children (a column per
# library) and the full timeline of each library's median child. Output in
# target/bench/coldpath/LABEL: client-N.err, server-N.err (the marks),
# client-N.txt, server-N.txt, meta-N.txt; the tables in
# target/bench/coldpath/table.md. The marks cost a formatted write(2) each
# (tens to hundreds of µs under emulation): compare spans measured this
# way, not these totals with bench/connect-compare.sh's.
#
# Environment: KRCORE_COLDPATH_LIBS (above), KRCORE_BENCH_NODE=1 (the
# children attached to a krcore-node started per run, its marks in
# node-N.err, "n" in the timelines; else KRCORE_NODE=off), KRCORE_BENCH_PORT (default
# 18777), KRCORE_BENCH_META_PORT (default 18790), KRCORE_BENCH_READY_S
# (default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
report_only=0
if [[ "${1:-}" == --report ]]; then report_only=1; shift; fi
rounds="${1:-5}"
repeats="${2:-1}"
[[ "$rounds" =~ ^[1-9][0-9]*$ && "$repeats" =~ ^[1-9][0-9]*$ ]] \
    || { echo "coldpath: ROUNDS and REPEATS must be positive integers" >&2; exit 2; }
out=target/bench/coldpath
bins=target/bench/coldpath-bin
libs="${KRCORE_COLDPATH_LIBS:-now=target/release}"
read -r -a specs <<<"$libs"
labels=()
for spec in "${specs[@]}"; do
    [[ "$spec" =~ ^[a-z0-9_-]+=.+$ ]] || { echo "coldpath: KRCORE_COLDPATH_LIBS: '$spec' is not LABEL=DIR" >&2; exit 2; }
    labels+=("${spec%%=*}")
done
port="${KRCORE_BENCH_PORT:-18777}"
meta_port="${KRCORE_BENCH_META_PORT:-18790}"
ready_s="${KRCORE_BENCH_READY_S:-60}"
server_gid=1
client_gid=2

me=coldpath
source bench/vm-helpers.sh

# One run of library $1, repeat $2. The logs go to the VM's own /tmp
# first (a mark is a write(2); on the shared directory each one would be
# a round trip to the host), then into $out/LABEL.
run() {
    local label="$1" i="$2" mpid spid mip addr crc=0 src=0 o
    local klib="$bins/lib-$label" kbin="$bins/connect-krcore-$label"
    o="$(mktemp -d)"
    mip="$(gid_ipv4 "$server_gid")"
    "$klib/krcore-meta" --listen "$mip:$meta_port" >"$o/meta-$i.txt" 2>&1 &
    mpid=$!
    wait_ready "$o/meta-$i.txt" "$mpid" '/serving on/p' >/dev/null
    export KRCORE_META="$mip:$meta_port" KRCORE_LOG=debug
    KRCORE_GID_INDEX="$server_gid" "$kbin" -s -g "$server_gid" -p "$port" \
        >"$o/server-$i.txt" 2>"$o/server-$i.err" &
    spid=$!
    addr="$(wait_ready "$o/server-$i.txt" "$spid" 's/^connect: server bound on \([0-9.]*\) .*/\1/p')" \
        || { kill "$mpid"; exit 1; }
    local node=off npid=
    if [[ "${KRCORE_BENCH_NODE:-}" == 1 ]]; then
        node="$o/node.sock"
        "$klib/krcore-node" --socket "$node" --gid-index "$client_gid" >"$o/node-$i.txt" 2>"$o/node-$i.err" &
        npid=$!
        wait_ready "$o/node-$i.txt" "$npid" '/serving at/p' >/dev/null || { kill "$spid" "$mpid"; exit 1; }
    fi
    env KRCORE_NODE="$node" ${KRCORE_BENCH_DGRAM:+KRCORE_DGRAM="$KRCORE_BENCH_DGRAM"} ${KRCORE_BENCH_LINK_AFTER:+KRCORE_LINK_AFTER="$KRCORE_BENCH_LINK_AFTER"} \
        KRCORE_BENCH_MARKS=1 KRCORE_GID_INDEX="$client_gid" "$kbin" -c "$addr" -m cold -g "$client_gid" \
        -p "$port" -n "$rounds" -r 100 >"$o/client-$i.txt" 2>"$o/client-$i.err" || crc=$?
    if [[ -n "$npid" ]]; then kill -TERM "$npid" 2>/dev/null || true; wait "$npid" || true; fi
    kill -TERM "$spid" 2>/dev/null || true
    wait "$spid" || src=$?
    kill -TERM "$mpid" 2>/dev/null || true
    wait "$mpid" || true
    unset KRCORE_META KRCORE_LOG
    mkdir -p "$out/$label"
    cp "$o"/* "$out/$label/"
    rm -rf "$o"
    if ((crc || src)); then
        echo "coldpath: $label repeat $i: the client exited $crc, the server $src; their logs are in $out/$label" >&2
        exit 1
    fi
}

if [[ "${KRCORE_IN_VM:-}" == 1 ]]; then
    if [[ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        bash scripts/rxe-up.sh 10
    fi
    n=${#labels[@]}
    for i in $(seq 1 "$repeats"); do
        for k in $(seq 0 $((n - 1))); do
            label="${labels[$(((k + i - 1) % n))]}"
            echo "== repeat $i/$repeats: $label ($(date +%T))"
            run "$label" "$i"
        done
    done
    exit 0
fi

if ((!report_only)); then
    host_preflight
    mkdir -p "$bins"
    for spec in "${specs[@]}"; do
        label="${spec%%=*}" dir="${spec#*=}"
        [[ -f "$dir/libkrcore.so" && -f "$dir/krcore-meta" ]] || { echo "coldpath: $dir has no libkrcore.so and krcore-meta" >&2; exit 2; }
        mkdir -p "$bins/lib-$label"
        cp "$dir/libkrcore.so" "$dir/krcore-meta" "$bins/lib-$label/"
        if [[ "${KRCORE_BENCH_NODE:-}" == 1 ]]; then cp "$dir/krcore-node" "$bins/lib-$label/"; fi
        cc -O2 -std=gnu11 -Wall -Wextra -Werror -DKRCORE -I include bench/connect.c \
            -L "$bins/lib-$label" -lkrcore -Wl,-rpath,"$PWD/$bins/lib-$label" -o "$bins/connect-krcore-$label"
    done
    rm -rf "$out" && mkdir -p "$out"
    echo "libraries: $libs; git: $(git rev-parse --short HEAD 2>/dev/null || echo '?'), uncommitted changes in src/: $(git --no-optional-locks status --porcelain -- src 2>/dev/null | wc -l) file(s); host load $(cut -d' ' -f1-3 /proc/loadavg)" >"$out/lib.txt"
    if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        KRCORE_IN_VM=1 bash "$0" "$rounds" "$repeats"
    else
        scripts/vm-run.sh "$out" env KRCORE_IN_VM=1 KRCORE_COLDPATH_LIBS="$libs" KRCORE_BENCH_PORT="$port" \
            KRCORE_BENCH_DGRAM="${KRCORE_BENCH_DGRAM:-}" KRCORE_BENCH_NODE="${KRCORE_BENCH_NODE:-}" KRCORE_BENCH_LINK_AFTER="${KRCORE_BENCH_LINK_AFTER:-}" \
            KRCORE_BENCH_META_PORT="$meta_port" KRCORE_BENCH_READY_S="$ready_s" \
            bash bench/coldpath.sh "$rounds" "$repeats"
    fi
fi

python3 bench/coldpath_report.py "$out" "${labels[@]}" | tee "$out/table.md"
