#!/usr/bin/env bash
# What loading libkrcore.so costs a new process, before any verb does
# work: four tiny programs, each spawned RUNS times in a row, alternating,
# mean time per spawn (exec to exit):
#   empty      int main(void) { return 0; }
#   empty-kr   the same, linked against libkrcore.so (--no-as-needed: the
#              library is loaded and its constructors run)
#   devlist    ibv_get_device_list() and exit, linked -libverbs
#   devlist-kr the same through libkrcore.so (which dlopens the real
#              libibverbs itself)
#   bench/load-cost.sh [RUNS]        (default 20) in the Soft-RoCE VM
#   KRCORE_LOAD_HOST=1 bench/load-cost.sh [RUNS]   on this machine
# Builds into target/bench/load against a snapshot of
# target/release/libkrcore.so (run `cargo build --release` first). Under the
# VM's TCG emulation every code page a process runs for the first time is
# translated, so these costs are far above the host's: run both.
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-20}"
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "load-cost: RUNS must be a positive integer" >&2; exit 2; }
out=target/bench/load
if [[ "${KRCORE_IN_VM:-}" != 1 ]]; then
    [[ -f target/release/libkrcore.so ]] || { echo "load-cost: run cargo build --release first" >&2; exit 1; }
    mkdir -p "$out"
    cp target/release/libkrcore.so "$out/"
    printf 'int main(void) { return 0; }\n' >"$out/empty.c"
    printf '#include <infiniband/verbs.h>\nint main(void) { int n; ibv_get_device_list(&n); return 0; }\n' >"$out/devlist.c"
    cc -O2 "$out/empty.c" -o "$out/empty"
    cc -O2 "$out/empty.c" -Wl,--no-as-needed -L "$out" -lkrcore -Wl,-rpath,"$PWD/$out" -o "$out/empty-kr"
    cc -O2 "$out/devlist.c" -libverbs -o "$out/devlist"
    cc -O2 "$out/devlist.c" -L "$out" -lkrcore -Wl,-rpath,"$PWD/$out" -libverbs -o "$out/devlist-kr"
    if [[ "${KRCORE_LOAD_HOST:-}" != 1 ]]; then
        exec scripts/vm-run.sh "$out/vm" env KRCORE_IN_VM=1 bash "$PWD/bench/load-cost.sh" "$runs"
    fi
else
    bash scripts/rxe-up.sh 2 >/dev/null
fi
for round in 1 2; do
    for b in empty empty-kr devlist devlist-kr; do
        t0=$(date +%s%N)
        for _ in $(seq "$runs"); do "$out/$b"; done
        t1=$(date +%s%N)
        echo "load_cost round=$round program=$b runs=$runs mean_us=$(((t1 - t0) / runs / 1000))"
    done
done
