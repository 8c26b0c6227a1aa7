#!/usr/bin/env bash
# Install test: `make install` into a DESTDIR as a package build would, then
# build programs against the staged install using nothing but
# `pkg-config --cflags --libs krcore`, check what they link to, and
# `make uninstall`. Needs a release build (cargo build --release) and a C
# compiler, pkg-config, readelf and ldd; no RDMA device, no root.
#   bash scripts/install-test.sh
# Prints `ok - ...` / `not ok - ...` per check and closes with
# `N passed, M failed`; the exit status is non-zero if any check failed.
# shellcheck disable=SC2317  # the helpers below run through check "$@"
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
root=$PWD

npass=0 nfail=0
ok() { echo "ok - $1"; npass=$((npass + 1)); }
notok() { echo "not ok - $1"; nfail=$((nfail + 1)); }
# check WHAT CMD...: one check, passes when CMD succeeds.
check() { local what="$1"; shift; if "$@"; then ok "$what"; else notok "$what"; fi; }
# has / lacks ERE TEXT: TEXT has (lacks) a line matching ERE.
has() { grep -qE -- "$1" <<<"$2"; }
lacks() { ! grep -qE -- "$1" <<<"$2"; }
# diag FILE: show a command's captured output under a failed check.
diag() { sed 's/^/    # /' "$1"; }
finish() { echo "$npass passed, $nfail failed"; ((nfail == 0)); exit $?; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/krcore-install-test.XXXXXX") || exit 2
trap 'rm -rf "$tmp"' EXIT

lib=target/release/libkrcore.so
if [[ ! -f $lib ]]; then
    notok "$lib exists (run cargo build --release first)"
    finish
fi
ok "$lib exists"

# Only this test's variables decide the layout, not the caller's environment.
unset PREFIX DESTDIR LIBDIR INCLUDEDIR BINDIR PKGCONFIGDIR MULTIARCH
cc=${CC:-cc}
multiarch=$("$cc" -print-multiarch 2>/dev/null)
libdir=/usr/lib${multiarch:+/$multiarch}
version=$(sed -n 's/^version *= *"\(.*\)"/\1/p' Cargo.toml | head -n 1)
bins=()
for f in src/bin/*.rs src/bin/*/main.rs; do
    [[ -e $f ]] || continue
    [[ $f == */main.rs ]] && f=${f%/main.rs} || f=${f%.rs}
    # The tests' hostile peer is not installed.
    [[ ${f##*/} == krcore-hostile ]] && continue
    bins+=("${f##*/}")
done

# --- make install -----------------------------------------------------------
stage=$tmp/stage
if make --no-print-directory install DESTDIR="$stage" PREFIX=/usr >"$tmp/install.out" 2>&1; then
    ok "make install DESTDIR=\$tmp PREFIX=/usr"
else
    notok "make install DESTDIR=\$tmp PREFIX=/usr"; diag "$tmp/install.out"
    finish
fi

# installed FILE MODE [SOURCE]: FILE is in the stage with MODE (and is a copy of SOURCE).
installed() {
    local f="$stage$1" mode="$2" src="${3:-}"
    [[ -f $f ]] && [[ $(stat -c %a "$f") == "$mode" ]] &&
        { [[ -z $src ]] || cmp -s "$f" "$src"; }
}
check "library at $libdir/libkrcore.so (0755)" installed "$libdir/libkrcore.so" 755 "$lib"
check "header at /usr/include/krcore.h (0644)" installed /usr/include/krcore.h 644 include/krcore.h
check "pkg-config file at $libdir/pkgconfig/krcore.pc (0644)" \
    installed "$libdir/pkgconfig/krcore.pc" 644
if ((${#bins[@]})); then
    for b in "${bins[@]}"; do
        check "binary at /usr/bin/$b (0755)" installed "/usr/bin/$b" 755 "target/release/$b"
    done
else
    check "no binary targets in src/bin: nothing installed in /usr/bin" \
        test ! -e "$stage/usr/bin"
fi
check "nothing else installed" \
    test "$(find "$stage" -type f | wc -l)" -eq $((3 + ${#bins[@]}))

# --- the .pc file -----------------------------------------------------------
pc=$stage$libdir/pkgconfig/krcore.pc
export PKG_CONFIG_LIBDIR=$stage$libdir/pkgconfig PKG_CONFIG_SYSROOT_DIR=$stage
unset PKG_CONFIG_PATH
# The stage's /usr paths must not be dropped as system directories.
export PKG_CONFIG_ALLOW_SYSTEM_CFLAGS=1 PKG_CONFIG_ALLOW_SYSTEM_LIBS=1
pkg-config --validate krcore >"$tmp/validate.out" 2>&1
if [[ $? -eq 0 && ! -s $tmp/validate.out ]]; then
    ok "pkg-config --validate krcore: no warnings"
else
    notok "pkg-config --validate krcore: no warnings"; diag "$tmp/validate.out"
fi
check "pkg-config --modversion krcore is Cargo.toml's version ($version)" \
    test "$(pkg-config --modversion krcore)" = "$version"
check "krcore.pc: no DESTDIR in it" lacks "$stage" "$(cat "$pc")"
pcvar() { env -u PKG_CONFIG_SYSROOT_DIR pkg-config --variable="$1" krcore; }
check "krcore.pc: prefix=/usr, libdir=$libdir, includedir=/usr/include" \
    test "$(pcvar prefix) $(pcvar libdir) $(pcvar includedir)" = "/usr $libdir /usr/include"
flags=$(pkg-config --cflags --libs krcore)
echo "    # pkg-config --cflags --libs krcore: $flags"
flags_ok() {
    [[ " $flags " == *" -I$stage/usr/include "* && " $flags " == *" -L$stage$libdir "* &&
       " $flags " == *" -lkrcore "* && $flags != *"$root"* ]]
}
check "pkg-config flags point into the install, not the source tree" flags_ok
check "pkg-config flags do not link libibverbs" lacks ibverbs "$flags"

# --- programs built with pkg-config only ------------------------------------
cat >"$tmp/version.c" <<'EOF'
#include <infiniband/verbs.h>
#include <krcore.h>
#include <stdio.h>
int main(int argc, char **argv)
{
	int n = 0;
	/* An ibv_* symbol, so the program needs the library for verbs too. */
	if (argc > 1)
		ibv_free_device_list(ibv_get_device_list(&n));
	(void)argv;
	printf("%s\n", krcore_version());
	return 0;
}
EOF
build() { # build NAME SOURCE
    # shellcheck disable=SC2086  # pkg-config's output is a list of words
    "$cc" -O2 -std=c11 -Wall -Wextra -Werror -o "$tmp/$1" "$2" $flags >"$tmp/$1.cc.out" 2>&1
}
progs=()
for p in pingpong:examples-c/rc_write_pingpong.c version:"$tmp/version.c"; do
    name=${p%%:*} src=${p#*:}
    what="cc ${src#"$tmp"/} \$(pkg-config --cflags --libs krcore)"
    if build "$name" "$src"; then ok "$what"; progs+=("$name"); else notok "$what"; diag "$tmp/$name.cc.out"; fi
done

for name in "${progs[@]}"; do
    dyn=$(readelf -d "$tmp/$name")
    check "$name: readelf -d: NEEDED libkrcore.so" \
        has 'NEEDED.*\[libkrcore\.so\]' "$dyn"
    check "$name: readelf -d: no NEEDED libibverbs" \
        lacks 'NEEDED.*libibverbs' "$dyn"
    check "$name: readelf -d: no RPATH/RUNPATH" \
        lacks '\((RPATH|RUNPATH)\)' "$dyn"
    deps=$(LD_LIBRARY_PATH=$stage$libdir ldd "$tmp/$name" 2>&1)
    check "$name: ldd with LD_LIBRARY_PATH=<installed libdir>: libkrcore.so => the installed copy" \
        has "^[[:space:]]*libkrcore\.so => $stage$libdir/libkrcore\.so " "$deps"
    check "$name: ldd: no libibverbs at load time" \
        lacks libibverbs "$deps"
done
if [[ " ${progs[*]} " == *" version "* ]]; then
    out=$(LD_LIBRARY_PATH=$stage$libdir "$tmp/version" 2>&1)
    check "version: runs from the installed library, krcore_version() = $version" \
        test "$out" = "$version"
fi

# --- make uninstall ---------------------------------------------------------
if make --no-print-directory uninstall DESTDIR="$stage" PREFIX=/usr >"$tmp/uninstall.out" 2>&1; then
    ok "make uninstall DESTDIR=\$tmp PREFIX=/usr"
else
    notok "make uninstall DESTDIR=\$tmp PREFIX=/usr"; diag "$tmp/uninstall.out"
fi
left=$(find "$stage" ! -type d)
check "make uninstall removed every installed file" test -z "$left"
[[ -z $left ]] || echo "    # left: ${left//$'\n'/ }"

# --- default prefix ---------------------------------------------------------
if make --no-print-directory install DESTDIR="$tmp/default" >"$tmp/default.out" 2>&1; then
    default_ok() {
        local d=$tmp/default/usr/local l=$tmp/default/usr/local${libdir#/usr}
        [[ -f $l/libkrcore.so && -f $d/include/krcore.h ]] &&
            grep -qx 'prefix=/usr/local' "$l/pkgconfig/krcore.pc"
    }
    check "default PREFIX: /usr/local${libdir#/usr}/libkrcore.so, prefix=/usr/local in krcore.pc" default_ok
else
    notok "make install DESTDIR=\$tmp (default PREFIX)"; diag "$tmp/default.out"
fi

finish
