#!/usr/bin/env bash
# The wire decoders under libFuzzer, bounded: checks that the seed corpus
# (fuzz/corpus/) is still what the encoders make, builds every target of
# fuzz/ (cargo-fuzz, nightly, ASan, debug assertions and overflow checks),
# then runs each for KRCORE_FUZZ_S seconds (default 20) from its seeds plus
# what earlier runs found (fuzz/target/corpus/<target>, not committed).
#   scripts/fuzz.sh [TARGET...]      (default: every target)
# Exit status 0 only if every target ran its time without a crash, leak,
# hang (-timeout) or failed property; a crashing input's path is printed
# (fuzz/artifacts/<target>/), to replay: cargo +nightly fuzz run TARGET PATH.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

secs="${KRCORE_FUZZ_S:-20}"
# No message is longer than a datagram of the largest MTU (4096).
max_len=4096

die() { echo "fuzz: $*" >&2; echo "0 passed, 1 failed"; exit 1; }

rustup run nightly rustc --version >/dev/null 2>&1 ||
    die "no nightly toolchain (cargo-fuzz needs it): rustup toolchain install nightly --profile minimal"
cargo +nightly fuzz --version >/dev/null 2>&1 ||
    die "cargo-fuzz is not installed: scripts/install-deps.sh installs it (cargo install --locked cargo-fuzz)"

echo "fuzz: seed corpus check"
cargo test -q --manifest-path fuzz/Cargo.toml --test seeds 2>&1 || die "the seed corpus check failed"

# -a: debug assertions and overflow checks (the encoders' consistency
# asserts and any arithmetic overflow in a decoder count as failures).
build=(+nightly fuzz build -a)
echo "fuzz: cargo ${build[*]}"
cargo "${build[@]}" || die "cargo-fuzz build failed"

if (($#)); then
    targets=("$@")
else
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
((${#targets[@]})) || die "no fuzz targets"

pass=0 fail=0
declare -a summary=()
logs=fuzz/target/logs
mkdir -p "$logs"
for t in "${targets[@]}"; do
    work="fuzz/target/corpus/$t"
    mkdir -p "$work" "fuzz/artifacts/$t"
    echo "fuzz: [$t] ${secs}s"
    t0=$SECONDS
    # New inputs go to the first corpus directory only: the committed seeds
    # stay as they are.
    cargo +nightly fuzz run -a "$t" "$work" "fuzz/corpus/$t" -- \
        -max_total_time="$secs" -max_len="$max_len" -timeout=10 -print_final_stats=1 \
        >"$logs/$t.log" 2>&1
    rc=$?
    took=$((SECONDS - t0))
    runs="$(sed -nE 's/^Done ([0-9]+) runs in ([0-9]+) second.*/\1/p' "$logs/$t.log" | tail -1)"
    cov="$(grep -oE 'cov: [0-9]+' "$logs/$t.log" | tail -1 | cut -d' ' -f2)"
    if ((rc == 0)) && [[ -n "$runs" ]]; then
        pass=$((pass + 1))
        summary+=("$(printf '  %-12s ok      %10s runs  %4ss  cov %s' "$t" "$runs" "$took" "${cov:-?}")")
    else
        fail=$((fail + 1))
        echo "fuzz: [$t] FAILED (exit $rc); from its log ($logs/$t.log):"
        # The panic or sanitizer report and libFuzzer's verdict (the whole
        # log's end if there is neither: a build or setup failure).
        if grep -qE "panicked at|==[0-9]+== ?ERROR|^SUMMARY" "$logs/$t.log"; then
            grep -E -A8 "panicked at|==[0-9]+== ?ERROR" "$logs/$t.log" | head -n 60
            grep -E "^SUMMARY|^Base64|Test unit written" "$logs/$t.log"
        else
            tail -n 40 "$logs/$t.log"
        fi | sed 's/^/    /'
        crash="$(sed -nE 's/.*Test unit written to (.*)$/\1/p' "$logs/$t.log" | tail -1)"
        if [[ -n "$crash" ]]; then
            echo "fuzz: [$t] crashing input: $crash ($(stat -c %s "$crash") bytes)"
            od -An -tx1 -v "$crash" | head -n 16 | sed 's/^/    /'
            echo "fuzz: [$t] replay: cargo +nightly fuzz run -a $t $crash"
        fi
        summary+=("$(printf '  %-12s FAILED  (exit %s)%s' "$t" "$rc" "${crash:+  input: $crash}")")
    fi
done

echo "fuzz: summary (${secs}s per target)"
printf '%s\n' "${summary[@]}"
echo "$pass passed, $fail failed"
((fail == 0))
