"""Slurm as the plan derives it (dscplan.slurm): slurm.conf's nodes from the inventory and the
probes, the GPUs as gres, cgroup or not (dsc_slurm_install); dsc_launch_mode slurm's batch job and
each node's task; a site's own Slurm (its partition and account, the nodes it knows); and the
refusals of a partition or account Slurm would read as more than a name, of nodes the master's
Slurm does not list, of restarts and of differing GPU counts.

    .venv/bin/pytest tests/unit/test_plan_slurm.py -q
"""
import shlex
import subprocess

import pytest

import dscplan
from plugins.filter.cluster import slurm_job
from tests.unit.plan_helpers import DEFAULTS, PATHS, cluster, plan, probe


def conf_lines(p):
    return p["slurm"]["conf"].splitlines()


def test_off_by_default_and_nothing_rendered():
    p, errors = plan(2)
    assert errors == []
    assert p["slurm"] == {"install": False, "partition": "dsc", "account": "", "controller": "", "conf": "",
                          "gres_conf": "", "cgroup_conf": ""}


def test_nodes_from_the_inventory_and_the_probe():
    hostvars, groups, probes = cluster(2, dsc_slurm_install=True, dsc_slurm_slurmd_timeout_s=30)
    probes["node1"].update(cpus=64, memory_mib=515000)
    probes["node2"].update(cpus=32, memory_mib=257000)
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert errors == []
    lines = conf_lines(p)
    assert "SlurmctldHost=node1(10.0.0.11)" in lines and "AuthType=auth/munge" in lines
    assert "SlurmdTimeout=30" in lines and "ReturnToService=2" in lines
    assert "NodeName=node1 NodeAddr=10.0.0.11 CPUs=64 RealMemory=489250 State=UNKNOWN" in lines
    assert "NodeName=node2 NodeAddr=10.0.0.12 CPUs=32 RealMemory=244150 State=UNKNOWN" in lines
    assert "PartitionName=dsc Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP" in lines
    assert "ProctrackType=proctrack/cgroup" in lines and p["slurm"]["cgroup_conf"].startswith("CgroupPlugin=")
    assert "GresTypes=gpu" not in lines and p["slurm"]["gres_conf"] == ""  # CPU nodes: no gres
    assert p["slurm"]["controller"] == "node1"


def test_gpus_as_gres_the_chosen_ones_only():
    hostvars, groups, probes = cluster(2, slots="auto", dsc_slurm_install=True)
    for h in probes:
        probes[h] = probe(hostvars[h]["dsc_addr"], gpus=4)
    hostvars["node2"]["dsc_gpus"] = [2, 3]
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert errors == []
    lines = conf_lines(p)
    assert "GresTypes=gpu" in lines
    assert any(x.startswith("NodeName=node1 ") and "Gres=gpu:4" in x for x in lines)
    assert any(x.startswith("NodeName=node2 ") and "Gres=gpu:2" in x for x in lines)
    assert p["slurm"]["gres_conf"].splitlines() == [
        *(f"NodeName=node1 Name=gpu File=/dev/nvidia{i}" for i in range(4)),
        "NodeName=node2 Name=gpu File=/dev/nvidia2", "NodeName=node2 Name=gpu File=/dev/nvidia3"]


def test_no_cgroup_for_a_container():
    p, errors = plan(2, dsc_slurm_install=True, dsc_slurm_cgroup=False)
    assert errors == []
    assert "ProctrackType=proctrack/linuxproc" in conf_lines(p) and "TaskPlugin=task/none" in conf_lines(p)
    assert p["slurm"]["cgroup_conf"] == ""


@pytest.mark.parametrize("partition", ["dsc;touch /tmp/x", "a b", "gpu[1-2]", "p,q", "dsc\n", "-x", ""])
def test_a_partition_that_is_more_than_a_name_is_refused(partition):
    p, errors = plan(2, dsc_slurm_partition=partition)
    assert p is None
    assert any(e.startswith("dsc_slurm_partition on host node1 is ") and "Fix: letters" in e for e in errors), errors


def slurm_run(n=2, options=None, **settings):
    return plan(n, options=options or {}, full_run=True, dsc_launch_mode="slurm", dsc_slurm_install=True, **settings)


def test_the_batch_job_holds_exactly_the_plans_nodes_and_takes_the_masters_port():
    p, errors = slurm_run(dsc_slurm_partition="train")
    assert errors == []
    run = p["run"]
    batch = run["files"]["slurm.sbatch"].splitlines()
    for line in ["#SBATCH --job-name=dsc-" + run["id"], "#SBATCH --partition=train", "#SBATCH --nodes=2",
                 "#SBATCH --nodelist=node1,node2", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive",
                 f"#SBATCH --output={run['dir']}/slurm-%j.out", f"#SBATCH --chdir={run['workdir']}"]:
        assert line in batch
    assert not any(x.startswith("#SBATCH --gres") for x in batch)  # CPU nodes
    assert ("  port=$(srun --nodes=1 --ntasks=1 --nodelist=node1 /usr/local/lib/dscluster/dsc_node.pyz "
            "free-port 29500 29510) || exit 3") in batch
    assert (f"  srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 /bin/bash {run['dir']}/slurm_task.sh "
            f"\"$port\" \"$attempt\" \"$agreed\" && exit 0") in batch
    assert "  agreed=''" in batch  # no {latest:GLOB} to agree on
    assert '  [ "$attempt" -lt 0 ] || exit 1' in batch  # max_restarts 0: no second attempt
    assert subprocess.run(["bash", "-n"], input=run["files"]["slurm.sbatch"], text=True).returncode == 0


