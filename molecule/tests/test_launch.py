"""launch.yml and its companions on the container cluster: 2 nodes x 1 CPU rank, gloo, pdsh."""
import itertools
import json
import time

import pytest

import dscplan
from cluster import TINY, UNTIL_STOPPED, wait


def tc(**kw):
    return ["-e", json.dumps({"dsc_train_config": dict(TINY, **kw)})]


def run_procs(cluster, node, run_id):
    r = cluster.exec(node, f"/usr/local/lib/dscluster/dsc_node.pyz procs {run_id}", user="dstrain")
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def zero3_run(provisioned, cluster):
    for n in cluster.names:  # a fresh run directory when the cluster is kept between sessions
        cluster.exec(n, "rm -rf /opt/dscluster/runs/t-zero3")
    # No preflight: no test here reads it (t-ifname's launch below runs it and reads its rows).
    r = cluster.playbook("launch.yml", "-e", "preset=zero3", "-e", "follow=true", "-e", "run_id=t-zero3",
                         "-e", "preflight=false", *tc(steps=12, save_every=6, lr=0.003))
    assert r.returncode == 0, r.output[-6000:]
    return r


def test_zero3_trains_across_two_nodes_to_completion(zero3_run, cluster):
    log = cluster.exec(cluster.master, "cat /opt/dscluster/runs/t-zero3/launcher.log").stdout
    assert "pdsh" in log and "dist_world_size=2" in log
    assert "--master_addr=" + cluster.info["hosts"][0]["ip"] in log
    rows = [json.loads(x) for x in cluster.exec(cluster.master, "cat /opt/dscluster/runs/t-zero3/metrics.jsonl").stdout.split("\n") if x]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < rows[0]["loss"]
    for node in cluster.names:  # each node keeps its own ranks' shards, marked complete
        cluster.exec(node, "test -f /opt/dscluster/runs/t-zero3/checkpoints/step12/COMPLETE")
        cluster.exec(node, "ls /opt/dscluster/runs/t-zero3/checkpoints/step6/*optim_states.pt")
        # py-cpuinfo's answer for this boot, kept by provision's op warm-up: the ranks read it
        # (no second probe written after the run started)
        kept = cluster.exec(node, "cat /opt/dscluster/cache/torch_extensions/cpuinfo.json; echo; "
                                  "cat /proc/sys/kernel/random/boot_id; "
                                  "find /opt/dscluster/cache/torch_extensions/cpuinfo.json "
                                  "-newer /opt/dscluster/runs/t-zero3/run_id").stdout.splitlines()
        assert json.loads(kept[0])["boot_id"] == kept[1] and json.loads(kept[0])["info"]["arch"] and len(kept) == 2, kept


def test_rank_env_names_the_interface_holding_each_address(zero3_run, cluster):
    """The environment DeepSpeed's runner exported to every rank (the master's run dir)."""
    text = cluster.exec(cluster.master, "cat /opt/dscluster/runs/t-zero3/.deepspeed_env").stdout
    env = dscplan.parse_ds_env(text)
    assert env["DS_ACCELERATOR"] == "cpu" and env["NCCL_IB_DISABLE"] == "1"
    assert env["DEEPSPEED_TIMEOUT"] == "30" and "NCCL_TIMEOUT" not in env
    assert env["DSC_RUN_ID"] == "t-zero3" and env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"]
    for h in cluster.info["hosts"]:
        addr = cluster.exec(h["name"], f"ip -4 -o addr show dev {env['GLOO_SOCKET_IFNAME']}").stdout
        assert f"inet {h['ip']}/" in addr


def rename_interface(cluster, node, old, new):
    """ip link's rename (the link goes down for it), the default route put back on the new name."""
    cluster.exec(node, f"r=$(ip route show default | sed 's/ dev [^ ]*//'); ip link set {old} down && "
                       f"ip link set {old} name {new} && ip link set {new} up && "
                       f"{{ [ -z \"$r\" ] || ip route replace $r dev {new}; }}")


