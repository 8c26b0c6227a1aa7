#!/usr/bin/env bash
# The README's demo: unmodified RDMA programs moving real data through
# libkrcore.so. Installs the dependencies, builds the release library, boots
# the Soft-RoCE VM (unless this machine has an RDMA device), then runs
# ibv_rc_pingpong and ib_write_lat with LD_PRELOAD=libkrcore.so,
# KRCORE_LOG=info and KRCORE_STATS=1 (the library prints its counters as one
# JSON line on stderr at exit). Exit status 0 only if both pairs succeeded and
# every process's counters show posts and polls through the library.
#   scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${KRCORE_IN_VM:-}" != 1 ]]; then
    scripts/install-deps.sh
    cargo build --release
    if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        KRCORE_IN_VM=1 exec bash "$0"
    fi
    echo "demo: booting the Soft-RoCE VM (software emulation, ~20 s)"
    exec scripts/vm-run.sh target/demo env KRCORE_IN_VM=1 bash scripts/demo.sh
fi

# ---- inside the VM, as root ------------------------------------------------
out="${KRCORE_VM_OUT:-$PWD/target/demo}"
mkdir -p "$out"
bash scripts/rxe-up.sh 2
echo "demo: rxe0 up: node A = GID 1 (10.77.0.1), node B = GID 2 (10.77.0.2)"
lib="$PWD/target/release/libkrcore.so"
preload=(env LD_PRELOAD="$lib" KRCORE_LOG=info KRCORE_STATS=1)

wait_port() {   # bounded poll until a TCP port listens (no fixed sleeps)
    local _
    for _ in $(seq 1 300); do
        ss -Hltn | awk '{print $4}' | grep -q ":$1\$" && return 0
        sleep 0.1
    done
    return 1
}

# stats LOG: print the library's stats line from a stderr log; fail unless
# data moved through the library (posts or ibv_wr_* calls, and polls).
stats() {
    python3 - "$1" <<'EOF'
import json, sys
for line in open(sys.argv[1], errors="replace"):
    if '{"krcore"' in line:   # "krcore-stats: {...}" (prefix tolerated)
        doc = json.loads(line[line.index('{"krcore"'):])
        c = doc["counters"]
        moved = c["post_send"] + c["post_recv"] + c["post_srq_recv"] + c["wr_calls"]
        print(f"    krcore {doc['krcore']} pid {doc['pid']}: contexts={c['contexts_opened']} "
              f"qps={c['qps_created']} mrs={c['mrs_registered']} post_send={c['post_send']} "
              f"post_recv={c['post_recv']} poll_cq={c['poll_cq']}")
        sys.exit(0 if c["contexts_opened"] >= 1 and moved > 0 and c["poll_cq"] > 0 else 1)
print("    no krcore stats line: the library was not on the path")
sys.exit(1)
EOF
}

# pair NAME PORT RESULT_REGEX SERVER_CMD... -- CLIENT_CMD...
pair() {
    local name="$1" port="$2" re="$3"; shift 3
    local srv=() ok=0 spid role
    while [[ "$1" != -- ]]; do srv+=("$1"); shift; done; shift
    echo
    echo "== $name (LD_PRELOAD=libkrcore.so KRCORE_LOG=info KRCORE_STATS=1)"
    echo "   server: ${srv[*]}"
    echo "   client: $*"
    timeout 120 "${preload[@]}" "${srv[@]}" >"$out/$name.server.out" 2>"$out/$name.server.err" &
    spid=$!
    wait_port "$port" || { echo "   server did not listen"; kill "$spid"; return 1; }
    timeout 120 "${preload[@]}" "$@" >"$out/$name.client.out" 2>"$out/$name.client.err" || ok=1
    wait "$spid" || ok=1
    for role in server client; do
        echo "  $role:"
        grep -E "$re" "$out/$name.$role.out" | sed 's/^/    /' || true
        grep -v '{"krcore"' "$out/$name.$role.err" | head -n 5 | sed 's/^/    log: /' || true
        stats "$out/$name.$role.err" || ok=1
    done
    return "$ok"
}

rc=0
pair ibv_rc_pingpong 18515 'bytes in|iters in' \
    ibv_rc_pingpong -d rxe0 -g 1 -p 18515 -c -- \
    ibv_rc_pingpong -d rxe0 -g 2 -p 18515 -c 10.77.0.1 || rc=1
pair ib_write_lat 18516 't_typical|^ *2 ' \
    ib_write_lat -d rxe0 -x 1 -p 18516 -s 2 -n 1000 -F -- \
    ib_write_lat -d rxe0 -x 2 -p 18516 -s 2 -n 1000 -F 10.77.0.1 || rc=1
echo
if ((rc == 0)); then
    echo "demo: OK: both programs moved data through libkrcore.so (logs in target/demo)"
else
    echo "demo: FAILED (logs in target/demo)"
fi
exit "$rc"
