"""Run control that never lies, on the container cluster (nodes without SYS_PTRACE): one run never
touches another, every node's status row reads its own record, and inventory mistakes fail
loudly before anything changes."""
import json
import threading

from cluster import PREFIX, TINY, UNTIL_STOPPED, addr, sh, wait
import cluster as tc

RUNS = "/opt/dscluster/runs"
OTHER_ROOT = "/opt/dscluster/runs-b"


def procs(cluster, node, run_id):
    r = cluster.exec(node, f"/usr/local/lib/dscluster/dsc_node.pyz procs {run_id}", user="dstrain", check=False)
    assert r.returncode == 0, r.stdout + r.stderr  # a lookup that cannot see is an error
    return json.loads(r.stdout)


def until_stopped(**train):
    """launch.yml's -e for a tiny paced run that the test ends itself (UNTIL_STOPPED, no checkpoint
    of its own), with train.run's settings `train` on top; no preflight: the runs are what these
    tests read."""
    return ["-e", json.dumps({"dsc_train_config": dict(TINY, **UNTIL_STOPPED, save_every=100000, **train)}),
            "-e", "preflight=false"]


def last_step(cluster, root, run_id):
    r = cluster.exec(cluster.master, f"tail -1 {root}/{run_id}/metrics.jsonl 2>/dev/null", check=False)
    return json.loads(r.stdout)["step"] if r.stdout.strip() else 0


def test_stopping_one_run_leaves_another_training(provisioned, cluster):
    """Two runs alive at once (two run roots, so each has its own lock and active run; ports
    29500 and 29501): stopping the first must not end the second (DeepSpeed's runner, sent
    SIGTERM, would pkill every launcher matching its command line on every node). The first is
    followed (launch.yml -e follow=true): stop.yml ends its follow with rc 0 and "stopped by
    stop.yml at step N" (N the last step logged), and status.yml -e follow=true of it says the same."""
    for n in cluster.names:
        cluster.exec(n, f"rm -rf {RUNS}/rc-a {OTHER_ROOT} && install -d -o dstrain -g dstrain {OTHER_ROOT}")
    train = until_stopped()
    # rc-a logs every 5th step: the follow's end names the last step logged, not the last trained
    train_a = until_stopped(log_every=5)
    followed, a_stopped = {}, False
    launch = threading.Thread(target=lambda: followed.update(r=cluster.playbook(
        "launch.yml", "-e", "run_id=rc-a", "-e", "follow=true", *train_a)))
    launch.start()
    try:
        # rc-a's rendezvous holds its port once it trains; only then is the next port taken
        # (the free-port check is per run root's lock: two roots starting at once can race).
        wait(lambda: last_step(cluster, RUNS, "rc-a") > 2, 240, "rc-a training")
        b = cluster.playbook("launch.yml", "-e", "run_id=rc-b", "-e", f"dsc_run_root={OTHER_ROOT}", *train)
        assert b.returncode == 0, b.output[-3000:]
        assert cluster.exec(cluster.master, f"cat {OTHER_ROOT}/rc-b/master_port").stdout.strip() != \
            cluster.exec(cluster.master, f"cat {RUNS}/rc-a/master_port").stdout.strip()
        wait(lambda: last_step(cluster, RUNS, "rc-a") > 2 and last_step(cluster, OTHER_ROOT, "rc-b") > 2, 240,
             "both runs training")
        stop = cluster.playbook("stop.yml", "-e", "run_id=rc-a")
        assert stop.returncode == 0, stop.output[-3000:]
        for n in cluster.names:
            assert procs(cluster, n, "rc-a") == [], n
            assert any("train.run" in p["cmd"] for p in procs(cluster, n, "rc-b")), f"rc-b lost its rank on {n}"
        a_stopped = True  # no process of rc-a on any node: the stop below is rc-b's alone
        launch.join(300)
        said = f"Run rc-a stopped by stop.yml at step {last_step(cluster, RUNS, 'rc-a')}."
        assert followed["r"].returncode == 0 and said in followed["r"].output, followed["r"].output[-3000:]
        before = last_step(cluster, OTHER_ROOT, "rc-b")
        wait(lambda: last_step(cluster, OTHER_ROOT, "rc-b") > before + 5, 120, "rc-b training on after rc-a's stop")
        status = cluster.playbook("status.yml", "-e", "run_id=rc-b", "-e", f"dsc_run_root={OTHER_ROOT}")
        for n in cluster.names:
            assert f"{n}: running, ranks alive 1" in status.output, status.output[-3000:]
        stopped = cluster.playbook("status.yml", "-e", "run_id=rc-a", "-e", "follow=true")
        assert stopped.returncode == 0 and said in stopped.output, stopped.output[-3000:]
        for n in cluster.names:
            assert f"{n}: stopped, ranks alive 0" in stopped.output, stopped.output[-3000:]
    finally:
        if not a_stopped:
            cluster.playbook("stop.yml", "-e", "run_id=rc-a")
        cluster.playbook("stop.yml", "-e", "run_id=rc-b", "-e", f"dsc_run_root={OTHER_ROOT}")
        launch.join(60)


