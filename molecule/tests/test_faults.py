"""Runs that survive faults, on the container cluster: a killed rank, a dead worker, a dropped
connection, a busy port, a second launch, a stop during a checkpoint write, automatic restart.
Each test measures what it claims and leaves nothing running (stop.yml in `finally`, unless the
test saw every process of its runs end)."""
import json
import subprocess
import time

import cluster as testcluster
from cluster import TINY, UNTIL_STOPPED, wait

RUNS = "/opt/dscluster/runs"
# A dead node must not leave the others blocked in a collective: the bound documented in
# docs/runs.md, "When something fails" (detection through pdsh and ssh keep-alives, then a
# teardown on every node).
EXIT_BOUND_S = {"rank": 30, "node": 60}


def launch(cluster, run_id, train, *extra, preset="zero2", follow=False, preflight=False):
    """A tiny run with train.run's settings `train` (steps, save_every; UNTIL_STOPPED's for a run
    the test ends itself); launch's preflight only where a test reads it (each costs seconds of
    CPU, and test_preflight.py covers it)."""
    for n in cluster.names:
        cluster.exec(n, f"rm -rf {RUNS}/{run_id}", check=False)
    r = cluster.playbook("launch.yml", "-e", f"preset={preset}", "-e", f"run_id={run_id}",
                         "-e", f"follow={str(follow).lower()}", "-e", f"preflight={str(preflight).lower()}",
                         "-e", json.dumps({"dsc_train_config": dict(TINY, **train)}),
                         *extra)
    assert r.returncode == 0, r.output[-5000:]
    return r




def nothing_left(cluster, nodes, run_id, only_this_run=False):
    """No process of the run (by its marker) and, unless another run is meant to be running, no
    training or launcher process at all on the nodes."""
    return all(cluster.procs(n, run_id) == [] and (only_this_run or
               cluster.exec(n, "pgrep -f '[t]rain.run|[d]eepspeed.launcher' || true").stdout.strip() == "")
               for n in nodes)


def test_killed_rank_ends_the_run_everywhere_naming_its_node(provisioned, cluster, figures):
    run_id, worker, ended = "f-kill", cluster.names[1], False
    try:
        launch(cluster, run_id, dict(UNTIL_STOPPED, save_every=5))
        cluster.wait_checkpoint(run_id, 5)
        victim = wait(lambda: cluster.rank_pids(worker, run_id), 30, "a rank on the worker")[0]
        t0 = time.time()
        cluster.exec(worker, f"kill -9 {victim}")
        wait(lambda: nothing_left(cluster, cluster.names, run_id), EXIT_BOUND_S["rank"],
             "every process of the run to exit")
        elapsed = time.time() - t0
        figures("rank killed", seconds_to_last_exit=round(elapsed, 1), node=worker)
        st = wait(lambda: (s := cluster.run_status(run_id))["state"] == "failed" and s, 30, "state failed")
        # status.yml's rendering of a failed run and its first error: the dead worker's below
        assert st["failed_node"] == worker and "killed by SIGKILL" in st["first_error"], st
        ended = True  # every process gone (resuming a failed run: test_launch's t-long, the no_ssh and Slurm runs)
    finally:
        if not ended:
            cluster.playbook("stop.yml", "-e", f"run_id={run_id}")


