#!/usr/bin/env bash
# Build the Debian 12 node image for the test cluster (debootstrap + podman import), cached:
# an existing image tagged $DSC_IMAGE is kept unless REBUILD=1.
#   scripts/build-image.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/containers.conf}
image=${DSC_IMAGE:-localhost/dscluster-node:bookworm}
cache=${DSC_CACHE:-/var/cache/dscluster}
if [ "${REBUILD:-0}" != 1 ] && podman image exists "$image"; then
  echo "image $image present (REBUILD=1 to rebuild)"; exit 0
fi
mkdir -p "$cache"
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
