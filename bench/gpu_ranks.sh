#!/usr/bin/env bash
# What measuring each rank's collectives costs on a GPU (the slow rank named while the run moves,
# docs/runs.md): train.run's 1.42 B GPT through the node helper's entry shim, as every launch
# starts it, with the ranks' times on (DSC_RANK_WINDOW=10, the default) and off (0), alternated,
# REPEATS times for each preset; prints each run's tokens/s and, per preset, the ratio of on to off
# in this call. The ds_config is the preset's as the plan renders it for GPUS bf16 GPUs.
#
#   [GPUS=N] bench/gpu_ranks.sh WHEELS_DIR "zero2 zero3" [REPEATS] [STEPS]
#     WHEELS_DIR  DeepSpeed's wheel and the node's missing dependencies (docs/benchmarks.md)
#     GPUS        ranks on this machine's GPUs (default 1); the global batch is 8 sequences a rank
# Everything lands in $OUT (default ./gpu-results): ranks-*.jsonl, summary-*.json, ranks.txt.
set -uo pipefail
wheels=$(realpath "$1"); presets=${2:-zero2 zero3}; repeats=${3:-2}; steps=${4:-40}; gpus=${GPUS:-1}
out=${OUT:-$PWD/gpu-results}; mkdir -p "$out"
. "$(dirname "$0")/gpu_ansible.sh"  # py, repo_path (no Ansible here)
root=$repo
$py -m pip install -q --no-index --no-deps --target /tmp/nodesite "$wheels"/*.whl || exit 1
export PYTHONPATH=/tmp/nodesite:$repo_path TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
for p in $presets; do
  $py - "$root/templates" "$p" "$gpus" > "/tmp/ds_$p.json" <<'PY' || exit 1
import json, sys
from dscplan.deepspeed_config import ds_config
print(json.dumps(ds_config(sys.argv[1], sys.argv[2], "cuda", ["9.0"],
                           {"micro_batch": 8, "grad_accum": 1, "train_batch": 8 * int(sys.argv[3])}, {})))
PY
done
for rep in $(seq "$repeats"); do
  for p in $presets; do
    # on first in odd repeats, off first in even ones: neither always runs on a warmer machine
    order="10 0"; [ $((rep % 2)) = 0 ] && order="0 10"
    for window in $order; do
      id=$p-w$window-$rep; run=/tmp/runs/$id; mkdir -p "$run"
      DSC_RUN_DIR=$run DSC_RANK_WINDOW=$window $py /tmp/nodesite/bin/deepspeed --num_gpus "$gpus" --master_port 29610 \
        --module dscnode entry --module train.run --deepspeed_config "/tmp/ds_$p.json" \
        --set size=1.3b --set seq_len=2048 --set steps="$steps" --set save_final=false > "$out/log-$id.txt" 2>&1 \
        || { echo "$id failed"; tail -30 "$out/log-$id.txt"; exit 1; }
      cp "$run/summary.json" "$out/summary-$id.json"; cp "$run/ranks.jsonl" "$out/ranks-$id.jsonl" 2>/dev/null
      echo "$p window=$window rep=$rep tokens/s $($py -c "import json;print(json.load(open('$run/summary.json'))['tokens_per_s'])")" \
        | tee -a "$out/ranks.txt"
      [ -f "$run/ranks.jsonl" ] && tail -1 "$run/ranks.jsonl" | tee -a "$out/ranks.txt"
    done
  done
done
$py - "$out/ranks.txt" <<'PY' | tee -a "$out/ranks.txt"
import sys, collections
runs = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    if " tokens/s " in line:
        f = line.split()
        runs[f[0]][f[1]].append(float(f[-1]))
for preset, by in runs.items():
    on, off = by["window=10"], by["window=0"]
    mean = lambda v: sum(v) / len(v)
    print(f"{preset}: measured {mean(on):,.0f} tok/s against {mean(off):,.0f} unmeasured ({len(on)} runs each): "
          f"ratio {mean(on) / mean(off):.4f}, cost {100 * (1 - mean(on) / mean(off)):+.2f} %")
PY
