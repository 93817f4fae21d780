#!/usr/bin/env bash
# Two (or more) inventory nodes on one host, as bench/inventory/gpu-two-nodes has them: each node gets
# a mount namespace of its own in which RUN_ROOT is a directory of its own, as it would be on
# separate machines (no_ssh mode runs a supervisor per node, each with its own run directory).
# Ansible enters a node's namespace through its ansible_shell_executable, written here as
# /srv/dsc-nodes/NODE/sh. Needs root and util-linux (unshare, nsenter, mountpoint).
#
#   bench/two_nodes_one_host.sh RUN_ROOT NODE...     e.g. /opt/dscluster/runs node1 node2
set -euo pipefail
root=$1; shift
base=/srv/dsc-nodes ns=/run/dsc-ns
mkdir -p "$ns" "$root"
install -d -m 0755 "$base"
# A namespace outlives its processes when bound to a file on a private mount.
mountpoint -q "$ns" || { mount --bind "$ns" "$ns"; mount --make-private "$ns"; }
for node in "$@"; do
  install -d -m 0755 "$base/$node" "$base/$node/runs"
  if ! mountpoint -q "$ns/$node"; then
    touch "$ns/$node"
    unshare --mount="$ns/$node" --propagation private mount --bind "$base/$node/runs" "$root"
  fi
  # Root enters the namespace; a become_user shell runs inside one already (sudo/su from it).
  printf '#!/bin/sh\n[ "$(id -u)" = 0 ] && exec nsenter --mount=%s -- /bin/sh "$@"\nexec /bin/sh "$@"\n' \
    "$ns/$node" > "$base/$node/sh"
  chmod 0755 "$base/$node/sh"
  echo "$node: $root is $base/$node/runs in its namespace; shell $base/$node/sh"
done
