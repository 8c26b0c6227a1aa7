#!/usr/bin/env bash
# ibv_reg_mr + ibv_dereg_mr latency: krcore's registration cache (a hit)
# against real registrations, in one VM boot (a benchmark, not a test: run
# it on an otherwise idle machine, emulation magnifies any load).
#   bench/reg-mr-compare.sh [REPEATS]        (default 1)
#   bench/reg-mr-compare.sh --report REPEATS (the table again, no new runs)
# Builds the library and bench/reg_mr.c (linked -libverbs only), boots the
# Soft-RoCE VM once (or uses this machine's RDMA device, CT_DEVICE, default
# rxe0) and runs bench/reg_mr three ways, REPEATS times, rotating the order:
#   plain  libibverbs alone
#   off    LD_PRELOAD=libkrcore.so KRCORE_MR_CACHE=0 (every registration real)
#   hit    LD_PRELOAD=libkrcore.so KRCORE_MR_CACHE=1 (warmed: every pair a hit)
# then prints the table (median over repeats of each run's median, in us)
# and the least-squares fit T = a*pages + b of real registrations, the
# cost model of `cargo bench --bench mr_trace` (KRCORE_REG_A_US/B_US).
# Results: target/bench/reg-mr/{plain,off,hit}-N.txt and table.md.
# KRCORE_BENCH_ITERS overrides reg_mr's sample count (31).
set -euo pipefail
cd "$(dirname "$0")/.."
report_only=0
if [[ "${1:-}" == --report ]]; then report_only=1; shift; fi
repeats="${1:-1}"
out=target/bench/reg-mr
bin=target/bench/reg_mr
lib="$PWD/target/release/libkrcore.so"

if [[ "${KRCORE_IN_VM:-}" == 1 ]]; then
    # Inside the VM (or on a host with an RDMA device): the measuring loop.
    if [[ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        bash scripts/rxe-up.sh 2
    fi
    args=()
    [[ -n "${KRCORE_BENCH_ITERS:-}" ]] && args=(-n "$KRCORE_BENCH_ITERS")
    configs=(plain off hit)
    for i in $(seq 1 "$repeats"); do
        for j in 0 1 2; do
            cfg="${configs[$(((i - 1 + j) % 3))]}"
            echo "== run $i/$repeats: $cfg"
            case "$cfg" in
                plain) env -u LD_PRELOAD "$bin" "${args[@]}" ;;
                off) LD_PRELOAD="$lib" KRCORE_MR_CACHE=0 "$bin" "${args[@]}" ;;
                hit) LD_PRELOAD="$lib" KRCORE_MR_CACHE=1 "$bin" "${args[@]}" ;;
            esac >"$out/$cfg-$i.txt"
            cat "$out/$cfg-$i.txt"
        done
    done
    exit 0
fi

if ((!report_only)); then
    cargo build --release   # the library under test must be the current source
    mkdir -p "$(dirname "$bin")"
    cc -O2 -std=gnu11 -Wall -Wextra -Werror -o "$bin" bench/reg_mr.c -libverbs -ldl
    rm -rf "$out" && mkdir -p "$out"
    if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        KRCORE_IN_VM=1 bash "$0" "$repeats"
    else
        scripts/vm-run.sh "$out" env KRCORE_IN_VM=1 \
            KRCORE_BENCH_ITERS="${KRCORE_BENCH_ITERS:-}" \
            bash bench/reg-mr-compare.sh "$repeats"
    fi
fi

python3 - "$out" "$repeats" <<'EOF' | tee "$out/table.md"
import statistics as st
import sys
from pathlib import Path

out, repeats = Path(sys.argv[1]), int(sys.argv[2])
COLS = ["size", "pages", "samples", "batch", "reg", "dereg", "pair", "p10", "p90", "hits", "misses"]
clock = []
runs = {}  # cfg -> size -> list of row dicts
for cfg in ("plain", "off", "hit"):
    for i in range(1, repeats + 1):
        for line in (out / f"{cfg}-{i}.txt").read_text().splitlines():
            if "clock_gettime=" in line:
                clock.append(float(line.split("clock_gettime=")[1].split("us")[0]))
            if line.startswith("#") or not line.strip():
                continue
            v = line.split()
            row = {k: float(x) for k, x in zip(COLS, v)}
            runs.setdefault(cfg, {}).setdefault(int(row["size"]), []).append(row)

def med(cfg, size, key):
    return st.median(r[key] for r in runs[cfg][size])

def human(n):
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"

sizes = sorted(runs["hit"])
print(f"ibv_reg_mr + ibv_dereg_mr, us per pair: median over {repeats} run(s) of each "
      "run's median sample (a sample = a batch of registrations then their "
      "deregistrations, timed as a whole); pages touched first; hit = krcore's "
      f"cache warmed first. clock_gettime here: {st.median(clock):.2f} us.\n")
print("| size | pages | plain libibverbs | krcore, cache off | krcore, cache hit | off/hit | plain/hit | hits/registrations |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
bad = []
for s in sizes:
    p, o, h = med("plain", s, "pair"), med("off", s, "pair"), med("hit", s, "pair")
    hits = sum(r["hits"] for r in runs["hit"][s])
    iters = sum(r["samples"] * r["batch"] for r in runs["hit"][s])
    if hits != iters:
        bad.append(human(s))
    print(f"| {human(s)} | {int(med('hit', s, 'pages'))} | {p:.1f} | {o:.1f} | {h:.2f} "
          f"| {o / h:.0f} | {p / h:.0f} | {int(hits)}/{int(iters)} |")
if bad:
    print(f"\nWARNING: not every timed pair was a cache hit at {', '.join(bad)}")

one = 1 << 20
if one in sizes:
    r = med("off", one, "pair") / med("hit", one, "pair")
    print(f"\n1 MiB: a hit is {r:.0f}x cheaper than a real registration "
          f"(krcore, cache off); target >= 50x: {'met' if r >= 50 else 'NOT MET'}")

def fit(cfg, key, relative=False):
    """Least squares T = a*pages + b over the sizes; relative=True weighs
    each size by 1/T^2 (minimises relative errors, so small sizes count)."""
    xs = [med(cfg, s, "pages") for s in sizes]
    ys = [med(cfg, s, key) for s in sizes]
    ws = [1 / y ** 2 if relative else 1.0 for y in ys]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    a = (sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys))
         / sum(w * (x - mx) ** 2 for w, x in zip(ws, xs)))
    b = my - a * mx
    # How well a line describes every size.
    worst = max(abs(a * x + b - y) / y for x, y in zip(xs, ys))
    return a, b, worst

print("\nFit over the sizes, T = a*pages + b (us), real registrations "
      "(least squares; 'relative': weighted by 1/T^2):\n")
print("| what | a (us/page) | b (us) | worst relative residual | relative: a | b | worst |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for cfg, name in (("plain", "plain libibverbs"), ("off", "krcore, cache off")):
    for key, what in (("reg", "ibv_reg_mr"), ("dereg", "ibv_dereg_mr"), ("pair", "reg + dereg")):
        a, b, w = fit(cfg, key)
        ra, rb, rw = fit(cfg, key, relative=True)
        print(f"| {name}: {what} | {a:.4f} | {b:.1f} | {w:.0%} | {ra:.4f} | {rb:.1f} | {rw:.0%} |")
a, b, _ = fit("plain", "reg")
print(f"\nFor the trace simulation (least-squares ibv_reg_mr cost of plain libibverbs in this VM):\n"
      f"    KRCORE_REG_A_US={a:.4f} KRCORE_REG_B_US={b:.1f} cargo bench --bench mr_trace")
EOF