def test_each_nodes_task_starts_its_launcher_in_the_foreground_on_the_port():
    p, errors = slurm_run()
    assert errors == []
    run = p["run"]
    task = run["files"]["slurm_task.sh"]
    assert subprocess.run(["bash", "-n"], input=task, text=True).returncode == 0
    lines = {line.split(")")[0].strip(): line for line in task.splitlines() if line.startswith("  node")}
    for node, rank in (("node1", 0), ("node2", 1)):
        argv = shlex.split(lines[node].split(") exec ", 1)[1].rsplit(" ;;", 1)[0])
        assert argv[:11] == [p["helper"], "start", run["dir"], run["id"], "--foreground", "--port", "$1",
                             "--attempt", "$2", "--agreed", "$3"]
        assert argv[11:11 + len(run["start_args"][node])] == run["start_args"][node]
        assert run["start_args"][node][2:4] == ["--hosts", node]  # each node's supervisor, its own node
        rest = argv[argv.index("--") + 1:]
        assert rest == run["commands"][node] and rest[rest.index("--node_rank") + 1] == str(rank)
    assert f"export DSC_RUN_ID={run['id']}" in task and f"export DS_ENV_FILE={run['dir']}/.deepspeed_env" in task


def test_restarts_are_the_batch_jobs_every_node_at_once():
    p, errors = slurm_run(options={"max_restarts": 2, "restart_backoff_s": 5})
    assert errors == []
    run = p["run"]
    batch = run["files"]["slurm.sbatch"]
    assert '  [ "$attempt" -lt 2 ] || exit 1' in batch and "wait_s=$(( 5 << (attempt - 1) ))" in batch
    assert f"  touch {run['dir']}/restarting" in batch
    for node in ("node1", "node2"):  # no node's supervisor restarts alone
        args = run["start_args"][node]
        assert args[args.index("--max-restarts") + 1] == "0"


def test_each_attempt_takes_the_latest_checkpoint_every_node_holds_complete():
    """A run that resumes with {latest:GLOB}: before each attempt the batch job asks every node
    (one task each) for its matches and gives every node's task the newest complete on all; the
    plan asks no node itself (the batch job does, when it runs)."""
    p, errors = slurm_run(options={"max_restarts": 1,
                                   "dsc_resume_args": ["--resume_from_checkpoint", "{latest:out/checkpoint-*}"]})
    assert errors == []
    run = p["run"]
    batch = run["files"]["slurm.sbatch"].splitlines()
    helper = p["helper"]
    assert (f"  agreed=$(srun --nodes=2 --ntasks-per-node=1 {helper} latest-states --cwd {run['workdir']} "
            f"'out/checkpoint-*' | {helper} agree-latest --nodes 2) || agreed=''") in batch
    asked, started = (next(i for i, x in enumerate(batch) if x.lstrip().startswith(w)) for w in ("agreed=$(", "srun --nodes=2"))
    assert batch.index("while :; do") < asked < started  # every attempt, the first too
    assert run["latest_globs"] == []
    assert subprocess.run(["bash", "-n"], input=run["files"]["slurm.sbatch"], text=True).returncode == 0


