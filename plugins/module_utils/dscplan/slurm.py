"""Slurm on the inventory's nodes (dsc_slurm_install, roles/slurm): slurm.conf, gres.conf and
cgroup.conf derived from the nodes' records and probes, the same text on every node. slurmctld
runs on the master; every node runs slurmd under its inventory name (`slurmd -N`), reached at its
training address, in one partition holding every node. Pure: unit-tested in
tests/unit/test_plan_slurm.py."""
from __future__ import annotations

import re

from .settings import as_bool

# A partition's name: no hostlist brackets, commas, spaces or '=', nothing a shell or slurm.conf's
# parser would read as more than a name.
SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# What Slurm keeps of a node's memory for itself: slurmd drains a node whose RealMemory is above
# what it measures, and the kernel's MemTotal moves by a few MiB between boots.
MEMORY_KEPT = 0.95
PORTS = {"SlurmctldPort": 6817, "SlurmdPort": 6818}


def slurm_problems(s, where, problems):
    """The refusal of a partition Slurm would read as more than a name (the nodes' names are
    inventory names, already letters, digits, '.' and '-': topology.HOST_NAME)."""
    partition = str(s["dsc_slurm_partition"])
    if not SLURM_NAME.fullmatch(partition):
        problems.add(f"dsc_slurm_partition {where} is {partition!r}. Fix: letters, digits, '.', '_' "
                     f"and '-' only, starting with a letter or digit (e.g. 'dsc').")


def slurm_plan(s, cluster_name, nodes, probes):
    """{install, partition, controller, conf, gres_conf, cgroup_conf} (install false: the rest
    empty but the partition)."""
    if not as_bool(s["dsc_slurm_install"]):
        return {"install": False, "partition": str(s["dsc_slurm_partition"]), "controller": "",
                "conf": "", "gres_conf": "", "cgroup_conf": ""}
    cgroup = as_bool(s["dsc_slurm_cgroup"])
    # The GPUs Slurm may give a job on each node: dsc_gpus' choice, else every one nvidia-smi lists.
    gpu_ids = {n["name"]: n["gpu_ids"] or list(range(n["gpus"])) for n in nodes}
    lines = [
        "# Written by the toolkit (roles/slurm) from the inventory and each node's probe: the same on",
        "# every node. Change the inventory and run provision.yml again, not this file.",
        f"ClusterName={cluster_name.lower()}",
        f"SlurmctldHost={nodes[0]['name']}({nodes[0]['addr']})",
        "AuthType=auth/munge",
        "CryptoType=crypto/munge",
        "SlurmUser=slurm",
        *(f"{k}={v}" for k, v in PORTS.items()),
        "StateSaveLocation=/var/lib/slurm/slurmctld",
        "SlurmdSpoolDir=/var/lib/slurm/slurmd",
        "SlurmctldPidFile=/run/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd.pid",
        "SlurmctldLogFile=/var/log/slurm/slurmctld.log",
        "SlurmdLogFile=/var/log/slurm/slurmd.log",
        # cgroup: every process of a job is tracked and ended with it; linuxproc where the node
        # has no cgroup tree of its own to give Slurm (a container).
        f"ProctrackType=proctrack/{'cgroup' if cgroup else 'linuxproc'}",
        f"TaskPlugin={'task/cgroup,task/affinity' if cgroup else 'task/none'}",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        # A node that comes back with its configuration valid is put back in service.
        "ReturnToService=2",
        "SchedulerType=sched/backfill",
        "JobAcctGatherType=jobacct_gather/none",
        "MpiDefault=none",
        *(["GresTypes=gpu"] if any(gpu_ids.values()) else []),
    ]
    for n in nodes:
        probe = probes.get(n["name"]) or {}
        memory = int((probe.get("memory_mib") or 0) * MEMORY_KEPT)
        lines.append(" ".join([f"NodeName={n['name']}", f"NodeAddr={n['addr']}",
                               f"CPUs={int(probe.get('cpus') or 1)}",
                               *([f"RealMemory={memory}"] if memory else []),
                               *([f"Gres=gpu:{len(gpu_ids[n['name']])}"] if gpu_ids[n["name"]] else []),
                               "State=UNKNOWN"]))
    lines.append(f"PartitionName={s['dsc_slurm_partition']} Nodes={','.join(n['name'] for n in nodes)} "
                 f"Default=YES MaxTime=INFINITE State=UP")
    gres = [f"NodeName={n['name']} Name=gpu File=/dev/nvidia{i}" for n in nodes for i in gpu_ids[n["name"]]]
    return {"install": True, "partition": str(s["dsc_slurm_partition"]), "controller": nodes[0]["name"],
            "conf": "\n".join(lines) + "\n", "gres_conf": "\n".join(gres) + "\n" if gres else "",
            "cgroup_conf": "CgroupPlugin=autodetect\nConstrainCores=yes\nConstrainDevices=yes\n" if cgroup else ""}