def test_a_node_whose_interface_has_another_name_gets_its_own(provisioned, cluster):
    """The worker's training address on an interface of another name than the master's: each
    node's ranks get their own NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME (the entry shim, by
    CROSS_RANK). gloo opens a device for each name it is given: one list for every node
    (eth0,dsc9) fails on both nodes, so training across them proves each got its own."""
    worker, run_id = cluster.names[1], "t-ifname"
    for n in cluster.names:
        cluster.exec(n, f"rm -rf /opt/dscluster/runs/{run_id}")
    rename_interface(cluster, worker, "eth0", "dsc9")
    try:
        r = cluster.playbook("launch.yml", "-e", "preset=zero2", "-e", "follow=true", "-e", f"run_id={run_id}",
                             *tc(steps=4, save_every=100))
        assert r.returncode == 0, r.output[-6000:]
        row = next(line for line in r.output.splitlines() if "rank network" in line and worker in line)
        assert "NCCL_SOCKET_IFNAME=dsc9, GLOO_SOCKET_IFNAME=dsc9 (this node's own" in row, row
        env = dscplan.parse_ds_env(cluster.exec(cluster.master, f"cat /opt/dscluster/runs/{run_id}/.deepspeed_env").stdout)
        assert env["DSC_NODE_GLOO_SOCKET_IFNAME"] == env["DSC_NODE_NCCL_SOCKET_IFNAME"] == "eth0/dsc9"
        assert "GLOO_SOCKET_IFNAME" not in env
        assert cluster.run_status(run_id)["last"]["step"] == 4
    finally:
        rename_interface(cluster, worker, "dsc9", "eth0")


def test_status_says_finished(zero3_run, cluster):
    """Workers have no launcher of their own: their rows come from the exit code the supervisor
    records on every node."""
    wait(lambda: all(cluster.exec(n, "test -f /opt/dscluster/runs/t-zero3/exit_code", check=False).returncode == 0
                     for n in cluster.names), 60, "the exit code on every node")
    r = cluster.playbook("status.yml", "-e", "run_id=t-zero3")
    assert r.returncode == 0, r.output[-3000:]
    assert "run t-zero3: finished" in r.output
    assert "step 12" in r.output
    for n in cluster.names:
        assert f"{n}: finished" in r.output, r.output[-3000:]


def test_a_used_run_directory_is_not_reused(zero3_run, cluster):
    r = cluster.playbook("launch.yml", "-e", "preset=zero3", "-e", "run_id=t-zero3")
    assert r.returncode != 0
    assert "already holds a run" in r.output and "resume.yml -e run_id=t-zero3" in r.output


# Every preset through DeepSpeed's config classes: tests/local/test_ds_config.py. Here the dry run
# of the preset with the most in it: the check ran on the master, the files on the nodes.
@pytest.mark.parametrize("preset", ["zero3-offload"])
def test_a_dry_run_writes_a_config_deepspeed_accepts_and_the_hostfile(provisioned, cluster, preset):
    r = cluster.playbook("launch.yml", "-e", f"preset={preset}", "-e", "dry_run=true", "-e", f"run_id=dry-{preset}",
                         "-e", "preflight=false")
    assert r.returncode == 0, r.output[-3000:]
    assert "Check the ds_config with DeepSpeed's own config classes" in r.output
    cfg = json.loads(cluster.exec(cluster.master, f"cat /opt/dscluster/runs/dry-{preset}/ds_config.json").stdout)
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 2
    assert cfg["zero_optimization"]["stage"] == int(preset[4])
    assert ("offload_optimizer" in cfg["zero_optimization"]) == preset.endswith("offload")
    hostfile = cluster.exec(cluster.master, f"cat /opt/dscluster/runs/dry-{preset}/hostfile").stdout
    assert [line for line in hostfile.splitlines() if not line.startswith("#")] == ["node1 slots=1", "node2 slots=1"]


def test_stop_ends_every_rank_and_resume_continues(provisioned, cluster, figures):
    ended = False
    try:
        _stop_and_resume(cluster, figures)
        ended = True  # resumed and followed to its end: nothing of t-long is left for stop.yml
    finally:
        if not ended:
            cluster.playbook("stop.yml", "-e", "run_id=t-long")


