#!/usr/bin/env bash
# Build the Debian 12 node image for the test cluster (mmdebstrap + podman import), and on it the
# systemd node image (molecule/node-systemd.Containerfile: systemd, dbus, firewalld), both cached:
# an existing image tagged $DSC_IMAGE / $DSC_SYSTEMD_IMAGE is kept unless REBUILD=1. mmdebstrap
# rather than debootstrap: it fetches with apt, in parallel, in about half the time and CPU.
#   molecule/build-image.sh [all|base|systemd]      # all (the default): base, then systemd on it
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
build_base() {
  if [ "${REBUILD:-0}" != 1 ] && podman image exists "$image"; then
    echo "image $image present (REBUILD=1 to rebuild)"; return
  fi
  root=$(mktemp -d "$cache/rootfs.XXXX")
  mmdebstrap --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --include=openssh-server,python3,python3-apt,sudo,iproute2,procps,ca-certificates,netcat-openbsd,rsync \
    bookworm "$root" http://deb.debian.org/debian >"$cache/mmdebstrap.log" 2>&1 \
    || { tail -20 "$cache/mmdebstrap.log"; exit 1; }
  # sshd exits at once without its privilege separation directory.
  mkdir -p "$root/run/sshd"
  # Host keys are generated per container at start (ssh-keygen -A), never baked into the image.
  rm -f "$root"/etc/ssh/ssh_host_*
  # mmdebstrap leaves no package lists nor downloaded packages; with an old lists mtime the first
  # apt task with cache_valid_time updates.
  touch -d @0 "$root"/var/lib/apt/lists
  tar -C "$root" -c . | podman import --change 'CMD ["/usr/sbin/sshd","-D"]' - "$image"
  echo "built $image"
}
root=
trap 'rm -rf "$root"' EXIT
mkdir -p "$cache"
case ${1:-all} in
  all) build_base; build_systemd ;;
  base) build_base ;;
  systemd) build_systemd ;;
  *) echo "usage: $0 [all|base|systemd]" >&2; exit 2 ;;
esac
