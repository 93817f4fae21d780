#!/usr/bin/env bash
# preset=auto beside the presets it is compared with, back to back on one machine, through
# bench/gpu.sh. bench/inventory/gpu-local without its fixed micro-batch, so that auto chooses one.
#
#   bench/gpu_auto.sh WHEELS_DIR COLLECTIONS_TGZ REFERENCE_PY [SIZE [ONE_GPU [TWO_GPUS]]]
#     SIZE 1.3b (default): the 1.42 B GPT at a global batch of 64 sequences, 10 steps; ONE_GPU
#       default "auto+gpus1 zero2+gpus1+mb16" plus plain PyTorch at micro-batch 16 x 4, TWO_GPUS
#       default "auto zero2+mb16".
#     SIZE 8b: the 8.47 B model (fits one H200 only with offload; 256 GB of host memory) at a
#       global batch of 16, 4 steps; ONE_GPU default "auto+gpus1 zero3-offload+gpus1+mb8",
#       TWO_GPUS default none.
#   REFS="" leaves plain PyTorch out. Results in $OUT/SIZE-one, $OUT/SIZE-two (gpu.sh's layout).
set -uo pipefail
here=$(dirname "$0") out=${OUT:-$PWD/gpu-results} size=${4:-1.3b}
case $size in
  1.3b) batch=64 steps=10 one=${5-"auto+gpus1 zero2+gpus1+mb16"} two=${6-"auto zero2+mb16"} refs=${REFS-torch16x4} ;;
  8b) batch=16 steps=4 one=${5-"auto+gpus1 zero3-offload+gpus1+mb8"} two=${6-} refs= ;;
  *) echo "SIZE is 1.3b or 8b" >&2; exit 2 ;;
esac
inv=$(mktemp -d) && cp -r bench/inventory/gpu-local/. "$inv/" && sed -i '/^dsc_micro_batch:/d' "$inv/group_vars/all.yml"
export INVENTORY=$inv
export LAUNCH_EXTRA="-e dsc_train_batch=$batch -e {\"dsc_train_config\":{\"size\":\"$size\",\"seq_len\":2048,\"steps\":$steps,\"save_final\":false}}"
[ -z "$one" ] || OUT=$out/$size-one bash "$here/gpu.sh" "$1" "$2" "$3" "$one" "$refs"
[ -z "$two" ] || OUT=$out/$size-two bash "$here/gpu.sh" "$1" "$2" "$3" "$two" ""
grep -h "preset=auto chose" "$out"/"$size"-*/launch-auto*.log | sort -u
