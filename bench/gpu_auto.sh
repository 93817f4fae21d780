#!/usr/bin/env bash
# preset=auto on one H200 and on two, at a global batch of 64 sequences (the 1.42 B GPT, 10
# steps), beside the preset it is compared with and plain PyTorch at micro-batch 16 x 4, in one
# call. inventory/gpu-local without its fixed micro-batch, so that auto chooses one.
#
#   bench/gpu_auto.sh WHEELS_DIR COLLECTIONS_TGZ REFERENCE_PY      (results in $OUT/one, $OUT/two)
set -uo pipefail
here=$(dirname "$0") out=${OUT:-$PWD/gpu-results}
inv=$(mktemp -d) && cp -r inventory/gpu-local/. "$inv/" && sed -i '/^dsc_micro_batch:/d' "$inv/group_vars/all.yml"
export INVENTORY=$inv LAUNCH_EXTRA='-e dsc_train_batch=64 -e {"dsc_train_config":{"size":"1.3b","seq_len":2048,"steps":10,"save_final":false}}'
OUT=$out/one bash "$here/gpu.sh" "$1" "$2" "$3" "auto+gpus1 zero2+gpus1+mb16" "torch16x4"
OUT=$out/two bash "$here/gpu.sh" "$1" "$2" "$3" "auto zero2+mb16" ""
grep -h "preset=auto chose" "$out"/*/launch-auto*.log | sort -u