def test_no_ssh_mode_trains_across_nodes_stops_everywhere_and_resumes(provisioned, cluster, tmp_path):
    """dsc_launch_mode no_ssh: Ansible starts DeepSpeed's launcher on every node (nothing sshes
    between nodes), the others on the port the master took; each node's row reads its own
    launcher; stop leaves no process of the run on any node; resume trains on to the end."""
    run, no_ssh = "ns-1", ["-e", "dsc_launch_mode=no_ssh"]
    for n in cluster.names:
        cluster.exec(n, f"rm -rf {RUNS}/{run}")
    # Paced as UNTIL_STOPPED's runs (0.1 s a step): 1500 steps outlast the status and the stop.
    train = ["-e", json.dumps({"dsc_train_config": dict(TINY, steps=1500, min_step_s=UNTIL_STOPPED["min_step_s"],
                                                        save_every=10)})]
    ended = False
    try:
        r = cluster.playbook("launch.yml", "-e", f"run_id={run}", *no_ssh, *train)  # with this mode's fast checks
        assert r.returncode == 0, r.output[-3000:]
        ports = {n: cluster.exec(n, f"cat {RUNS}/{run}/master_port").stdout.strip() for n in cluster.names}
        assert len(set(ports.values())) == 1, ports
        for n in cluster.names:  # a launcher of its own on every node, with the whole world
            def log(n=n):
                return cluster.exec(n, f"cat {RUNS}/{run}/launcher.log 2>/dev/null", check=False).stdout
            wait(lambda: "dist_world_size" in log(), 120, f"{n}'s launcher")
            assert f"--node_rank={cluster.names.index(n)}" in log() and "dist_world_size=2" in log(), log()[-2000:]
        wait(lambda: last_step(cluster, RUNS, run) > 25, 240, f"{run} past its second checkpoint")
        status = cluster.playbook("status.yml", "-e", f"run_id={run}", *no_ssh)
        for n in cluster.names:
            assert f"{n}: running, ranks alive 1" in status.output, status.output[-3000:]
        stop = cluster.playbook("stop.yml", "-e", f"run_id={run}", *no_ssh)
        assert stop.returncode == 0, stop.output[-3000:]
        for n in cluster.names:
            assert f"{n}: stopped" in stop.output and procs(cluster, n, run) == [], stop.output[-3000:]
        stopped_at = last_step(cluster, RUNS, run)
        assert stopped_at < 1500
        # On to a nearer end than the launch's 1500 (as resume.yml -e allows): past the stop.
        end = stopped_at + 20
        resume = cluster.playbook("resume.yml", "-e", f"run_id={run}", "-e", "follow=true", "-e", "preflight=false", *no_ssh,
                                  "-e", json.dumps({"dsc_entry_args": ["--set", f"steps={end}"]}))
        assert resume.returncode == 0, resume.output[-3000:]
        assert last_step(cluster, RUNS, run) == end
        for n in cluster.names:
            assert cluster.exec(n, f"cat {RUNS}/{run}/exit_code").stdout.strip() == "0", n
        ended = True  # every node's launcher recorded its end: nothing left for stop.yml
        # each node's own launcher log, read on that node (and fetched from it)
        logs = cluster.playbook("logs.yml", "-e", f"run_id={run}", "-e", "lines=3", *no_ssh,
                                "-e", f"logs_dest={tmp_path}")
        assert logs.returncode == 0, logs.output[-3000:]
        for n in cluster.names:
            assert f"== {n} (last 3 lines)" in logs.output, logs.output[-3000:]
            assert (tmp_path / run / n / "launcher.log").stat().st_size > 0
    finally:
        if not ended:
            cluster.playbook("stop.yml", "-e", f"run_id={run}", *no_ssh)


def test_no_ssh_nodes_resume_from_the_checkpoint_every_node_holds(provisioned, cluster, tmp_path):
    """A {latest:GLOB} resume where every node starts its own launcher: the runs role asks every
    node for its matches and each starts with the newest all hold (molecule/cluster.py says how)."""
    tc.resumed_at_the_checkpoint_every_node_holds(cluster, "ns-latest", tmp_path / "code", cluster.names,
                                                  mode=["-e", "dsc_launch_mode=no_ssh"])


