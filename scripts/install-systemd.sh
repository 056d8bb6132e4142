#!/usr/bin/env bash
# Install the bucketfs@.service template, the fstab mount helper, and one config file.
#   sudo scripts/install-systemd.sh NAME URL MOUNTPOINT [bucketfs mount options...]
#   sudo scripts/install-systemd.sh imagenet s3://my-bucket/imagenet /mnt/imagenet --allow-other --max-memory 2G
# then: systemctl daemon-reload && systemctl enable --now bucketfs@imagenet
# BUCKETFS=/path/to/bucketfs names the executable (a venv's or pyenv's, which sudo's
# secure_path hides); mount.fuse.bucketfs is taken from beside it.
set -euo pipefail
usage() {
  cat >&2 <<'USAGE'
usage: sudo scripts/install-systemd.sh NAME URL MOUNTPOINT [bucketfs mount options...]
  e.g. sudo scripts/install-systemd.sh imagenet s3://my-bucket/imagenet /mnt/imagenet --allow-other --max-memory 2G
then: systemctl daemon-reload && systemctl enable --now bucketfs@NAME
USAGE
  exit 2
}
fail() { echo "install-systemd.sh: $1" >&2; exit "${2:-2}"; }
[ $# -ge 3 ] || usage

# The config is read twice: systemd's EnvironmentFile parser removes one level of
# quotes, then ExecStart's unbraced $BUCKETFS_OPTIONS is split at whitespace, honouring
# quotes and backslashes. So each option is backslash-escaped for the split, and each
# value single-quoted for the file; else a value with a space becomes two arguments.
SAFE='^[A-Za-z0-9_./:=,@%+-]*$'
env_quote() {  # for the EnvironmentFile parser (bash reads it the same way)
  if [[ $1 =~ $SAFE ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}
split_escape() {  # for systemd's whitespace split of $BUCKETFS_OPTIONS
  printf '%s' "$1" | sed 's/[^A-Za-z0-9_./:=,@%+-]/\\&/g'
}

name=$1 url=$2 mountpoint=$3; shift 3
# NAME becomes /etc/bucketfs/NAME.conf and the unit bucketfs@NAME.
case $name in ''|*/*) fail "NAME '$name' must be a non-empty name without '/' (it names /etc/bucketfs/NAME.conf and bucketfs@NAME)";; esac
# The unit runs from /, and creates the mountpoint: a relative one would land there.
case $mountpoint in /*) ;; *) fail "MOUNTPOINT '$mountpoint' must be an absolute path";; esac
root=${DESTDIR:-}
here=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${BUCKETFS:-}" ]; then
  bin=$BUCKETFS
  [ -x "$bin" ] || fail "BUCKETFS=$bin is not an executable" 1
  helper=$(dirname "$bin")/mount.fuse.bucketfs
else
  bin=$(command -v bucketfs) || fail "bucketfs is not on PATH (pip install bucketfs). Installed in a venv or with pyenv? sudo's secure_path hides it: run sudo env PATH=\"\$PATH\" scripts/install-systemd.sh ..., or sudo BUCKETFS=\"\$(command -v bucketfs)\" scripts/install-systemd.sh ..." 1
  helper=$(command -v mount.fuse.bucketfs) || helper=$(dirname "$bin")/mount.fuse.bucketfs
fi
[ -x "$helper" ] || fail "mount.fuse.bucketfs is not installed beside $bin" 1
options=()
for arg in "$@"; do
  case $arg in *$'\n'*) fail "an option value contains a newline, which a systemd config line cannot hold";; esac
  options+=("$(split_escape "$arg")")
done
# bucketfs's own parser judges the URL and options, as the unit will run them (it says
# why, in one line): an error at install time, not at systemctl start.
"$bin" mount --check "$url" "$mountpoint" --foreground "$@" || exit $?
install -d "$root/etc/systemd/system" "$root/etc/bucketfs" "$root/usr/local/bin" "$root/sbin" \
  "$root/usr/local/share/doc/bucketfs"
install -m 0644 "$here/systemd/bucketfs@.service" "$root/etc/systemd/system/bucketfs@.service"
# The unit's Documentation= points here.
install -m 0644 "$here/README.md" "$root/usr/local/share/doc/bucketfs/README.md"
# systemd's PATH and mount(8) look in fixed places: link the pip-installed entry points there.
[ "$bin" = "$root/usr/local/bin/bucketfs" ] || ln -sf "$bin" "$root/usr/local/bin/bucketfs"
ln -sf "$helper" "$root/sbin/mount.fuse.bucketfs"
conf="$root/etc/bucketfs/$name.conf"
umask 077  # the options may name a key file
{
  echo "BUCKETFS_URL=$(env_quote "$url")"
  echo "BUCKETFS_MOUNTPOINT=$(env_quote "$mountpoint")"
  echo "BUCKETFS_OPTIONS=$(env_quote "${options[*]:-}")"
} > "$conf"
echo "installed $root/etc/systemd/system/bucketfs@.service and $conf"
echo "next: systemctl daemon-reload && systemctl enable --now bucketfs@$name"
