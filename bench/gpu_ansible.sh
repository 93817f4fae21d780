# Sourced by the GPU benchmarks (bench/gpu*.sh): the carried ansible-core and collections beside
# the GPU image's python (which has jinja2, yaml, packaging), in a folder of their own named only
# for ansible-playbook's own process.  gpu_ansible WHEELS_DIR COLLECTIONS_TGZ
# Sets py and exports ANSIBLE_COLLECTIONS_PATH and DSC_WHEELHOUSE.
py=/opt/torch/.venv/bin/python3
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
gpu_ansible() {
  local wheels=$1 coll=$2
  if [ ! -f /tmp/anssite/bin/ansible-playbook ]; then
    $py -m pip install -q --no-index --no-deps --target /tmp/anssite "$wheels"/ansible_core-*.whl \
      "$wheels"/resolvelib-*.whl "$wheels"/cryptography-*.whl "$wheels"/cffi-*.whl "$wheels"/pycparser-*.whl || return 1
    mkdir -p /tmp/anssite/collections && tar -C /tmp/anssite/collections -xzf "$coll"
  fi
  export ANSIBLE_COLLECTIONS_PATH=/tmp/anssite/collections DSC_WHEELHOUSE=$wheels
}
