#!/usr/bin/env bash
# The README's demo: what krcore is for, on a real RDMA stack (kernel
# Soft-RoCE, rxe), in a few minutes. Installs the dependencies, builds the
# release library, the VQP examples (examples-c) and bench/connect.c (raw
# and -DKRCORE), boots the Soft-RoCE VM (unless this machine has an RDMA
# device) with 5 emulated nodes (GID index i = 10.77.0.i), and there:
#   1. starts krcore-meta on node 1 and waits (bounded) for "serving on";
#   2. virtual QPs: examples-c/vqp_echo_server (one VQP, qbind + qpop_msgs)
#      on node 1 and four vqp_echo_client processes on nodes 2-5 (qconnect,
#      messages of 1 B to 1 MiB, every echo checked byte for byte);
#   3. connect cost: bench/connect.c with a few rounds: raw verbs (create QP,
#      INIT, exchange over TCP, RTR, RTS, first READ) against krcore's
#      qconnect warm (live link) and cold (new process), also attached to
#      the host's agent (krcore-node, its socket in KRCORE_NODE), medians and
#      ratios;
#   4. pass-through: unmodified ibv_rc_pingpong and ib_write_lat with
#      LD_PRELOAD=libkrcore.so and KRCORE_STATS=1 (counters prove the data
#      went through the library);
#   5. transparent VQPs: the same programs with KRCORE_VIRTUALIZE=1, their
#      counters showing their QPs were virtual.
# Exit status 0 only if every step succeeded and its checks passed. Logs in
# target/demo.
#   scripts/demo.sh
# Environment: KRCORE_DEMO_MSGS (messages per echo client, 200),
# KRCORE_DEMO_ROUNDS (raw and warm connections, 20),
# KRCORE_DEMO_COLD_ROUNDS (cold processes of each kind, 3).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/demo-bin          # bench/connect.c builds (not target/demo: the logs)
ex=target/examples-c/krcore  # the VQP examples, linked -lkrcore

if [[ "${KRCORE_IN_VM:-}" != 1 ]]; then
    start=$SECONDS
    scripts/install-deps.sh
    cargo build --release
    make -s -C examples-c krcore
    mkdir -p "$bin"
    cc -O2 -std=gnu11 -Wall -Wextra -Werror bench/connect.c -libverbs -o "$bin/connect"
    cc -O2 -std=gnu11 -Wall -Wextra -Werror -DKRCORE -I include bench/connect.c \
        -L target/release -lkrcore -Wl,-rpath,"$PWD/target/release" -o "$bin/connect-krcore"
    rm -rf target/demo
    rc=0
    if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        KRCORE_IN_VM=1 bash "$0" || rc=$?
    else
        echo "demo: booting the Soft-RoCE VM (software emulation, ~20 s)"
        scripts/vm-run.sh target/demo env KRCORE_IN_VM=1 \
            KRCORE_DEMO_MSGS="${KRCORE_DEMO_MSGS:-200}" \
            KRCORE_DEMO_ROUNDS="${KRCORE_DEMO_ROUNDS:-20}" \
            KRCORE_DEMO_COLD_ROUNDS="${KRCORE_DEMO_COLD_ROUNDS:-3}" \
            bash scripts/demo.sh || rc=$?
    fi
    echo "demo: took $((SECONDS - start)) s in all"
    exit "$rc"
fi

# ---- inside the VM, as root ------------------------------------------------
out="${KRCORE_VM_OUT:-$PWD/target/demo}"
mkdir -p "$out"
msgs="${KRCORE_DEMO_MSGS:-100}"
rounds="${KRCORE_DEMO_ROUNDS:-20}"
cold_rounds="${KRCORE_DEMO_COLD_ROUNDS:-3}"
lib="$PWD/target/release/libkrcore.so"
meta_addr=10.77.0.1:18700
echo_port=5000
bash scripts/rxe-up.sh 5
echo "demo: rxe0 up with 5 emulated nodes: GID index i = 10.77.0.i"

