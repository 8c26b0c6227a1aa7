#!/usr/bin/env bash
# Virtual QPs against raw verbs (issue 7): the data path, a full mesh and
# memory, krcore and raw verbs alternating in ONE VM boot, reported as
# ratios measured side by side.
#   bench/vqp-compare.sh [REPEATS]          (default 3)
#   bench/vqp-compare.sh --report REPEATS   (the table again, no new runs)
# Builds bench/datapath.c twice (cc): target/bench/bin/datapath linked
# -libverbs (raw) and target/bench/bin/datapath-krcore (-DKRCORE) linked
# against a snapshot of target/release/libkrcore.so (copied, with
# krcore-meta, to target/bench/krcore-lib-vqp, so that a cargo build during
# the run cannot change the library under it; sha256 in
# target/bench/vqp/krcore-lib.txt). The library is not built here: run
# `cargo build --release` first (the script refuses a missing library and
# warns when src/ is newer). Then boots the Soft-RoCE VM once (or uses this
# machine's RDMA device when /sys/class/infiniband is not empty; CT_DEVICE,
# default rxe0), brings up rxe with 10 emulated nodes (GID index i =
# 10.77.0.i) and runs REPEATS times:
#   datapath: raw and krcore at once, taking turns slice by slice (the
#           connect and first READs, tenths of the latency phase, each
#           throughput trial, the echo phase; the token goes over two
#           FIFOs, datapath -T), so both sides of a ratio see the same
#           moments of the VM; raw takes the first turn in odd repeats.
#           raw: datapath server (GID index 1) + client (GID index 2): READ
#           latency, READ throughput (window), echo latency 8 B / 4 KiB /
#           64 KiB; krcore: the same with a qbind server and a qconnect
#           client (KRCORE_GID_INDEX of each node), krcore-meta on
#           10.77.0.1 (waits for "serving on").
#   mesh, mem: raw and krcore back to back, a few seconds apart (raw first
#           in odd repeats):
#           mesh: MESH_PROCS processes on GID indexes 1..N connecting
#           all-to-all, raw with RC QPs and a TCP exchange, krcore twice:
#           order "ordered" (a rank qconnects back to a lower rank once
#           that one announced its own connect) and order "natural" (every
#           process qconnects to all others at once; a failure there is
#           recorded, not fatal: see the report), then, when the snapshot
#           has krcore-node, "ordered" again with every process attached
#           to one agent started for it (the host's: the emulated nodes
#           are one machine); mem: bytes per RC QP,
#           and per VQP and per link (MEM_PEERS peer processes).
# Readiness comes from the printed lines (server "ready", krcore-meta
# "serving on", the mesh workers' "ready"/"done" read by their
# coordinator); every wait and every process is bounded (READY_S,
# RUN_S). Results in target/bench/vqp: dp-{raw,krcore}-N.txt (client),
# dp-*-server-N.txt, hw-dp-N.txt (rxe hardware counters during the run),
# mesh-raw-N-R.txt, mesh-krcore-{ordered,natural,ordered-agent}-N-R.txt
# (+ .rc), node-N.txt (the agent's output),
# mem-{raw,krcore}-N.txt, meta-N.txt, and table.md (bench/vqp_report.py).
#
# Environment:
#   KRCORE_BENCH_READS        timed 8-byte READs (default 2000)
#   KRCORE_BENCH_TPUT_OPS     READs per throughput trial at 8 B (4 KiB: a
#                             quarter) (default 4000)
#   KRCORE_BENCH_WINDOW       outstanding READs (default 32)
#   KRCORE_BENCH_ECHOS        echoes at 8 B and 4 KiB (default 500)
#   KRCORE_BENCH_LARGE_ECHOS  echoes at 64 KiB (default 200)
#   KRCORE_BENCH_MESH_PROCS   processes of the mesh (default 8, at most 10)
#   KRCORE_BENCH_MESH_ROUNDS  meshes per half and repeat (default 1)
#   KRCORE_BENCH_MEM_VQPS     VQPs of the memory measurement (default 1000)
#   KRCORE_BENCH_MEM_PEERS    peer processes, one link each (default 8)
#   KRCORE_BENCH_RAW_QP_PAIRS raw RC QP pairs of the memory measurement
#                             (default 100)
#   KRCORE_BENCH_PORT         first TCP / qbind port (default 18800)
#   KRCORE_BENCH_META_PORT    krcore-meta's TCP port (default 18790)
#   KRCORE_BENCH_READY_S      wait for a server's ready line (default 60)
#   KRCORE_BENCH_DGRAM        KRCORE_DGRAM of the krcore processes (default:
#                             the library's): 0 makes every VQP wait for its
#                             link, as before the datagram tier
#   KRCORE_BENCH_RUN_S        bound on each client / coordinator (default 300)
set -euo pipefail
cd "$(dirname "$0")/.."
report_only=0
if [[ "${1:-}" == --report ]]; then report_only=1; shift; fi
repeats="${1:-3}"
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || { echo "vqp-compare: REPEATS must be a positive integer" >&2; exit 2; }
out=target/bench/vqp
bin=target/bench/bin/datapath
kbin=target/bench/bin/datapath-krcore
# The snapshot of the library (and krcore-meta) the krcore half runs on
# (not connect-compare's: the two scripts may run one after the other).
klib=target/bench/krcore-lib-vqp
reads="${KRCORE_BENCH_READS:-2000}"
tput_ops="${KRCORE_BENCH_TPUT_OPS:-4000}"
window="${KRCORE_BENCH_WINDOW:-32}"
echos="${KRCORE_BENCH_ECHOS:-500}"
large_echos="${KRCORE_BENCH_LARGE_ECHOS:-200}"
mesh_procs="${KRCORE_BENCH_MESH_PROCS:-8}"
mesh_rounds="${KRCORE_BENCH_MESH_ROUNDS:-1}"
mem_vqps="${KRCORE_BENCH_MEM_VQPS:-1000}"
mem_peers="${KRCORE_BENCH_MEM_PEERS:-8}"
raw_pairs="${KRCORE_BENCH_RAW_QP_PAIRS:-100}"
port="${KRCORE_BENCH_PORT:-18800}"
meta_port="${KRCORE_BENCH_META_PORT:-18790}"
ready_s="${KRCORE_BENCH_READY_S:-60}"
run_s="${KRCORE_BENCH_RUN_S:-300}"
server_gid=1
client_gid=2
hw="/sys/class/infiniband/${CT_DEVICE:-rxe0}/ports/1/hw_counters"

