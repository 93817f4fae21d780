#!/usr/bin/env bash
# preset=auto on a user's own DeepSpeed script (bench/user_gpt2: transformers' GPT2LMHeadModel,
# 24 x 2048, sequence 2048, dropout on, config.json beside it) against the same script by hand, in
# one call on a GPU machine with no network (the image's CUDA torch at /opt/torch/.venv).
#
#   bench/gpu_user_auto.sh WHEELS ["AUTO"] ["HAND"]
#     WHEELS  DeepSpeed and the deps the image lacks, ansible-core and its deps, collections.tgz
#             (ansible.posix, community.crypto, community.general), as bench/gpu_launch.sh
#     AUTO    attention kinds run through launch.yml -e preset=auto (default "eager sdpa")
#     HAND    by-hand runs attn:preset:micro-batch (default: eager at zero1/2/3 x 4/8)
#   STEPS (12), TIMED (8): optimizer steps, of which the last TIMED are timed. The global batch is
#   32 sequences of 2048 tokens (dsc_train_batch=32) on one GPU.
# provision.yml (existing env, bench/inventory/gpu-local without its micro-batch and train config)
# runs once per machine. Each launch: auto's choice (launch.yml's line), memory.json's prediction,
# memory.jsonl's measured peak, step_downs.jsonl, the script's RESULT line. By hand: the auto run's
# own rendered ds_config.json with the preset's zero_optimization and the micro-batch swapped in,
# `deepspeed --num_gpus 1 user_gpt2.py --deepspeed_config ...`. Every result is a line of
# $OUT/user-auto.jsonl as it lands; logs and configs in $OUT/user-auto-logs.tgz.
set -uo pipefail
wheels=$(realpath "$1"); autos=${2-"eager sdpa"}
hand=${3-"eager:zero2:8 eager:zero1:8 eager:zero2:4 eager:zero1:4 eager:zero3:8 eager:zero3:4"}
steps=${STEPS:-12} timed=${TIMED:-8}
out=${OUT:-$PWD/gpu-results}; mkdir -p "$out"; logs=/tmp/user-auto-logs; mkdir -p $logs
res=$out/user-auto.jsonl
code=$PWD/bench/user_gpt2 runs=/opt/dscluster/runs
. "$(dirname "$0")/gpu_ansible.sh"
gpu_ansible "$wheels" "$wheels/collections.tgz" || exit 1
inv=/tmp/user-auto-inventory
if [ ! -d $inv ]; then
  cp -r bench/inventory/gpu-local $inv
  sed -i '/^dsc_micro_batch:/d; /^# The 1.42 B/d; /^dsc_train_config:/,/^  save_final:/d' $inv/group_vars/all.yml
fi
ap() { "$DSC_ANSIBLE_PLAYBOOK" -i $inv "$@"; }
now() { date +%s.%N; }
pack() { tar -C $logs -czf $out/user-auto-logs.tgz . 2>/dev/null; }
if [ ! -f /tmp/dsc-provision.done ]; then
  t0=$(now)
  ap provision.yml > $logs/provision.log 2>&1 || { tail -60 $logs/provision.log; exit 1; }
  echo "{\"what\": \"provision\", \"seconds\": $(awk "BEGIN{print $(now) - $t0}")}" | tee -a $res
  touch /tmp/dsc-provision.done
fi
shape='"dsc_model_shape": {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 50257, "seq_len": 2048'
for attn in $autos; do
  id=user-auto-$attn-$(date +%s) t0=$(now)
  extra="$shape$([ $attn = sdpa ] && echo ', "attention": "sdpa"')}"
  ap launch.yml -e preset=auto -e follow=true -e run_id=$id -e dsc_train_batch=32 \
    -e dsc_code_dir=$code -e dsc_entry_script=user_gpt2.py \
    -e "{\"dsc_entry_args\": [\"--attn\", \"$attn\", \"--steps\", \"$steps\", \"--timed\", \"$timed\"], \"dsc_resume_args\": [], $extra}" \
    > $logs/launch-$attn.log 2>&1
  rc=$? wall=$(awk "BEGIN{print $(now) - $t0}")
  mkdir -p $logs/$id && cp $runs/$id/*.json $runs/$id/*.jsonl $runs/$id/launcher.log $logs/$id/ 2>/dev/null
  $py - "$attn" "$id" "$rc" "$wall" $logs/launch-$attn.log $runs/$id >> $res <<'PY'
import json, re, sys
from pathlib import Path
attn, rid, rc, wall, log, run = sys.argv[1:]
run, text = Path(run), Path(log).read_text(errors="replace")
def js(name):
    try:
        return json.loads((run / name).read_text())
    except (OSError, ValueError):
        return None
def jl(name):
    try:
        return [json.loads(l) for l in (run / name).read_text().splitlines() if l.strip()]
    except (OSError, ValueError):
        return []
launcher = (run / "launcher.log").read_text(errors="replace") if (run / "launcher.log").exists() else ""
result = [json.loads(m) for m in re.findall(r"RESULT (\{.*\})", launcher)]
chose = sorted(set(re.findall(r"preset=auto chose[^\"\\]*", text)))
print(json.dumps({"what": "auto", "attn": attn, "run_id": rid, "rc": int(rc), "wall_s": float(wall),
                  "chose": chose, "launch": js("launch.json"), "memory": js("memory.json"),
                  "measured": jl("memory.jsonl"), "step_downs": jl("step_downs.jsonl"),
                  "result": result[-1] if result else None,
                  "oom": "OutOfMemoryError" in launcher or "CUDA out of memory" in launcher}))
PY
  tail -1 $res | cut -c1-600; pack
  [ "$attn" = eager ] && base=$runs/$id/ds_config.json
done
[ -f "${base:-}" ] || base=$(ls -t $runs/user-auto-*/ds_config.json 2>/dev/null | head -1)
# By hand: as root, after every launch (JIT cache read, not written: FusedAdam was built at provision).
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/opt/dscluster/cache/torch_extensions
port=29650
for h in $hand; do
  IFS=: read -r attn preset mb <<< "$h"
  cfg=$logs/hand-$attn-$preset-mb$mb.json
  $py - "$base" templates/ds_config/$preset.json "$mb" > $cfg <<'PY'
import json, sys
base, zero = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
mb = int(sys.argv[3])
base["zero_optimization"] = zero["zero_optimization"]
base.update(train_batch_size=32, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=32 // mb)
print(json.dumps(base, indent=1))
PY
  port=$((port + 1)) t0=$(now)
  timeout 240 /opt/torch/.venv/bin/deepspeed --num_gpus 1 --master_port $port $code/user_gpt2.py \
    --deepspeed_config $cfg --attn $attn --steps $steps --timed $timed > $logs/hand-$attn-$preset-mb$mb.log 2>&1
  rc=$? wall=$(awk "BEGIN{print $(now) - $t0}")
  $py - "$attn" "$preset" "$mb" "$rc" "$wall" $logs/hand-$attn-$preset-mb$mb.log >> $res <<'PY'
import json, re, sys
attn, preset, mb, rc, wall, log = sys.argv[1:]
text = open(log, errors="replace").read()
result = [json.loads(m) for m in re.findall(r"RESULT (\{.*\})", text)]
oom = re.findall(r"(?:OutOfMemoryError|CUDA out of memory)[^\n]{0,200}", text)
print(json.dumps({"what": "hand", "attn": attn, "preset": preset, "micro_batch": int(mb), "rc": int(rc),
                  "wall_s": float(wall), "result": result[-1] if result else None, "oom": oom[:1]}))
PY
  tail -1 $res | cut -c1-400; pack
done
pack
