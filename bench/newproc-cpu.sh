#!/usr/bin/env bash
# The CPU a new process uses until its first GET (issue 21: a burst of new
# processes is CPU-bound), raw verbs, krcore and krcore attached to a
# krcore-node agent, one fresh kv_client at a time in one VM boot.
#   bench/newproc-cpu.sh [ROUNDS]   (default 7: ROUNDS processes per mode,
#                                    the modes alternating)
# Builds examples-c/kv_server.c and kv_client.c twice (raw, -DKRCORE)
# against a snapshot of target/release (bench/vm-helpers.sh's build_pair;
# run `cargo build --release` first), boots the VM, starts krcore-meta, a
# kv_server of each build and the agent, loads 100 keys, then runs
# `kv_client -n 1 -T` per mode and round and reads its CPU time (user +
# system, all threads, getrusage) at main, set-up (device, PD, CQ, MR),
# path, connected and its first GET ("*_cpu_us" of its kv_times line).
# Output: one line per process, then the medians per mode (ms), in
# target/bench/newproc-cpu/cpu.txt. Every wait is bounded.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-7}"
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "newproc-cpu: ROUNDS must be a positive integer" >&2; exit 2; }
me=newproc-cpu
ready_s=60
out=target/bench/newproc-cpu
bin=target/bench/bin
klib=target/bench/newproc-lib
source bench/vm-helpers.sh

if [[ "${KRCORE_IN_VM:-}" == 1 ]]; then
    [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]] || bash scripts/rxe-up.sh 4 >/dev/null
    addr="$(gid_ipv4 1)"
    pids=()
    trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
    "$klib/krcore-meta" --listen "$addr:18791" >"$out/meta.log" 2>&1 &
    pids+=($!)
    wait_ready "$out/meta.log" "$!" '/serving on/p' >/dev/null
    export KRCORE_META="$addr:18791"
    KRCORE_GID_INDEX=1 "$bin/kv_server-krcore" -a "$addr" -P 18800 >"$out/server-krcore.log" 2>&1 &
    pids+=($!)
    wait_ready "$out/server-krcore.log" "$!" '/^kv_server: ready:/p' >/dev/null
    "$bin/kv_server" -a "$addr" -P 18801 >"$out/server-raw.log" 2>&1 &
    pids+=($!)
    wait_ready "$out/server-raw.log" "$!" '/^kv_server: ready:/p' >/dev/null
    KRCORE_GID_INDEX=2 "$klib/krcore-node" --socket /tmp/newproc-node.sock --gid-index 2 >"$out/agent.log" 2>&1 &
    pids+=($!)
    wait_ready "$out/agent.log" "$!" '/serving at/p' >/dev/null
    KRCORE_GID_INDEX=2 timeout 60 "$bin/kv_client-krcore" -a "$addr" -P 18800 -k 100 -L -n 0 >/dev/null
    timeout 60 "$bin/kv_client" -g 2 -a "$addr" -P 18801 -k 100 -L -n 0 >/dev/null
    cpu() { grep -o '[a-z_]*cpu_us=[0-9]*' | tr '\n' ' '; }
    for i in $(seq 1 "$rounds"); do
        echo "raw $(timeout 60 "$bin/kv_client" -g 3 -a "$addr" -P 18801 -k 100 -n 1 -T | cpu)"
        echo "krcore $(KRCORE_GID_INDEX=3 timeout 60 "$bin/kv_client-krcore" -a "$addr" -P 18800 -k 100 -n 1 -T | cpu)"
        echo "agent $(KRCORE_NODE=/tmp/newproc-node.sock KRCORE_GID_INDEX=3 timeout 60 \
            "$bin/kv_client-krcore" -a "$addr" -P 18800 -k 100 -n 1 -T | cpu)"
    done >"$out/cpu.txt"
    exit 0
fi

host_preflight
rm -rf "$out" && mkdir -p "$out"
build_pair examples-c/kv_server.c "$bin/kv_server" "$bin/kv_server-krcore" "$klib"
build_pair examples-c/kv_client.c "$bin/kv_client" "$bin/kv_client-krcore" "$klib"
[[ -x "$klib/krcore-node" ]] || { echo "$me: no krcore-node in target/release" >&2; exit 2; }
if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
    KRCORE_IN_VM=1 bash "$0" "$rounds"
else
    scripts/vm-run.sh "$out" env KRCORE_IN_VM=1 bash bench/newproc-cpu.sh "$rounds"
fi
python3 - "$out/cpu.txt" <<'EOF' | tee -a "$out/cpu.txt"
import collections, statistics, sys

keys = ["main_cpu_us", "setup_cpu_us", "path_cpu_us", "connected_cpu_us", "cpu_us"]
names = ["main", "set-up", "path", "connected", "first GET"]
seen = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    mode, *fields = line.split()
    for f in fields:
        k, v = f.split("=")
        seen[mode][k].append(int(v) / 1000)
print("| mode | " + " | ".join(names) + " | processes |")
print("| --- |" + " ---: |" * (len(names) + 1))
for mode, kv in seen.items():
    print(f"| {mode} | " + " | ".join(f"{statistics.median(kv[k]):.1f}" for k in keys) + f" | {len(kv['cpu_us'])} |")
EOF
