#!/usr/bin/env bash
# The project's one test command: dependencies, release build, host unit
# tests, C tests, then the integration suite and rdma-core's own test suite
# against real RDMA (Soft-RoCE in a VM unless this machine has an RDMA
# device). Every stage runs even if an earlier one failed (unless it depends
# on it), and a summary closes the run.
#   scripts/test.sh            (exit status: 0 only if every stage passed)
# KRCORE_SUITE_ARGS="-k perftest" passes extra arguments to the suite.
# After the unit tests, the wire decoders under libFuzzer (scripts/fuzz.sh):
# KRCORE_FUZZ_S seconds per target, default 20.
# KRCORE_SOAK=1 adds the VQP soak (scripts/soak.sh, KRCORE_SOAK_S seconds,
# default 300) as a last stage; it is not run otherwise.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

declare -a names=() results=() secs=()
failed=0

logs=target/test-logs
rm -rf "$logs" && mkdir -p "$logs"

# stage NAME CMD...: run, time and record one stage (output also kept in
# $logs/NAME.log so that the test counts can be added up at the end).
stage() {
    local name="$1"; shift
    local t0=$SECONDS rc
    echo "==> [$name] $*"
    "$@" 2>&1 | tee "$logs/$name.log"; rc=$?
    names+=("$name"); secs+=($((SECONDS - t0)))
    if ((rc == 0)); then results+=("ok"); else results+=("FAILED (exit $rc)"); failed=1; fi
    return "$rc"
}
skip() { names+=("$1"); secs+=(0); results+=("skipped: $2"); failed=1; }

# shellcheck disable=SC2317  # called indirectly through stage
integration() {
    # shellcheck disable=SC2206  # word splitting of the extra args is wanted
    local extra=(${KRCORE_SUITE_ARGS:-})
    rm -rf target/integration
    if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        # A real (or already configured) RDMA device: no VM needed.
        python3 tests/integration/suite.py --out target/integration "${extra[@]}"
    else
        scripts/vm-run.sh target/integration \
            python3 tests/integration/suite.py --setup-rxe --out target/integration "${extra[@]}"
    fi
}

# rdma-core's own tests (../shared/rdma-core-tests), baseline vs preloaded in
# one boot; every test's outcome must be the same in both modes.
# shellcheck disable=SC2317  # called indirectly through stage
rdma_core_tests() {
    local cmd=(python3 tests/integration/rdma_core_tests.py --out target/rdma-core-tests)
    rm -rf target/rdma-core-tests
    if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
        "${cmd[@]}"
    else
        scripts/vm-run.sh target/rdma-core-tests "${cmd[@]}" --setup-rxe
    fi
}

# The Rust test binaries of tests/rdma_*.rs (their RDMA tests are ignored on
# a machine without a device) go to target/rdma-tests, where the integration
# suite finds them and runs them with --ignored.
# shellcheck disable=SC2317  # called indirectly through stage
rdma_tests_build() {
    rm -rf target/rdma-tests && mkdir -p target/rdma-tests
    cargo test --release --no-run --message-format=json 2>/dev/null | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["name"].startswith("rdma_") and "test" in m["target"]["kind"]:
        shutil.copy(m["executable"], "target/rdma-tests/" + m["target"]["name"])
        print("rdma test binary:", m["target"]["name"])
'
    [[ -n "$(ls target/rdma-tests)" ]]
}

# Formatting (rustfmt.toml) and clippy with warnings as errors.
# shellcheck disable=SC2317  # called indirectly through stage
lint() {
    cargo fmt --check && cargo clippy --release -- -D warnings
}

stage install-deps scripts/install-deps.sh
if stage build cargo build --release; then
    stage lint lint
    stage install bash scripts/install-test.sh
    stage unit-tests cargo test --release
    stage fuzz bash scripts/fuzz.sh
    if [[ -f c-tests/Makefile ]]; then
        stage c-tests make -C c-tests
    fi
    stage rdma-tests-build rdma_tests_build
    stage integration integration
    if [[ -f ../shared/rdma-core-tests/run_tests.py ]]; then
        stage rdma-core-tests rdma_core_tests
    else
        # A user's checkout has no ../shared: not a failure.
        echo "==> [rdma-core-tests] skipped: ../shared/rdma-core-tests not found" \
             "(rdma-core's own test suite is not part of this checkout)"
        names+=(rdma-core-tests); secs+=(0); results+=("skipped (no tests dir)")
    fi
    if [[ "${KRCORE_SOAK:-0}" == 1 ]]; then
        stage soak bash scripts/soak.sh "${KRCORE_SOAK_S:-300}"
    fi
else
    skip install "build failed"
    skip unit-tests "build failed"
    skip fuzz "build failed"
    skip integration "build failed"
    skip rdma-core-tests "build failed"
fi

echo
echo "==> summary"
for i in "${!names[@]}"; do
    printf '  %-16s %-28s %5ss\n' "${names[$i]}" "${results[$i]}" "${secs[$i]}"
done
printf '  %-16s %-28s %5ss\n' total "" "$SECONDS"
# One closing count over everything: cargo's "test result: ... N passed; M
# failed" lines plus the suites' "N passed, N failed"; a stage that failed
# without reporting tests (a build error, say) counts as one failure.
read -r npass nfail < <(
    cat "$logs"/install.log "$logs"/unit-tests.log "$logs"/fuzz.log "$logs"/integration.log "$logs"/rdma-core-tests.log \
        2>/dev/null | tr -d '\r' |
    sed -nE 's/^test result: .* ([0-9]+) passed; ([0-9]+) failed.*/\1 \2/p;
             s/^([0-9]+) passed, ([0-9]+) failed$/\1 \2/p' |
    awk '{p += $1; f += $2} END {print p + 0, f + 0}')
((failed && nfail == 0)) && nfail=1
if ((failed)); then echo "scripts/test.sh: FAILED"; else echo "scripts/test.sh: all stages passed"; fi
echo "$npass passed, $nfail failed"
exit "$failed"
