#!/usr/bin/env bash
# Install the bucketfs@.service template, the fstab mount helper, and one config file.
#   sudo scripts/install-systemd.sh NAME URL MOUNTPOINT [bucketfs mount options...]
#   sudo scripts/install-systemd.sh imagenet s3://my-bucket/imagenet /mnt/imagenet --allow-other --max-memory 2G
# then: systemctl daemon-reload && systemctl enable --now bucketfs@imagenet
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,6p' "$0"; exit 2
fi
name=$1 url=$2 mountpoint=$3; shift 3
root=${DESTDIR:-}
here=$(cd "$(dirname "$0")/.." && pwd)
bin=$(command -v bucketfs) || { echo "bucketfs is not installed (pip install bucketfs)" >&2; exit 1; }
helper=$(command -v mount.fuse.bucketfs) || { echo "mount.fuse.bucketfs is not installed" >&2; exit 1; }
install -d "$root/etc/systemd/system" "$root/etc/bucketfs" "$root/usr/local/bin" "$root/sbin"
install -m 0644 "$here/systemd/bucketfs@.service" "$root/etc/systemd/system/bucketfs@.service"
# systemd's PATH and mount(8) look in fixed places: link the pip-installed entry points there.
[ "$bin" = "$root/usr/local/bin/bucketfs" ] || ln -sf "$bin" "$root/usr/local/bin/bucketfs"
ln -sf "$helper" "$root/sbin/mount.fuse.bucketfs"
conf="$root/etc/bucketfs/$name.conf"
umask 077  # the options may name a key file
{
  echo "BUCKETFS_URL=$url"
  echo "BUCKETFS_MOUNTPOINT=$mountpoint"
  echo "BUCKETFS_OPTIONS=$*"
} > "$conf"
echo "installed $root/etc/systemd/system/bucketfs@.service and $conf"
echo "next: systemctl daemon-reload && systemctl enable --now bucketfs@$name"
