#!/usr/bin/env bash
# Instructions per 8-byte READ, raw verbs against a VQP, counted exactly:
# the datapath client (bench/datapath.c) runs under valgrind's callgrind,
# which counts every user-space instruction the process executes (not the
# kernel's: rxe's work inside the posting system call is the same in both
# modes). Unlike a time, a count does not move with the host's load.
#   bench/vqp-instructions.sh
# Boots the Soft-RoCE VM (or uses this machine's RDMA device), brings up
# rxe with 3 emulated nodes, starts krcore-meta (waits for "serving on")
# and, per mode, a datapath server (GID index 1, waits for "ready") and a
# client (GID index 2) under callgrind with READS latency READs. Prints,
# from the client's callgrind output (bench/callgrind_calls.py), what one
# `ibv_post_send` and one `ibv_poll_cq` of the latency loop cost:
#   instructions mode=raw|krcore post_ir=.. poll_ir=.. polls_per_read=..
#     read_ir=..
# and the krcore/raw difference per READ. Needs target/release (cargo
# build --release) and valgrind. Results in target/bench/instr.
#
# Environment: KRCORE_BENCH_READS (default 1000), KRCORE_BENCH_PORT
# (default 18850), KRCORE_BENCH_META_PORT (default 18849),
# KRCORE_BENCH_READY_S (default 120: valgrind starts slowly),
# KRCORE_BENCH_RUN_S (default 900), KRCORE_BENCH_VALGRIND_OPTS (more
# callgrind options, e.g. --dump-instr=yes to see the cost of each
# instruction with callgrind_annotate or kcachegrind).
set -euo pipefail
cd "$(dirname "$0")/.."
me=vqp-instructions
out=target/bench/instr
bin=target/bench/bin/datapath
kbin=target/bench/bin/datapath-krcore
klib=target/bench/krcore-lib-instr
reads="${KRCORE_BENCH_READS:-1000}"
vg_opts="${KRCORE_BENCH_VALGRIND_OPTS:-}"
port="${KRCORE_BENCH_PORT:-18850}"
meta_port="${KRCORE_BENCH_META_PORT:-18849}"
ready_s="${KRCORE_BENCH_READY_S:-120}"
run_s="${KRCORE_BENCH_RUN_S:-900}"
source bench/vm-helpers.sh

# One mode ($1: raw|krcore) on port $2: server, then the client under
# callgrind; its counts into $out/cg-$1.out, the summary line to stdout.
run_mode() {
    local mode="$1" p="$2" b spid addr rc=0
    if [[ "$mode" == raw ]]; then b="$bin"; else b="$kbin"; fi
    KRCORE_GID_INDEX=1 "$b" server -g 1 -p "$p" >"$out/server-$mode.txt" 2>&1 &
    spid=$!
    addr="$(wait_ready "$out/server-$mode.txt" "$spid" 's/^datapath: server ready on \([0-9.]*\) .*/\1/p')" || return 1
    KRCORE_GID_INDEX=2 timeout "$run_s" valgrind --tool=callgrind $vg_opts --callgrind-out-file="$out/cg-$mode.out" \
        "$b" client "$addr" -g 2 -p "$p" -r "$reads" -n 64 -w 32 -e 1 -E 1 -t clock \
        >"$out/client-$mode.txt" 2>"$out/valgrind-$mode.txt" || rc=$?
    wait "$spid" || rc=$?
    if ((rc)); then
        echo "$me: $mode failed (exit $rc):" >&2
        cat "$out/client-$mode.txt" "$out/valgrind-$mode.txt" "$out/server-$mode.txt" >&2
        return 1
    fi
    python3 bench/callgrind_calls.py "$out/cg-$mode.out" one_read poll1 >"$out/calls-$mode.txt"
    # The latency loop: one_read posts through the provider's (raw) or
    # our (krcore) post_send, then polls through poll1 until the READ
    # completed; the heaviest callee of each is the verb.
    awk -v mode="$mode" -v reads="$reads" '
        function field(k,   i, a) { for (i = 1; i <= NF; i++) if (split($i, a, "=") == 2 && a[1] == k) return a[2] }
        $2 == "caller=one_read" && field("callee") != "poll1" && field("callee") !~ /clock_gettime/ && !post { post = field("ir_per_call"); posts = field("calls") }
        $2 == "caller=poll1" && field("callee") !~ /clock_gettime|sched_yield|_dl_/ && !poll { poll = field("ir_per_call"); polls = field("calls") }
        END {
            if (!post || !poll) { print mode ": no post or poll calls found" > "/dev/stderr"; exit 1 }
            ppr = polls / posts
            printf "instructions mode=%s posts=%d post_ir=%.1f polls=%d poll_ir=%.1f polls_per_read=%.3f read_ir=%.1f\n", mode, posts, post, polls, poll, ppr, post + ppr * poll
        }' "$out/calls-$mode.txt"
}

if [[ "${KRCORE_IN_VM:-}" == 1 ]]; then
    if [[ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        bash scripts/rxe-up.sh 3
    fi
    mip="$(gid_ipv4 1)"
    "$klib/krcore-meta" --listen "$mip:$meta_port" >"$out/meta.txt" 2>&1 &
    mpid=$!
    wait_ready "$out/meta.txt" "$mpid" '/serving on/p' >/dev/null
    rc=0
    run_mode raw "$port" >"$out/summary.txt" || rc=1
    ((rc)) || KRCORE_META="$mip:$meta_port" run_mode krcore $((port + 1)) >>"$out/summary.txt" || rc=1
    kill -TERM "$mpid" 2>/dev/null || true
    wait "$mpid" || true
    exit "$rc"
fi

for tool in cc python3; do
    command -v "$tool" >/dev/null || { echo "$me: $tool not found (scripts/install-deps.sh)" >&2; exit 2; }
done
# Not needed by the tests, so not in scripts/install-deps.sh.
command -v valgrind >/dev/null || { echo "$me: valgrind not found (apt-get install valgrind)" >&2; exit 2; }
for f in target/release/libkrcore.so target/release/krcore-meta; do
    [[ -f "$f" ]] || { echo "$me: $f is missing: run cargo build --release first" >&2; exit 2; }
done
build_pair bench/datapath.c "$bin" "$kbin" "$klib"
rm -rf "$out" && mkdir -p "$out"
echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?'), uncommitted changes in src/: $(git --no-optional-locks status --porcelain -- src 2>/dev/null | wc -l) file(s)" >"$out/krcore-lib.txt"
if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
    KRCORE_IN_VM=1 bash "$0"
else
    scripts/vm-run.sh "$out" env KRCORE_IN_VM=1 KRCORE_BENCH_READS="$reads" \
        KRCORE_BENCH_PORT="$port" KRCORE_BENCH_META_PORT="$meta_port" \
        KRCORE_BENCH_READY_S="$ready_s" KRCORE_BENCH_RUN_S="$run_s" \
        KRCORE_BENCH_VALGRIND_OPTS="$vg_opts" bash bench/vqp-instructions.sh
fi
cat "$out/summary.txt"
awk '{ for (i = 1; i <= NF; i++) { split($i, a, "="); v[$2 "," a[1]] = a[2] } }
     END { printf "instructions krcore_minus_raw per READ: post %+.1f, poll %+.1f, READ %+.1f (%.2fx)\n",
           v["mode=krcore,post_ir"] - v["mode=raw,post_ir"], v["mode=krcore,poll_ir"] - v["mode=raw,poll_ir"],
           v["mode=krcore,read_ir"] - v["mode=raw,read_ir"], v["mode=krcore,read_ir"] / v["mode=raw,read_ir"] }' "$out/summary.txt"
