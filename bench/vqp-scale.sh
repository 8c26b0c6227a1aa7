#!/usr/bin/env bash
# Physical QPs and memory for N application RC QPs, transparent VQPs
# (KRCORE_VIRTUALIZE=1) against plain RC QPs (issue 8), all in ONE VM boot.
#   bench/vqp-scale.sh [REPEATS]          (default 1)
#   bench/vqp-scale.sh --report REPEATS   (the table again, no new runs)
# Builds bench/vqp_scale.c (cc, linked -libverbs only: the library is
# LD_PRELOADed) to target/bench/bin/vqp_scale and snapshots
# target/release/libkrcore.so and krcore-meta to target/bench/krcore-lib-scale
# (so that a cargo build during the run cannot change them; sha256 in
# target/bench/scale/krcore-lib.txt). The library is not built here: run
# `cargo build --release` first. Then boots the Soft-RoCE VM once (or uses
# this machine's RDMA device when /sys/class/infiniband is not empty;
# CT_DEVICE, default rxe0), brings up rxe with 3 emulated nodes (GID index
# i = 10.77.0.i), starts krcore-meta --listen 10.77.0.1:META_PORT --slots
# 65536 (waits, bounded, for "serving on") for the whole boot and runs,
# REPEATS times, for each N of SIZES, the three modes in a rotating order:
#   raw    vqp_scale as is (libibverbs only);
#   plain  LD_PRELOAD=libkrcore.so, KRCORE_META and KRCORE_GID_INDEX set,
#          no KRCORE_VIRTUALIZE: every RC QP real (pass-through);
#   virt   the same and KRCORE_VIRTUALIZE=1: every RC QP virtual, the two
#          processes connecting at the same time (each makes a link);
#   virt-o the same, node 1 connecting its first QP before node 2 starts
#          (vqp_scale -o): one link between the two.
# One run: the node-1 process (GID index 1) forks the node-2 peer (GID
# index 2); each creates N RC QPs and connects them pairwise with plain
# ibv_modify_qp, one checked SEND per QP each way; then, with all N
# connected, the kernel QPs of each process (`rdma resource show qp`,
# the library's own included), its VmRSS / VmSize / VmPin before and
# after, the machine's kernel memory (VmallocUsed + SUnreclaim) and the
# wall time (see bench/vqp_scale.c). Every run is bounded (RUN_S); the
# only waits are for printed lines (krcore-meta's "serving on") and for
# the processes themselves.
# Results in target/bench/scale: MODE-N-R.txt (both processes' lines),
# qps-idle.txt (the QPs before the first run: the kernel's and
# krcore-meta's), meta.txt, and table.md (bench/vqp_scale_report.py).
#
# Environment:
#   KRCORE_BENCH_SIZES      the values of N (default "10 100 1000")
#   KRCORE_BENCH_MODES      the modes (default "raw plain virt virt-o")
#   KRCORE_BENCH_META_PORT  krcore-meta's TCP port (default 18795)
#   KRCORE_BENCH_READY_S    wait for krcore-meta's line (default 60)
#   KRCORE_BENCH_RUN_S      bound on each run (default 600)
set -euo pipefail
cd "$(dirname "$0")/.."
report_only=0
if [[ "${1:-}" == --report ]]; then report_only=1; shift; fi
repeats="${1:-1}"
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || { echo "vqp-scale: REPEATS must be a positive integer" >&2; exit 2; }
out=target/bench/scale
bin=target/bench/bin/vqp_scale
klib=target/bench/krcore-lib-scale
sizes="${KRCORE_BENCH_SIZES:-10 100 1000}"
modes="${KRCORE_BENCH_MODES:-raw plain virt virt-o}"
meta_port="${KRCORE_BENCH_META_PORT:-18795}"
ready_s="${KRCORE_BENCH_READY_S:-60}"
run_s="${KRCORE_BENCH_RUN_S:-600}"
server_gid=1

me=vqp-scale
source bench/vm-helpers.sh

