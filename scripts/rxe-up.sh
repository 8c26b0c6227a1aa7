#!/usr/bin/env bash
# Bring up Soft-RoCE on a dummy netdev with N emulated nodes (one IPv4 address,
# hence one RoCE v2 GID, each): 10.77.0.1 is GID index 1, 10.77.0.2 index 2...
# Idempotent; run as root inside the testbed VM (or on any rxe-capable host).
set -euo pipefail
nodes="${1:-2}"
if [[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]] && rdma link show 2>/dev/null | grep -q rxe0; then
    exit 0
fi
KDIR="${KRCORE_VM_KERNEL_DIR:-}"
if [[ -n "$KDIR" && -d "$KDIR/lib/modules/$(uname -r)" ]]; then
    modprobe -d "$KDIR" rdma_rxe
else
    modprobe rdma_rxe
fi
ip link add dummy0 type dummy 2>/dev/null || true
for i in $(seq 1 "$nodes"); do ip addr add "10.77.0.$i/24" dev dummy0 2>/dev/null || true; done
ip link set dummy0 up
ip link set lo up
rdma link add rxe0 type rxe netdev dummy0
# Wait (bounded) until every node's GID is populated.
for _ in $(seq 1 100); do
    n=0
    for i in $(seq 1 "$nodes"); do
        g="$(cat /sys/class/infiniband/rxe0/ports/1/gids/$i 2>/dev/null || true)"
        [[ -n "$g" && "$g" != "0000:0000:0000:0000:0000:0000:0000:0000" ]] && n=$((n+1))
    done
    ((n == nodes)) && exit 0
    sleep 0.1
done
echo "rxe-up: GIDs did not appear" >&2; exit 1