# On exit, stop the background processes this script started and that are
# still running (its own jobs, by pid).
cleanup() {
    local p
    for p in $(jobs -p); do kill -TERM "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

# wait_line LOG PID REGEX SECONDS: poll (bounded) until the log of process
# PID has a line matching REGEX; fail when PID exits first or time runs out.
wait_line() {
    local log="$1" pid="$2" re="$3" deadline=$((SECONDS + $4))
    while ((SECONDS < deadline)); do
        grep -q -- "$re" "$log" 2>/dev/null && return 0
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "   $log: the process exited before it was ready:"; sed 's/^/     /' "$log"
            return 1
        fi
        sleep 0.05
    done
    echo "   $log: not ready within $4 s:"; sed 's/^/     /' "$log"
    return 1
}

# stop PID: SIGTERM, then wait for it (bounded); its exit status.
stop() {
    local pid="$1" i
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    wait "$pid"
}

echo_ok=0 bench_ok=0 pass_ok=0 virt_ok=0
summary_echo="" summary_bench=""
t_echo=0 t_bench=0 t_pass=0 t_virt=0

# ---- 1. krcore-meta ---------------------------------------------------------
echo
echo "== 1. krcore-meta: the directory VQPs find each other through (node 1)"
timeout 900 target/release/krcore-meta --listen "$meta_addr" >"$out/meta.log" 2>&1 &
meta_pid=$!
if ! wait_line "$out/meta.log" "$meta_pid" 'krcore-meta: serving on' 60; then
    echo "demo: FAILED: krcore-meta did not start (logs in target/demo)"
    exit 1
fi
sed 's/^/   /' "$out/meta.log" | head -n 2
export KRCORE_META="$meta_addr"

# ---- 2. echo over virtual QPs -----------------------------------------------
echo_demo() {
    local sizes=(1 4096 65536 1048576) spid i node cpids=() rc=0 total=0 bytes=0 line
    echo
    echo "== 2. virtual QPs: one echo server VQP (qbind + qpop_msgs) on node 1,"
    echo "      4 client processes on nodes 2-5 (qconnect), $msgs messages each"
    timeout 300 "$ex/vqp_echo_server" -d rxe0 -a 10.77.0.1 -P "$echo_port" \
        >"$out/echo-server.out" 2>"$out/echo-server.err" &
    spid=$!
    wait_line "$out/echo-server.out" "$spid" 'ready: bound' 60 || return 1
    sed 's/^/   /' "$out/echo-server.out"
    for i in 0 1 2 3; do
        node=$((i + 2))
        KRCORE_GID_INDEX=$node timeout 180 "$ex/vqp_echo_client" -d rxe0 -a 10.77.0.1 \
            -P "$echo_port" -s "${sizes[i]}" -n "$msgs" \
            >"$out/echo-client-$node.out" 2>"$out/echo-client-$node.err" &
        cpids+=($!)
        total=$((total + msgs))
        bytes=$((bytes + msgs * sizes[i]))
    done
    echo "   (the clients run at once on the VM's 2 emulated CPUs: round trips include waiting"
    echo "   for a CPU; each qconnect is its process's first: library start, lookup, link handshake)"
    for i in 0 1 2 3; do
        node=$((i + 2))
        if wait "${cpids[i]}"; then
            sed "s/^vqp_echo_client: /   node $node: /" "$out/echo-client-$node.out"
        else
            rc=1
            echo "   node $node: client FAILED:"
            sed 's/^/     /' "$out/echo-client-$node.out" "$out/echo-client-$node.err"
        fi
    done
    stop "$spid" || { rc=1; echo "   the server exited with an error:"; sed 's/^/     /' "$out/echo-server.err"; }
    line="$(grep 'echoed' "$out/echo-server.out" || true)"
    echo "   ${line:-the server printed no summary}"
    if [[ "$line" != *"echoed $total messages ($bytes bytes) from 4 senders, 0 failed, "* ]]; then
        echo "   expected: echoed $total messages ($bytes bytes) from 4 senders, 0 failed"
        rc=1
    fi
    if ((rc == 0)); then
        summary_echo="4 clients x $msgs messages (1 B - 1 MiB) echoed through one bound VQP, every byte checked"
    fi
    return "$rc"
}
t=$SECONDS
echo_demo && echo_ok=1
t_echo=$((SECONDS - t))

# ---- 3. connect cost ----------------------------------------------------------
bench_demo() {
    local spid rc=0
    echo
    echo "== 3. connect cost, raw verbs vs qconnect (bench/connect.c, node 2 -> node 1): until the"
    echo "      QP can send, and until a first 8 B READ completed (software-emulated RDMA:"
    echo "      compare the rows, not the absolute numbers)"
    # Raw verbs: the server (node 1) makes and connects a QP per round; it
    # exits when the client (node 2) is done.
    timeout 240 "$bin/connect" -s -d rxe0 -g 1 -p 18777 >"$out/raw-server.out" 2>&1 &
    spid=$!
    wait_line "$out/raw-server.out" "$spid" 'server listening on' 60 || return 1
    if ! timeout 180 "$bin/connect" -c 10.77.0.1 -d rxe0 -g 2 -p 18777 -n "$rounds" -r 100 \
        >"$out/raw.out" 2>"$out/raw.err"; then
        sed 's/^/   raw: /' "$out/raw.err"
        stop "$spid" || true
        return 1
    fi
    wait "$spid" || { sed 's/^/   raw server: /' "$out/raw-server.out"; return 1; }

    # krcore: a VQP bound with qbind on node 1 (connect-krcore -s answers
    # the clients' MR requests); warm and cold clients on node 2.
    KRCORE_GID_INDEX=1 timeout 300 "$bin/connect-krcore" -s -d rxe0 -g 1 -p 18778 \
        >"$out/krcore-server.out" 2>&1 &
    spid=$!
    wait_line "$out/krcore-server.out" "$spid" 'server bound on' 60 || return 1
    KRCORE_GID_INDEX=2 timeout 180 "$bin/connect-krcore" -c 10.77.0.1 -m warm -d rxe0 -g 2 \
        -p 18778 -n "$rounds" -r 100 >"$out/krcore-warm.out" 2>"$out/krcore-warm.err" \
        || { rc=1; sed 's/^/   warm: /' "$out/krcore-warm.err"; }
    KRCORE_GID_INDEX=2 timeout 180 "$bin/connect-krcore" -c 10.77.0.1 -m cold -d rxe0 -g 2 \
        -p 18778 -n "$cold_rounds" -r 100 >"$out/krcore-cold.out" 2>"$out/krcore-cold.err" \
        || { rc=1; sed 's/^/   cold: /' "$out/krcore-cold.err"; }
    # The same new processes attached to the host's agent (krcore-node):
    # lookups and their first READs through it.
    local npid sock=/tmp/krcore-demo-node.sock
    KRCORE_GID_INDEX=2 timeout 300 target/release/krcore-node --socket "$sock" --gid-index 2 >"$out/node.log" 2>&1 &
    npid=$!
    if wait_line "$out/node.log" "$npid" 'krcore-node: serving at' 60; then
        KRCORE_NODE="$sock" KRCORE_GID_INDEX=2 timeout 180 "$bin/connect-krcore" -c 10.77.0.1 -m cold -d rxe0 -g 2 \
            -p 18778 -n "$cold_rounds" -r 100 >"$out/krcore-agent.out" 2>"$out/krcore-agent.err" \
            || { rc=1; sed 's/^/   agent: /' "$out/krcore-agent.err"; }
    else
        rc=1
        sed 's/^/   krcore-node: /' "$out/node.log"
    fi
    stop "$npid" || true
    stop "$spid" || { rc=1; sed 's/^/   krcore server: /' "$out/krcore-server.out"; }
    ((rc == 0)) || return 1
    summary_bench="$(python3 - "$out" "$rounds" "$cold_rounds" <<'EOF'
import statistics, sys
from pathlib import Path

out, rounds, cold = Path(sys.argv[1]), sys.argv[2], sys.argv[3]

# bench/connect.c prints one line per round with total_us (connect + first
# 8 B READ) and read_us (the first READ): "round N ..." (raw, krcore warm),
# "cold N kind=cold|first ..." (krcore cold). Medians over the rounds of
# the total and of the connect alone (total - read).
def medians(name, prefix, kind=None):
    rows = []
    for line in (out / name).read_text().splitlines():
        if line.startswith(prefix):
            kv = dict(t.split("=", 1) for t in line.split() if "=" in t)
            if kind and kv.get("kind") != kind:
                continue
            rows.append((float(kv["total_us"]), float(kv["total_us"]) - float(kv["read_us"])))
    if not rows:
        sys.exit(f"   {name}: no round lines")
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)

raw = medians("raw.out", "round ")
warm = medians("krcore-warm.out", "round ")
cold_ = medians("krcore-cold.out", "cold ", "cold")
first = medians("krcore-cold.out", "cold ", "first")
agent_cold = medians("krcore-agent.out", "cold ", "cold")
agent_first = medians("krcore-agent.out", "cold ", "first")

def x(r):
    return f"{r:.0f}x" if r >= 10 else f"{r:.1f}x" if r >= 1 else f"{r:.2f}x"

rows = [
    ("raw verbs: create QP, INIT, TCP exchange, RTR, RTS", raw),
    ("krcore warm: create VQP, qconnect (live link)", warm),
    ("krcore cold: new process, lookup + link handshake", cold_),
    ("krcore cold, the process's first extended verb", first),
    ("krcore cold, attached to the host's agent", agent_cold),
    ("krcore first extended verb, attached to the agent", agent_first),
]
w = max(len(r[0]) for r in rows)
print(f"   {'medians, microseconds':<{w}}  {'connect':>8} {'raw/this':>8}  {'+1st READ':>9} {'raw/this':>8}")
for label, (tot, conn) in rows:
    print(f"   {label:<{w}}  {conn:>8.1f} {x(raw[1] / conn):>8}  {tot:>9.1f} {x(raw[0] / tot):>8}")
print(f"   (raw and warm: {rounds} rounds each; cold: {cold} new processes with the library started, "
      f"and {cold} where qconnect starts it)")
print(f"warm qconnect {x(raw[1] / warm[1])} cheaper than a raw verbs connect "
      f"({x(raw[0] / warm[0])} with the first READ); a cold one (a new process's first "
      f"contact) costs {x(cold_[1] / raw[1])} a raw connect; a new process's first extended verb until its "
      f"first READ costs {x(first[0] / raw[0])} a raw connect + READ, {x(agent_first[0] / raw[0])} attached to the agent")
EOF
)" || return 1
    echo "$summary_bench" | sed '$d'
    summary_bench="$(echo "$summary_bench" | tail -n 1)"
}
t=$SECONDS
bench_demo && bench_ok=1
t_bench=$((SECONDS - t))
# Pass-through needs no meta server (step 5 names it itself).
unset KRCORE_META

