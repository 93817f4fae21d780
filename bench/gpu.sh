#!/usr/bin/env bash
# GPU benchmark on a machine with an existing CUDA torch and no network (issue: H200 numbers):
# provision.yml with bench/inventory/gpu-local (the existing interpreter + an offline wheelhouse),
# launch.yml for each preset, then the hand-run reference (DeepSpeed ZeRO-2/3 and plain PyTorch)
# in the same session. Everything lands in $OUT (default ./gpu-results).
#
#   bench/gpu.sh WHEELS_DIR COLLECTIONS_TGZ REFERENCE_PY "PRESETS" "REFS"
#     WHEELS_DIR       wheels for the node (DeepSpeed + missing deps) and for Ansible (ansible-core + deps)
#     COLLECTIONS_TGZ  ansible_collections/{ansible/posix,community/crypto,community/general} as .tgz
#     REFERENCE_PY     the hand-run reference script (gpt_reference.py)
#     PRESETS          e.g. "zero2 zero3 auto"; a variant adds +compile, +mbN (micro-batch) or +gpusN
#                      (slots), e.g. "zero2+gpus1 zero2+gpus1+compile+mb12"
#     REFS             e.g. "ds2 ds3 torch"; ds2x2/ds3x2 run the hand-run reference on 2 GPUs,
#                      torch16x4 plain PyTorch at micro-batch 16 x 4 accumulation steps
#   PREFLIGHT=1 runs preflight.yml (all-reduce across the node's GPUs) after provisioning.
#   INVENTORY (default bench/inventory/gpu-local), RUNS (where the master's run directories are,
#   default /opt/dscluster/runs) and PROVISION_ARGS (e.g. "-f 1") let it drive other inventories.
set -uo pipefail
wheels=$(realpath "$1"); coll=$(realpath "$2"); ref=$(realpath "$3"); presets=${4:-zero2}; refs=${5:-}
out=${OUT:-$PWD/gpu-results}; mkdir -p "$out"
. "$(dirname "$0")/gpu_ansible.sh"
gpu_ansible "$wheels" "$coll" || exit 1
ap() { "$DSC_ANSIBLE_PLAYBOOK" -i "${INVENTORY:-bench/inventory/gpu-local}" "$@"; }
echo "image TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-unset} (the toolkit renders its own from nvidia-smi)"
if [ ! -f /tmp/dsc-provision.done ]; then
  t0=$(date +%s.%N)
  ap ${PROVISION_ARGS:-} provision.yml > "$out/provision.log" 2>&1 || { tail -60 "$out/provision.log"; exit 1; }
  echo "provision.yml: $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" | tee "$out/provision.txt" /tmp/dsc-provision.done
  grep -A4 '"node | python' "$out/provision.log"
fi
if [ "${PREFLIGHT:-0}" = 1 ]; then
  ap preflight.yml -e '{"dsc_entry_args": ["--sizes", "1,16,256,1024", "--iters", "20"]}' \
    -e preflight_report_dir="$out" > "$out/preflight.log" 2>&1; echo "preflight rc=$?"
  grep -E '"(all-reduce|slots|env and versions|driver|interface) ' "$out/preflight.log"
fi
for p in $presets; do
  t0=$(date +%s.%N)
  preset=${p%%+*}; extra=()
  for opt in $(echo "$p" | tr '+' ' ' | cut -d' ' -f2-); do
    [ "$opt" = "$preset" ] && continue
    case $opt in
      compile) extra+=(-e '{"dsc_entry_args": ["--set", "compile=true"]}') ;;
      mb*) extra+=(-e "dsc_micro_batch=${opt#mb}") ;;
      gpus*) extra+=(-e "dsc_slots=${opt#gpus}") ;;
    esac
  done
  id=gpu-${p//+/-}-$(date +%s)
  ap launch.yml -e preset=$preset -e follow=true -e run_id=$id "${extra[@]}" ${LAUNCH_EXTRA:-} > "$out/launch-$p.log" 2>&1
  rc=$?
  d=${RUNS:-/opt/dscluster/runs}/$id
  cp $d/metrics.jsonl "$out/metrics-$p.jsonl" 2>/dev/null; cp $d/summary.json "$out/summary-$p.json" 2>/dev/null
  grep -E '"event": "start"|TORCH_CUDA_ARCH_LIST' $d/launcher.log | head -2 > "$out/start-$p.txt"
  echo "{\"preset\": \"$p\", \"rc\": $rc, \"playbook_start\": $t0}" > "$out/run-$p.json"
  echo "launch $p rc=$rc"; tail -2 "$out/metrics-$p.jsonl" 2>/dev/null
  [ $rc -eq 0 ] || grep -E "Error|error" $d/launcher.log | head -5
  cp $d/launcher.log "$out/launcher-$p.log" 2>/dev/null
done
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/opt/dscluster/cache/torch_extensions
cd "$(dirname "$ref")"
for r in $refs; do
  case $r in
    ds2) /opt/torch/.venv/bin/deepspeed --num_gpus 1 --master_port 29600 "$ref" --mode ds --stage 2 ;;
    ds3) /opt/torch/.venv/bin/deepspeed --num_gpus 1 --master_port 29601 "$ref" --mode ds --stage 3 ;;
    ds2x2) /opt/torch/.venv/bin/deepspeed --num_gpus 2 --master_port 29602 "$ref" --mode ds --stage 2 ;;
    ds3x2) /opt/torch/.venv/bin/deepspeed --num_gpus 2 --master_port 29603 "$ref" --mode ds --stage 3 ;;
    torch) $py "$ref" --mode torch ;;
    torch16x4) $py "$ref" --mode torch --mb 16 --accum 4 ;;  # a global batch of 64 sequences
  esac 2>&1 | grep RESULT | sed "s/^/$r /" | tee -a "$out/reference.txt"
done
# One archive: the device link returns only a few files.
tar -C "$out" -czf /tmp/gpu-results.tgz --exclude gpu-results.tgz . && mv /tmp/gpu-results.tgz "$out/"
