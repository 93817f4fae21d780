"""Benchmark (not a test): how long Ansible takes before DeepSpeed starts, and how long status.yml
takes, on the 2-node container cluster and on this machine as a one-node cluster (inventory/local),
beside the same `deepspeed` command run by hand, in one call.

    .venv/bin/python bench/launch.py [--reps 3] [--where cluster local]
    bench/launch.py --where gpu        # on a GPU machine: bench/inventory/gpu-local, the 1.42 B GPT
                                       # (DSC_ANSIBLE_PLAYBOOK names the ansible-playbook command)

For each launch: `ansible_s` is from `ansible-playbook launch.yml` starting to the supervisor
spawning DeepSpeed's launcher (the mtime of launcher.child in the run directory, written right
after the spawn; the containers share this machine's clock); `first_step_s` is to the first line of
metrics.jsonl. The hand-run side is what a user types after provisioning: as the training user on
the master, in a run directory already in place, `deepspeed --hostfile ... --module train.run`.
Reps alternate which side goes first, so that neither always gets the warmer machine. Prints a table and writes
bench/results/launch.json. Provisions both clusters first when needed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import cluster as testcluster
from dscnode import INSTALLED_PATH

ROOT = Path(__file__).resolve().parents[1]

RUNS = "/opt/dscluster/runs"
TRAIN = {"steps": 6, "vocab_size": 512, "seq_len": 64, "save_final": False}
# The GPU side: the reference GPT of docs/benchmarks.md, a few steps.
GPU_TRAIN = {"size": "1.3b", "seq_len": 2048, "steps": 4, "save_final": False}
VENV_BIN = Path(sys.executable).parent


class Local:
    """This machine through an inventory of its own (inventory/local, bench/inventory/gpu-local),
    with the same few methods as testcluster.Cluster."""
    master = "localhost"
    names = ["localhost"]
    addr = "127.0.0.1"

    def __init__(self, inventory="inventory/local"):
        self.inventory = inventory

    def playbook(self, *args):
        command = os.environ.get("DSC_ANSIBLE_PLAYBOOK", str(VENV_BIN / "ansible-playbook")).split()
        r = subprocess.run([*command, "-i", self.inventory, *args], cwd=ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           env=dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg")))
        r.output = r.stdout
        return r

    def exec(self, node, cmd, user="root", check=True):
        argv = ["bash", "-c", cmd] if user == "root" else ["su", "-s", "/bin/bash", user, "-c", cmd]
        r = subprocess.run(argv, text=True, capture_output=True)
        if check and r.returncode != 0:
            sys.exit(f"{cmd}: {r.stderr}")
        return r


def wait_for(c, path, t0, timeout=600):
    while time.time() - t0 < timeout:
        if c.exec(c.master, f"test -s {path}", check=False).returncode == 0:
            return time.time() - t0
        time.sleep(0.1)
    sys.exit(f"no {path} after {timeout} s")


def mtime(c, path):
    return float(c.exec(c.master, f"stat -c %.Y {path}").stdout.strip())


def via_playbook(c, run_id, train):
    t0 = time.time()
    r = c.playbook("launch.yml", "-e", "preset=zero2", "-e", f"run_id={run_id}",
                   "-e", json.dumps({"dsc_train_config": train}))
    returned = time.time() - t0
    if r.returncode != 0:
        sys.exit(r.output[-3000:])
    first = wait_for(c, f"{RUNS}/{run_id}/metrics.jsonl", t0)
    wait_for(c, f"{RUNS}/{run_id}/exit_code", t0)
    return {"ansible_s": mtime(c, f"{RUNS}/{run_id}/launcher.child") - t0, "playbook_s": returned,
            "first_step_s": first}


def by_hand(c, template, run_id, addr):
    src, dst = f"{RUNS}/{template}", f"{RUNS}/{run_id}"
    for n in c.names:  # the files a user would already have in place on every node
        c.exec(n, f"rm -rf {dst} && cp -a {src} {dst} && cd {dst} && rm -rf metrics.jsonl summary.json "
                  f"launcher.* exit_code checkpoints && sed -i 's,{src},{dst},g' .deepspeed_env", user="dstrain")
    port = c.exec(c.master, f"cat {dst}/master_port").stdout.strip()
    one = " --no_ssh_check" if len(c.names) == 1 else ""
    deepspeed = c.exec(c.master, f"grep -m1 '^PATH=' {dst}/.deepspeed_env").stdout.split("=", 1)[1].split(":")[0]
    # The environment a user sets by hand (the env's PATH, the accelerator, caches, NCCL), and the
    # node helper on the import path: train/ takes the run directory's names from it (a launch's
    # ranks run inside it; DeepSpeed's runner passes PYTHONPATH on to the other nodes).
    cmd = (f"cd {dst}/code && set -a && . {dst}/.deepspeed_env && set +a && "
           f"DS_ENV_FILE={dst}/.deepspeed_env DSC_RUN_DIR={dst} PYTHONPATH={INSTALLED_PATH} "
           f"{deepspeed}/deepspeed --hostfile {dst}/hostfile --master_addr {addr} "
           f"--master_port {port}{one} --module train.run --deepspeed_config {dst}/ds_config.json "
           f"--config {dst}/train.json > {dst}/launcher.log 2>&1; echo $? > {dst}/exit_code")
    t0 = time.time()
    c.exec(c.master, f"setsid bash -c '{cmd}' < /dev/null > /dev/null 2>&1 &", user="dstrain")
    first = wait_for(c, f"{dst}/metrics.jsonl", t0)
    wait_for(c, f"{dst}/exit_code", t0)
    return {"first_step_s": first}


def status_time(c, run_id):
    t0 = time.time()
    r = c.playbook("status.yml", "-e", f"run_id={run_id}")
    if r.returncode != 0:
        sys.exit(r.output[-3000:])
    return time.time() - t0


def median(rows, key):
    return round(statistics.median(r[key] for r in rows), 2)


def measure(name, c, addr, reps, train=TRAIN):
    r = c.playbook("provision.yml")
    if r.returncode != 0:
        sys.exit(r.output[-3000:])
    stamp = time.strftime("%H%M%S")
    playbook, hand, status = [], [], []
    template = None
    for i in range(reps):
        pb_id = f"bench-pb-{stamp}-{i}"
        # Alternate which side goes first, so that neither always finds the warmer machine
        # (the hand-run side copies a run directory the playbook rendered: rep 0 starts there).
        if i % 2 == 0 or template is None:
            playbook.append(via_playbook(c, pb_id, train))
            hand.append(by_hand(c, pb_id, f"bench-hand-{stamp}-{i}", addr))
        else:
            hand.append(by_hand(c, template, f"bench-hand-{stamp}-{i}", addr))
            playbook.append(via_playbook(c, pb_id, train))
        template = template or pb_id
        status.append(status_time(c, pb_id))
        print(f"{name} rep {i}: Ansible before DeepSpeed {playbook[-1]['ansible_s']:.1f} s, "
              f"first step {playbook[-1]['first_step_s']:.1f} s (by hand {hand[-1]['first_step_s']:.1f} s), "
              f"status.yml {status[-1]:.1f} s", flush=True)
    res = {"reps": reps, "launch_yml": playbook, "by_hand": hand, "status_yml_s": [round(s, 2) for s in status],
           "median_ansible_s": median(playbook, "ansible_s"),
           "median_first_step_s": median(playbook, "first_step_s"),
           "median_by_hand_first_step_s": median(hand, "first_step_s"),
           "median_status_s": round(statistics.median(status), 2)}
    res["first_step_ratio"] = round(res["median_first_step_s"] / res["median_by_hand_first_step_s"], 2)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--where", nargs="+", default=["cluster", "local"], choices=["cluster", "local", "gpu"])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "launch.json"))
    a = p.parse_args()
    results = {}
    for where in a.where:  # one after the other: never two clusters busy at once
        if where == "cluster":
            c = testcluster.Cluster(testcluster.up(2))
            results[where] = measure(where, c, c.info["hosts"][0]["ip"], a.reps)
        elif where == "local":
            results[where] = measure(where, Local(), Local.addr, a.reps)
        else:
            results[where] = measure(where, Local("bench/inventory/gpu-local"), Local.addr, a.reps, GPU_TRAIN)
    out = Path(a.out)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print("\n| where | Ansible before DeepSpeed (median s) | first step, launch.yml | first step, by hand | ratio | status.yml |")
    print("|---|---|---|---|---|---|")
    for where, r in results.items():
        print(f"| {where} | {r['median_ansible_s']} | {r['median_first_step_s']} | "
              f"{r['median_by_hand_first_step_s']} | {r['first_step_ratio']} | {r['median_status_s']} |")
    print(f"raw: {out}")


if __name__ == "__main__":
    main()