me=vqp-compare
source bench/vm-helpers.sh

# The rxe hardware counters (name=value lines) into $1.
hw_snap() {
    if [[ -d "$hw" ]]; then
        for f in "$hw"/*; do echo "$(basename "$f")=$(cat "$f")"; done >"$1"
    else
        : >"$1"
    fi
}

# Counter deltas between two snapshots ($1 before, $2 after), non-zero only.
hw_delta() {
    awk -F= 'NR == FNR { a[$1] = $2; next } ($1 in a) && $2 - a[$1] != 0 { printf "%s=%d\n", $1, $2 - a[$1] }' "$1" "$2"
}

# The data path of repeat $1, ports $2 (raw) and $3 (krcore), $4 the mode
# that takes the first turn: both servers up, then both clients at once,
# taking turns slice by slice (datapath -T: a token over two FIFOs), so
# that the two sides of a ratio are measured within a second of each other.
run_datapath() {
    local i="$1" pr="$2" pk="$3" first="$4" mode b p spid addr rc tag
    local -A sp cp
    for mode in raw krcore; do
        if [[ "$mode" == raw ]]; then b="$bin"; p="$pr"; else b="$kbin"; p="$pk"; fi
        KRCORE_GID_INDEX="$server_gid" "$b" server -g "$server_gid" -p "$p" \
            >"$out/dp-$mode-server-$i.txt" 2>&1 &
        sp[$mode]=$!
        addr="$(wait_ready "$out/dp-$mode-server-$i.txt" "${sp[$mode]}" 's/^datapath: server ready on \([0-9.]*\) .*/\1/p')" || return 1
    done
    # The FIFOs live in the guest's /tmp (the shared output directory
    # cannot hold one).
    local turns_dir
    turns_dir="$(mktemp -d)"
    mkfifo "$turns_dir/raw" "$turns_dir/krcore"
    hw_snap "$out/.hw0"
    for mode in raw krcore; do
        if [[ "$mode" == raw ]]; then b="$bin"; p="$pr"; else b="$kbin"; p="$pk"; fi
        local other=raw turns
        [[ "$mode" == raw ]] && other=krcore
        turns="$turns_dir/$mode,$turns_dir/$other"
        [[ "$mode" == "$first" ]] && turns+=",first"
        KRCORE_GID_INDEX="$client_gid" timeout "$run_s" "$b" client "$addr" -g "$client_gid" -p "$p" \
            -r "$reads" -n "$tput_ops" -w "$window" -e "$echos" -E "$large_echos" -T "$turns" \
            >"$out/dp-$mode-$i.txt" 2>&1 &
        cp[$mode]=$!
    done
    local failed=0
    for mode in raw krcore; do
        rc=0; wait "${cp[$mode]}" || rc=$?
        if ((rc)); then
            failed=1
            echo "vqp-compare: datapath client $mode-$i failed (exit $rc):" >&2
            cat "$out/dp-$mode-$i.txt" >&2
            # The other client waits for a turn that never comes.
            kill "${cp[raw]}" "${cp[krcore]}" 2>/dev/null || true
        fi
    done
    hw_snap "$out/.hw1"
    hw_delta "$out/.hw0" "$out/.hw1" >"$out/hw-dp-$i.txt"
    rm -rf "$turns_dir"
    for mode in raw krcore; do
        tag="$mode-$i"
        if ((failed)); then kill "${sp[$mode]}" 2>/dev/null || true; fi
        rc=0; wait "${sp[$mode]}" || rc=$?
        grep -e '^datapath_summary' -e '^echo .*skipped' "$out/dp-$tag.txt" || true
        if ((rc)) && ! ((failed)); then
            failed=1
            echo "vqp-compare: datapath server $tag failed (exit $rc):" >&2
            cat "$out/dp-$mode-server-$i.txt" >&2
        fi
    done
    return "$failed"
}

