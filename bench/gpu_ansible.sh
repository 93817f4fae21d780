# Sourced by the GPU benchmarks (bench/gpu*.sh): the carried ansible-core and collections beside
# the GPU image's python (which has jinja2, yaml, packaging), in a folder of their own named only
# for ansible-playbook's own process.  gpu_ansible WHEELS_DIR COLLECTIONS_TGZ
# Sets py and repo_path; gpu_ansible writes /tmp/ansible-playbook and exports
# ANSIBLE_COLLECTIONS_PATH, DSC_WHEELHOUSE and DSC_ANSIBLE_PLAYBOOK (bench/launch.py's).
py=/opt/torch/.venv/bin/python3
# The project's own Python for processes without the control venv, whose .pth names the same
# paths (scripts/import-paths.sh): the plan and the filters import dscplan and dscnode, bench's
# scripts cluster and train (tests/unit/test_bench_imports.py keeps them importable so).
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
repo_path=$(sh "$repo/scripts/import-paths.sh" "$repo" | paste -sd:)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
gpu_ansible() {
  local wheels=$1 coll=$2
  if [ ! -f /tmp/anssite/bin/ansible-playbook ]; then
    $py -m pip install -q --no-index --no-deps --target /tmp/anssite "$wheels"/ansible_core-*.whl \
      "$wheels"/resolvelib-*.whl "$wheels"/cryptography-*.whl "$wheels"/cffi-*.whl "$wheels"/pycparser-*.whl || return 1
    mkdir -p /tmp/anssite/collections && tar -C /tmp/anssite/collections -xzf "$coll"
  fi
  printf '#!/bin/sh\nPYTHONPATH=/tmp/anssite:%s exec %s /tmp/anssite/bin/ansible-playbook "$@"\n' \
    "$repo_path" "$py" > /tmp/ansible-playbook && chmod +x /tmp/ansible-playbook
  export ANSIBLE_COLLECTIONS_PATH=/tmp/anssite/collections DSC_WHEELHOUSE=$wheels \
    DSC_ANSIBLE_PLAYBOOK=/tmp/ansible-playbook
}
