"""Slurm installed by the toolkit (dsc_slurm_install, roles/slurm) on two more nodes of the test
network that run systemd (molecule/node-systemd.Containerfile on the provisioned image: its env,
torch and DeepSpeed), behind the toolkit's firewalld, reached over SSH as the cluster's nodes are:
`provision.yml --tags network,slurm` (the plan, the training user, the firewall and Slurm alone),
then runs launched through Slurm (dsc_launch_mode slurm), and through it as a site's own Slurm
(dsc_slurm_install false: its partition and account, the nodes it knows). The containers give
slurmd no cgroup tree of its own: dsc_slurm_cgroup false (proctrack/linuxproc); a stopped slurmd
makes its node DOWN after 20 s (dsc_slurm_slurmd_timeout_s) instead of Slurm's 300."""
import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest

import cluster as tc

NODES = [{"name": f"slu{i}", "ip": tc.addr(50 + i), "ip6": tc.addr6(50 + i), "port": 22} for i in (1, 2)]
SLURM = ("cluster_network_firewall_backend: firewalld\n"
         "dsc_slurm_install: true\n"
         "dsc_slurm_cgroup: false\n"
         "dsc_slurm_slurmd_timeout_s: 20\n"
         "dsc_launch_mode: slurm\n")
# The same nodes' Slurm as a site's own: the toolkit neither installs nor configures it.
SITE = ("cluster_network_firewall_backend: firewalld\n"
        "dsc_launch_mode: slurm\n"
        "dsc_slurm_account: research\n")
RUNS = "/opt/dscluster/runs"
KEY = Path.home() / ".dscluster" / "keys" / "testcluster" / "munge.key"


@pytest.fixture(scope="module")
def slurm_nodes(cluster, node_image, tmp_path_factory):
    """The two systemd nodes, their inventory, and the first provision.yml --tags network,slurm."""
    where = tmp_path_factory.mktemp("slurm")
    image = tc.systemd_image(node_image[0])
    with tc.extra_nodes(NODES, where, lambda c, h: tc.start_systemd(c, h["name"], h["ip"], h["ip6"], image),
                        extra=SLURM) as inventory:
        first = cluster.playbook("provision.yml", "--tags", "network,slurm", inventory=inventory)
        tc.write_inventory(NODES, inv=where / "site", known_hosts=where / "known_hosts", extra=SITE)
        # slu2 under a name Slurm does not know (the same node, reached at the same address).
        renamed = [NODES[0], dict(NODES[1], name="gpu-07")]
        tc.write_inventory(renamed, inv=where / "renamed", known_hosts=where / "known_hosts", extra=SITE)
        yield {"inventory": inventory, "first": first, "site": where / "site", "renamed": where / "renamed"}

def test_provision_installs_slurm_that_runs_a_step_on_every_node(slurm_nodes, cluster):
    first = slurm_nodes["first"]
    assert first.returncode == 0, first.output[-6000:]
    assert "TASK [slurm : Run one job step on every node as the training user]" in first.output
    nodes = cluster.exec("slu1", "sinfo --noheader --Node --format '%N %P %T'").stdout.split("\n")
    assert sorted(n.split() for n in nodes if n) == [["slu1", "dsc*", "idle"], ["slu2", "dsc*", "idle"]]
    # One munge key: made once on the control node, readable by its owner alone there and on the
    # nodes, and what one node signs the other verifies.
    assert KEY.stat().st_mode & 0o777 == 0o400
    digest = hashlib.sha256(KEY.read_bytes()).hexdigest()
    for h in NODES:
        key = cluster.exec(h["name"], "stat -c '%U:%G %a' /etc/munge/munge.key && sha256sum /etc/munge/munge.key")
        assert key.stdout.split()[:3] == ["munge:munge", "400", digest], key.stdout
    credential = cluster.exec("slu1", "munge -n").stdout
    assert subprocess.run(["podman", "exec", "-i", tc.PREFIX + "slu2", "unmunge"], input=credential,
                          capture_output=True, text=True).returncode == 0
    conf = [cluster.exec(h["name"], "cat /etc/slurm/slurm.conf").stdout for h in NODES]
    cpus = cluster.exec("slu2", "nproc").stdout.strip()
    assert conf[0] == conf[1] and f"NodeName=slu2 NodeAddr={NODES[1]['ip']} CPUs={cpus} " in conf[0]
    # A job of the training user's, through the firewall, on both nodes at once.
    step = cluster.exec("slu1", "cd /tmp && runuser -u dstrain -- srun --nodes 2 --ntasks-per-node 1 "
                                "sh -c 'echo $SLURMD_NODENAME $(id -un)'")
    assert sorted(step.stdout.splitlines()) == ["slu1 dstrain", "slu2 dstrain"], step.stdout