def test_dead_worker_ends_the_run_on_the_master(provisioned, cluster, figures):
    run_id, worker = "f-down", cluster.names[1]
    firewall = cluster.exec(worker, "ufw status verbose").stdout
    assert "Status: active" in firewall, firewall
    try:
        launch(cluster, run_id, dict(UNTIL_STOPPED, save_every=5))
        cluster.wait_checkpoint(run_id, 5)
        t0 = time.time()
        subprocess.run(["podman", "stop", "-t", "0", testcluster.PREFIX + worker], check=True, capture_output=True)
        wait(lambda: nothing_left(cluster, [cluster.master], run_id), EXIT_BOUND_S["node"],
             "every process of the run on the master to exit")
        elapsed = time.time() - t0
        figures("worker stopped", seconds_to_last_exit=round(elapsed, 1), node=worker)
        st = wait(lambda: (s := cluster.run_status(run_id))["state"] == "failed" and s, 30, "state failed")
        assert st["failed_node"] == worker and f"connection to {worker} was lost" in st["first_error"], st
        shown = cluster.playbook("status.yml", "-e", f"run_id={run_id}")
        assert f"run {run_id}: failed - first error: the connection to {worker} was lost" in shown.output, \
            shown.output[-3000:]
        assert f"{worker}: unreachable" in shown.output, shown.output[-3000:]
    finally:
        cluster.start_again(worker)
        # The node is back as after a reboot: its firewall loaded from its files by ufw's boot
        # script (the container's start, molecule/cluster.py), the same rules as before (nothing
        # on disk was lost), and nothing of the run survived on it.
        assert cluster.exec(worker, "ufw status verbose").stdout == firewall, firewall
        # Nothing of the run on any node: no stop.yml needed after this.
        assert nothing_left(cluster, cluster.names, run_id)


