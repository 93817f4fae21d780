"""dsc_launch_mode slurm: the run is one Slurm batch job on exactly the inventory's nodes (the Slurm
provision.yml installs with dsc_slurm_install, or the site's own). The job's task on each node
starts that node's DeepSpeed launcher as no_ssh does, under the node helper's supervisor in the
foreground; the batch job restarts every node together (max_restarts), a second launch queues
behind the first, and stop cancels the job. The job is the training user's, named dsc-<run id>:
every lookup is of that user's jobs of that name."""
from __future__ import annotations

import shlex

from dscnode.rundir import RunDir

from .base import LauncherRecord, QueueRecord
from .no_ssh import PerNode

JOB_PREFIX = "dsc-"


class Slurm(PerNode):
    mode = "slurm"
    queues = True
    agrees_latest = "batch job"

    def probe_options(self):
        return ["--slurm"]

    def record(self, nodes, master, slurm):
        return LauncherRecord(name=self.mode, start_nodes=[], peers=[], log_nodes=[n.name for n in nodes],
                              ssh_mesh=False, queue=QueueRecord(partition=slurm.partition, job_prefix=JOB_PREFIX))

    def restarts(self, max_restarts):
        return 0  # the batch job restarts every node's task together, never one supervisor alone

    def cluster_problems(self, nodes, where, problems):
        counts = {n.name: len(n.gpu_ids) or n.gpus for n in nodes if n.reachable}
        if len(set(counts.values())) > 1:
            detail = ", ".join(f"{k} {v}" for k, v in counts.items())
            problems.add(f"dsc_launch_mode {where} is 'slurm' but the nodes' GPU counts differ ({detail}): "
                         f"one Slurm job gives every node the same gres. Fix: the same count on every "
                         f"node (dsc_gpus), or dsc_launch_mode pdsh.")

    def run_problems(self, master, nodes, slurm, run_id, probe, problems):
        node_problems(master, slurm.partition, [n.name for n in nodes], run_id, probe.get("slurm"), problems)

    def files(self, plan, run_id, run_dir, workdir, commands, start_args, env, restarts, globs):
        return batch_files(plan, run_id, run_dir, workdir, commands, start_args, env, restarts, globs)


def node_problems(master, partition, names, run_id, view, problems):
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
    queued = (view.get("jobs") or {}).get(f"{JOB_PREFIX}{run_id}")
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


def batch_files(plan, run_id, run_dir, workdir, commands, start_args, env, restarts, globs=()):
    """dsc_launch_mode slurm: the run directory's batch job and per-node task (file name -> text).
    The job holds exactly the plan's nodes (exclusive, their GPUs as gres); each attempt's first
    step takes the first free master port on the master (the node helper's free-port), then one
    task per node starts that node's DeepSpeed launcher (--no_ssh --node_rank) under the node
    helper's supervisor in the foreground, on that port. A task that fails ends the others
    (--kill-on-bad-exit): the ranks of the other nodes do not wait for a node that is gone. Then,
    up to `restarts` (max_restarts, backoff_s) times, the job starts every node again from the
    latest complete checkpoint, after a backoff that doubles (as the supervisor's, up to 600 s);
    the run directory's `restarting` mark says so meanwhile (status, follow). Where the run
    resumes with `{latest:GLOB}` (`globs`), each attempt first asks every node for its matches
    and passes the newest complete on all of them to every node's task (agree-latest)."""
    most, backoff = restarts
    gpus = {len(n.gpu_ids) or n.gpus for n in plan.nodes}
    names = ",".join(plan.node_names)
    q = shlex.quote
    batch = [
        "#!/bin/bash",
        f"# Run {run_id}, written by the toolkit (launch.yml submits it with sbatch on the master).",
        f"#SBATCH --job-name={JOB_PREFIX}{run_id}",
        f"#SBATCH --partition={plan.slurm.partition}",
        *([f"#SBATCH --account={plan.slurm.account}"] if plan.slurm.account else []),
        f"#SBATCH --nodes={plan.num_nodes}",
        f"#SBATCH --nodelist={names}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        *([f"#SBATCH --gres=gpu:{gpus.pop()}"] if gpus and max(gpus) > 0 else []),
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        f"#SBATCH --chdir={workdir}",
        "set -u",
        "attempt=0",
        "while :; do",
        f"  port=$(srun --nodes=1 --ntasks=1 --nodelist={q(plan.master)} {q(plan.helper)} free-port "
        f"{plan.master_port_first} {plan.master_port_last}) || exit 3",
        *([f"  agreed=$(srun --nodes={plan.num_nodes} --ntasks-per-node=1 {q(plan.helper)} latest-states "
           f"--cwd {q(workdir)} {' '.join(map(q, globs))} | {q(plan.helper)} agree-latest --nodes {plan.num_nodes}) "
           f"|| agreed=''"]
          if globs else ["  agreed=''"]),
        f"  srun --nodes={plan.num_nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 "
        f"/bin/bash {q(run_dir + '/' + RunDir.SLURM_TASK)} \"$port\" \"$attempt\" \"$agreed\" && exit 0",
        # 6: a node's GPU gate refused the restart (its task recorded why): no further attempt
        "  [ $? -ne 6 ] || exit 6",
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
            "# the batch job's attempt in $2 (above 0: a restart, from the latest complete checkpoint),",
            "# what every node agreed each {latest:GLOB} is in $3.",
            "set -eu",
            *(f"export {k}={q(str(v))}" for k, v in sorted(dict(env, DS_ENV_FILE=f"{run_dir}/{RunDir.DS_ENV}").items())),
            'case "$SLURMD_NODENAME" in']
    for node, cmd in commands.items():
        argv = [plan.helper, "start", run_dir, run_id, "--foreground", "--port", "$1", "--attempt", "$2",
                "--agreed", "$3", *start_args[node], "--", *cmd]
        task.append(f"  {node}) exec " + " ".join(f'"{a}"' if a in ("$1", "$2", "$3") else q(a) for a in argv) + " ;;")
    task += [f'  *) echo "node $SLURMD_NODENAME is not one of run {run_id}\'s nodes ({names})" >&2; exit 2 ;;',
             "esac"]
    return {RunDir.SLURM_BATCH: "\n".join(batch) + "\n", RunDir.SLURM_TASK: "\n".join(task) + "\n"}
