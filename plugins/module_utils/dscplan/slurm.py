"""Slurm on the inventory's nodes (dsc_slurm_install, roles/slurm): slurm.conf, gres.conf and
cgroup.conf derived from the nodes' records and probes, the same text on every node. slurmctld
runs on the master; every node runs slurmd under its inventory name (`slurmd -N`), reached at its
training address, in one partition holding every node. Pure: unit-tested in
tests/unit/test_plan_slurm.py."""
from __future__ import annotations

import re


from .problems import as_bool, is_int

# A partition's name: no hostlist brackets, commas, spaces or '=', nothing a shell or slurm.conf's
# parser would read as more than a name.
SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# What Slurm keeps of a node's memory for itself: slurmd drains a node whose RealMemory is above
# what it measures, and the kernel's MemTotal moves by a few MiB between boots.
MEMORY_KEPT = 0.95
PORTS = {"SlurmctldPort": 6817, "SlurmdPort": 6818}


def slurm_problems(s, nodes, probes, where, problems):
    """The refusals of Slurm's settings: a partition or account Slurm would read as more than a
    name (the nodes' names are inventory names, already letters, digits, '.' and '-':
    topology.HOST_NAME); a SlurmdTimeout that is not a positive number of seconds; a node without
    systemd where the toolkit installs Slurm (roles/slurm runs munge, slurmctld and slurmd as
    systemd services: it would fail there halfway through provision). What launching through
    Slurm refuses is the slurm launcher's (launchers/slurm.py)."""
    if as_bool(s["dsc_slurm_install"]):
        for n in nodes:
            if n.reachable and (probes.get(n.name) or {}).get("systemd") is False:
                problems.add(f"dsc_slurm_install on host {n.name} is true, but systemd does not run "
                             f"there (no /run/systemd/system): the toolkit runs munge, slurmctld and "
                             f"slurmd as systemd services. Fix: boot the node with systemd, or set "
                             f"dsc_slurm_install: false and use the site's own Slurm (or "
                             f"another launch mode).")
    for var, example in (("dsc_slurm_partition", "'dsc'"), ("dsc_slurm_account", "'research', or '' for the user's default")):
        value = str(s[var])
        if (value or var == "dsc_slurm_partition") and not SLURM_NAME.fullmatch(value):
            problems.add(f"{var} {where} is {value!r}. Fix: letters, digits, '.', '_' and '-' only, "
                         f"starting with a letter or digit (e.g. {example}).")
    timeout = s["dsc_slurm_slurmd_timeout_s"]
    if not is_int(timeout) or int(timeout) <= 0:
        problems.add(f"dsc_slurm_slurmd_timeout_s {where} is {timeout!r}. Fix: seconds, a whole number "
                     f"above 0 (Slurm's default is 300).")


def slurm_plan(s, cluster_name, nodes, probes):
    """{install, partition, account, controller, conf, gres_conf, cgroup_conf} (install false: a
    site's own Slurm, or none; controller and the files empty)."""
    names = {"partition": str(s["dsc_slurm_partition"]), "account": str(s["dsc_slurm_account"] or "")}
    if not as_bool(s["dsc_slurm_install"]):
        return {"install": False, **names, "controller": "", "conf": "", "gres_conf": "", "cgroup_conf": ""}
    cgroup = as_bool(s["dsc_slurm_cgroup"])
    # The GPUs Slurm may give a job on each node: dsc_gpus' choice, else every one nvidia-smi lists.
    gpu_ids = {n.name: n.gpu_ids or list(range(n.gpus)) for n in nodes}
    lines = [
        "# Written by the toolkit (roles/slurm) from the inventory and each node's probe: the same on",
        "# every node. Change the inventory and run provision.yml again, not this file.",
        f"ClusterName={cluster_name.lower()}",
        f"SlurmctldHost={nodes[0].name}({nodes[0].addr})",
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
        # A node whose slurmd has not answered for this long is DOWN (jobs that need it pend).
        f"SlurmdTimeout={int(s['dsc_slurm_slurmd_timeout_s'])}",
        "SchedulerType=sched/backfill",
        "JobAcctGatherType=jobacct_gather/none",
        "MpiDefault=none",
        *(["GresTypes=gpu"] if any(gpu_ids.values()) else []),
    ]
    for n in nodes:
        probe = probes.get(n.name) or {}
        memory = int((probe.get("memory_mib") or 0) * MEMORY_KEPT)
        lines.append(" ".join([f"NodeName={n.name}", f"NodeAddr={n.addr}",
                               f"CPUs={int(probe.get('cpus') or 1)}",
                               *([f"RealMemory={memory}"] if memory else []),
                               *([f"Gres=gpu:{len(gpu_ids[n.name])}"] if gpu_ids[n.name] else []),
                               "State=UNKNOWN"]))
    lines.append(f"PartitionName={s['dsc_slurm_partition']} Nodes={','.join(n.name for n in nodes)} "
                 f"Default=YES MaxTime=INFINITE State=UP")
    gres = [f"NodeName={n.name} Name=gpu File=/dev/nvidia{i}" for n in nodes for i in gpu_ids[n.name]]
    return {"install": True, **names, "controller": nodes[0].name,
            "conf": "\n".join(lines) + "\n", "gres_conf": "\n".join(gres) + "\n" if gres else "",
            "cgroup_conf": "CgroupPlugin=autodetect\nConstrainCores=yes\nConstrainDevices=yes\n" if cgroup else ""}
