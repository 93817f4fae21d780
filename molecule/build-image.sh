#!/usr/bin/env bash
# Build the Debian 12 node image for the test cluster (debootstrap + podman import), and on it the
# systemd node image (molecule/node-systemd.Containerfile: systemd, dbus, firewalld), both cached:
# an existing image tagged $DSC_IMAGE / $DSC_SYSTEMD_IMAGE is kept unless REBUILD=1.
#   molecule/build-image.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/containers.conf}
image=${DSC_IMAGE:-localhost/dscluster-node:bookworm}
systemd_image=${DSC_SYSTEMD_IMAGE:-localhost/dscluster-node:bookworm-systemd}
cache=${DSC_CACHE:-/var/cache/dscluster}
build_systemd() {
  if [ "${REBUILD:-0}" != 1 ] && podman image exists "$systemd_image"; then
    echo "image $systemd_image present (REBUILD=1 to rebuild)"; return
  fi
  podman build -q --network=host --build-arg BASE="$image" -t "$systemd_image" \
    -f "$here/node-systemd.Containerfile" "$here" >"$cache/systemd-image.log" 2>&1 \
    || { tail -20 "$cache/systemd-image.log"; exit 1; }
  echo "built $systemd_image"
}
mkdir -p "$cache"
if [ "${REBUILD:-0}" != 1 ] && podman image exists "$image"; then
  echo "image $image present (REBUILD=1 to rebuild)"; build_systemd; exit 0
fi
root=$(mktemp -d "$cache/rootfs.XXXX")
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase \
  --include=openssh-server,python3,python3-apt,sudo,iproute2,procps,ca-certificates,netcat-openbsd,rsync \
  bookworm "$root" http://deb.debian.org/debian >"$cache/debootstrap.log" 2>&1 \
  || { tail -20 "$cache/debootstrap.log"; exit 1; }
# sshd exits at once without its privilege separation directory.
mkdir -p "$root/run/sshd"
# Host keys are generated per container at start (ssh-keygen -A), never baked into the image.
rm -f "$root"/etc/ssh/ssh_host_*
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
# No package lists and an old lists mtime: the first apt task with cache_valid_time updates.
touch -d @0 "$root"/var/lib/apt/lists
tar -C "$root" -c . | podman import --change 'CMD ["/usr/sbin/sshd","-D"]' - "$image"
echo "built $image"
build_systemd
