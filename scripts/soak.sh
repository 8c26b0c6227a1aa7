#!/usr/bin/env bash
# The VQP soak (c-tests/vqp_soak.c, issue 9): SECONDS (default 300) of
# process churn on 10 emulated nodes (clients binding, connecting, sending,
# READing, exiting, reconnecting, killed with SIGKILL) against one
# long-lived server, checking that no message of a surviving pair is lost
# or duplicated, that no VQP hangs, that errors are only ever on VQPs to
# killed peers, and that the server's RSS and physical QPs stay bounded.
#   scripts/soak.sh [SECONDS]      (exit status 0 only if the soak passed)
# Builds the library and target/soak/vqp_soak if needed; runs in the
# Soft-RoCE VM (scripts/vm-run.sh, scripts/rxe-up.sh 10) unless this machine
# already has an RDMA device with the testbed's GIDs. KRCORE_SOAK_SEED
# replays a run's random choices, KRCORE_SOAK_CLIENTS (6) sets how many
# clients run at once (KRCORE_CONNECT_TIMEOUT_MS, KRCORE_MR_LEASE_MS,
# KRCORE_LINK_PROBE_MS, KRCORE_META_LEASE_MS, KRCORE_MAX_LINKS,
# KRCORE_LINK_IDLE_MS pass through too). Output: target/soak-out/vqp_soak.log.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
secs="${1:-${KRCORE_SOAK_S:-300}}"
[[ "$secs" =~ ^[0-9]+$ ]] || { echo "usage: scripts/soak.sh [SECONDS]" >&2; exit 2; }
if [[ ! -f target/release/libkrcore.so || ! -f target/release/krcore-meta ]]; then
    cargo build --release || exit 2
fi
make -s -C c-tests soak || exit 2
out=target/soak-out
mkdir -p "$out"
log="$out/vqp_soak.log"
envs=(env "KRCORE_SOAK_S=$secs")
# The soak's knobs and the library's timing knobs pass into the VM.
for v in KRCORE_SOAK_SEED KRCORE_SOAK_CLIENTS KRCORE_CONNECT_TIMEOUT_MS KRCORE_MR_LEASE_MS \
         KRCORE_LINK_PROBE_MS KRCORE_META_LEASE_MS KRCORE_MAX_LINKS KRCORE_LINK_IDLE_MS; do
    [[ -n "${!v:-}" ]] && envs+=("$v=${!v}")
done
echo "==> soak: $secs s (log: $log)"
if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then
    "${envs[@]}" target/soak/vqp_soak 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
else
    scripts/vm-run.sh "$out" bash -c 'bash scripts/rxe-up.sh 10 && exec "$@"' soak \
        "${envs[@]}" target/soak/vqp_soak 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
fi
echo
echo "==> soak summary"
grep -E '^(NOTE vqp_soak:|FAIL|PASS vqp_soak$)' "$log" | sed 's/^/  /'
if ((rc == 0)) && grep -q '^PASS vqp_soak$' "$log"; then
    echo "scripts/soak.sh: PASSED ($secs s)"
    exit 0
fi
echo "scripts/soak.sh: FAILED (exit $rc)"
exit 1