# ---- 4. pass-through ---------------------------------------------------------
# counters LOG: the library's counters from a stderr log, one short line;
# fail unless data moved through the library (posts or ibv_wr_*, and polls).
counters() {
    python3 - "$1" "${2:-0}" <<'EOF'
import json, sys
for line in open(sys.argv[1], errors="replace"):
    if '{"krcore"' in line:   # "krcore-stats: {...}" (prefix tolerated)
        c = json.loads(line[line.index('{"krcore"'):])["counters"]
        moved = c["post_send"] + c["post_recv"] + c["post_srq_recv"] + c["wr_calls"]
        print(f"post_send={c['post_send']} post_recv={c['post_recv']} poll_cq={c['poll_cq']}", end="")
        virt = sys.argv[2] == "1"
        if virt:
            print(f" qps_virtualized={c['qps_virtualized']} links_opened={c['links_opened']}", end="")
        sys.exit(0 if c["contexts_opened"] >= 1 and moved > 0 and c["poll_cq"] > 0
                 and (not virt or c["qps_virtualized"] > 0) else 1)
print("no krcore stats line: the library was not on the path", end="")
sys.exit(1)
EOF
}

# pair NAME PORT RESULT_REGEX AWK_FORMAT SERVER_CMD... -- CLIENT_CMD...
# (prints the client's first line matching RESULT_REGEX through AWK_FORMAT)
# With VIRT=1 both run with KRCORE_VIRTUALIZE=1 (server on GID 1, client on
# GID 2) and must show their QPs were virtual.
pair() {
    local name="$1" port="$2" re="$3" fmt="$4"; shift 4
    local srv=() ok=0 spid role res c
    while [[ "$1" != -- ]]; do srv+=("$1"); shift; done; shift
    local venv=()
    ((${VIRT:-0})) && venv=(KRCORE_VIRTUALIZE=1 KRCORE_META="$meta_addr")
    timeout 120 env LD_PRELOAD="$lib" KRCORE_STATS=1 "${venv[@]}" KRCORE_GID_INDEX=1 "${srv[@]}" \
        >"$out/$name.server.out" 2>"$out/$name.server.err" &
    spid=$!
    local _
    for _ in $(seq 1 300); do   # bounded wait for the server's TCP port
        ss -Hltn | awk '{print $4}' | grep -q ":$port\$" && break
        kill -0 "$spid" 2>/dev/null || break
        sleep 0.05
    done
    timeout 120 env LD_PRELOAD="$lib" KRCORE_STATS=1 "${venv[@]}" KRCORE_GID_INDEX=2 "$@" \
        >"$out/$name.client.out" 2>"$out/$name.client.err" || ok=1
    wait "$spid" || ok=1
    res="$(grep -E "$re" "$out/$name.client.out" | head -n 1 | awk "$fmt")"
    printf '   %-16s %s\n' "$name" "${res:-no result line}"
    for role in server client; do
        c="$(counters "$out/$name.$role.err" "${VIRT:-0}")" || ok=1
        printf '   %-16s %s through libkrcore.so: %s\n' "" "$role" "$c"
    done
    ((ok == 0)) || { echo "   $name FAILED (logs in target/demo/$name.*)"; }
    return "$ok"
}