def test_a_sites_own_slurm_takes_its_partition_and_account_and_must_know_every_node():
    p, errors = plan(2, full_run=True, options={}, dsc_launch_mode="slurm", dsc_slurm_partition="gpu",
                     dsc_slurm_account="research")
    assert errors == []
    assert p["slurm"] == {"install": False, "partition": "gpu", "account": "research", "controller": "", "conf": "",
                          "gres_conf": "", "cgroup_conf": ""}
    batch = p["run"]["files"]["slurm.sbatch"].splitlines()
    assert "#SBATCH --partition=gpu" in batch and "#SBATCH --account=research" in batch
    assert not any(x.startswith("#SBATCH --account") for x in slurm_run()[0]["run"]["files"]["slurm.sbatch"].splitlines())

    def refusals(view):
        hostvars, groups, probes = cluster(2, dsc_launch_mode="slurm", dsc_slurm_partition="gpu")
        probes["node1"]["slurm"] = view
        return dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, full_run=True)[1]

    errors = refusals({"partitions": {"gpu": ["node1", "gpu-07"], "debug": ["node2"]}})
    assert errors == ["dsc_launch_mode on host node1 is 'slurm' but Slurm's partition gpu does not hold node2 (it "
                      "holds node1, gpu-07): the job's node list is the inventory's names. Fix: name the "
                      "inventory's hosts as Slurm names the nodes (NodeName in slurm.conf; sinfo -N on node1), "
                      "or the partition that holds them (dsc_slurm_partition)."], errors
    errors = refusals({"partitions": {"debug": ["node1", "node2"], "batch": []}})
    assert errors == ["dsc_slurm_partition on host node1 is 'gpu' but Slurm has no such partition (it has batch, "
                      "debug). Fix: the partition that holds the inventory's nodes (sinfo on node1)."], errors
    errors = refusals({"error": "[Errno 2] No such file or directory: 'sinfo'"})
    assert len(errors) == 1 and errors[0].startswith(
        "dsc_launch_mode on host node1 is 'slurm' but Slurm does not answer there (sinfo, squeue): [Errno 2]"), errors
    assert "Fix: the Slurm client and munge on node1" in errors[0]
    errors = refusals({"partitions": {"gpu": ["node1", "node2"]}, "jobs": {"dsc-r7": ["12", "PENDING"]}})
    assert errors == []
    hostvars, groups, probes = cluster(2, dsc_launch_mode="slurm", runs=[{"id": "r7", "started": False}])
    probes["node1"]["slurm"]["jobs"] = {"dsc-r7": ["12", "PENDING"]}
    for options in ({"run_id": "r7"}, {"run_id": "r7", "resume": True}):
        errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, options, full_run=True)[1]
        assert "run_id 'r7' is Slurm job 12 (PENDING) on node1 already: a second job would run it twice. " \
               "Fix: follow it (status.yml -e run_id=r7 -e follow=true), or stop it first (stop.yml -e run_id=r7)." in errors, errors
    # Provisioning and status read no Slurm: only a launch (or resume) checks the nodes.
    hostvars, groups, probes = cluster(2, dsc_launch_mode="slurm")
    del probes["node1"]["slurm"]
    assert dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {})[1] == []


@pytest.mark.parametrize("var, value", [("dsc_slurm_account", "a b"), ("dsc_slurm_account", "-x"),
                                        ("dsc_slurm_account", "acct,other"), ("dsc_slurm_account", "acct\n"),
                                        ("dsc_slurm_account", "../etc"), ("dsc_slurm_account", "$(id)"),
                                        ("dsc_slurm_slurmd_timeout_s", 0), ("dsc_slurm_slurmd_timeout_s", "5m"),
                                        ("dsc_slurm_slurmd_timeout_s", "30\n"), ("dsc_slurm_slurmd_timeout_s", "30;reboot"),
                                        ("dsc_slurm_slurmd_timeout_s", True)])
def test_an_account_or_timeout_slurm_would_misread_is_refused(var, value):
    p, errors = plan(2, **{var: value})
    assert p is None and any(e.startswith(f"{var} on host node1 is {value!r}. Fix: ") for e in errors), errors


def test_slurm_mode_refusals():
    hostvars, groups, probes = cluster(2, slots="auto", dsc_launch_mode="slurm", dsc_slurm_install=True)
    for h, count in (("node1", 4), ("node2", 2)):
        probes[h] = probe(hostvars[h]["dsc_addr"], gpus=count)
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, full_run=True)
    assert any("the nodes' GPU counts differ (node1 4, node2 2)" in e for e in errors), errors
    for h in probes:
        probes[h] = probe(hostvars[h]["dsc_addr"], gpus=4)
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, full_run=True)
    assert errors == [] and "#SBATCH --gres=gpu:4" in p["run"]["files"]["slurm.sbatch"]


def test_installing_slurm_on_a_node_without_systemd_is_refused_naming_it():
    """roles/slurm runs munge, slurmctld and slurmd as systemd services: a node whose probe saw no
    systemd is refused before any change, not halfway through provision."""
    hostvars, groups, probes = cluster(2, dsc_slurm_install=True)
    probes["node1"]["systemd"], probes["node2"]["systemd"] = True, False
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert p is None and len(errors) == 1 and errors[0].startswith(
        "dsc_slurm_install on host node2 is true, but systemd does not run there") and "Fix:" in errors[0]
    probes["node2"]["systemd"] = True
    assert dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)[1] == []


def test_a_strangers_job_of_the_runs_name_is_neither_waited_for_nor_cancelled():
    """The run's job is the training user's own of its name (plugins/filter/cluster.slurm_job over
    squeue's lines, newest first); and the probe lists the training user's jobs only, so a job
    another user named dsc-<run id> does not block the launch."""
    lines = ["41|RUNNING|None|eve|dsc-r1", "40|PENDING|Priority|dstrain|dsc-r1", "39|RUNNING|None|dstrain|dsc-r2"]
    assert slurm_job(lines, "dstrain", "dsc-r1") == {"id": "40", "state": "PENDING", "reason": "Priority",
                                                     "user": "dstrain", "name": "dsc-r1"}
    assert slurm_job(lines[:1], "dstrain", "dsc-r1") == {} and slurm_job([], "dstrain", "dsc-r1") == {}
    hostvars, groups, probes = cluster(2, dsc_launch_mode="slurm")
    probes["node1"]["slurm"]["jobs"] = {}  # squeue --user dstrain: eve's dsc-r1 is not listed
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {"run_id": "r1"},
                                  now="20261130-000000", full_run=True)
    assert errors == [], errors
