#!/usr/bin/env bash
# On one two-GPU host, back to back: two inventory nodes with one GPU each, launched without SSH
# (bench/inventory/gpu-two-nodes, dsc_launch_mode no_ssh), against one node with both GPUs
# (bench/inventory/gpu-local) and hand-run DeepSpeed on both GPUs, zero2 then zero3; then a no_ssh run
# through status.yml, stop.yml (and a count of the run's processes left anywhere) and resume.yml.
#
#   bench/gpu_no_ssh.sh WHEELS_DIR COLLECTIONS_TGZ REFERENCE_PY [STAGES]   (STAGES: "2 3" default)
#
# WHEELS_DIR, COLLECTIONS_TGZ, REFERENCE_PY as for bench/gpu.sh (REFERENCE_PY with set_device).
# Results in $OUT/two, $OUT/one (bench/gpu.sh's files) and $OUT/control (the control-flow logs).
set -uo pipefail
wheels=$1 coll=$2 ref=$3 stages=${4:-2 3}
out=${OUT:-$PWD/gpu-results}
here=$(dirname "$0")
bash "$here/two_nodes_one_host.sh" /opt/dscluster/runs node1 node2 || exit 1
two() { INVENTORY=bench/inventory/gpu-two-nodes PROVISION_ARGS="-f 1" RUNS=/srv/dsc-nodes/node1/runs \
        OUT=$out/two bash "$here/gpu.sh" "$wheels" "$coll" "$ref" "$1" ""; }
one() { OUT=$out/one bash "$here/gpu.sh" "$wheels" "$coll" "$ref" "$1" "$2"; }
for stage in $stages; do
  two zero$stage || exit 1
  # provision.yml ran through the two nodes' namespaces: the host's own run root is made here.
  install -d -o dstrain -g dstrain -m 0755 /opt/dscluster/runs
  one zero$stage ds${stage}x2
done

# status, stop (nothing left on either node), resume to the end: a 125M GPT that saves often.
ctl=$out/control; mkdir -p "$ctl"
. "$here/gpu_ansible.sh"
gpu_ansible "$wheels" "$coll" || exit 1
ap() { "$DSC_ANSIBLE_PLAYBOOK" -i bench/inventory/gpu-two-nodes "$@"; }
id=ctl-$(date +%s) metrics=/srv/dsc-nodes/node1/runs/$id/metrics.jsonl
ap launch.yml -e preset=zero2 -e run_id=$id \
  -e '{"dsc_train_config": {"size": "125m", "seq_len": 1024, "steps": 400, "save_every": 50}}' \
  > "$ctl/launch.log" 2>&1; echo "launch rc=$?"
for _ in $(seq 120); do
  step=$(tail -1 "$metrics" 2>/dev/null | $py -c 'import json,sys; print(json.loads(sys.stdin.read() or "{}").get("step", 0))' 2>/dev/null)
  [ "${step:-0}" -ge 120 ] && break; sleep 1
done
ap status.yml -e run_id=$id > "$ctl/status.log" 2>&1; echo "status rc=$?"
grep -A4 '"run '"$id" "$ctl/status.log"
ap stop.yml -e run_id=$id > "$ctl/stop.log" 2>&1; echo "stop rc=$?"
grep -E '"msg": "node' "$ctl/stop.log"
for n in node1 node2; do  # every process that carries the run's id, read by root from /proc
  echo "$n after stop: $(/srv/dsc-nodes/$n/sh -c "python3 /usr/local/lib/dscluster/dsc_node.pyz procs $id")"
done | tee "$ctl/left.txt"
ap resume.yml -e run_id=$id -e follow=true > "$ctl/resume.log" 2>&1; echo "resume rc=$?"
grep -E '"state"|resum' "$ctl/resume.log" | head -5
for n in node1 node2; do echo "$n exit_code $(cat /srv/dsc-nodes/$n/runs/$id/exit_code)"; done | tee "$ctl/exit.txt"
cp /srv/dsc-nodes/node1/runs/$id/metrics.jsonl "$ctl/" 2>/dev/null
# where the resumed attempt started: the first logged step that is not after the one before it
$py -c 'import json, sys
steps = [json.loads(x)["step"] for x in open(sys.argv[1])]
print(next((f"stopped after step {a}, resumed at step {b}" for a, b in zip(steps, steps[1:]) if b <= a), "no restart seen"))' \
  "$ctl/metrics.jsonl" | tee "$ctl/resumed-from.txt"
tar -C "$out" -czf /tmp/no-ssh.tgz . && mv /tmp/no-ssh.tgz "$out/"
