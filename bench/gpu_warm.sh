#!/usr/bin/env bash
# Provision's warm-up (dscnode.warm) on a GPU node, as the deepspeed role runs it: the kind's
# source builds deepspeed_warm_ops' cuda list (FusedAdam with nvcc, DeepSpeedCPUAdam), its build is
# packed as the role packs it and unpacked in another cache, where a node that is not the source
# loads it without a build; an empty cache's node awaits both. Prints each warm's JSON and time.
#
#   bench/gpu_warm.sh WHEELS_DIR     # DeepSpeed and its missing dependencies, for the GPU image's python
set -uo pipefail
wheels=$(realpath "$1"); out=${OUT:-$PWD/gpu-results}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/node PATH=/tmp/site/bin:$PATH DS_ACCELERATOR=cuda
export TORCH_CUDA_ARCH_LIST=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | sort -u | paste -sd';')
echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
warm() {  # warm NAME [--build]
  local t0=$(date +%s.%N)
  TORCH_EXTENSIONS_DIR=/tmp/ext/$1 python3 -m dscnode warm --ops=FusedAdamBuilder,CPUAdamBuilder \
    --report=/tmp/ext/report.txt --gpus="$(nvidia-smi -L | wc -l)" "${@:2}" > "$out/warm-$1.json" 2> "$out/warm-$1.err"
  echo "$1 rc=$? $(awk "BEGIN{print $(date +%s.%N) - $t0}") s: $(tail -1 "$out/warm-$1.json")"
}
mkdir -p /tmp/ext/source /tmp/ext/shipped /tmp/ext/bare
warm source --build
tar -C /tmp/ext/source --exclude=lock -czf /tmp/ext/ops-shipment.tar.gz fused_adam cpu_adam
tar -C /tmp/ext/shipped -xzf /tmp/ext/ops-shipment.tar.gz
echo "shipment $(du -h /tmp/ext/ops-shipment.tar.gz | cut -f1)"
warm shipped
warm bare
