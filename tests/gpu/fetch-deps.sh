#!/usr/bin/env bash
# Makes the checkout buildable on a GPU host that reaches no package registry.
#
# Run on a Debian development machine, in a checkout of weightd: downloads the
# Debian packages weightd builds and runs against (runtime and -dev, listed in
# DEPS below; extra package names may be given as arguments) into .devdeps/,
# which git ignores, and writes .devdeps/env.sh. Copy the tree with .devdeps/
# to the GPU host and there, from the checkout's root:
#
#   source .devdeps/env.sh       # unpacks under $WEIGHTD_DEVDEPS_ROOT (/opt/weightd-deps)
#   cmake -B build-gpu -DCMAKE_BUILD_TYPE=Release && cmake --build build-gpu -j
#
# env.sh points pkg-config, CMake and the dynamic loader at the unpacked
# packages; the binaries built there find the libraries through
# LD_LIBRARY_PATH, so source it in every shell that runs them.
set -euo pipefail
DEPS=(libuv1 libuv1-dev libcjson1 libcjson-dev libmicrohttpd12 libmicrohttpd-dev libxxhash0 libxxhash-dev liburing2 liburing-dev
      libcurl4 libcurl4-openssl-dev libnghttp2-14 libpsl5 librtmp1 libssh2-1
      libldap-2.5-0 libunistring2)  # libcurl4 links libldap-2.5, libpsl5 libunistring.so.2: not on the Ubuntu 24.04 GPU host
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=$root/.devdeps
mkdir -p "$out"
cd "$out"
rm -f ./*.deb
pkgs=("${DEPS[@]}" "$@")
ls /var/lib/apt/lists/*_Packages >/dev/null 2>&1 || apt-get update -qq
apt-get download "${pkgs[@]}" >/dev/null 2>"$out/download.log" || {
  cat "$out/download.log" >&2
  echo "fetch-deps: apt-get download failed" >&2
  exit 1
}
for p in "${pkgs[@]}"; do
  compgen -G "${p}_*.deb" >/dev/null || { echo "fetch-deps: $p was not downloaded" >&2; exit 1; }
done
cat > env.sh <<'SH'
# Sourced on the GPU host (bash): unpacks the packages beside this file and
# points pkg-config, CMake and the loader at them. Written by tests/gpu/fetch-deps.sh.
_wd_deps=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_wd_root=${WEIGHTD_DEVDEPS_ROOT:-/opt/weightd-deps}
mkdir -p "$_wd_root"
for _wd_f in "$_wd_deps"/*.deb; do dpkg-deb -x "$_wd_f" "$_wd_root"; done
_wd_lib=$_wd_root/usr/lib/x86_64-linux-gnu
# The packages' .pc and CMake files name /usr: rebase them onto the unpacked tree.
grep -rlZ '/usr' "$_wd_lib/pkgconfig" "$_wd_lib/cmake" 2>/dev/null |
  xargs -0 -r sed -i -e "s#=/usr#=$_wd_root/usr#g" -e "s#\"/usr#\"$_wd_root/usr#g"
export PKG_CONFIG_PATH=$_wd_lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
export CMAKE_PREFIX_PATH=$_wd_root/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
export LD_LIBRARY_PATH=$_wd_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
unset _wd_deps _wd_root _wd_lib _wd_f
SH
echo "fetch-deps: $(ls ./*.deb | wc -l) packages in $out; on the GPU host: source .devdeps/env.sh"
