"""Benchmark (not a test): what provision, launch, status and stop cost as the cluster grows, on
container clusters of 2, 4 and 8 nodes on this machine, each size's times against 2 nodes, and a
straight line (a fixed part and a part per node, least squares over the sizes) for 32 and 128.

    .venv/bin/python bench/scale.py [--nodes 2 4 8] [--provisioned]    # after scripts/test.sh has set things up

Each size starts from new containers of the bare node image (sshd and python3; the test
wheelhouse is pushed from the control node). "cold provision" makes them a cluster: the env, torch
and DeepSpeed installed from the wheelhouse, DeepSpeed's ops built on one node and shipped to the
others (the count of nodes that built an op is printed), the training user, SSH trust, the
firewall. "no-change provision" is the same again. "launch" is launch.yml without preflight or
follow, from its start to its return (Ansible, the run's files on every node, DeepSpeed's runner
started on the master: the run then trains detached); "status" and "stop" are status.yml and
stop.yml of that run. All on 2 shared cores: Ansible's per-node work and the nodes' own work share
them, so the growth measured here is an upper bound of what separate machines would show. The
cold provision's slowest tasks are printed per size too (where the growth comes from), and each
playbook's CPU seconds on the control node and on the nodes (the nodes' part is what separate
machines run in parallel). --provisioned starts the nodes from the provisioned node image instead
(a first provision, no install, no op built). Prints a table and writes bench/results/scale.json
(scale-provisioned.json).
"""
import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

import cluster as testcluster

ROOT = Path(__file__).resolve().parents[1]
RUN = "bench-scale"
TIMINGS = Path(tempfile.mkdtemp(prefix="dsc-scale-")) / "timings.jsonl"
os.environ["DSC_TIMINGS"] = str(TIMINGS)  # the dsc_timings callback: each task's wall time


# Every container's CPU time (cgroup v1's cpuacct of podman's parent group; the outsider idles).
NODES_CPU = Path("/sys/fs/cgroup/cpuacct/libpod_parent/cpuacct.usage")


def cpu_seconds():
    """(the control node's: ansible-playbook and every process it waited for; the nodes')."""
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, int(NODES_CPU.read_text()) / 1e9 if NODES_CPU.exists() else float("nan")


def timed(c, label, playbook, *args):
    """The playbook's run with .seconds and .cpu: the CPU seconds it took on the control node and
    on the nodes (on 2 shared cores both count against the same wall time; on separate machines
    the nodes' part runs on each node's own cores)."""
    before = cpu_seconds()
    r = c.playbook(playbook, *args)
    r.cpu = [round(b - a, 1) for a, b in zip(before, cpu_seconds(), strict=True)]
    if r.returncode != 0:
        sys.exit(f"{label}: {playbook} failed\n{r.output[-3000:]}")
    changed = sum(v.get("changed", 0) for v in r.recap.values())
    print(f"  {label:<22} {r.seconds:7.1f} s   changed={changed}   CPU s: control node {r.cpu[0]}, nodes {r.cpu[1]}",
          flush=True)
    return r


def task_hosts(output, name, state):
    """The hosts a task reported `state` (changed, ok, skipping) for, from Ansible's output."""
    section = output.split(f"TASK [{name}")[1].split("TASK [")[0] if f"TASK [{name}" in output else ""
    return [line.split("[", 1)[1].split("]")[0] for line in section.splitlines() if line.startswith(f"{state}: [")]


def one_size(n, image, first):
    testcluster.down()
    c = testcluster.Cluster(testcluster.up(n, image=image))
    train = json.dumps({"dsc_train_config": dict(testcluster.TINY, **testcluster.UNTIL_STOPPED)})
    cold = timed(c, first, "provision.yml")
    slowest = sorted(json.loads(TIMINGS.read_text().splitlines()[-1])["tasks"].items(), key=lambda kv: -kv[1])[:6]
    built = task_hosts(cold.output, "deepspeed : Warm the JIT op cache", "changed")
    rebuilt = task_hosts(cold.output, "deepspeed : Warm the shipped ops", "changed")
    shipped = task_hosts(cold.output, "deepspeed : Unpack the source's ops", "changed")
    print(f"  ops built on {built}, shipped to {len(shipped)} nodes, built again after shipping on {rebuilt}", flush=True)
    print("  slowest tasks of the cold provision: " + "; ".join(f"{k} {v} s" for k, v in slowest), flush=True)
    runs = {first: cold, "no-change provision": timed(c, "no-change provision", "provision.yml"),
            "launch": timed(c, "launch", "launch.yml", "-e", "preset=zero2", "-e", f"run_id={RUN}",
                            "-e", "preflight=false", "-e", train),
            "status": timed(c, "status", "status.yml", "-e", f"run_id={RUN}"),
            "stop": timed(c, "stop", "stop.yml", "-e", f"run_id={RUN}")}
    return {"seconds": {k: round(r.seconds, 1) for k, r in runs.items()},
            "cpu_s": {k: {"control node": r.cpu[0], "nodes": r.cpu[1]} for k, r in runs.items()}, "ops_built_on": built,
            "ops_shipped_to": shipped, "built_after_shipping": rebuilt, "cold_slowest_tasks": dict(slowest)}


def line(sizes, seconds):
    """(fixed, per node) of the least-squares line through (nodes, seconds)."""
    mx, my = sum(sizes) / len(sizes), sum(seconds) / len(seconds)
    per = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds, strict=True)) / sum((x - mx) ** 2 for x in sizes)
    return my - per * mx, per


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--provisioned", action="store_true",
                   help="nodes from the provisioned node image (molecule/cluster.py image): a first provision, not a cold one")
    a = p.parse_args()
    image, first = ((testcluster.provisioned_image()[0], "first provision") if a.provisioned
                    else (testcluster.IMAGE, "cold provision"))
    results = {}
    for n in a.nodes:
        print(f"{n} nodes:", flush=True)
        results[n] = one_size(n, image, first)
    testcluster.down()
    sizes = sorted(results)
    base = results[sizes[0]]["seconds"]
    print(f"\nwhat | {' | '.join(f'{n} nodes s (x {sizes[0]})' for n in sizes)} | fixed s + s per node | 32 nodes s | 128 nodes s")
    fits = {}
    for what in base:
        ys = [results[n]["seconds"][what] for n in sizes]
        fixed, per = line(sizes, ys) if len(sizes) > 1 else (base[what], 0.0)
        fits[what] = {"fixed_s": round(fixed, 1), "per_node_s": round(per, 2)}
        cells = " | ".join(f"{y} ({y / base[what]:.2f})" for y in ys)
        print(f"{what} | {cells} | {fixed:.1f} + {per:.2f} | {fixed + 32 * per:.0f} | {fixed + 128 * per:.0f}")
    out = ROOT / "bench" / "results" / f"scale{'-provisioned' if a.provisioned else ''}.json"
    out.write_text(json.dumps({"sizes": {str(n): r for n, r in results.items()}, "line": fits}, indent=1) + "\n")
    print(f"\n{out}")


if __name__ == "__main__":
    main()