# One mesh: mode $1, order $2 (- for raw), repeat $3, round $4, port $5,
# and for krcore the host's agent's socket $6 (the file's name says
# "agent"; none: KRCORE_NODE=off). A failure of the krcore natural order
# is recorded (.rc) and tolerated.
run_mesh() {
    local mode="$1" order="$2" i="$3" r="$4" p="$5" sock="${6:-}" b f rc=0
    if [[ "$mode" == raw ]]; then
        b="$bin"; f="$out/mesh-raw-$i-$r.txt"
        timeout "$run_s" "$b" mesh -N "$mesh_procs" -p "$p" -Q >"$f" 2>&1 || rc=$?
    else
        b="$kbin"; f="$out/mesh-krcore-$order${sock:+-agent}-$i-$r.txt"
        KRCORE_NODE="${sock:-off}" timeout "$run_s" "$b" mesh -N "$mesh_procs" -p "$p" -Q -o "$order" >"$f" 2>&1 || rc=$?
    fi
    echo "$rc" >"$f.rc"
    grep -e '^mesh_summary' -e '^qps_summary' "$f" || true
    if ((rc)); then
        if [[ "$order" == natural ]]; then
            echo "vqp-compare: krcore mesh (natural order) failed (exit $rc), recorded:" >&2
            grep -v -e '^worker' -e '^qps' "$f" | head -n 20 >&2
            return 0
        fi
        echo "vqp-compare: mesh $mode $order repeat $i failed (exit $rc):" >&2
        cat "$f" >&2
        return 1
    fi
}

