#!/usr/bin/env bash
# Checks the systemd files as `cmake --install` puts them in place:
#   1. the build is installed into a scratch root (DESTDIR, so every path keeps
#      the configured prefix, as a package would have it);
#   2. the unit's ExecStart names the installed weightd and the installed
#      configuration, and `weightd --config FILE --help` accepts that file
#      (--help exits after the file is read and checked);
#   3. the socket unit and the configuration agree (ListenStream = socket,
#      FileDescriptorName = socket_fd_name's default);
#   4. `systemd-analyze verify` on copies of weightd.service and weightd.socket
#      whose ExecStart points into the scratch root: any output at all fails
#      the test (verify only warns on unknown keys and directives);
#   5. the sysusers.d entry creates the weightd user and group in an empty
#      root, and the tmpfiles.d entry then creates /run/weightd (root:weightd,
#      0755) there; any output besides sysusers' "Creating ..." lines fails.
# Skips (77) where systemd's tools are missing (Debian: apt-get install systemd).
#
# usage: systemd_verify.sh BUILD_DIR
set -euo pipefail
build=$1
for tool in systemd-analyze systemd-sysusers systemd-tmpfiles; do
  if ! command -v "$tool" >/dev/null; then
    echo "systemd_verify: $tool is missing (Debian: apt-get install systemd); skipping"
    exit 77
  fi
done
tmp=$(mktemp -d "${WD_TEST_TMP:-/tmp}/systemd-verify-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
dest=$tmp/dest
fail() {
  echo "systemd_verify: $*" >&2
  exit 1
}

DESTDIR=$dest cmake --install "$build" >"$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install failed"; }
# Exactly one of each, under the scratch root: nothing may land outside it.
one() {
  local found
  found=$(find "$dest" -path "*/$1" -type f)
  [ -n "$found" ] && [ "$(printf '%s\n' "$found" | wc -l)" -eq 1 ] || fail "expected one installed $1, found: ${found:-none}"
  printf '%s\n' "$found"
}
service=$(one systemd/system/weightd.service)
socket=$(one systemd/system/weightd.socket)
sysusers=$(one sysusers.d/weightd.conf)
tmpfiles=$(one tmpfiles.d/weightd.conf)
echo "installed: ${service#"$dest"} ${socket#"$dest"} ${sysusers#"$dest"} ${tmpfiles#"$dest"}"

# ---- 2. ExecStart names what was installed ------------------------------------------------
exec_start=$(sed -n 's/^ExecStart=//p' "$service")
[ "$(printf '%s\n' "$exec_start" | wc -l)" -eq 1 ] || fail "weightd.service needs exactly one ExecStart=: $exec_start"
read -r -a words <<<"$exec_start"
bin=${words[0]}
config=
for ((i = 1; i < ${#words[@]}; i++)); do
  [ "${words[i]}" = "--config" ] && config=${words[i + 1]:-}
done
case $bin in /*) ;; *) fail "ExecStart's program is not an absolute path: $bin" ;; esac
case $config in /*) ;; *) fail "ExecStart has no absolute --config path: $exec_start" ;; esac
[ -x "$dest$bin" ] || fail "ExecStart names $bin, which was not installed"
[ -f "$dest$config" ] || fail "ExecStart names the configuration $config, which was not installed"
"$dest$bin" --config "$dest$config" --help >"$tmp/help.out" 2>&1 || {
  cat "$tmp/help.out"
  fail "weightd does not accept the installed configuration $config"
}

# ---- 3. the socket unit and the configuration agree -------------------------------------------
listen=$(sed -n 's/^ListenStream=//p' "$socket")
fdname=$(sed -n 's/^FileDescriptorName=//p' "$socket")
cfg_socket=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("socket", ""))' "$dest$config")
[ "$listen" = "$cfg_socket" ] || fail "weightd.socket listens on '$listen', the configuration says socket '$cfg_socket'"
# grep reads the saved help: "--help | grep -q" fails under pipefail when grep exits
# before weightd has written its last line (SIGPIPE).
grep -Eq "^  socket_fd_name +default $fdname " "$tmp/help.out" ||
  fail "weightd.socket's FileDescriptorName=$fdname is not socket_fd_name's default"
grep -q '^RuntimeDirectory=' "$service" && fail "RuntimeDirectory= would delete the socket's directory at every stop"

# ---- 4. systemd-analyze verify ---------------------------------------------------------------
units=$tmp/units
mkdir -p "$units"
sed -e "s#^ExecStart=$bin #ExecStart=$dest$bin #" -e "s# --config $config# --config $dest$config#" "$service" \
  >"$units/weightd.service"
cp "$socket" "$units/weightd.socket"
grep -q "^ExecStart=$dest$bin --config $dest$config" "$units/weightd.service" || fail "could not point ExecStart into $dest"
if ! (cd "$units" && systemd-analyze verify weightd.socket weightd.service) >"$tmp/verify.out" 2>&1; then
  cat "$tmp/verify.out" >&2
  fail "systemd-analyze verify failed"
fi
if [ -s "$tmp/verify.out" ]; then
  cat "$tmp/verify.out" >&2
  fail "systemd-analyze verify printed warnings (they count as failures)"
fi
echo "systemd-analyze verify: weightd.service and weightd.socket are clean"

# ---- 5. sysusers.d and tmpfiles.d in an empty root ---------------------------------------------
root=$tmp/root
mkdir -p "$root/etc"
systemd-sysusers --root="$root" "$sysusers" >"$tmp/sysusers.out" 2>&1 || {
  cat "$tmp/sysusers.out" >&2
  fail "systemd-sysusers failed on $sysusers"
}
if grep -v '^Creating \(user\|group\) ' "$tmp/sysusers.out" >&2; then fail "systemd-sysusers warned"; fi
user=$(grep '^weightd:' "$root/etc/passwd") || fail "sysusers made no weightd user"
group=$(grep '^weightd:' "$root/etc/group") || fail "sysusers made no weightd group"
IFS=: read -r _ _ uid ugid _ _ shell <<<"$user"
IFS=: read -r _ _ gid _ <<<"$group"
[ "$ugid" = "$gid" ] || fail "the weightd user's primary group is $ugid, not weightd ($gid)"
[ "$uid" -lt 1000 ] || fail "weightd is not a system user (uid $uid)"
case $shell in */nologin | */false) ;; *) fail "weightd has a login shell: $shell" ;; esac
systemd-tmpfiles --create --root="$root" "$tmpfiles" >"$tmp/tmpfiles.out" 2>&1 || {
  cat "$tmp/tmpfiles.out" >&2
  fail "systemd-tmpfiles --create failed on $tmpfiles"
}
[ -s "$tmp/tmpfiles.out" ] && { cat "$tmp/tmpfiles.out" >&2; fail "systemd-tmpfiles warned"; }
socket_dir=$(dirname "$listen")
[ -d "$root$socket_dir" ] || fail "tmpfiles.d did not create $socket_dir, where the socket lives"
got=$(stat -c '%u:%g %a' "$root$socket_dir")
[ "$got" = "0:$gid 755" ] || fail "$socket_dir is $got, expected 0:$gid 755 (root, group weightd)"
echo "sysusers.d: user weightd ($uid:$gid, $shell); tmpfiles.d: $socket_dir $got"
