"""Benchmark (not a test): what provision, launch, status and stop cost as the cluster grows, on
container clusters of 2, 4 and 8 nodes on this machine, each size's times against 2 nodes, and a
straight line (a fixed part and a part per node, least squares over the sizes) for 32 and 128.

    .venv/bin/python bench/scale.py [--nodes 2 4 8]    # after scripts/test.sh has set things up

The nodes start from the provisioned node image (molecule/cluster.py image: one node of the bare
image provisioned through provision.yml, DeepSpeed's CPU ops built there once), so that no node
compiles an op or installs a package: "first provision" is what makes such nodes a cluster (the
training user, SSH trust, the firewall, the env compared with the lock, the ops found built), and
"no-change provision" the same again. "launch" is launch.yml without preflight or follow, from its
start to its return (Ansible, the run's files on every node, DeepSpeed's runner started on the
master: the run then trains detached); "status" and "stop" are status.yml and stop.yml of that run.
All on 2 shared cores: Ansible's per-node work and the ranks' start-up share them, so the growth
measured here is an upper bound of what separate machines would show. Prints a table and writes
bench/results/scale.json.
"""
import argparse
import json
import sys
from pathlib import Path

import cluster as testcluster

ROOT = Path(__file__).resolve().parents[1]
RUN = "bench-scale"


def timed(c, label, playbook, *args):
    r = c.playbook(playbook, *args)
    if r.returncode != 0:
        sys.exit(f"{label}: {playbook} failed\n{r.output[-3000:]}")
    changed = sum(v.get("changed", 0) for v in r.recap.values())
    print(f"  {label:<22} {r.seconds:7.1f} s   changed={changed}", flush=True)
    return round(r.seconds, 1)


def one_size(n, image):
    testcluster.down()
    c = testcluster.Cluster(testcluster.up(n, image=image))
    train = json.dumps({"dsc_train_config": dict(testcluster.TINY, **testcluster.UNTIL_STOPPED)})
    return {
        "first provision": timed(c, "first provision", "provision.yml"),
        "no-change provision": timed(c, "no-change provision", "provision.yml"),
        "launch": timed(c, "launch", "launch.yml", "-e", "preset=zero2", "-e", f"run_id={RUN}",
                        "-e", "preflight=false", "-e", train),
        "status": timed(c, "status", "status.yml", "-e", f"run_id={RUN}"),
        "stop": timed(c, "stop", "stop.yml", "-e", f"run_id={RUN}"),
    }


def line(sizes, seconds):
    """(fixed, per node) of the least-squares line through (nodes, seconds)."""
    mx, my = sum(sizes) / len(sizes), sum(seconds) / len(seconds)
    per = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds, strict=True)) / sum((x - mx) ** 2 for x in sizes)
    return my - per * mx, per


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    a = p.parse_args()
    image, _ = testcluster.provisioned_image()
    results = {}
    for n in a.nodes:
        print(f"{n} nodes:", flush=True)
        results[n] = one_size(n, image)
    testcluster.down()
    sizes, base = sorted(results), results[min(results)]
    print(f"\nwhat | {' | '.join(f'{n} nodes s (x {min(sizes)})' for n in sizes)} | fixed s + s per node | 32 nodes s | 128 nodes s")
    fits = {}
    for what in base:
        fixed, per = line(sizes, [results[n][what] for n in sizes]) if len(sizes) > 1 else (base[what], 0.0)
        fits[what] = {"fixed_s": round(fixed, 1), "per_node_s": round(per, 2)}
        cells = " | ".join(f"{results[n][what]} ({results[n][what] / base[what]:.2f})" for n in sizes)
        print(f"{what} | {cells} | {fixed:.1f} + {per:.2f} | {fixed + 32 * per:.0f} | {fixed + 128 * per:.0f}")
    out = ROOT / "bench" / "results" / "scale.json"
    out.write_text(json.dumps({"seconds": {str(n): r for n, r in results.items()}, "line": fits}, indent=1) + "\n")
    print(f"\n{out}")


if __name__ == "__main__":
    main()
