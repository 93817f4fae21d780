#!/usr/bin/env bash
# What continuing on another world size costs at the conversion (docs/benchmarks.md): DeepSpeed's
# universal checkpoint (ds_to_universal, then load_universal) on train.run's GPT.
#   1. a run trains STEPS steps and saves at SAVE (its losses after SAVE are the reference);
#   2. ds_to_universal converts that checkpoint (timed);
#   3. a run resumes from the universal checkpoint with load_universal and trains to STEPS: its
#      loss at each step after SAVE against the first run's at the same step (the same data).
#
#   [GPUS=N] [SIZE=1.3b SEQ=2048 PRESET=zero2 MB=8] [OVERRIDES=JSON] [WORKERS=4] \
#     bench/gpu_universal.sh WHEELS_DIR [SAVE] [STEPS]
#     OVERRIDES   merged into the preset's ds_config as dsc_ds_config_overrides are, e.g.
#                 '{"optimizer": {"params": {"torch_adam": true}}}' (no FusedAdam build first)
#     WORKERS     ds_to_universal's --num_extract_workers
#     WHEELS_DIR  DeepSpeed's wheel and the node's missing dependencies (docs/benchmarks.md); "-"
#                 uses the python already on PATH ($PY) as it is (DS_ACCELERATOR=cpu, SIZE=tiny:
#                 the script's own check on a machine without a GPU)
# Everything lands in $OUT (default ./gpu-results): universal.txt, universal.json, the logs.
set -uo pipefail
wheels=$1; save=${2:-10}; steps=${3:-12}; gpus=${GPUS:-1}
size=${SIZE:-1.3b}; seq=${SEQ:-2048}; preset=${PRESET:-zero2}; mb=${MB:-8}
out=${OUT:-$PWD/gpu-results}; mkdir -p "$out"; out=$(realpath "$out")
. "$(dirname "$0")/gpu_ansible.sh"  # py, repo_path (no Ansible here)
if [ "$wheels" = - ]; then
  py=${PY:-python3}; accel=${DS_ACCELERATOR:-cpu}
  export PYTHONPATH=$repo_path
else
  $py -m pip install -q --no-index --no-deps --target /tmp/nodesite "$(realpath "$wheels")"/*.whl || exit 1
  accel=cuda
  export PYTHONPATH=/tmp/nodesite:$repo_path TORCH_CUDA_ARCH_LIST=9.0
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
work=${WORK:-/tmp/universal}; rm -rf "$work"; mkdir -p "$work"
for load in false true; do
  $py - "$repo/templates" "$preset" "$accel" "$gpus" "$mb" "$load" "${OVERRIDES:-{\}}" > "$work/ds-$load.json" <<'PY' || exit 1
import json, sys
from dscplan.deepspeed_config import ds_config
templates, preset, accel, gpus, mb, load, overrides = sys.argv[1:]
cfg = ds_config(templates, preset, accel, ["9.0"] if accel == "cuda" else [],
                {"micro_batch": int(mb), "grad_accum": 1, "train_batch": int(mb) * int(gpus)}, json.loads(overrides))
if load == "true":
    cfg["checkpoint"] = {"load_universal": True}
print(json.dumps(cfg))
PY
done
train() {  # train RUN_ID LOAD_UNIVERSAL [train.run options]
  local id=$1 load=$2; shift 2
  mkdir -p "$work/$id"
  DSC_RUN_DIR=$work/$id $py -m torch.distributed.run --nproc_per_node "$gpus" --master_port 29620 \
    -m train.run --deepspeed_config "$work/ds-$load.json" --set size="$size" --set seq_len="$seq" \
    --set steps="$steps" --set save_final=false "$@" > "$out/log-$id.txt" 2>&1 \
    || { echo "$id failed"; tail -30 "$out/log-$id.txt"; exit 1; }
}
train saved false --set save_every="$save"
ckpt=$work/saved/checkpoints/step$save
[ -f "$ckpt/COMPLETE" ] || { echo "no complete checkpoint at $ckpt"; exit 1; }
# the universal folder where train.run looks for checkpoints (checkpoint_dir), the same tag and
# its marker: train.run's resume picks it as it picks any complete checkpoint
t0=$EPOCHREALTIME
$py -m deepspeed.checkpoint.ds_to_universal --input_folder "$ckpt" --output_folder "$work/universal/step$save" \
  --inject_missing_state --num_extract_workers "${WORKERS:-4}" > "$out/log-convert.txt" 2>&1 || { echo "ds_to_universal failed"; tail -30 "$out/log-convert.txt"; exit 1; }
t1=$EPOCHREALTIME
cp "$ckpt/COMPLETE" "$work/universal/step$save/"
train resumed true --resume --set checkpoint_dir="$work/universal"
grep -q "resume: loaded $work/universal/step$save (step $save)" "$out/log-resumed.txt" \
  || { echo "the resumed run did not load the universal checkpoint"; tail -30 "$out/log-resumed.txt"; exit 1; }
$py - "$work" "$save" "$t0" "$t1" "$out" <<'PY'
import json, os, sys
work, save, t0, t1, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
def losses(run):
    return {m["step"]: m["loss"] for m in map(json.loads, open(f"{work}/{run}/metrics.jsonl")) if "loss" in m}
def size(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
a, b = losses("saved"), losses("resumed")
after = sorted(s for s in b if s > save)
result = {"convert_s": round(t1 - t0, 1), "checkpoint_bytes": size(f"{work}/saved/checkpoints/step{save}"),
          "universal_bytes": size(f"{work}/universal/step{save}"), "saved_at": save,
          "loss_before": a.get(save), "steps": {s: {"uninterrupted": a[s], "from_universal": b[s]} for s in after},
          "max_abs_diff": max(abs(a[s] - b[s]) for s in after)}
json.dump(result, open(f"{out}/universal.json", "w"), indent=1)
print(f"ds_to_universal: {result['convert_s']} s for {result['checkpoint_bytes'] / 2**30:.2f} GiB "
      f"({result['universal_bytes'] / 2**30:.2f} GiB universal); loss at step {save} {result['loss_before']:.4f}")
for s in after:
    print(f"step {s}: uninterrupted {a[s]:.4f}, from the universal checkpoint {b[s]:.4f}")
print(f"largest difference {result['max_abs_diff']:.2e}")
PY