def test_a_second_provision_changes_nothing(slurm_nodes, cluster):
    again = cluster.playbook("provision.yml", "--tags", "network,slurm", inventory=slurm_nodes["inventory"])
    assert again.returncode == 0, again.output[-5000:]
    changed = [block.splitlines()[0] for block in again.output.split("TASK [")[1:] if "changed: [" in block]
    assert all(again.recap[h["name"]]["changed"] == 0 for h in NODES), changed


def _lines(output, *needles):
    """The lines of a playbook's output holding any of the needles (the docs show them)."""
    return [line.strip().strip('",') for line in output.splitlines()
            if any(n in line for n in needles) and "TASK [" not in line]


def _slurm_state(cluster, node):
    return cluster.exec("slu1", f"sinfo --noheader --Node --nodes {node} --format %T").stdout.strip()


def test_a_node_whose_slurmd_is_stopped_fails_preflight_and_a_job_pends_for_it(slurm_nodes, cluster, figures):
    """preflight's fast checks (no all-reduce: these nodes have no env, whose rows fail too) name
    the node; once slurmctld marks it DOWN (SlurmdTimeout 20 s here), a launch pends with Slurm's
    reason, which status shows, and stop cancels the pending job."""
    inv = slurm_nodes["inventory"]
    cluster.exec("slu2", "systemctl stop slurmd")
    try:
        r = cluster.playbook("preflight.yml", "-e", "preflight_full=false", inventory=inv)
        tc.wait(lambda: _slurm_state(cluster, "slu2").startswith("down"), 90, "slu2 DOWN in Slurm")
        launched = cluster.playbook("launch.yml", "-e", "run_id=sl-0", "-e", "preflight=false",
                                    "-e", json.dumps({"dsc_train_config": dict(tc.TINY, steps=20)}), inventory=inv)
        pending = cluster.playbook("status.yml", "-e", "run_id=sl-0", inventory=inv)
        stop = cluster.playbook("stop.yml", "-e", "run_id=sl-0", inventory=inv)
    finally:
        cluster.exec("slu2", "systemctl start slurmd")
    assert r.returncode != 0 and "Preflight failed" in r.output, r.output[-4000:]
    report = json.loads((Path.home() / ".dscluster" / "reports" / "preflight-testcluster-latest.json").read_text())
    rows = {(x["check"], x["node"]): (x["status"], x["detail"]) for x in report["checks"]}
    assert rows[("munge", "slu1")][0] == rows[("munge", "slu2")][0] == "PASS", rows
    assert rows[("slurm", "slu1")] == ("PASS", "slurmd answers; idle in partition dsc"), rows
    assert rows[("slurm", "slu2")][0] == "FAIL" and rows[("slurm", "slu2")][1].startswith("slurmd does not answer"), rows
    assert "systemctl status slurmd on slu2" in r.output
    assert launched.returncode == 0 and "Run sl-0 submitted as Slurm job" in launched.output, launched.output[-4000:]
    job = re.search(r"Slurm job (\d+): PENDING \((ReqNodeNotAvail[^)]*)\)", pending.output)
    assert job and "slu2" in job.group(2), pending.output[-3000:]
    assert stop.returncode == 0 and f"Slurm job {job.group(1)} of run sl-0: JobState=CANCELLED" in stop.output, stop.output[-3000:]
    tc.wait(lambda: _slurm_state(cluster, "slu2") == "idle", 60, "slu2 back in service")
    figures("slurm down", preflight=_lines(r.output, "slurmd does not answer"),
            pending=_lines(pending.output, "Slurm job"), stop=_lines(stop.output, "JobState="))


def _run_state(cluster, run):
    return {h["name"]: cluster.exec(h["name"], f"cat {RUNS}/{run}/exit_code 2>/dev/null", check=False).stdout.strip()
            for h in NODES}


def _last_step(cluster, run):
    r = cluster.exec("slu1", f"tail -1 {RUNS}/{run}/metrics.jsonl 2>/dev/null", check=False)
    return json.loads(r.stdout)["step"] if r.stdout.strip() else 0


