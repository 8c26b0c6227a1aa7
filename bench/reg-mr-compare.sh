#!/usr/bin/env bash
# ibv_reg_mr + ibv_dereg_mr latency: krcore's registration cache (misses
# and hits) against plain libibverbs, side by side in one VM boot (a
# benchmark, not a test: run it on an otherwise idle machine, emulation
# magnifies any load).
#   bench/reg-mr-compare.sh [REPEATS]        (default 1)
#   bench/reg-mr-compare.sh --report REPEATS (the table again, no new runs)
# Builds the library and bench/reg_mr.c (linked -libverbs only), boots the
# Soft-RoCE VM once (or uses this machine's RDMA device, CT_DEVICE, default
# rxe0) and runs bench/reg_mr once per configuration, REPEATS times, the
# order changing every repeat (a balanced Latin square: each configuration
# runs first, and right after each other one, equally often):
#   plain  libibverbs alone, memory pre-faulted
#   miss   LD_PRELOAD=libkrcore.so KRCORE_MR_CACHE_ENTRIES=1: every pair
#          misses and the cache evicts one idle region (deregistered by the
#          background thread, a batch of 16 at a time)
#   hit    LD_PRELOAD=libkrcore.so, cache warmed: every pair a hit
#   off    LD_PRELOAD=libkrcore.so KRCORE_MR_CACHE=0: every pair real
# All four cycle register/deregister pairs through the same pool of
# distinct pre-faulted buffers per size (see bench/reg_mr.c), each pair
# timed on its own; each run reports per-size medians. Then, in the same
# boot, the hit configuration once more under `strace -f` with markers
# around the timed pairs, to count the calling thread's system calls.
# bench/reg_mr_report.py prints the table (median us per configuration,
# miss/plain and hit/plain computed per repeat against the plain run of
# the same repeat, with their median and min-max over repeats), the
# system-call count and the least-squares fit T = a*pages + b of real
# registrations (the cost model of `cargo bench --bench mr_trace`).
# After each repeat, reg_mr -I (plain and miss pairs alternating in one
# process) twice: as is (inter-N.txt) and with KRCORE_MR_DEREG_BATCH=0,
# the eviction's deregistration on the calling thread (inter0-N.txt).
# Results: target/bench/reg-mr/{CONFIG}-N.txt, inter*-N.txt, order.txt, strace-hit*.txt
# and table.md.
#
# Environment:
#   KRCORE_BENCH_ITERS          timed pairs per size and run (reg_mr -n, 101)
#   KRCORE_BENCH_SIZES          sizes in bytes (default: reg_mr's, 4 KiB..64 MiB
#                               in powers of 4)
#   KRCORE_BENCH_CONFIGS        default "plain miss hit off" (plain is needed
#                               for the ratios)
#   KRCORE_BENCH_STRACE_PAIRS   hit pairs per size counted under strace
#                               (default 1000; 0 skips the strace run)
set -euo pipefail
cd "$(dirname "$0")/.."
report_only=0
if [[ "${1:-}" == --report ]]; then report_only=1; shift; fi
repeats="${1:-1}"
out=target/bench/reg-mr
bin=target/bench/reg_mr
lib="$PWD/target/release/libkrcore.so"
configs="${KRCORE_BENCH_CONFIGS:-plain miss hit off}"
sizes="${KRCORE_BENCH_SIZES:-}"
strace_pairs="${KRCORE_BENCH_STRACE_PAIRS:-1000}"
strace_sizes=(4096 1048576)
read -r -a cfgs <<<"$configs"

# Row i (1-based) of a balanced Latin square (Williams design) over the
# configurations: the order of repeat i.
order_of() {
    local i="$1" n="${#cfgs[@]}" j k r period
    local base=() row=()
    for ((j = 0; j < n; j++)); do
        if ((j == 0)); then base+=(0)
        elif ((j % 2)); then base+=($(((j + 1) / 2)))
        else base+=($((n - j / 2))); fi
    done
    period=$n
    ((n % 2)) && period=$((2 * n))   # odd n: the square and its mirror
    k=$(((i - 1) % period))
    r=$((k % n))
    for ((j = 0; j < n; j++)); do row+=("${cfgs[$(((base[j] + r) % n))]}"); done
    if ((k >= n)); then
        for ((j = n - 1; j >= 0; j--)); do printf '%s ' "${row[$j]}"; done
    else
        printf '%s ' "${row[@]}"
    fi
    echo
}

run_cfg() {
    local cfg="$1"; shift
    case "$cfg" in
        plain) env -u LD_PRELOAD "$bin" "$@" ;;
        miss) env LD_PRELOAD="$lib" KRCORE_MR_CACHE=1 KRCORE_MR_CACHE_ENTRIES=1 "$bin" "$@" ;;
        hit) env -u KRCORE_MR_CACHE_ENTRIES -u KRCORE_MR_CACHE_BYTES \
                LD_PRELOAD="$lib" KRCORE_MR_CACHE=1 "$bin" "$@" ;;
        off) env LD_PRELOAD="$lib" KRCORE_MR_CACHE=0 "$bin" "$@" ;;
        *) echo "reg-mr-compare: unknown configuration '$cfg' (plain, miss, hit, off)" >&2; return 2 ;;
    esac
}

