#!/usr/bin/env bash
# The paper's elastic experiments (issue 21; KRCORE paper §5.3.1 and
# §5.3.2), raw verbs and krcore side by side in one VM boot, on the
# key-value store of examples-c/ (kv_server, kv_client; GETs are one-sided
# READs of a hash bucket, PUTs messages):
#   bench/elastic-compare.sh [REPEATS]         (default 2)
#   bench/elastic-compare.sh --report REPEATS  (the table again, no new runs)
#
# Elastic bootstrap: for each N in NS (8 32 64) and each mode, a fresh
# server (and, for krcore, a fresh krcore-meta) on node 1 (GID index 1,
# 10.77.0.1), its table loaded with KEYS keys by one client's PUTs (each
# read back), then N new kv_client processes started at once by
# bench/elastic_launch.c on nodes 2-9 (GID indexes in turn; forked first,
# each waiting before its exec, then all released at one instant, their
# start): each connects, GETs a random key (checked), waits until all N
# have, then does GETS more (checked). Reported: the start to each
# process's first GET served (median, max over the N), the start to the
# last process's first GET ("all served"), and the GET throughput of all
# N together after they were all served.
# Serverless fetch: SERVERLESS fresh processes one after the other, each
# connecting and READing the server's 64 KiB object (checked byte for
# byte): start to data verified. Each is handed where the object lies
# (kv_client -o ADDR:RKEY, from kv_server's ready line), as a serverless
# function is given its input's location: krcore sends no HELLO; raw
# verbs still makes its TCP exchange, which its QP needs.
#
# Modes (their order alternates per repeat, so that neither always runs
# first after boot):
#   raw     kv_server / kv_client built -libverbs: an RC QP per client over
#           a TCP exchange (the server creates and connects a QP for each).
#   krcore  built -DKRCORE against a snapshot of target/release/libkrcore.so:
#           one VQP bound with qbind, clients qconnect + HELLO. KRCORE_META
#           and KRCORE_GID_INDEX set, every other knob at the library's
#           default.
#   agent   krcore with the per-host krcore-node agent (issue 21): only when
#           the snapshot has a krcore-node binary (one agent on the clients' first
#           GID, their KRCORE_NODE its socket).
#   agent-b with KRCORE_BENCH_LIB_DIR_B: the agent mode with that library
#           (kv_server-krcore-b and kv_client-krcore-b built against it, its
#           krcore-meta and krcore-node), so that two libraries are compared
#           in one boot. (Only the clients through LD_LIBRARY_PATH was
#           tried: their library, mapped by no process that lives, was read
#           again from the VM's host file system by each new process, 50-70
#           ms of the fetch whichever library it was.)
#
# The library is not built here: run `cargo build --release` first. The
# library, krcore-meta (and krcore-node) are copied to
# target/bench/elastic-lib so that a build during the run cannot change
# them; their sha256 and the git commit go to target/bench/elastic/lib.txt.
# Results in target/bench/elastic: burst-MODE-nN-R.txt (elastic_launch's
# per-process lines and its summary), serverless-MODE-R.txt, the servers',
# meta's and loaders' logs, the krcore processes' counters at exit
# (KRCORE_STATS_FILE: stats-MODE-nN-R/PID.json of the burst's clients,
# server-MODE-nN-R.json; they change nothing before the exit), and table.md (bench/elastic_report.py: medians
# over the repeats and the ratios raw / krcore computed per repeat).
#
# Environment:
#   KRCORE_BENCH_NS            the Ns of the bootstrap (default "8 32 64")
#   KRCORE_BENCH_MODES         the modes run (default "raw krcore agent"; a
#                              subset to look at one, e.g. a failure)
#   KRCORE_BENCH_GETS          GETs per client after all are served (1000)
#   KRCORE_BENCH_KEYS          keys loaded (1000)
#   KRCORE_BENCH_SERVERLESS    serverless processes per mode and repeat (20)
#   KRCORE_BENCH_CLIENT_GIDS   the clients' GID indexes (2,3,4,5,6,7,8,9)
#   KRCORE_BENCH_PORT          kv_server's TCP / VQP port (18800)
#   KRCORE_BENCH_META_PORT     krcore-meta's TCP port (18791)
#   KRCORE_BENCH_READY_S       wait for a server's ready line (60 s)
#   KRCORE_BENCH_BURST_S       bound on one burst, spawn to the last exit (300 s)
#   KRCORE_BENCH_STALL_S       a burst still running this long (60 s): what its
#                              server, krcore-meta and 3 clients wait in goes to
#                              stall-MODE-nN-R.txt (threads' state and kernel
#                              wait channel; user stacks with gdb, if installed)
#   KRCORE_BENCH_LIB_DIR       where libkrcore.so, krcore-meta and krcore-node
#                              are taken from (target/release)
#   KRCORE_BENCH_LIB_DIR_B     a second library (libkrcore.so, krcore-meta,
#                              krcore-node): adds the agent-b mode (above)
#   KRCORE_BENCH_AGENT_ARGS    krcore-node's arguments (default: --socket SOCK --gid-index 2)
#   KRCORE_BENCH_AGENT_READY   sed expression of krcore-node's ready line
#   KRCORE_BENCH_LOG           KRCORE_LOG for every process in the VM (a
#                              diagnosis: logs go to the servers' logs and
#                              burst-*.err, and change the timings; "info"
#                              costs little, "debug" ruins a burst)
#   KRCORE_BENCH_SERVER_LOG    KRCORE_LOG for kv_server alone (the side a
#                              burst's failures were seen on; overrides
#                              KRCORE_BENCH_LOG there)
#   KRCORE_VM_MEMORY           the VM's memory (scripts/vm-run.sh; this
#                              script's default 3G: 64 clients and a server)
set -euo pipefail
cd "$(dirname "$0")/.."
report_only=0
if [[ "${1:-}" == --report ]]; then report_only=1; shift; fi
repeats="${1:-2}"
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || { echo "elastic-compare: REPEATS must be a positive integer" >&2; exit 2; }
out=target/bench/elastic
bindir=target/bench/bin
klib=target/bench/elastic-lib
klib_b=target/bench/elastic-lib-b
libdir_b="${KRCORE_BENCH_LIB_DIR_B:-}"
libdir="${KRCORE_BENCH_LIB_DIR:-target/release}"
ns="${KRCORE_BENCH_NS:-8 32 64}"
gets="${KRCORE_BENCH_GETS:-1000}"
keys="${KRCORE_BENCH_KEYS:-1000}"
serverless="${KRCORE_BENCH_SERVERLESS:-20}"
client_gids="${KRCORE_BENCH_CLIENT_GIDS:-2,3,4,5,6,7,8,9}"
port="${KRCORE_BENCH_PORT:-18800}"
meta_port="${KRCORE_BENCH_META_PORT:-18791}"
ready_s="${KRCORE_BENCH_READY_S:-60}"
burst_s="${KRCORE_BENCH_BURST_S:-300}"
stall_s="${KRCORE_BENCH_STALL_S:-60}"
agent_sock=/tmp/krcore-node-bench.sock
agent_args="${KRCORE_BENCH_AGENT_ARGS:---socket $agent_sock --gid-index 2}"
agent_ready="${KRCORE_BENCH_AGENT_READY:-/serving at/p}"
server_gid=1
nodes=10