def test_a_second_launch_queues_stop_cancels_and_resume_continues(slurm_nodes, cluster, figures):
    """A long run; a second launch queues behind it (launch.yml returns saying so, runs.yml numbers
    it, a resume of it is refused: it would be submitted twice); stop cancels the first job
    (CANCELLED, nothing left on either node) and the queued run starts and is followed to its end
    on both nodes, with its progress lines (the run through Slurm to completion); the first
    resumes from its checkpoint to a nearer end."""
    inv = slurm_nodes["inventory"]
    first, second = "sl-2", "sl-3"

    def launch(run, **train):
        r = cluster.playbook("launch.yml", "-e", f"run_id={run}", "-e", "preflight=false",
                             "-e", json.dumps({"dsc_train_config": dict(tc.TINY, **train)}), inventory=inv)
        assert r.returncode == 0, r.output[-6000:]
        return r

    # Another local user names held jobs as the run's, before its launch and after: neither
    # blocks the launch nor is taken for the run (stop cancels the run's own).
    cluster.exec("slu1", "id eve >/dev/null 2>&1 || useradd -m eve")
    strangers = [_stranger_job(cluster, first)]
    launch(first, **tc.UNTIL_STOPPED, save_every=20)
    strangers.append(_stranger_job(cluster, first))
    tc.wait(lambda: _last_step(cluster, first) > 45, 180, f"{first} past its second checkpoint")
    # paced (6 s of steps at least): the follow below, every 2 s, shows progress lines of it
    queued = launch(second, steps=40, min_step_s=0.15)
    job2 = re.search(rf"Run {second} submitted as Slurm job (\d+) \(world size 2, partition dsc\): PENDING", queued.output)
    assert job2, queued.output[-3000:]
    runs = cluster.playbook("runs.yml", inventory=inv)
    assert f"1. job {job2.group(1)} dsc-{second} (dstrain), waiting for " in runs.output, runs.output[-3000:]
    pending = cluster.playbook("status.yml", "-e", f"run_id={second}", inventory=inv)
    assert re.search(rf"Slurm job {job2.group(1)}: PENDING \(\w+\)", pending.output), pending.output[-3000:]
    twice = cluster.playbook("resume.yml", "-e", f"run_id={second}", inventory=inv)  # not started: not active
    assert twice.returncode != 0 and f"run_id '{second}' is Slurm job {job2.group(1)} (PENDING) on slu1 already" \
        in twice.output, twice.output[-3000:]
    status = cluster.playbook("status.yml", "-e", f"run_id={first}", inventory=inv)
    job1 = re.search(r"Slurm job (\d+): RUNNING", status.output)
    assert job1 and "slu2: running, ranks alive 1" in status.output, status.output[-4000:]
    stop = cluster.playbook("stop.yml", "-e", f"run_id={first}", inventory=inv)
    assert stop.returncode == 0, stop.output[-4000:]
    assert f"Slurm job {job1.group(1)} of run {first}: JobState=CANCELLED" in stop.output, stop.output[-4000:]
    held = cluster.exec("slu1", "squeue --noheader --user eve --format '%i %T'").stdout.split("\n")
    assert sorted(line.split()[0] for line in held if line) == sorted(strangers), held  # eve's, untouched
    cluster.exec("slu1", f"scancel {' '.join(strangers)}")
    for h in NODES:
        assert f"{h['name']}: stopped" in stop.output
        left = cluster.exec(h["name"], f"/usr/local/lib/dscluster/dsc_node.pyz procs {first}", user="dstrain")
        assert json.loads(left.stdout) == [], left.stdout
    followed = cluster.playbook("status.yml", "-e", f"run_id={second}", "-e", "follow=true", "-e", "follow_every_s=2",
                                inventory=inv)
    assert followed.returncode == 0 and f"Run {second} finished at step 40." in followed.output, followed.output[-4000:]
    # followed to the end, with its progress lines while it trained, on both nodes
    assert any(x.startswith(f"run {second}: running, step ") and "/40, loss " in x
               for x in followed.output.splitlines()), followed.output[-4000:]
    assert _run_state(cluster, second) == {"slu1": "0", "slu2": "0"}
    for n, h in enumerate(NODES):  # each node's own launcher, with the whole world
        log = cluster.exec(h["name"], f"cat {RUNS}/{second}/launcher.log").stdout
        assert f"--node_rank={n}" in log and "dist_world_size=2" in log, log[-2000:]
    job = cluster.exec("slu1", f"ls {RUNS}/{second}/ | grep '^slurm-.*out$'").stdout.split()
    assert len(job) == 1, job
    end = _last_step(cluster, first) + 10
    resumed = cluster.playbook("resume.yml", "-e", f"run_id={first}", "-e", "follow=true",
                               "-e", json.dumps({"dsc_entry_args": ["--set", f"steps={end}"]}), inventory=inv)
    assert resumed.returncode == 0 and f"Run {first} finished at step {end}." in resumed.output, resumed.output[-4000:]
    assert _run_state(cluster, first) == {"slu1": "0", "slu2": "0"}
    figures("slurm", queued=_lines(queued.output, "submitted as Slurm job"),
            runs=_lines(runs.output, "Slurm queue", "running: job", "1. job"),
            status=_lines(status.output, "Slurm job", ": running, ranks alive"),
            pending=_lines(pending.output, "Slurm job", ": not started"),
            stop=_lines(stop.output, "JobState=", ": stopped"))


