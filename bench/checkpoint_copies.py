"""Benchmark (not a test): what keeping each node's checkpoint part on the next node costs
(dsc_checkpoint_copies, dscnode.copies), on the container cluster of 2 nodes: the same zero2 run
with copies off and on, alternating (off, on, off, on), each saving every --save-every steps. For
each run: the median time of a step that follows a save (where a copy runs beside the ranks) and
of every other step; for each copy its bytes and seconds. The ratio printed is the on-runs'
median step against the off-runs', in the same call.

    .venv/bin/python bench/checkpoint_copies.py [--steps 300] [--save-every 20] [--size small]
                                                 # after scripts/test.sh has set things up

Writes bench/results/checkpoint_copies.json. Both nodes and Ansible share this machine's cores, so
a copy here competes with the ranks for the same CPU: an upper bound of what separate machines see.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import cluster as testcluster

ROOT = Path(__file__).resolve().parents[1]
RUNS = "/opt/dscluster/runs"


def one_run(c, run_id, copies, a):
    for node in c.names:
        c.exec(node, f"rm -rf {RUNS}/{run_id}")
    train = {"dsc_train_config": dict(testcluster.TINY, size=a.size, vocab_size=8192, steps=a.steps,
                                      save_every=a.save_every, keep_checkpoints=2)}
    r = c.playbook("launch.yml", "-e", "preset=zero2", "-e", f"run_id={run_id}", "-e", "preflight=false",
                   "-e", "follow=true", "-e", f"dsc_checkpoint_copies={str(copies).lower()}", "-e", json.dumps(train))
    if r.returncode != 0:
        sys.exit(f"{run_id}: launch failed\n{r.output[-3000:]}")
    rows = [json.loads(x) for x in c.exec(c.master, f"cat {RUNS}/{run_id}/metrics.jsonl").stdout.splitlines()]
    times = {row["step"]: row["time"] for row in rows}
    steps = sorted(times)[5:]  # past the first steps (warm-up)
    took = {s: times[s] - times[s - 1] for s in steps if s - 1 in times}
    after_save = [t for s, t in took.items() if (s - 1) % a.save_every == 0]
    other = [t for s, t in took.items() if (s - 1) % a.save_every != 0]
    made = c.exec(c.master, f"cat {RUNS}/{run_id}/copies.jsonl", check=False).stdout.splitlines()
    return {"copies": copies, "median_step_s": round(statistics.median(took.values()), 4),
            "median_after_save_s": round(statistics.median(after_save), 4) if after_save else None,
            "median_other_s": round(statistics.median(other), 4) if other else None,
            "copies_made": [{k: json.loads(x)[k] for k in ("tag", "bytes", "seconds", "failed")} for x in made]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--size", default="small")
    a = p.parse_args()
    testcluster.down()
    c = testcluster.Cluster(testcluster.up(2, image=testcluster.provisioned_image()[0]))
    r = c.playbook("provision.yml")
    if r.returncode != 0:
        sys.exit(f"provision failed\n{r.output[-3000:]}")
    runs = [one_run(c, f"bench-copies-{i}", copies, a) for i, copies in enumerate((False, True, False, True))]
    off = statistics.median(x["median_step_s"] for x in runs if not x["copies"])
    on = statistics.median(x["median_step_s"] for x in runs if x["copies"])
    copied = [m for x in runs for m in x["copies_made"]]
    out = {"steps": a.steps, "save_every": a.save_every, "size": a.size, "runs": runs,
           "median_step_off_s": off, "median_step_on_s": on, "ratio_on_off": round(on / off, 3),
           "copy_bytes_median": statistics.median(m["bytes"] for m in copied) if copied else None,
           "copy_seconds_median": round(statistics.median(m["seconds"] for m in copied), 2) if copied else None}
    for x in runs:
        print(f"copies {'on ' if x['copies'] else 'off'}: median step {x['median_step_s']:.4f} s "
              f"(after a save {x['median_after_save_s']}, other {x['median_other_s']}), "
              f"{len(x['copies_made'])} copies")
    print(f"median step with copies / without: {out['ratio_on_off']:.3f}; a copy: "
          f"{(out['copy_bytes_median'] or 0) / 1e6:.1f} MB in {out['copy_seconds_median']} s (medians)")
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "checkpoint_copies.json").write_text(json.dumps(out, indent=1) + "\n")
    testcluster.down()


if __name__ == "__main__":
    main()