me=elastic-compare
source bench/vm-helpers.sh

# Stops process $1 (SIGTERM, then SIGKILL after 10 s); its exit status.
stop_pid() {
    local pid="$1" deadline=$((SECONDS + 10)) rc=0
    kill -TERM "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.05; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" || rc=$?
    return "$rc"
}

# ---- the krcore-node agent (issue 21) ----------------------------------------
# The agent mode starts "$klib/krcore-node --socket $agent_sock" (its meta
# servers from KRCORE_META) on the clients' first GID (all clients share one
# agent: one emulated device, so one host in this testbed), waits (bounded)
# for its "serving at" line, and runs the clients with KRCORE_NODE=that
# socket. KRCORE_BENCH_AGENT_ARGS / KRCORE_BENCH_AGENT_READY override the
# command line and the ready line. Without a krcore-node binary in the
# snapshot the mode is skipped (with a message).
agent_pid=
have_agent() { [[ -x "$klib/krcore-node" ]]; }
# The library of mode $1.
lib_of() { if [[ "$1" == agent-b ]]; then echo "$klib_b"; else echo "$klib"; fi; }
# The agent of mode $1 for run $2.
start_agent() {
    local lib tag="$2"
    lib="$(lib_of "$1")"
    rm -f "$agent_sock"
    # shellcheck disable=SC2086  # the arguments are meant to split
    KRCORE_GID_INDEX=2 "$lib/krcore-node" $agent_args >"$out/agent-$tag.log" 2>&1 &
    agent_pid=$!
    wait_ready "$out/agent-$tag.log" "$agent_pid" "$agent_ready" >/dev/null
}
stop_agent() {
    [[ -n "$agent_pid" ]] || return 0
    stop_pid "$agent_pid" || true
    agent_pid=
}

