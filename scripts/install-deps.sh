#!/usr/bin/env bash
# Install everything the build, the fuzz targets and the Soft-RoCE VM testbed
# need on a fresh Debian 12 machine. Idempotent: a second run only checks.
set -euo pipefail

KERNEL_PKG="${KRCORE_VM_KERNEL_PKG:-linux-image-6.1.0-50-amd64-unsigned}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
KDIR="${KRCORE_VM_KERNEL_DIR:-$HOME/.cache/krcore/kernel}"

APT_PKGS=(qemu-system-x86 rdma-core ibverbs-providers ibverbs-utils
          libibverbs-dev librdmacm-dev rdmacm-utils perftest kmod iproute2
          busybox-static libclang-dev pkg-config python3 gcc g++ make
          python3-pyverbs)

missing=()
for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "install-deps: apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! command -v vng >/dev/null 2>&1; then
    echo "install-deps: pip install virtme-ng"
    python3 -m pip install -q virtme-ng
fi

# cargo-fuzz, for scripts/fuzz.sh (which also needs a nightly toolchain:
# it says so if there is none). g++ above builds libFuzzer.
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "install-deps: cargo install cargo-fuzz"
    cargo install -q --locked --version 0.13.2 cargo-fuzz
fi

# The VM kernel: unpacked outside /var/tmp (a fresh tmpfs inside the VM).
if ! ls "$KDIR"/boot/vmlinuz-* >/dev/null 2>&1; then
    echo "install-deps: fetching $KERNEL_PKG"
    mkdir -p "$KDIR" && tmp="$(mktemp -d)"
    # A machine whose packages were all present may never have fetched the
    # package lists: update once if the first download fails.
    (cd "$tmp" && { apt-get download "$KERNEL_PKG" >/dev/null 2>&1 ||
                    { apt-get update -qq && apt-get download "$KERNEL_PKG" >/dev/null; }; })
    dpkg-deb -x "$tmp"/*.deb "$KDIR"
    rm -rf "$tmp"
    kver="$(ls "$KDIR/lib/modules")"
    depmod -b "$KDIR" "$kver"
fi
echo "install-deps: ok (kernel in $KDIR)"
