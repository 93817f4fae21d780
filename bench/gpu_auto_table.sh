#!/usr/bin/env bash
# Every hand-picked DeepSpeed configuration of three transformers models, built from a config.json
# alone, on one GPU: ZeRO stage 0/1/2/3 x micro-batch 1, 2, 4, ... (up to the global batch; a
# stage's ladder stops at its first OOM), each configuration's peak GPU memory
# (max_memory_allocated, and reserved) and tokens/s over 2 timed optimizer steps after 1 warm-up,
# so that preset=auto's choice can be set against the best hand-picked one. One call on a GPU
# machine with no network (the image's CUDA torch and transformers at /opt/torch/.venv).
#
#   bench/gpu_auto_table.sh            (in the run tool: carry [".whl"], timeout_s 600)
#     .whl/ (WHEELS)  DeepSpeed 0.19.8 and the deps the image lacks, installed into the image's
#                     venv; .whl/fused_adam-ext.tgz, if there, is an earlier call's FusedAdam build
#   MODELS ("llama gpt2 bert"), run one after another, one process each (bench/gpu_auto_table.py:
#   llama 20 x 2560 eager, seq 2048, global batch 32; gpt2 20 x 2304, seq 1024, global batch 64;
#   bert-MLM 24 x 1280, seq 512, global batch 256; their config.json in bench/auto_table/NAME/).
#   TOTAL (545): seconds this script may take in all; each model's loop stops at BUDGET (170) s or
#   at its share of what is left (75 s kept for each model after it), whichever comes first, and
#   a line lists what it skipped. RESUME=FILE: configurations FILE has on this GPU stand.
# Results: $OUT/auto-table.jsonl (a line per configuration as it lands), the tails of the logs in
# $OUT/auto-table-logs.txt, the config.json files in $OUT/auto_table/NAME/, the FusedAdam JIT build
# in $OUT/fused_adam-ext.tgz (put it in .whl/ to skip the build in a later call).
set -uo pipefail
t_start=$(date +%s)
total=${TOTAL:-545} budget=${BUDGET:-170} models=${MODELS:-"llama gpt2 bert"} resume=${RESUME:-}
wheels=${WHEELS:-.whl}
out=${OUT:-$PWD/gpu-results}; mkdir -p "$out"
res=$out/auto-table.jsonl logs=/tmp/auto-table-logs summary=$out/auto-table-logs.txt
mkdir -p $logs
. "$(dirname "$0")/gpu_ansible.sh"  # py, repo_path and the NCCL settings (no Ansible here)
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
export PYTHONPATH=$repo_path  # dscplan composes each configuration's ds_config
note() { echo "$*" | tee -a $summary; }

note "== nvidia-smi -L"; nvidia-smi -L 2>&1 | tee -a $summary
t0=$(date +%s)
$py -m pip install -q --no-index --no-deps "$wheels"/*.whl > $logs/pip.log 2>&1 \
  || { note "pip install failed:"; tail -20 $logs/pip.log | tee -a $summary; exit 1; }
note "== wheels installed in $(( $(date +%s) - t0 )) s: $($py -c 'import deepspeed, transformers, torch; print("deepspeed", deepspeed.__version__, "transformers", transformers.__version__, "torch", torch.__version__)' 2>&1 | tail -1)"
if [ -f "$wheels/fused_adam-ext.tgz" ]; then
  # An earlier call's build: its outputs newer than DeepSpeed's sources, so ninja has nothing to do.
  mkdir -p $TORCH_EXTENSIONS_DIR && tar -xzf "$wheels/fused_adam-ext.tgz" -C $TORCH_EXTENSIONS_DIR
  csrc=$($py -c 'import deepspeed, os; print(os.path.dirname(deepspeed.__file__))')/ops/csrc
  find "$csrc" -type f -exec touch -d 2000-01-01 {} +
  find $TORCH_EXTENSIONS_DIR -type f -exec touch {} +
  note "== fused_adam build from $wheels/fused_adam-ext.tgz unpacked"
fi

set -- $models; left_models=$#; port=29611
for m in $models; do
  now=$(date +%s)
  deadline=$(( t_start + total - 75 * (left_models - 1) ))
  kill_after=$(( deadline - now + 40 ))
  [ $kill_after -gt $(( t_start + total + 35 - now )) ] && kill_after=$(( t_start + total + 35 - now ))
  [ $kill_after -lt 30 ] && kill_after=30
  note "== $m: budget $budget s, deadline in $(( deadline - now )) s (killed after $kill_after s)"
  port=$((port + 1))
  MASTER_PORT=$port timeout -k 10 $kill_after $py bench/gpu_auto_table.py --model $m --out $res \
    --budget $budget --deadline $deadline ${resume:+--resume "$resume"} > $logs/$m.log 2>&1
  rc=$?
  note "== $m: rc $rc after $(( $(date +%s) - now )) s"
  [ $rc -ne 0 ] && echo "{\"what\": \"process\", \"model\": \"$m\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - now ))}" >> $res
  { echo "-- tail of $m.log"; grep -v '^{' $logs/$m.log | tail -40; } >> $summary
  mkdir -p $out/auto_table/$m && cp bench/auto_table/$m/config.json $out/auto_table/$m/ 2>/dev/null
  left_models=$((left_models - 1))
done
if [ -d $TORCH_EXTENSIONS_DIR ] && [ ! -f "$wheels/fused_adam-ext.tgz" ]; then
  tar -czf $out/fused_adam-ext.tgz -C $TORCH_EXTENSIONS_DIR . && note "== fused_adam build: $(du -h $out/fused_adam-ext.tgz | cut -f1)"
fi
note "== done in $(( $(date +%s) - t_start )) s"