meta_pid=
server_pid=
addr=
object_at=

# Starts mode $1's servers (tag $2): krcore-meta (krcore, agent), the
# agent (agent), kv_server; sets addr, server_pid, object_at (where the
# server's 64 KiB object lies: ADDR:RKEY), and for the krcore modes exports
# KRCORE_META.
start_servers() {
    local mode="$1" tag="$2" sbin=kv_server
    addr="$(gid_ipv4 "$server_gid")" || return 1
    if [[ "$mode" != raw ]]; then
        "$(lib_of "$mode")/krcore-meta" --listen "$addr:$meta_port" >"$out/meta-$tag.log" 2>&1 &
        meta_pid=$!
        wait_ready "$out/meta-$tag.log" "$meta_pid" '/serving on/p' >/dev/null || return 1
        export KRCORE_META="$addr:$meta_port"
        sbin=kv_server-krcore
        if [[ "$mode" == agent-b ]]; then sbin=kv_server-krcore-b; fi
    fi
    if [[ "$mode" == agent* ]]; then
        start_agent "$mode" "$tag" || return 1
    fi
    KRCORE_GID_INDEX="$server_gid" KRCORE_STATS_FILE="$PWD/$out/server-$tag.json" \
        env ${KRCORE_BENCH_SERVER_LOG:+KRCORE_LOG="$KRCORE_BENCH_SERVER_LOG"} "$bindir/$sbin" -a "$addr" -P "$port" >"$(server_log "$tag")" 2>&1 &
    server_pid=$!
    object_at="$(wait_ready "$(server_log "$tag")" "$server_pid" \
        's/^kv_server: ready:.*; object 0x\([0-9a-f]*\) rkey 0x\([0-9a-f]*\).*/\1:\2/p')"
}

# Where kv_server (tag $1) logs: with KRCORE_BENCH_SERVER_LOG, in the VM's
# memory (a write to the shared results directory blocks the writer, and
# a server logging every packet there starves its own service thread),
# moved into $out when it stops.
server_log() {
    if [[ -n "${KRCORE_BENCH_SERVER_LOG:-}" && -w /dev/shm ]]; then
        echo "/dev/shm/server-$1.log"
    else
        echo "$out/server-$1.log"
    fi
}

# Stops whatever start_servers started (tag $1); 1 if the server did not
# exit 0.
stop_servers() {
    local tag="$1" rc=0
    if [[ -n "$server_pid" ]]; then stop_pid "$server_pid" || rc=$?; fi
    server_pid=
    if [[ "$(server_log "$tag")" != "$out/server-$tag.log" ]]; then
        mv "$(server_log "$tag")" "$out/server-$tag.log" 2>/dev/null || true
    fi
    stop_agent
    if [[ -n "$meta_pid" ]]; then stop_pid "$meta_pid" || true; fi
    meta_pid=
    unset KRCORE_META KRCORE_NODE
    if ((rc)); then
        echo "$me: kv_server exited with status $rc:" >&2
        cat "$out/server-$tag.log" >&2
        return 1
    fi
}