def _stop_and_resume(cluster, figures):
    for n in cluster.names:
        cluster.exec(n, "rm -rf /opt/dscluster/runs/t-long")
    # No preflight here (a later resume's preflight is the one this test reads).
    r = cluster.playbook("launch.yml", "-e", "preset=zero2", "-e", "run_id=t-long", "-e", "preflight=false",
                         *tc(**UNTIL_STOPPED, save_every=10))
    assert r.returncode == 0, r.output[-4000:]
    cluster.wait_checkpoint("t-long", 10)
    assert all(run_procs(cluster, n, "t-long") for n in cluster.names), "ranks should run on every node"
    # train.run's min_step_s: each logged step at least 0.1 s after the one before
    rows = cluster.exec(cluster.master, "head -10 /opt/dscluster/runs/t-long/metrics.jsonl").stdout.splitlines()
    times = [json.loads(x)["time"] for x in rows]
    assert len(times) == 10 and min(b - a for a, b in itertools.pairwise(times)) >= UNTIL_STOPPED["min_step_s"] - 0.005, times
    # a second launch while it runs is refused: test_faults.py's f-drop and test_privilege.py's ops-1
    _a_dry_run_changes_nothing_outside_its_run_dir(cluster)
    again = cluster.playbook("resume.yml", "-e", "run_id=t-long")
    assert again.returncode != 0 and "run_id 't-long' is still running on node1" in again.output
    stop = cluster.playbook("stop.yml")  # no run_id: the active run
    assert stop.returncode == 0 and "processes of run t-long; none left" in stop.output, stop.output[-3000:]
    for n in cluster.names:
        assert run_procs(cluster, n, "t-long") == []
        ps = cluster.exec(n, "ps -eo args | grep -c '[t]rain.run' || true").stdout.strip()
        assert ps == "0", f"{n}: {ps} training processes left"
    status = cluster.playbook("status.yml", "-e", "run_id=t-long")
    assert "run t-long: stopped" in status.output
    for n in cluster.names:  # every row from that node's own record, workers included
        assert f"{n}: stopped, ranks alive 0" in status.output, status.output[-3000:]
    saved = max(set.intersection(*(cluster.complete_steps(n, "t-long") for n in cluster.names)))
    none_active = cluster.playbook("stop.yml")
    assert none_active.returncode != 0 and "No run is active on node1" in none_active.output \
        and "t-long" in none_active.output, none_active.output[-2000:]
    _a_stale_op_build_lock_fails_preflight_until_stop_removes_it(cluster)
    res = cluster.playbook("resume.yml", "-e", "follow=true", "-e", "follow_every_s=2", "-e", "preflight=false",
                           "-e", "run_id=t-long", "-e", f"steps={saved + 4}")
    assert res.returncode == 0, res.output[-4000:]
    # each node's state is the resumed attempt's: the worker's ranks never train under the last
    # attempt's end (the exit code of the stop, written to every node)
    polls = [x for x in res.output.splitlines() if x.startswith("run t-long: running, ") and " nodes " in x]
    assert polls and not [x for x in polls if ":stopped" in x or ":failed" in x], polls
    summary = json.loads(cluster.exec(cluster.master, "cat /opt/dscluster/runs/t-long/summary.json").stdout)
    assert summary["start_step"] == saved and summary["steps"] == saved + 4
    log = cluster.exec(cluster.master, "cat /opt/dscluster/runs/t-long/launcher.log").stdout
    assert "resume: loaded" in log
    finished = cluster.playbook("resume.yml", "-e", "run_id=t-long")
    assert finished.returncode != 0 and "run_id 't-long' finished on node1" in finished.output \
        and "-e steps=N to train it on" in finished.output, finished.output[-2000:]
    end = saved + 4
    _the_worker_wiped_gets_its_part_back_from_the_masters_copy(cluster, figures, f"step{end}")
    # trained on to a new end, its own configuration kept, from the checkpoint it ended with
    further = cluster.playbook("resume.yml", "-e", "follow=true", "-e", "preflight=false", "-e", "run_id=t-long",
                               "-e", f"steps={saved + 8}")
    assert further.returncode == 0 and f"Run t-long finished at step {saved + 8}." in further.output, further.output[-4000:]
    summary = json.loads(cluster.exec(cluster.master, "cat /opt/dscluster/runs/t-long/summary.json").stdout)
    assert summary["start_step"] == saved + 4 and summary["steps"] == saved + 8, summary
    log = cluster.exec(cluster.master, "cat /opt/dscluster/runs/t-long/launcher.log").stdout
    assert f"[dsc_node] checkpoint step{end}: node2's part put back from its copy on node1" in log, log[-3000:]
    for n in cluster.names:  # the end every later resume or restart of the run starts from
        kept = json.loads(cluster.exec(n, "cat /opt/dscluster/runs/t-long/train.json").stdout)
        assert kept == dict(TINY, **dict(UNTIL_STOPPED, steps=saved + 8), save_every=10), (n, kept)