# One run: mode $1, N $2, repeat $3; krcore-meta at $4 (ip:port), pid $5.
run_one() {
    local mode="$1" n="$2" i="$3" meta="$4" mpid="$5" f rc=0
    local -a pre=()
    f="$out/$mode-$n-$i.txt"
    case "$mode" in
        raw) ;;
        plain) pre=(env LD_PRELOAD="$PWD/$klib/libkrcore.so" KRCORE_META="$meta") ;;
        virt|virt-o) pre=(env LD_PRELOAD="$PWD/$klib/libkrcore.so" KRCORE_META="$meta" KRCORE_VIRTUALIZE=1) ;;
        *) echo "vqp-scale: unknown mode $mode" >&2; return 1 ;;
    esac
    # vqp_scale bounds its own waits to RUN_S; timeout is the backstop.
    local -a opt=()
    [[ "$mode" == virt-o ]] && opt=(-o)
    timeout $((2 * run_s + 120)) "${pre[@]}" "$bin" -n "$n" -m "$mode" -t "$run_s" -M "$mpid" \
        "${opt[@]}" >"$f" 2>&1 || rc=$?
    echo "$rc" >"$f.rc"
    grep -e '^scale ' -e '^scale_qps .*who=node' "$f" | sed 's/^/  /' || true
    if ((rc)); then
        echo "vqp-scale: $mode N=$n repeat $i failed (exit $rc):" >&2
        tail -n 30 "$f" >&2
        return 1
    fi
}

report_table() {
    python3 bench/vqp_scale_report.py "$out" "$repeats" "$sizes" "$modes"
}

if [[ "${KRCORE_IN_VM:-}" == 1 ]]; then
    # Inside the VM (or on a host with an RDMA device): the measuring loop.
    if [[ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        bash scripts/rxe-up.sh 3
    fi
    mip="$(gid_ipv4 "$server_gid")"
    "$klib/krcore-meta" --listen "$mip:$meta_port" --slots 65536 >"$out/meta.txt" 2>&1 &
    mpid=$!
    wait_ready "$out/meta.txt" "$mpid" '/serving on/p' >/dev/null
    rdma resource show qp >"$out/qps-idle.txt" 2>&1 || true
    echo "krcore-meta pid $mpid" >>"$out/qps-idle.txt"
    failed=0
    read -r -a mode_list <<<"$modes"
    for i in $(seq 1 "$repeats"); do
        for n in $sizes; do
            # Rotate the order of the modes by repeat and size.
            k=$(( (i + n) % ${#mode_list[@]} ))
            order=("${mode_list[@]:k}" "${mode_list[@]:0:k}")
            for mode in "${order[@]}"; do
                echo "== run $i/$repeats: N=$n $mode ($(date +%T))"
                run_one "$mode" "$n" "$i" "$mip:$meta_port" "$mpid" || failed=1
            done
        done
    done
    kill -TERM "$mpid" 2>/dev/null || true
    wait "$mpid" || true
    echo "== done ($(date +%T))"
    exit "$failed"
fi

if ((!report_only)); then
    host_preflight
    mkdir -p "$(dirname "$bin")" "$klib"
    cp target/release/libkrcore.so target/release/krcore-meta "$klib/"
    # -I include: the counters' enum (read through dlsym, not linked).
    cc -O2 -std=gnu11 -Wall -Wextra -Werror -I include bench/vqp_scale.c -libverbs -ldl -o "$bin"
    rm -rf "$out" && mkdir -p "$out"
    started=$SECONDS
    {
        echo "library: target/release/libkrcore.so, copied $(date -u +%FT%TZ)"
        echo "built: $(date -u -r target/release/libkrcore.so +%FT%TZ)"
        (cd "$klib" && sha256sum libkrcore.so krcore-meta)
        echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?'), uncommitted changes in src/: $(git --no-optional-locks status --porcelain -- src 2>/dev/null | wc -l) file(s)"
        echo "host load average before the run: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPU(s)"
        echo "settings: sizes=$sizes modes=$modes repeats=$repeats"
    } >"$out/krcore-lib.txt"
    rc=0
    if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        KRCORE_IN_VM=1 bash "$0" "$repeats" || rc=$?
    else
        scripts/vm-run.sh "$out" env KRCORE_IN_VM=1 \
            KRCORE_BENCH_SIZES="$sizes" KRCORE_BENCH_MODES="$modes" \
            KRCORE_BENCH_META_PORT="$meta_port" KRCORE_BENCH_READY_S="$ready_s" \
            KRCORE_BENCH_RUN_S="$run_s" \
            bash bench/vqp-scale.sh "$repeats" || rc=$?
    fi
    echo "run time: $((SECONDS - started)) s (build excluded, VM boot included)" >>"$out/krcore-lib.txt"
    if ((rc)); then
        echo "vqp-scale: some runs failed (exit $rc); the table shows what completed" >&2
    fi
fi

report_table | tee "$out/table.md"