# The client binary and its per-mode arguments (raw: -g %g, the GID index
# elastic_launch gives each child; krcore: KRCORE_GID_INDEX, which the
# launcher sets for every child).
client_cmd() {
    case "$1" in
        raw) echo "$bindir/kv_client -g %g" ;;
        agent-b) echo "$bindir/kv_client-krcore-b" ;;
        *) echo "$bindir/kv_client-krcore" ;;
    esac
}

# A burst (tag $1) still running after stall_s: where its processes wait
# (a stall seen only in runs without logs: stop 42). Killed with the
# burst's end otherwise (it looks at the clock every second).
stall_watch() {
    local end=$((SECONDS + stall_s)) pid t
    while ((SECONDS < end)); do sleep 1; done
    {
        echo "# $(date +%T): the burst still runs after $stall_s s"
        for pid in "$server_pid" ${meta_pid:-} $(pgrep -f "$bindir/kv_client" | head -3); do
            echo "## pid $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-160)"
            for t in /proc/"$pid"/task/*; do
                echo "${t##*/} $(cat "$t/comm" 2>/dev/null) state $(cut -d' ' -f3 "$t/stat" 2>/dev/null) wchan $(cat "$t/wchan" 2>/dev/null)"
            done
            if command -v gdb >/dev/null; then
                timeout 60 gdb -p "$pid" -batch -ex 'thread apply all bt 16' 2>/dev/null | grep -E '^(Thread|#)'
            fi
        done
    } >"$out/stall-$1.txt" 2>&1
}