echo
echo "== 4. pass-through: unmodified perftest / pingpong with LD_PRELOAD=libkrcore.so"
rc4=0 t=$SECONDS
pair ibv_rc_pingpong 18515 'bytes in' '{ print $1, "bytes in", $4, "s:", $7, "Mbit/s" }' \
    ibv_rc_pingpong -d rxe0 -g 1 -p 18515 -c -- \
    ibv_rc_pingpong -d rxe0 -g 2 -p 18515 -c 10.77.0.1 || rc4=1
pair ib_write_lat 18516 '^ *2 +1000 ' \
    '{ printf "%s B x %s: latency typical %s us, average %s us\n", $1, $2, $5, $6 }' \
    ib_write_lat -d rxe0 -x 1 -p 18516 -s 2 -n 1000 -F -- \
    ib_write_lat -d rxe0 -x 2 -p 18516 -s 2 -n 1000 -F 10.77.0.1 || rc4=1
((rc4 == 0)) && pass_ok=1
t_pass=$((SECONDS - t))

echo
echo "== 5. transparent virtual QPs: the same unmodified programs with KRCORE_VIRTUALIZE=1:"
echo "      their RC QPs become virtual QPs on the links between the two processes"
rc5=0 t=$SECONDS
VIRT=1 pair ibv_rc_pingpong_v 18517 'bytes in' '{ print $1, "bytes in", $4, "s:", $7, "Mbit/s" }' \
    ibv_rc_pingpong -d rxe0 -g 1 -p 18517 -c -- \
    ibv_rc_pingpong -d rxe0 -g 2 -p 18517 -c 10.77.0.1 || rc5=1
