#!/usr/bin/env bash
# On a GPU machine with no network (the device image: CUDA torch at /opt/torch/.venv, no Ansible):
# install the carried Ansible and collections beside the image's python, then run bench/launch.py
# --where gpu (provision.yml with bench/inventory/gpu-local, launch.yml vs the same deepspeed command by
# hand, status.yml). WHEELS holds the node's wheels (DeepSpeed and the deps the image lacks), the
# Ansible wheels and collections.tgz (ansible.posix, community.crypto, community.general).
#   bench/gpu_launch.sh WHEELS OUT_JSON [REPS]
#   bench/gpu_launch.sh WHEELS clm OUT_DIR [bench/gpu_clm.py options]   (run_clm.py: launch.yml vs by hand)
set -euo pipefail
wheels=$(realpath "$1"); out=$2; reps=${3:-2}
. "$(dirname "$0")/gpu_ansible.sh"
gpu_ansible "$wheels" "$wheels/collections.tgz" || exit 1
if [ "$out" = clm ]; then
  PYTHONPATH=$repo_path exec $py bench/gpu_clm.py --out "$3" "${@:4}"
fi
PYTHONPATH=$repo_path $py bench/launch.py --where gpu --reps "$reps" --out "$out"