def _inventory(cluster, folder, hosts):
    """An edited copy of the cluster's inventory: these hosts, its own group_vars."""
    folder.mkdir(parents=True)
    (folder / "hosts.yml").write_text(json.dumps({"all": {"children": {"cluster": {"hosts": hosts}}}}))
    (folder / "group_vars").symlink_to(cluster.inventory / "group_vars")
    return folder


def _hosts(cluster):
    return {h["name"]: {"ansible_host": h["ip"], "ansible_port": h["port"], "dsc_slots": 1}
            for h in cluster.info["hosts"]}


def test_inventory_mistakes_fail_loudly_and_change_nothing(provisioned, cluster, tmp_path):
    first, second = cluster.names[0], cluster.names[1]
    twice = _hosts(cluster)
    twice["node1b"] = dict(twice[first], dsc_addr=addr(201))
    down = _hosts(cluster)
    down[second]["ansible_host"] = addr(250)  # in the test network, held by no container
    cases = [
        (_inventory(cluster, tmp_path / "empty", {}), [], "has no host in the group 'cluster'"),
        (tmp_path / "no-such-inventory", [], "has no host in the group 'cluster'"),
        (_inventory(cluster, tmp_path / "twice", twice), [],
         f"ansible_host on host node1b is {twice[first]['ansible_host']}"),
        (_inventory(cluster, tmp_path / "down", down), [], f"host {second} could not be probed"),
        (cluster.inventory, ["--limit", first], f"--limit leaves out {second}"),
    ]
    saved = cluster.inventory
    try:
        for inventory, args, needle in cases:
            cluster.inventory = inventory
            r = cluster.playbook("provision.yml", *args, timeout=300)
            assert r.returncode != 0, (inventory, r.output[-2000:])
            assert needle in r.output, (inventory, r.output[-2000:])
            assert "Make every node identical" not in r.output, inventory
            assert all(v.get("changed", 0) == 0 for v in r.recap.values()), (inventory, r.recap)
    finally:
        cluster.inventory = saved


def test_an_iperf3_pair_that_cannot_be_measured_is_a_warn_row_saying_why(provisioned, cluster, tmp_path, figures):
    """preflight.yml's iperf3 pairs, each broken its own way: on the worker a loop kills every
    iperf3 (the server of ours dies under the node helper, the pair to it is a WARN row); on the
    master another local user listens on iperf3's port first (no server of ours starts there, the
    pair to it is named with who holds the port, and nothing is sent to the squatter)."""
    master, worker, pid_file = cluster.names[0], cluster.names[1], "/tmp/iperf3-killer.pid"
    squat = ("import socket; s=socket.socket(); s.bind(('0.0.0.0', 5201)); s.listen(1); s.settimeout(300); "
             "open('/tmp/squat.ready','w').close()\ntry:\n c,_=s.accept(); open('/tmp/squat.hit','w').close()\n"
             "except OSError: pass")
    cluster.exec(master, "id eve >/dev/null 2>&1 || useradd -m eve; rm -f /tmp/squat.ready /tmp/squat.hit")
    cluster.exec(master, f"(nohup python3 -c \"{squat}\" >/dev/null 2>&1 &); for i in $(seq 50); do "
                         "test -f /tmp/squat.ready && break; sleep 0.1; done; test -f /tmp/squat.ready", user="eve")
    # A loop on the worker kills its iperf3 every 0.3 s until the preflight is over.
    sh("podman", "exec", "-d", PREFIX + worker, "sh", "-c",
       f"echo $$ > {pid_file}; while :; do pkill -x iperf3; sleep 0.3; done")
    try:
        wait(lambda: cluster.exec(worker, f"test -s {pid_file}", check=False).returncode == 0, 30, "the iperf3 killer")
        r = cluster.playbook("preflight.yml", "-e", f"preflight_report_dir={tmp_path}")
        hit = cluster.exec(master, "test -e /tmp/squat.hit", check=False).returncode == 0
    finally:
        cluster.exec(worker, f"kill $(cat {pid_file}) && rm -f {pid_file}", check=False)
        cluster.exec(master, "pkill -u eve -f squat.ready", check=False)
    report = json.loads((tmp_path / "preflight-testcluster-latest.json").read_text())
    rows = {x["node"]: x for x in report["checks"] if x["check"] == "iperf3"}
    assert rows[master]["status"] == "WARN" and rows[master]["detail"], report["checks"]
    squatted = rows[worker]
    assert squatted["status"] == "WARN" and squatted["detail"] == (
        f"{worker} -> {master}: port 5201 on {master}: another process listens on it already; it is held by "
        f"a process of eve") and squatted["fix"] == "end that process, or set preflight_iperf_port to a free port", squatted
    assert not hit, "the client measured the squatter's server"
    figures("preflight fault", fault="another user on the iperf3 port", check="iperf3", node=worker,
            status=squatted["status"], detail=squatted["detail"], fix=squatted["fix"])
    s = report["summary"]
    assert s["pass"] + s["warn"] + s["fail"] == len(report["checks"])
    assert f"{s['pass']} passed, {s['warn']} warnings, {s['fail']} failed" in r.output