if [[ "${KRCORE_IN_VM:-}" == 1 ]]; then
    # Inside the VM (or on a host with an RDMA device): the measuring loop.
    if [[ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        bash scripts/rxe-up.sh 2
    fi
    args=()
    [[ -n "${KRCORE_BENCH_ITERS:-}" ]] && args=(-n "$KRCORE_BENCH_ITERS")
    read -r -a size_args <<<"$sizes"
    : >"$out/order.txt"
    for i in $(seq 1 "$repeats"); do
        read -r -a order <<<"$(order_of "$i")"
        echo "$i ${order[*]}" >>"$out/order.txt"
        for cfg in "${order[@]}"; do
            echo "== run $i/$repeats: $cfg ($(date +%T))"
            run_cfg "$cfg" "${args[@]}" "${size_args[@]}" >"$out/$cfg-$i.txt"
            cat "$out/$cfg-$i.txt"
        done
        # Plain and miss side by side in one process, pair by pair
        # (reg_mr -I): the miss/plain ratio without between-run noise.
        echo "== run $i/$repeats: interleaved plain/miss ($(date +%T))"
        env LD_PRELOAD="$lib" KRCORE_MR_CACHE=1 KRCORE_MR_CACHE_ENTRIES=1 \
            "$bin" -I "${args[@]}" "${size_args[@]}" >"$out/inter-$i.txt"
        cat "$out/inter-$i.txt"
        # The same with the eviction's deregistration on the calling thread.
        echo "== run $i/$repeats: interleaved plain/miss, KRCORE_MR_DEREG_BATCH=0 ($(date +%T))"
        env LD_PRELOAD="$lib" KRCORE_MR_CACHE=1 KRCORE_MR_CACHE_ENTRIES=1 KRCORE_MR_DEREG_BATCH=0 \
            "$bin" -I "${args[@]}" "${size_args[@]}" >"$out/inter0-$i.txt"
        cat "$out/inter0-$i.txt"
    done
    if ((strace_pairs > 0)); then
        # The hit configuration under strace: reg_mr -S writes a marker
        # (one write(2)) before and after the timed pairs of each size and
        # does not time them; the report counts the calling thread's system
        # calls in between. -E sets the preload for the traced program only.
        echo "== hit pairs under strace ($strace_pairs per size: ${strace_sizes[*]}) ($(date +%T))"
        strace -f -qq -s 100 -o "$out/strace-hit.txt" \
            -E LD_PRELOAD="$lib" -E KRCORE_MR_CACHE=1 \
            "$bin" -S -n "$strace_pairs" "${strace_sizes[@]}" >"$out/strace-hit-out.txt"
        cat "$out/strace-hit-out.txt"
    fi
    echo "== done ($(date +%T))"
    exit 0
fi

if ((!report_only)); then
    # Prerequisites (the VM sees this machine's root file system, so what is
    # installed here is there too).
    for tool in cc python3; do
        command -v "$tool" >/dev/null || { echo "reg-mr-compare: $tool not found (scripts/install-deps.sh)" >&2; exit 2; }
    done
    if ((strace_pairs > 0)) && ! command -v strace >/dev/null; then
        echo "reg-mr-compare: strace not found: it counts the system calls of cache hits." >&2
        echo "  Install it (apt-get install -y strace) or skip that check with KRCORE_BENCH_STRACE_PAIRS=0." >&2
        exit 2
    fi
    [[ " $configs " == *" plain "* ]] || { echo "reg-mr-compare: KRCORE_BENCH_CONFIGS must include plain (the ratios' reference)" >&2; exit 2; }
    for cfg in "${cfgs[@]}"; do
        case "$cfg" in plain | miss | hit | off) ;; *) echo "reg-mr-compare: unknown configuration '$cfg'" >&2; exit 2 ;; esac
    done
    cargo build --release   # the library under test must be the current source
    mkdir -p "$(dirname "$bin")"
    cc -O2 -std=gnu11 -Wall -Wextra -Werror -o "$bin" bench/reg_mr.c -libverbs -ldl
    rm -rf "$out" && mkdir -p "$out"
    if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        KRCORE_IN_VM=1 bash "$0" "$repeats"
    else
        scripts/vm-run.sh "$out" env KRCORE_IN_VM=1 \
            KRCORE_BENCH_ITERS="${KRCORE_BENCH_ITERS:-}" \
            KRCORE_BENCH_SIZES="$sizes" \
            KRCORE_BENCH_CONFIGS="$configs" \
            KRCORE_BENCH_STRACE_PAIRS="$strace_pairs" \
            bash bench/reg-mr-compare.sh "$repeats"
    fi
fi

python3 bench/reg_mr_report.py "$out" "$repeats" | tee "$out/table.md"