# One burst: mode $1, N $2, repeat $3.
run_burst() {
    local mode="$1" n="$2" i="$3" tag="$1-n$2-$3" rc=0 cmd
    cmd="$(client_cmd "$mode")"
    start_servers "$mode" "$tag" || { stop_servers "$tag" || true; return 1; }
    # The load: one client PUTs every key and reads each back (checked).
    # shellcheck disable=SC2086
    KRCORE_GID_INDEX=2 timeout "$burst_s" ${cmd//%g/2} -a "$addr" -P "$port" \
        -k "$keys" -L -n 0 >"$out/load-$tag.txt" 2>&1 || rc=$?
    if ((rc)); then
        echo "$me: loading the table failed ($rc):" >&2
        cat "$out/load-$tag.txt" >&2
        stop_servers "$tag" || true
        return 1
    fi
    if [[ "$mode" == agent* ]]; then export KRCORE_NODE="$agent_sock"; fi
    # Each krcore client writes its counters at exit (observation only:
    # which of its work requests went on the datagram tier).
    mkdir -p "$out/stats-$tag"
    stall_watch "$tag" &
    local watch=$!
    # The kernel's TCP counters over the burst (listen queue overflows
    # and SYN retransmissions delay a connect by a second each).
    nstat -n 2>/dev/null || true
    # shellcheck disable=SC2086
    KRCORE_STATS_FILE="$PWD/$out/stats-$tag/%p.json" "$bindir/elastic_launch" burst -n "$n" -g "$client_gids" -t "$burst_s" -- \
        $cmd -a "$addr" -P "$port" -k "$keys" -n $((gets + 1)) -T -W 3 \
        >"$out/burst-$tag.txt" 2>"$out/burst-$tag.err" || rc=$?
    kill "$watch" 2>/dev/null || true
    wait "$watch" 2>/dev/null || true
    nstat -z TcpExtListenOverflows TcpExtListenDrops TcpExtTCPSynRetrans TcpRetransSegs TcpExtTCPTimeouts >"$out/tcp-$tag.txt" 2>&1 || true
    stop_servers "$tag" || rc=1
    grep '^burst ' "$out/burst-$tag.txt" || true
    if ((rc)); then
        echo "$me: burst $tag failed; its errors (first 20 lines):" >&2
        head -20 "$out/burst-$tag.err" >&2
        return 1
    fi
}

# The serverless fetch: mode $1, repeat $2.
run_serverless() {
    local mode="$1" i="$2" tag="$1-sl-$2" rc=0 cmd
    cmd="$(client_cmd "$mode")"
    start_servers "$mode" "$tag" || { stop_servers "$tag" || true; return 1; }
    if [[ "$mode" == agent* ]]; then export KRCORE_NODE="$agent_sock"; fi
    # shellcheck disable=SC2086
    "$bindir/elastic_launch" serial -n "$serverless" -g "$client_gids" -t 60 -- \
        $cmd -a "$addr" -P "$port" -o "$object_at" -T \
        >"$out/serverless-$mode-$i.txt" 2>"$out/serverless-$mode-$i.err" || rc=$?
    stop_servers "$tag" || rc=1
    grep '^serial ' "$out/serverless-$mode-$i.txt" || true
    if ((rc)); then
        echo "$me: serverless $tag failed; its errors (first 20 lines):" >&2
        head -20 "$out/serverless-$mode-$i.err" >&2
        return 1
    fi
}

if [[ "${KRCORE_IN_VM:-}" == 1 ]]; then
    # Inside the VM (or on a host with an RDMA device): the measuring loop,
    # its progress and failures also kept in run.log.
    exec > >(tee -a "$out/run.log") 2>&1
    if [[ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        bash scripts/rxe-up.sh "$nodes"
    fi
    modes=(raw krcore)
    if have_agent; then
        modes+=(agent)
    else
        echo "== $me: no krcore-node in $libdir: the \"krcore + agent\" mode is skipped"
    fi
    if [[ -x "$bindir/kv_client-krcore-b" ]]; then modes+=(agent-b); fi
    if [[ -n "${KRCORE_BENCH_MODES:-}" ]]; then
        read -r -a modes <<<"$KRCORE_BENCH_MODES"
    fi
    failed=0
    for i in $(seq 1 "$repeats"); do
        # Odd repeats: raw first; even: reversed.
        order=("${modes[@]}")
        if ((i % 2 == 0)); then
            order=()
            for ((k = ${#modes[@]} - 1; k >= 0; k--)); do order+=("${modes[k]}"); done
        fi
        for n in $ns; do
            for mode in "${order[@]}"; do
                echo "== repeat $i/$repeats: N=$n $mode ($(date +%T))"
                run_burst "$mode" "$n" "$i" || { failed=$((failed + 1)); echo "$me: FAILED: burst $mode N=$n repeat $i" >&2; }
            done
        done
        for mode in "${order[@]}"; do
            echo "== repeat $i/$repeats: serverless $mode ($(date +%T))"
            run_serverless "$mode" "$i" || { failed=$((failed + 1)); echo "$me: FAILED: serverless $mode repeat $i" >&2; }
        done
    done
    echo "== done ($(date +%T)), $failed run(s) failed"
    exit $((failed > 0))
fi

vm_rc=0
if ((!report_only)); then
    for tool in cc python3; do
        command -v "$tool" >/dev/null || { echo "$me: $tool not found (scripts/install-deps.sh)" >&2; exit 2; }
    done
    for f in "$libdir/libkrcore.so" "$libdir/krcore-meta"; do
        [[ -f "$f" ]] || { echo "$me: $f is missing: run cargo build --release first" >&2; exit 2; }
    done
    if [[ "$libdir" == target/release && -n "$(find src Cargo.toml -newer target/release/libkrcore.so -print -quit)" ]]; then
        echo "$me: warning: src/ has changes newer than target/release/libkrcore.so (cargo build --release?)" >&2
    fi
    rm -rf "$klib" && mkdir -p "$klib" "$bindir"
    cp "$libdir/libkrcore.so" "$libdir/krcore-meta" "$klib/"
    if [[ -x "$libdir/krcore-node" ]]; then cp "$libdir/krcore-node" "$klib/"; fi
    rm -rf "$klib_b"
    rm -f "$bindir"/kv_*-krcore-b
    if [[ -n "$libdir_b" ]]; then
        mkdir -p "$klib_b"
        cp "$libdir_b/libkrcore.so" "$libdir_b/krcore-meta" "$libdir_b/krcore-node" "$klib_b/"
    fi
    cflags=(-O2 -std=gnu11 -Wall -Wextra -Werror)
    cc "${cflags[@]}" examples-c/kv_server.c -libverbs -o "$bindir/kv_server"
    cc "${cflags[@]}" examples-c/kv_client.c -libverbs -o "$bindir/kv_client"
    for p in kv_server kv_client; do
        cc "${cflags[@]}" -DKRCORE -I include "examples-c/$p.c" -L "$klib" -lkrcore \
            -Wl,-rpath,"$PWD/$klib" -o "$bindir/$p-krcore"
    done
    if [[ -n "$libdir_b" ]]; then
        for p in kv_server kv_client; do
            cc "${cflags[@]}" -DKRCORE -I include "examples-c/$p.c" -L "$klib_b" -lkrcore \
                -Wl,-rpath,"$PWD/$klib_b" -o "$bindir/$p-krcore-b"
        done
    fi
    cc "${cflags[@]}" bench/elastic_launch.c -o "$bindir/elastic_launch"
    rm -rf "$out" && mkdir -p "$out"
    {
        echo "library: $libdir/libkrcore.so, copied $(date -u +%FT%TZ)"
        echo "built: $(date -u -r "$libdir/libkrcore.so" +%FT%TZ)"
        (cd "$klib" && sha256sum ./*)
        if [[ -n "$libdir_b" ]]; then echo "library B (agent-b): $libdir_b"; (cd "$klib_b" && sha256sum ./*); fi
        echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?'), uncommitted changes in src/: $(git --no-optional-locks status --porcelain -- src 2>/dev/null | wc -l) file(s)"
        echo "host load average before the run: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPU(s)"
        echo "NS=$ns GETS=$gets KEYS=$keys SERVERLESS=$serverless CLIENT_GIDS=$client_gids"
    } >"$out/lib.txt"
    # The host's load while the VM runs (its CPUs run the VM's emulated
    # ones: another VM or a build on the host slows both modes).
    (while :; do echo "$(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"; sleep 5; done) \
        >"$out/host-load.txt" 2>/dev/null &
    sampler=$!
    trap 'kill "$sampler" 2>/dev/null || true' EXIT
    if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        KRCORE_IN_VM=1 bash "$0" "$repeats" || vm_rc=$?
    else
        KRCORE_VM_MEMORY="${KRCORE_VM_MEMORY:-3G}" scripts/vm-run.sh "$out" env KRCORE_IN_VM=1 \
            KRCORE_BENCH_NS="$ns" KRCORE_BENCH_GETS="$gets" KRCORE_BENCH_KEYS="$keys" \
            KRCORE_BENCH_SERVERLESS="$serverless" KRCORE_BENCH_CLIENT_GIDS="$client_gids" \
            KRCORE_BENCH_PORT="$port" KRCORE_BENCH_META_PORT="$meta_port" \
            KRCORE_BENCH_READY_S="$ready_s" KRCORE_BENCH_BURST_S="$burst_s" KRCORE_BENCH_STALL_S="$stall_s" \
            KRCORE_BENCH_LIB_DIR="$libdir" ${KRCORE_BENCH_MODES:+KRCORE_BENCH_MODES="$KRCORE_BENCH_MODES"} \
            ${KRCORE_BENCH_AGENT_ARGS:+KRCORE_BENCH_AGENT_ARGS="$KRCORE_BENCH_AGENT_ARGS"} \
            ${KRCORE_BENCH_AGENT_READY:+KRCORE_BENCH_AGENT_READY="$KRCORE_BENCH_AGENT_READY"} \
            ${KRCORE_BENCH_LOG:+KRCORE_LOG="$KRCORE_BENCH_LOG"} \
            ${KRCORE_BENCH_SERVER_LOG:+KRCORE_BENCH_SERVER_LOG="$KRCORE_BENCH_SERVER_LOG"} \
            bash bench/elastic-compare.sh "$repeats" || vm_rc=$?
    fi
    kill "$sampler" 2>/dev/null || true
fi

python3 bench/elastic_report.py "$out" "$repeats" | tee "$out/table.md"
exit "$vm_rc"