def test_a_failing_script_shows_its_first_exception_and_traceback(provisioned, cluster, tmp_path):
    """The failure text of the latest attempt: the exception line with the node that printed it
    and that rank's traceback, at the end of follow and in status."""
    (tmp_path / "boom.py").write_text(
        "import os\n\n\ndef main():\n"
        "    raise ValueError('bad shape (3, 4) on rank ' + os.environ.get('RANK', '?'))\n\n\nmain()\n")
    r = cluster.playbook("launch.yml", "-e", "run_id=rc-boom", "-e", "follow=true", "-e", "preflight=false",
                         "-e", f"dsc_code_dir={tmp_path}",
                         "-e", "dsc_entry_script=boom.py", "-e", "dsc_ds_config_mode=none")
    assert r.returncode != 0
    assert "Run rc-boom failed" in r.output and "ValueError: bad shape (3, 4) on rank" in r.output, r.output[-3000:]
    assert "Traceback (most recent call last):" in r.output and "in main" in r.output, r.output[-3000:]
    status = cluster.playbook("status.yml", "-e", "run_id=rc-boom")
    assert "run rc-boom: failed" in status.output and "traceback (latest attempt):" in status.output, \
        status.output[-3000:]


def test_runs_lists_every_run_with_its_state(provisioned, cluster):
    """runs.yml after the runs above (and the other test files'): finished, stopped and failed ones
    with their ids, newest first."""
    r = cluster.playbook("runs.yml")
    assert r.returncode == 0, r.output[-3000:]
    rows = {line.split(" | ")[0].strip(' "'): line for line in r.output.splitlines() if " | " in line}
    assert " | finished | " in rows["ns-1"] and " | stopped | " in rows["rc-a"], r.output[-3000:]
    assert " | failed | " in rows["rc-boom"]
    order = [k for k in rows if k in ("rc-a", "ns-1", "rc-boom")]
    assert order == ["rc-boom", "ns-1", "rc-a"], order  # newest first


def test_two_launches_at_once_start_exactly_one_run(provisioned, cluster):
    """Two launch.yml started together pass their plans side by side; the run root's lock lets
    exactly one start, with different run ids and with the same one."""
    train = until_stopped()
    for ids in (["race-a", "race-b"], ["race-same", "race-same"]):
        for n in cluster.names:
            cluster.exec(n, f"rm -rf {' '.join(f'{RUNS}/{i}' for i in set(ids))}")
        results, winner = [None, None], None

        def go(k):
            results[k] = cluster.playbook("launch.yml", "-e", f"run_id={ids[k]}", *train)  # noqa: B023 - joined in this iteration
        threads = [threading.Thread(target=go, args=(k,)) for k in (0, 1)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            started = [r for r in results if r.returncode == 0]
            refused = [r for r in results if r.returncode != 0]
            assert len(started) == 1 and len(refused) == 1, [r.output[-1500:] for r in results]
            # Refused by start's lock, or (same id) by write-run once the winner's log exists.
            assert any(why in refused[0].output for why in ("is active", "is already running", "already holds a run")), \
                refused[0].output[-2000:]
            winner = ids[results.index(started[0])]
            supervisors = cluster.exec(cluster.master, "pgrep -u dstrain -fc '[d]sc_node.pyz start' || true").stdout.strip()
            assert supervisors == "1", f"{supervisors} supervisors for {ids}"
            for n in cluster.names:
                wait(lambda: len(cluster.rank_pids(n, winner)) == 1, 120, f"one rank of {winner} on {n}")  # noqa: B023 - called in this iteration
        finally:  # the run that started, or (a check above failed first) both
            for run_id in [winner] if winner else set(ids):
                cluster.playbook("stop.yml", "-e", f"run_id={run_id}")