VIRT=1 pair ib_write_lat_v 18518 '^ *2 +1000 ' \
    '{ printf "%s B x %s: latency typical %s us, average %s us\n", $1, $2, $5, $6 }' \
    ib_write_lat -d rxe0 -x 1 -p 18518 -s 2 -n 1000 -F -- \
    ib_write_lat -d rxe0 -x 2 -p 18518 -s 2 -n 1000 -F 10.77.0.1 || rc5=1
((rc5 == 0)) && virt_ok=1
t_virt=$((SECONDS - t))
stop "$meta_pid" >/dev/null 2>&1 || true

# ---- summary ------------------------------------------------------------------
verdict() { (($1)) && echo "OK    " || echo "FAILED"; }
echo
echo "== summary (steps 1-5: $SECONDS s)"
echo "   $(verdict $echo_ok) echo over virtual QPs (${t_echo} s): ${summary_echo:-see above}"
echo "   $(verdict $bench_ok) connect cost (${t_bench} s): ${summary_bench:-see above}"
echo "   $(verdict $pass_ok) pass-through (${t_pass} s): ibv_rc_pingpong and ib_write_lat moved data through libkrcore.so"
echo "   $(verdict $virt_ok) transparent (${t_virt} s): the same programs ran on virtual QPs (KRCORE_VIRTUALIZE=1)"
if ((echo_ok && bench_ok && pass_ok && virt_ok)); then
    echo "demo: OK (logs in target/demo)"
    exit 0
fi
echo "demo: FAILED (logs in target/demo)"
exit 1