def _stranger_job(cluster, run):
    """A held job of eve's named as the run's job (dsc-<run id>: run ids show in squeue): its id."""
    return cluster.exec("slu1", f"cd /tmp && runuser -u eve -- sbatch --parsable --hold --mem=1M "
                                f"--job-name=dsc-{run} --wrap 'sleep 600'").stdout.strip().split(";")[0]


def test_a_sites_own_slurm_must_know_every_node_before_a_job_is_submitted(slurm_nodes, cluster):
    """dsc_slurm_install false: an inventory naming slu2 as Slurm does not (gpu-07, the same node)
    is refused by the plan, before any node changes and before anything is submitted."""
    r = cluster.playbook("launch.yml", "-e", "run_id=sl-x", "-e", "preflight=false", inventory=slurm_nodes["renamed"])
    assert r.returncode != 0, r.output[-3000:]
    assert ("dsc_launch_mode on host slu1 is 'slurm' but Slurm's partition dsc does not hold gpu-07 (it holds "
            "slu1, slu2)") in r.output and "Fix: name the inventory's hosts as Slurm names the nodes" in r.output, r.output[-3000:]
    assert all(v.get("changed", 0) == 0 for v in r.recap.values()), r.recap
    assert cluster.exec("slu1", "squeue --noheader --name dsc-sl-x").stdout.strip() == ""
    assert cluster.exec("slu1", f"test -e {RUNS}/sl-x", check=False).returncode != 0


def test_a_killed_rank_restarts_every_node_from_the_checkpoint(slurm_nodes, cluster):
    """max_restarts through Slurm, as a site's own (dsc_slurm_install false, the job charged to
    dsc_slurm_account): a rank killed on slu2 ends its node's task, which ends the other
    (--kill-on-bad-exit); the batch job starts both again from the latest complete checkpoint, and
    the followed run finishes with one restart, its job COMPLETED in status."""
    inv, run, steps = slurm_nodes["site"], "sl-4", 150
    r = cluster.playbook("launch.yml", "-e", f"run_id={run}", "-e", "preflight=false", "-e", "max_restarts=1",
                         "-e", "restart_backoff_s=1",
                         "-e", json.dumps({"dsc_train_config": dict(tc.TINY, steps=steps, save_every=10, min_step_s=0.05)}), inventory=inv)
    assert r.returncode == 0, r.output[-6000:]
    job = re.search(rf"Run {run} submitted as Slurm job (\d+)", r.output).group(1)
    assert "Account=research " in cluster.exec("slu1", f"scontrol show job {job}").stdout
    tc.wait(lambda: _last_step(cluster, run) > 25, 180, f"{run} past its second checkpoint")
    victim = tc.wait(lambda: cluster.rank_pids("slu2", run), 30, "a rank on slu2")[0]
    cluster.exec("slu2", f"kill -9 {victim}")
    followed = cluster.playbook("status.yml", "-e", f"run_id={run}", "-e", "follow=true", inventory=inv)
    assert followed.returncode == 0 and f"Run {run} finished at step {steps}." in followed.output, followed.output[-4000:]
    ended = cluster.playbook("status.yml", "-e", f"run_id={run}", inventory=inv)
    assert f"Slurm job {job}: COMPLETED" in ended.output, ended.output[-3000:]  # kept until MinJobAge
    out = cluster.exec("slu1", f"cat {RUNS}/{run}/slurm-*.out").stdout
    assert "[dsc slurm] restart 1/1 of every node in 1 s from the latest complete checkpoint" in out, out[-2000:]
    assert _run_state(cluster, run) == {"slu1": "0", "slu2": "0"}
    summary = json.loads(cluster.exec("slu1", f"cat {RUNS}/{run}/summary.json").stdout)
    assert 10 <= summary["start_step"] < steps, summary  # the second attempt resumed from a checkpoint


def test_a_resume_takes_the_checkpoint_every_node_holds(slurm_nodes, cluster, tmp_path):
    """A {latest:GLOB} resume through Slurm: the batch job asks every node for its matches (a task
    on each) and gives every node's task the newest all hold (molecule/cluster.py says how)."""
    tc.resumed_at_the_checkpoint_every_node_holds(cluster, "sl-latest", tmp_path / "code", [h["name"] for h in NODES],
                                                  inventory=slurm_nodes["inventory"])
