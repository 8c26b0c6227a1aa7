# Helpers of the side-by-side VM benchmarks (bench/connect-compare.sh,
# bench/vqp-compare.sh, bench/vqp-instructions.sh, bench/vqp-scale.sh), sourced after `cd` to the repository. The caller
# sets `me` (its name, for messages) and `ready_s`.

# The host side's prerequisites: the tools, the release library and
# krcore-meta (exit 2 without them), and a warning when src/ is newer than
# the library.
host_preflight() {
    local tool f
    for tool in cc python3; do
        command -v "$tool" >/dev/null || { echo "$me: $tool not found (scripts/install-deps.sh)" >&2; exit 2; }
    done
    for f in target/release/libkrcore.so target/release/krcore-meta; do
        [[ -f "$f" ]] || { echo "$me: $f is missing: run cargo build --release first" >&2; exit 2; }
    done
    if [[ -n "$(find src Cargo.toml -newer target/release/libkrcore.so -print -quit)" ]]; then
        echo "$me: warning: src/ has changes newer than target/release/libkrcore.so (cargo build --release?)" >&2
    fi
}

# Waits until the log ($1) of the process $2 has a line matching the sed
# expression $3 (printed: what it extracts), the process is gone, or
# $ready_s seconds have passed.
wait_ready() {
    local log="$1" pid="$2" expr="$3" deadline=$((SECONDS + ready_s)) got
    while ((SECONDS < deadline)); do
        # Not there yet: the process's shell, forked, has not opened it.
        got="$(sed -n "$expr" "$log" 2>/dev/null)"
        if [[ -n "$got" ]]; then echo "$got"; return 0; fi
        kill -0 "$pid" 2>/dev/null || { echo "$me: $log: the process exited before it was ready:" >&2; cat "$log" >&2; return 1; }
        sleep 0.05
    done
    echo "$me: $log: not ready within ${ready_s} s:" >&2
    cat "$log" >&2
    kill "$pid" 2>/dev/null || true
    return 1
}

# The IPv4 address of the RoCE v2 GID at index $1 (::ffff:a.b.c.d).
gid_ipv4() {
    local g
    g="$(cat "/sys/class/infiniband/${CT_DEVICE:-rxe0}/ports/1/gids/$1")"
    [[ "$g" == 0000:0000:0000:0000:0000:ffff:* ]] || { echo "$me: GID index $1 ($g) is not IPv4-mapped" >&2; return 1; }
    printf '%d.%d.%d.%d\n' "0x${g:30:2}" "0x${g:32:2}" "0x${g:35:2}" "0x${g:37:2}"
}

# Snapshot target/release's library, krcore-meta and krcore-node into $4 (so that a
# cargo build during a run cannot change them) and build the benchmark
# source $1 twice: $2 linked -libverbs (raw), $3 with -DKRCORE against
# the snapshot.
build_pair() {
    local src="$1" bin="$2" kbin="$3" klib="$4"
    mkdir -p "$(dirname "$bin")" "$klib"
    cp target/release/libkrcore.so target/release/krcore-meta "$klib/"
    [[ ! -f target/release/krcore-node ]] || cp target/release/krcore-node "$klib/"
    cc -O2 -std=gnu11 -Wall -Wextra -Werror "$src" -libverbs -o "$bin"
    cc -O2 -std=gnu11 -Wall -Wextra -Werror -DKRCORE -I include "$src" \
        -L "$klib" -lkrcore -Wl,-rpath,"$PWD/$klib" -o "$kbin"
}
