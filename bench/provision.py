"""Benchmark (not a test): provision.yml on the container test cluster, cold and re-run, for 2 and
4 nodes, and what the ansible.cfg tuning (pipelining, ControlPersist, forks, fact cache) gives on a
no-change re-run, as a ratio against the same run with each of them switched off.

    .venv/bin/python bench/provision.py [--nodes 2 4]      # after scripts/test.sh has set things up

Prints a table and writes bench/results/provision.json. Each cluster size starts from new
containers (the node image and the wheelhouse are cached; apt packages come from the mirror).
"""
import argparse
import json
import sys
from pathlib import Path

import cluster as testcluster

ROOT = Path(__file__).resolve().parents[1]

# Each tuned setting of ansible.cfg back at Ansible's default.
UNTUNED = {"ANSIBLE_PIPELINING": "False", "ANSIBLE_SSH_ARGS": "", "ANSIBLE_FORKS": "5",
           "ANSIBLE_GATHERING": "implicit", "ANSIBLE_CACHE_PLUGIN": "memory"}


def run(c, label, env=None):
    r = c.playbook("provision.yml", env=env)
    if r.returncode != 0:
        sys.exit(f"{label}: provision.yml failed\n{r.output[-3000:]}")
    changed = sum(v.get("changed", 0) for v in r.recap.values())
    print(f"  {label:<28} {r.seconds:7.1f} s   changed={changed}", flush=True)
    return {"seconds": round(r.seconds, 1), "changed": changed}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    a = p.parse_args()
    results = {}
    for n in a.nodes:
        print(f"{n} nodes:", flush=True)
        testcluster.down()
        c = testcluster.Cluster(testcluster.up(n))
        res = {"cold": run(c, "cold"), "rerun_tuned": run(c, "no-change re-run (tuned)"),
               "rerun_untuned": run(c, "no-change re-run (untuned)", UNTUNED)}
        res["rerun_tuned_2"] = run(c, "no-change re-run (tuned)")
        tuned = min(res["rerun_tuned"]["seconds"], res["rerun_tuned_2"]["seconds"])
        res["tuning_speedup"] = round(res["rerun_untuned"]["seconds"] / tuned, 2)
        print(f"  tuning speed-up on a re-run: {res['tuning_speedup']}x", flush=True)
        results[str(n)] = res
    testcluster.down()
    out = ROOT / "bench" / "results" / "provision.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print("\nnodes | cold s | re-run s (tuned) | re-run s (untuned) | tuning speed-up")
    for n, r in results.items():
        print(f"{n} | {r['cold']['seconds']} | {min(r['rerun_tuned']['seconds'], r['rerun_tuned_2']['seconds'])} | "
              f"{r['rerun_untuned']['seconds']} | {r['tuning_speedup']}x")


if __name__ == "__main__":
    main()