run_mem() {
    local mode="$1" i="$2" p="$3" f="$out/mem-$1-$2.txt" rc=0
    if [[ "$mode" == raw ]]; then
        timeout "$run_s" "$bin" mem -q "$raw_pairs" -p "$p" >"$f" 2>&1 || rc=$?
    else
        timeout "$run_s" "$kbin" mem -K "$mem_peers" -V "$mem_vqps" -p "$p" >"$f" 2>&1 || rc=$?
    fi
    grep '^mem_summary' "$f" || true
    if ((rc)); then
        echo "vqp-compare: mem $mode repeat $i failed (exit $rc):" >&2
        cat "$f" >&2
        return 1
    fi
}

# Ports of repeat $1: 20 per repeat and half.
ports_of() { echo $((port + 40 * ($1 - 1) + ($2 == 1 ? 20 : 0))); }

# Phase $1 (mesh|mem) of mode $2, repeat $3. krcore's ports are
# 20 above raw's.
run_phase() {
    local phase="$1" mode="$2" i="$3" p
    p="$(ports_of "$i" $([[ "$mode" == raw ]] && echo 0 || echo 1))"
    case "$phase/$mode" in
        mesh/raw)
            for r in $(seq 1 "$mesh_rounds"); do run_mesh raw - "$i" "$r" $((p + 1 + r)) || return 1; done ;;
        mesh/krcore)
            for r in $(seq 1 "$mesh_rounds"); do
                run_mesh krcore ordered "$i" "$r" $((p + 1 + 3 * r)) || return 1
                run_mesh krcore natural "$i" "$r" $((p + 2 + 3 * r)) || return 1
            done
            # The ordered mesh again, every process attached to the host's
            # agent (issue 21): their first READs go through it until their
            # own links are up.
            if [[ -x "$klib/krcore-node" ]]; then
                local npid sock=/tmp/vqp-compare-node.sock rc=0
                "$klib/krcore-node" --meta "$KRCORE_META" --socket "$sock" >"$out/node-$i.txt" 2>&1 &
                npid=$!
                if wait_ready "$out/node-$i.txt" "$npid" '/serving at/p' >/dev/null; then
                    for r in $(seq 1 "$mesh_rounds"); do
                        run_mesh krcore ordered "$i" "$r" $((p + 3 + 3 * r)) "$sock" || { rc=1; break; }
                    done
                else
                    rc=1
                fi
                kill -TERM "$npid" 2>/dev/null || true
                wait "$npid" || true
                return "$rc"
            fi ;;
        mem/raw) run_mem raw "$i" $((p + 10)) ;;
        mem/krcore) run_mem krcore "$i" $((p + 15)) ;;
    esac
}

# Repeat $1: krcore-meta up for the whole repeat (idle, event driven,
# while raw runs); the data path with raw and krcore taking turns, then
# mesh and memory each raw and krcore back to back, so that the two sides
# of a ratio are measured a few seconds apart, not minutes; which side goes
# first alternates by repeat.
run_repeat() {
    local i="$1" mpid mip mrc=0 rc=0 order
    if ((i % 2)); then order="raw krcore"; else order="krcore raw"; fi
    mip="$(gid_ipv4 "$server_gid")" || return 1
    "$klib/krcore-meta" --listen "$mip:$meta_port" --slots 4096 >"$out/meta-$i.txt" 2>&1 &
    mpid=$!
    wait_ready "$out/meta-$i.txt" "$mpid" '/serving on/p' >/dev/null || return 1
    echo "== run $i/$repeats: datapath, raw and krcore taking turns, ${order%% *} first ($(date +%T))"
    KRCORE_META="$mip:$meta_port" run_datapath "$i" "$(ports_of "$i" 0)" "$(ports_of "$i" 1)" "${order%% *}" || rc=1
    for phase in mesh mem; do
        ((rc)) && break
        for m in $order; do
            echo "== run $i/$repeats: $phase $m ($(date +%T))"
            if [[ "$m" == krcore ]]; then
                KRCORE_META="$mip:$meta_port" run_phase "$phase" "$m" "$i" || { rc=1; break 2; }
            else
                run_phase "$phase" "$m" "$i" || { rc=1; break 2; }
            fi
        done
    done
    kill -TERM "$mpid" 2>/dev/null || true
    wait "$mpid" || mrc=$?
    if ((rc)); then
        echo "vqp-compare: repeat $i failed (krcore-meta exit $mrc); meta output:" >&2
        cat "$out/meta-$i.txt" >&2
        return 1
    fi
}