def _the_worker_wiped_gets_its_part_back_from_the_masters_copy(cluster, figures, tag):
    """Each node's part of the run's last checkpoint is kept on the other node before the run's
    end is recorded; the worker's checkpoints then go (a replaced disk)."""
    ckpt = "/opt/dscluster/runs/t-long/checkpoints"
    digest = "find . -type f ! -path './.dsc_parts/*' | sort | xargs sha256sum"
    for node, keeper in (("node1", "node2"), ("node2", "node1")):
        own = cluster.exec(node, f"cd {ckpt}/{tag} && {digest}").stdout
        kept = cluster.exec(keeper, f"cd {ckpt}/{tag}/.dsc_parts/{node} && {digest}").stdout
        assert own and kept == own and "COMPLETE" in own, (node, own, kept)
    rows = [json.loads(x) for x in cluster.exec(cluster.master, "cat /opt/dscluster/runs/t-long/copies.jsonl").stdout.splitlines()]
    last = rows[-1]
    assert last["tag"] == tag and last["kept"] == ["node1's on node2", "node2's on node1"] and not last["failed"], last
    figures("checkpoint copies", copies=len(rows), bytes=last["bytes"], seconds=last["seconds"])
    cluster.exec("node2", f"rm -rf {ckpt}")


def test_a_users_own_ds_config_is_used_and_validated_by_deepspeed(provisioned, cluster, tmp_path):
    """File mode: the user's config reaches every node as written (no preset, optimizer or batch
    of the toolkit's; its csv monitor and node-local checkpoints only), and DeepSpeed's own config
    classes accept it (dry run)."""
    own = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
           "zero_optimization": {"stage": 1}}
    (tmp_path / "ds_config.json").write_text(json.dumps(own))
    r = cluster.playbook("launch.yml", "-e", "dry_run=true", "-e", "run_id=dry-own-config", "-e", "preflight=false",
                         "-e", "dsc_ds_config_mode=file", "-e", f"dsc_ds_config_file={tmp_path}/ds_config.json")
    assert r.returncode == 0, r.output[-3000:]
    assert "Check the ds_config with DeepSpeed's own config classes" in r.output
    for n in cluster.names:
        got = json.loads(cluster.exec(n, "cat /opt/dscluster/runs/dry-own-config/ds_config.json").stdout)
        # the toolkit adds only DeepSpeed's csv monitor and node-local checkpoint storage
        assert got.pop("csv_monitor")["output_path"] == "/opt/dscluster/runs/dry-own-config/monitor/"
        assert got.pop("checkpoint") == {"use_node_local_storage": True}
        assert got == own


def _a_dry_run_changes_nothing_outside_its_run_dir(cluster):
    """With a run active: a dry run, even with replace=true, leaves it training and writes only its
    own run dir."""
    for n in cluster.names:
        cluster.exec(n, "touch /tmp/dry-marker")
    time.sleep(1)  # what the dry run writes is newer than every node's marker
    dry = cluster.playbook("launch.yml", "-e", "run_id=t-dry", "-e", "dry_run=true", "-e", "replace=true")
    assert dry.returncode == 0, dry.output[-3000:]
    for n in cluster.names:
        assert run_procs(cluster, n, "t-long"), f"the dry run stopped t-long on {n}"
        # Aside: runtime state (/run: sshd's motd, ufw's lock), logs, Ansible's own temp and async
        # files, the active run's directory, bytecode caches.
        changed = cluster.exec(n, "find / -xdev -newer /tmp/dry-marker -type f "
                                  "-not -path '/proc/*' -not -path '/tmp/*' -not -path '/run/*' -not -path '/var/log/*' "
                                  "-not -path '*/.ansible/tmp/*' -not -path '*/.ansible_async/*' "
                                  "-not -path '/opt/dscluster/runs/t-long/*' "
                                  "-not -path '/opt/dscluster/runs/t-dry/*' -not -name '*.pyc'").stdout.split()
        assert changed == [], f"{n}: a dry run wrote {changed}"
        assert cluster.exec(n, "test -f /opt/dscluster/runs/t-dry/ds_config.json", check=False).returncode == 0


def _a_stale_op_build_lock_fails_preflight_until_stop_removes_it(cluster):
    """A rank killed mid-build leaves torch's lock: every later build on that node would wait for
    it forever. The launch's preflight refuses, naming it; stop.yml removes it."""
    worker, lock = cluster.names[1], "/opt/dscluster/cache/torch_extensions/killed_op/lock"
    cluster.exec(worker, f"mkdir -p {lock.rsplit('/', 1)[0]} && touch -d '-10 min' {lock}", user="dstrain")
    refused = cluster.playbook("resume.yml", "-e", "run_id=t-long")
    assert refused.returncode != 0 and "stale op-build lock" in refused.output and lock in refused.output, \
        refused.output[-3000:]
    stop = cluster.playbook("stop.yml", "-e", "run_id=t-long")
    assert stop.returncode == 0 and f"Removed stale op-build locks: {lock}" in stop.output, stop.output[-3000:]
    assert cluster.exec(worker, f"test -e {lock}", check=False).returncode != 0