def test_a_run_survives_a_dropped_connection_and_its_replacement_stopped_mid_checkpoint_resumes(provisioned, cluster,
                                                                                                figures):
    """f-drop trains on through dropped SSH sessions; a second launch is refused until it says
    replace=true. The run that replaces it, f-second, is then stopped inside a checkpoint write,
    held open deterministically (the file the master's rank 0 writes is a FIFO with no reader:
    storage that stalls), and resumes from the checkpoint before it (one start for both faults)."""
    first, run_id, every, ended = "f-drop", "f-second", 4, False
    try:
        launch(cluster, first, dict(UNTIL_STOPPED, save_every=1000))
        wait(lambda: cluster.run_status(first)["last"], 120, "a first logged step")
        # Drop every SSH session from the control node (Ansible's persistent ones included).
        for n in cluster.names:
            cluster.exec(n, "pkill -f '[s]shd: root' || true")
        before = cluster.run_status(first)["last"]["step"]
        wait(lambda: cluster.run_status(first)["last"]["step"] > before + 2, 60, "steps after the drop")
        st = cluster.playbook("status.yml", "-e", f"run_id={first}")
        assert st.returncode == 0 and f"run {first}: running" in st.output, st.output[-3000:]
        second = cluster.playbook("launch.yml", "-e", f"run_id={run_id}")
        assert second.returncode != 0 and f"run {first} is active on {cluster.master}" in second.output
        assert "-e replace=true" in second.output
        assert all(v.get("changed", 0) == 0 for v in second.recap.values()), second.recap
        replaced = launch(cluster, run_id, dict(UNTIL_STOPPED, save_every=every), "-e", "replace=true")
        assert f"replacing run {first}" in replaced.output, replaced.output[-3000:]
        assert nothing_left(cluster, cluster.names, first, only_this_run=True)
        assert wait(lambda: cluster.rank_pids(cluster.names[1], run_id), 60, "the new run's ranks")
        cluster.wait_checkpoint(run_id, 2 * every)
        now = cluster.run_status(run_id)["last"]["step"]
        # 12 saves ahead: about 5 s at this run's pace (0.1 s a step, a checkpoint, fsynced,
        # every 4 steps), and the FIFO is in place one podman exec from now.
        stuck = (now // every + 12) * every
        cluster.exec(cluster.master, f"mkdir -p {RUNS}/{run_id}/checkpoints/step{stuck} && "
                                     f"mkfifo {RUNS}/{run_id}/checkpoints/step{stuck}/mp_rank_00_model_states.pt",
                     user="dstrain")
        wait(lambda: cluster.run_status(run_id)["last"]["step"] == stuck, 120, f"the run to reach step {stuck}")
        time.sleep(3)  # every rank is now inside save(): the master's write blocks, the others wait
        assert cluster.run_status(run_id)["last"]["step"] == stuck
        stop = cluster.playbook("stop.yml", "-e", f"run_id={run_id}")
        assert stop.returncode == 0, stop.output[-3000:]
        assert nothing_left(cluster, cluster.names, run_id)
        complete = set.intersection(*(cluster.complete_steps(n, run_id) for n in cluster.names))
        assert stuck not in complete and max(complete) == stuck - every, sorted(complete)[-3:]
        res = cluster.playbook("resume.yml", "-e", f"run_id={run_id}", "-e", "follow=true", "-e", "preflight=false",
                               "-e", json.dumps({"dsc_entry_args": ["--set", f"steps={stuck - 2}"]}))
        assert res.returncode == 0, res.output[-4000:]
        ended = True  # followed to its end: nothing of the run is left for stop.yml
        log = cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/launcher.log").stdout
        previous = stuck - every
        assert f"resume: loaded {RUNS}/{run_id}/checkpoints/step{previous} (step {previous})" in log
        figures("stop during checkpoint write", half_written_step=stuck, resumed_from=previous)
    finally:
        if not ended:
            cluster.playbook("stop.yml", "-e", f"run_id={first}")
            cluster.playbook("stop.yml", "-e", f"run_id={run_id}")


def _hold_port(cluster, port):
    code = (f"import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('0.0.0.0', {port})); s.listen(1); "
            f"open('/tmp/hold{port}','w').close(); time.sleep(600)")
    cluster.exec(cluster.master, f"rm -f /tmp/hold{port}; (nohup python3 -c \"{code}\" >/dev/null 2>&1 &); "
                                 f"for i in $(seq 50); do test -f /tmp/hold{port} && break; sleep 0.1; done; "
                                 f"test -f /tmp/hold{port}")


def test_busy_master_port_takes_the_next_retention_keeps_n_and_an_exhausted_range_says_so(provisioned, cluster,
                                                                                            figures):
    """A run whose master port is taken trains on the next one; its retention keeps the newest
    keep_checkpoints complete checkpoints on every node; a range with no free port is refused."""
    _hold_port(cluster, 29500)
    try:
        # saves at steps 5, 10, 15 and the final 20: the two oldest pruned
        r = launch(cluster, "f-port", {"steps": 20, "save_every": 5, "keep_checkpoints": 2}, follow=True,
                   preflight=True)
        assert cluster.exec(cluster.master, f"cat {RUNS}/f-port/master_port").stdout.strip() == "29501"
        assert "--master_port=29501" in cluster.exec(cluster.master, f"cat {RUNS}/f-port/launcher.log").stdout
        assert "launch will take 29501" in r.output  # the preflight warning
        for n in cluster.names:
            ls = cluster.exec(n, f"ls {RUNS}/f-port/checkpoints").stdout.split()
            assert sorted(d for d in ls if d.startswith("step")) == ["step15", "step20"], (n, ls)
        narrow = ["-e", "dsc_master_port_last=29500", "-e", "run_id=f-full", "-e", "dry_run=true"]
        checked = cluster.playbook("launch.yml", *narrow)
        assert checked.returncode != 0 and "every port 29500-29500 is in use on node1" in checked.output
        unchecked = cluster.playbook("launch.yml", *narrow[:-2], "-e", "preflight=false")
        assert unchecked.returncode != 0
        assert "did not start on node1: every master port from 29500 to 29500 is in use" in unchecked.output
    finally:
        cluster.exec(cluster.master, "pkill -f 'time.sleep\\(600\\)'", check=False)


SMALL = "/mnt/small/runs"  # a 16 MiB tmpfs on every node (molecule/cluster.py)


def test_a_full_run_root_fails_the_run_with_its_reason(provisioned, cluster, figures):
    """A run root that fills up fails the run before a save, with the reason, an exit code and its
    restarts; filled to the last byte mid-run, the run fails with an exit code all the same."""
    for n in cluster.names:
        cluster.exec(n, f"rm -rf {SMALL} && install -d -o dstrain -g dstrain {SMALL}")

    # No preflight (its disk row wants 20 GiB free): the run's own check before each save is tested.
    def run(run_id, **train):
        return cluster.playbook("launch.yml", "-e", f"run_id={run_id}", "-e", f"dsc_run_root={SMALL}",
                                "-e", "preflight=false",
                                "-e", "follow=true", "-e", "max_restarts=1", "-e", "restart_backoff_s=1",
                                "-e", json.dumps({"dsc_train_config": dict(TINY, **train)}))
    ended = False
    try:
        full = run("small-full", steps=100000, save_every=2, keep_checkpoints=1000)
        assert full.returncode != 0
        st = cluster.run_status("small-full", root=SMALL)
        assert st["state"] == "failed" and st["exit_code"] not in (None, "0") and st["restarts"] == 1, st
        assert "needs" in st["first_error"] and "GiB free" in st["first_error"] and "Fix:" in st["first_error"], st
        figures("full run root", first_error=st["first_error"][:300], restarts=st["restarts"])
        # Filled to the last byte mid-run: the ranks fail on their writes, the supervisor still
        # records an exit code (in the room it reserved at the start).
        for n in cluster.names:
            cluster.exec(n, f"rm -rf {SMALL}/small-full")
        filled = cluster.playbook("launch.yml", "-e", "run_id=small-fill", "-e", f"dsc_run_root={SMALL}",
                                  "-e", "preflight=false",
                                  "-e", json.dumps({"dsc_train_config": dict(TINY, **UNTIL_STOPPED, save_every=100000)}))
        assert filled.returncode == 0, filled.output[-3000:]
        wait(lambda: (cluster.run_status("small-fill", root=SMALL).get("last") or {}).get("step", 0) > 2, 240,
             "small-fill training")
        cluster.exec(cluster.master, f"dd if=/dev/zero of={SMALL}/filler bs=64k 2>/dev/null; true", user="dstrain")
        st = wait(lambda: (s := cluster.run_status("small-fill", root=SMALL))["state"] not in ("running", "stalled")
                  and s, 240, "small-fill to end on the full disk")
        assert st["state"] == "failed" and st["exit_code"] not in (None, "0"), st
        ended = True  # both runs' supervisors recorded their ends: nothing left for stop.yml
        figures("disk filled mid-run", state=st["state"], exit_code=st["exit_code"], first_error=(st["first_error"] or "")[:200])
    finally:
        if not ended:
            cluster.playbook("stop.yml", "-e", "run_id=small-fill", "-e", f"dsc_run_root={SMALL}")
            cluster.playbook("stop.yml", "-e", "run_id=small-full", "-e", f"dsc_run_root={SMALL}")
        for n in cluster.names:
            cluster.exec(n, f"rm -rf {SMALL}/*", check=False)


def test_one_node_failing_mid_provision_stops_every_node_naming_it(provisioned, cluster):
    """A node whose op build fails (here: its cached FusedAdam library corrupted, so loading it
    fails on that node only) ends provision.yml on every node at that task, naming the node,
    never a template error about the failed node's missing facts later on."""
    worker = cluster.names[-1]
    lib = cluster.exec(worker, "find /opt/dscluster/cache/torch_extensions -name 'fused_adam*.so' | head -1").stdout.strip()
    assert lib, "no built FusedAdam on the provisioned node"
    cluster.exec(worker, f"cp -p {lib} {lib}.keep && truncate -s 64 {lib}")
    try:
        r = cluster.playbook("provision.yml")
        assert r.returncode != 0, r.output[-3000:]
        assert "TASK [deepspeed : Warm the JIT op cache" in r.output, r.output[-4000:]
        after = r.output.split("TASK [deepspeed : Warm the JIT op cache", 1)[1]
        assert f"fatal: [{worker}]" in after and "fatal: [node1]" not in r.output, r.output[-4000:]
        # every node stopped at that task: no later task or play ran anywhere (the report play's
        # table among them), and no template error about the failed node's facts
        assert "TASK [" not in after and "PLAY [" not in after, after[-3000:]
        assert "HostVarsVars" not in r.output
    finally:
        cluster.exec(worker, f"mv {lib}.keep {lib}")