report_table() {
    python3 bench/vqp_report.py "$out" "$repeats"
}

if [[ "${KRCORE_IN_VM:-}" == 1 ]]; then
    # KRCORE_DGRAM of every krcore process (the library's default when unset).
    if [[ -n "${KRCORE_BENCH_DGRAM:-}" ]]; then export KRCORE_DGRAM="$KRCORE_BENCH_DGRAM"; fi
    # Inside the VM (or on a host with an RDMA device): the measuring loop.
    if [[ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        bash scripts/rxe-up.sh 10
    fi
    for i in $(seq 1 "$repeats"); do
        run_repeat "$i"
    done
    echo "== done ($(date +%T))"
    exit 0
fi

if ((!report_only)); then
    host_preflight
    ((mesh_procs >= 2 && mesh_procs <= 10)) || { echo "vqp-compare: KRCORE_BENCH_MESH_PROCS must be in [2, 10] (10 emulated nodes)" >&2; exit 2; }
    ((mem_peers >= 2 && mem_peers <= 9)) || { echo "vqp-compare: KRCORE_BENCH_MEM_PEERS must be in [2, 9] (10 emulated nodes)" >&2; exit 2; }
    build_pair bench/datapath.c "$bin" "$kbin" "$klib"
    rm -rf "$out" && mkdir -p "$out"
    started=$SECONDS
    {
        echo "library: target/release/libkrcore.so, copied $(date -u +%FT%TZ)"
        echo "built: $(date -u -r target/release/libkrcore.so +%FT%TZ)"
        (cd "$klib" && sha256sum libkrcore.so krcore-meta)
        echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?'), uncommitted changes in src/: $(git --no-optional-locks status --porcelain -- src 2>/dev/null | wc -l) file(s)"
        echo "host load average before the run: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPU(s) (other VMs on this host skew both halves)"
        echo "settings: reads=$reads tput_ops=$tput_ops window=$window echos=$echos large_echos=$large_echos mesh_procs=$mesh_procs mesh_rounds=$mesh_rounds mem_vqps=$mem_vqps mem_peers=$mem_peers raw_qp_pairs=$raw_pairs"
    } >"$out/krcore-lib.txt"
    if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        KRCORE_IN_VM=1 bash "$0" "$repeats"
    else
        scripts/vm-run.sh "$out" env KRCORE_IN_VM=1 \
            KRCORE_BENCH_READS="$reads" KRCORE_BENCH_TPUT_OPS="$tput_ops" \
            KRCORE_BENCH_WINDOW="$window" KRCORE_BENCH_ECHOS="$echos" \
            KRCORE_BENCH_LARGE_ECHOS="$large_echos" \
            KRCORE_BENCH_MESH_PROCS="$mesh_procs" KRCORE_BENCH_MESH_ROUNDS="$mesh_rounds" \
            KRCORE_BENCH_MEM_VQPS="$mem_vqps" KRCORE_BENCH_MEM_PEERS="$mem_peers" \
            KRCORE_BENCH_RAW_QP_PAIRS="$raw_pairs" \
            KRCORE_BENCH_PORT="$port" KRCORE_BENCH_META_PORT="$meta_port" \
            KRCORE_BENCH_READY_S="$ready_s" KRCORE_BENCH_RUN_S="$run_s" \
            ${KRCORE_BENCH_DGRAM:+KRCORE_BENCH_DGRAM="$KRCORE_BENCH_DGRAM"} \
            bash bench/vqp-compare.sh "$repeats"
    fi
    echo "run time: $((SECONDS - started)) s (build excluded, VM boot included)" >>"$out/krcore-lib.txt"
fi

report_table | tee "$out/table.md"
