#!/usr/bin/env bash
# Install the bucketfs@.service template, the fstab mount helper, and one config file.
#   sudo scripts/install-systemd.sh NAME URL MOUNTPOINT [bucketfs mount options...]
#   sudo scripts/install-systemd.sh imagenet s3://my-bucket/imagenet /mnt/imagenet --allow-other --max-memory 2G
# then: systemctl daemon-reload && systemctl enable --now bucketfs@imagenet
set -euo pipefail
usage() {
  cat >&2 <<'USAGE'
usage: sudo scripts/install-systemd.sh NAME URL MOUNTPOINT [bucketfs mount options...]
  e.g. sudo scripts/install-systemd.sh imagenet s3://my-bucket/imagenet /mnt/imagenet --allow-other --max-memory 2G
then: systemctl daemon-reload && systemctl enable --now bucketfs@NAME
USAGE
  exit 2
}
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
root=${DESTDIR:-}
here=$(cd "$(dirname "$0")/.." && pwd)
bin=$(command -v bucketfs) || { echo "bucketfs is not installed (pip install bucketfs)" >&2; exit 1; }
helper=$(command -v mount.fuse.bucketfs) || { echo "mount.fuse.bucketfs is not installed" >&2; exit 1; }
options=()
for arg in "$@"; do
  case $arg in *$'\n'*) echo "an option value contains a newline, which a systemd config line cannot hold" >&2; exit 2;; esac
  options+=("$(split_escape "$arg")")
done
install -d "$root/etc/systemd/system" "$root/etc/bucketfs" "$root/usr/local/bin" "$root/sbin"
install -m 0644 "$here/systemd/bucketfs@.service" "$root/etc/systemd/system/bucketfs@.service"
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
