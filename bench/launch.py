"""Benchmark (not a test): time from `ansible-playbook launch.yml` to the first logged step,
beside the same `deepspeed` command run by hand on the master of the same cluster, with the ratio.

    .venv/bin/python bench/launch.py [--reps 2]     # provisions the test cluster first if needed

The hand-run side is what a user types after provisioning: as the training user on the master,
in a run directory already on every node, `deepspeed --hostfile ... --module train.run ...`.
Both sides train the same tiny GPT across the 2 nodes (gloo); reps alternate so that neither
side gets a warmer machine. Prints a table and writes bench/results/launch.json.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "molecule"))
import cluster as testcluster  # noqa: E402

RUNS = "/opt/dscluster/runs"
TRAIN = {"steps": 6, "vocab_size": 512, "seq_len": 64, "save_final": False}


def wait_for(c, path, t0, timeout=600):
    while time.time() - t0 < timeout:
        if c.exec(c.master, f"test -s {path}", check=False).returncode == 0:
            return time.time() - t0
        time.sleep(0.2)
    sys.exit(f"no {path} after {timeout} s")


def via_playbook(c, run_id):
    t0 = time.time()
    r = c.playbook("launch.yml", "-e", "preset=zero2", "-e", f"run_id={run_id}",
                   "-e", json.dumps({"dsc_train_config": TRAIN}))
    if r.returncode != 0:
        sys.exit(r.output[-3000:])
    first = wait_for(c, f"{RUNS}/{run_id}/metrics.jsonl", t0)
    wait_for(c, f"{RUNS}/{run_id}/exit_code", t0)
    return first


def by_hand(c, template, run_id):
    src, dst = f"{RUNS}/{template}", f"{RUNS}/{run_id}"
    for n in c.names:  # the files a user would already have in place on every node
        c.exec(n, f"rm -rf {dst} && cp -a {src} {dst} && cd {dst} && rm -rf metrics.jsonl summary.json "
                  f"launcher.log exit_code checkpoints && sed -i 's,{src},{dst},g' .deepspeed_env", user="dstrain")
    port = c.exec(c.master, f"cat {dst}/master_port").stdout.strip()
    addr = c.info["hosts"][0]["ip"]
    cmd = (f"cd {dst}/code && DS_ENV_FILE={dst}/.deepspeed_env DSC_RUN_DIR={dst} "
           f"/opt/dscluster/env/bin/deepspeed --hostfile {dst}/hostfile --master_addr {addr} "
           f"--master_port {port} --module train.run --deepspeed_config {dst}/ds_config.json "
           f"--config {dst}/train.json > {dst}/launcher.log 2>&1; echo $? > {dst}/exit_code")
    t0 = time.time()
    c.exec(c.master, f"setsid bash -c '{cmd}' < /dev/null > /dev/null 2>&1 &", user="dstrain")
    first = wait_for(c, f"{dst}/metrics.jsonl", t0)
    wait_for(c, f"{dst}/exit_code", t0)
    return first


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=2)
    a = p.parse_args()
    c = testcluster.Cluster(testcluster.up(2))
    r = c.playbook("provision.yml")
    if r.returncode != 0:
        sys.exit(r.output[-3000:])
    stamp = time.strftime("%H%M%S")
    playbook, hand = [], []
    for i in range(a.reps):
        playbook.append(via_playbook(c, f"bench-pb-{stamp}-{i}"))
        hand.append(by_hand(c, f"bench-pb-{stamp}-{i}", f"bench-hand-{stamp}-{i}"))
        print(f"rep {i}: launch.yml {playbook[-1]:.1f} s, by hand {hand[-1]:.1f} s", flush=True)
    res = {"launch_yml_s": [round(x, 1) for x in playbook], "by_hand_s": [round(x, 1) for x in hand],
           "median_launch_yml_s": round(statistics.median(playbook), 1),
           "median_by_hand_s": round(statistics.median(hand), 1)}
    res["ratio"] = round(res["median_launch_yml_s"] / res["median_by_hand_s"], 2)
    (ROOT / "bench" / "results" / "launch.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"time to first logged step: launch.yml {res['median_launch_yml_s']} s, "
          f"hand-run deepspeed {res['median_by_hand_s']} s, ratio {res['ratio']}")


if __name__ == "__main__":
    main()
