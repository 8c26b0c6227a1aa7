#!/usr/bin/env bash
# Boot the testbed kernel under QEMU (virtme-ng, software emulation) on a
# read-only view of this machine's root file system and run one command as
# root inside it. The command's exit status is passed back.
#   scripts/vm-run.sh <outdir> <command...>
# <outdir> is shared read-write with the guest (results land there).
# KRCORE_VM_CPUS (default 2) and KRCORE_VM_MEMORY (default 2G) size the guest.
set -euo pipefail
KDIR="${KRCORE_VM_KERNEL_DIR:-$HOME/.cache/krcore/kernel}"
out="$1"; shift
mkdir -p "$out"
out="$(cd "$out" && pwd)"
vmlinuz="$(ls "$KDIR"/boot/vmlinuz-* | head -n1)"
[[ -f "$vmlinuz" ]] || { echo "vm-run: no kernel in $KDIR (run scripts/install-deps.sh)" >&2; exit 2; }
export KRCORE_VM_KERNEL_DIR="$KDIR"
# Quote the command for the guest shell.
cmd="$(printf '%q ' "$@")"
exec vng --run "$vmlinuz" --disable-kvm --cpus "${KRCORE_VM_CPUS:-2}" --memory "${KRCORE_VM_MEMORY:-2G}" \
    --rwdir="$out" --cwd "$PWD" --exec "KRCORE_VM_KERNEL_DIR=$KDIR KRCORE_VM_OUT=$out $cmd"
