#!/usr/bin/env bash
# Installs the build into a scratch prefix and builds a program against it
# with pkg-config, then runs it: the installed header, library and .pc file
# must work together wherever the prefix is.
set -euo pipefail
build=$1 src=$2 tmp=${WD_TEST_TMP:-/tmp}/install-check-$$
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp"
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
export PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig:$tmp/prefix/lib/x86_64-linux-gnu/pkgconfig"
cc "$src" $(pkg-config --cflags --libs weightd) -Wl,-rpath,"$(pkg-config --variable=libdir weightd)" -o "$tmp/consumer"
out=$("$tmp/consumer")
[ "$out" = "weightd $(pkg-config --modversion weightd): plan does not fit the checkpoint" ] || {
  echo "unexpected output: $out" >&2
  exit 1
}
echo "installed library works: $out"
