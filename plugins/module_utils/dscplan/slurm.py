"""Slurm on the inventory's nodes (dsc_slurm_install, roles/slurm): slurm.conf, gres.conf and
cgroup.conf derived from the nodes' records and probes, the same text on every node. slurmctld
runs on the master; every node runs slurmd under its inventory name (`slurmd -N`), reached at its
training address, in one partition holding every node. Pure: unit-tested in
tests/unit/test_plan_slurm.py."""
from __future__ import annotations

import re
import shlex

from dscnode.rundir import RunDir

from .problems import is_int
from .settings import as_bool

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
    systemd services: it would fail there halfway through provision); nodes whose GPU counts
    differ, which one job's gres can't give."""
    if as_bool(s["dsc_slurm_install"]):
        for n in nodes:
            if n["reachable"] and (probes.get(n["name"]) or {}).get("systemd") is False:
                problems.add(f"dsc_slurm_install on host {n['name']} is true, but systemd does not run "
                             f"there (no /run/systemd/system): the toolkit runs munge, slurmctld and "
                             f"slurmd as systemd services. Fix: boot the node with systemd, or set "
                             f"dsc_slurm_install: false and use the site's own Slurm (or "
                             f"dsc_launch_mode pdsh).")
    for var, example in (("dsc_slurm_partition", "'dsc'"), ("dsc_slurm_account", "'research', or '' for the user's default")):
        value = str(s[var])
        if (value or var == "dsc_slurm_partition") and not SLURM_NAME.fullmatch(value):
            problems.add(f"{var} {where} is {value!r}. Fix: letters, digits, '.', '_' and '-' only, "
                         f"starting with a letter or digit (e.g. {example}).")
    timeout = s["dsc_slurm_slurmd_timeout_s"]
    if not is_int(timeout) or int(timeout) <= 0:
        problems.add(f"dsc_slurm_slurmd_timeout_s {where} is {timeout!r}. Fix: seconds, a whole number "
                     f"above 0 (Slurm's default is 300).")
    if s["dsc_launch_mode"] != "slurm":
        return
    counts = {n["name"]: len(n["gpu_ids"]) or n["gpus"] for n in nodes if n["reachable"]}
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"{k} {v}" for k, v in counts.items())
        problems.add(f"dsc_launch_mode {where} is 'slurm' but the nodes' GPU counts differ ({detail}): "
                     f"one Slurm job gives every node the same gres. Fix: the same count on every "
                     f"node (dsc_gpus), or dsc_launch_mode pdsh.")


def slurm_node_problems(master, partition, names, run_id, view, problems):
    """dsc_launch_mode slurm, before a job is submitted (launch, resume): the Slurm the master's
    client reaches (`view`: its probe's sinfo and squeue, dscnode.probe.slurm_partitions)
    answers, has the partition, and the partition holds every node under its inventory name (the
    job's --nodelist): a site's own Slurm, or the one roles/slurm installed. And the run has no
    job in the queue already (pending, it is not active on the nodes yet: a second submission
    would run it twice)."""
    where = f"on host {master}"
    if view is None:  # the master did not answer: its own refusal says so
        return
    if "error" in view:
        problems.add(f"dsc_launch_mode {where} is 'slurm' but Slurm does not answer there "
                     f"(sinfo, squeue): {view['error']}. Fix: the Slurm client and munge on {master}, reaching "
                     f"slurmctld (`scontrol ping`), or dsc_slurm_install: true and provision.yml "
                     f"(the toolkit installs Slurm on the nodes).")
        return
    queued = (view.get("jobs") or {}).get(f"dsc-{run_id}")
    if queued:
        problems.add(f"run_id {run_id!r} is Slurm job {queued[0]} ({queued[1]}) on {master} already: a "
                     f"second job would run it twice. Fix: follow it (status.yml -e run_id={run_id} "
                     f"-e follow=true), or stop it first (stop.yml -e run_id={run_id}).")
    held = view["partitions"].get(partition)
    if held is None:
        problems.add(f"dsc_slurm_partition {where} is {partition!r} but Slurm has no such partition "
                     f"(it has {', '.join(sorted(view['partitions'])) or 'none'}). Fix: the partition "
                     f"that holds the inventory's nodes (sinfo on {master}).")
        return
    missing = [n for n in names if n not in held]
    if missing:
        problems.add(f"dsc_launch_mode {where} is 'slurm' but Slurm's partition {partition} does not hold "
                     f"{', '.join(missing)} (it holds {', '.join(held)}): the job's node list is the "
                     f"inventory's names. Fix: name the inventory's hosts as Slurm names the nodes "
                     f"(NodeName in slurm.conf; sinfo -N on {master}), or the partition that holds "
                     f"them (dsc_slurm_partition).")


def slurm_plan(s, cluster_name, nodes, probes):
    """{install, partition, account, controller, conf, gres_conf, cgroup_conf} (install false: a
    site's own Slurm, or none; controller and the files empty)."""
    names = {"partition": str(s["dsc_slurm_partition"]), "account": str(s["dsc_slurm_account"] or "")}
    if not as_bool(s["dsc_slurm_install"]):
        return {"install": False, **names, "controller": "", "conf": "", "gres_conf": "", "cgroup_conf": ""}
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
        # A node whose slurmd has not answered for this long is DOWN (jobs that need it pend).
        f"SlurmdTimeout={int(s['dsc_slurm_slurmd_timeout_s'])}",
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
    return {"install": True, **names, "controller": nodes[0]["name"],
            "conf": "\n".join(lines) + "\n", "gres_conf": "\n".join(gres) + "\n" if gres else "",
            "cgroup_conf": "CgroupPlugin=autodetect\nConstrainCores=yes\nConstrainDevices=yes\n" if cgroup else ""}


def batch_files(plan, run_id, run_dir, workdir, commands, start_args, env, restarts):
    """dsc_launch_mode slurm: the run directory's batch job and per-node task (file name -> text).
    The job holds exactly the plan's nodes (exclusive, their GPUs as gres); each attempt's first
    step takes the first free master port on the master (the node helper's free-port), then one
    task per node starts that node's DeepSpeed launcher (--no_ssh --node_rank) under the node
    helper's supervisor in the foreground, on that port. A task that fails ends the others
    (--kill-on-bad-exit): the ranks of the other nodes do not wait for a node that is gone. Then,
    up to `restarts` (max_restarts, backoff_s) times, the job starts every node again from the
    latest complete checkpoint, after a backoff that doubles (as the supervisor's, up to 600 s);
    the run directory's `restarting` mark says so meanwhile (status, follow)."""
    most, backoff = restarts
    gpus = {len(n["gpu_ids"]) or n["gpus"] for n in plan["nodes"]}
    names = ",".join(plan["node_names"])
    q = shlex.quote
    batch = [
        "#!/bin/bash",
        f"# Run {run_id}, written by the toolkit (launch.yml submits it with sbatch on the master).",
        f"#SBATCH --job-name=dsc-{run_id}",
        f"#SBATCH --partition={plan['slurm']['partition']}",
        *([f"#SBATCH --account={plan['slurm']['account']}"] if plan["slurm"]["account"] else []),
        f"#SBATCH --nodes={plan['num_nodes']}",
        f"#SBATCH --nodelist={names}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        *([f"#SBATCH --gres=gpu:{gpus.pop()}"] if gpus and max(gpus) > 0 else []),
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        f"#SBATCH --chdir={workdir}",
        "set -u",
        "attempt=0",
        "while :; do",
        f"  port=$(srun --nodes=1 --ntasks=1 --nodelist={q(plan['master'])} {q(plan['helper'])} free-port "
        f"{plan['master_port_first']} {plan['master_port_last']}) || exit 3",
        f"  srun --nodes={plan['num_nodes']} --ntasks-per-node=1 --kill-on-bad-exit=1 "
        f"/bin/bash {q(run_dir + '/' + RunDir.SLURM_TASK)} \"$port\" \"$attempt\" && exit 0",
        f"  [ \"$attempt\" -lt {most} ] || exit 1",
        "  attempt=$((attempt + 1))",
        f"  wait_s=$(( {backoff} << (attempt - 1) )); [ \"$wait_s\" -le 600 ] || wait_s=600",
        f"  touch {q(run_dir + '/' + RunDir.RESTARTING)}",
        f"  echo \"[dsc slurm] restart $attempt/{most} of every node in $wait_s s from the latest complete checkpoint\"",
        "  sleep \"$wait_s\"",
        "done",
    ]
    task = ["#!/bin/bash",
            f"# Run {run_id}: this node's launcher (Slurm's task on it), on the master port in $1,",
            "# the batch job's attempt in $2 (above 0: a restart, from the latest complete checkpoint).",
            "set -eu",
            *(f"export {k}={q(str(v))}" for k, v in sorted(dict(env, DS_ENV_FILE=f"{run_dir}/{RunDir.DS_ENV}").items())),
            'case "$SLURMD_NODENAME" in']
    for node, cmd in commands.items():
        argv = [plan["helper"], "start", run_dir, run_id, "--foreground", "--port", "$1", "--attempt", "$2",
                *start_args[node], "--", *cmd]
        task.append(f"  {node}) exec " + " ".join(f'"{a}"' if a in ("$1", "$2") else q(a) for a in argv) + " ;;")
    task += [f'  *) echo "node $SLURMD_NODENAME is not one of run {run_id}\'s nodes ({names})" >&2; exit 2 ;;',
             "esac"]
    return {RunDir.SLURM_BATCH: "\n".join(batch) + "\n", RunDir.SLURM_TASK: "\n".join(task) + "\n"}
