"""Runs that survive faults, on the container cluster: a killed rank, a dead worker, a dropped
connection, a busy port, a second launch, a stop during a checkpoint write, automatic restart.
Each test measures what it claims and leaves nothing running (stop.yml in `finally`)."""
import json
import subprocess
import time

import cluster as testcluster

RUNS = "/opt/dscluster/runs"
TINY = {"vocab_size": 512, "seq_len": 64}
# A dead node must not leave the others blocked in a collective: the bound documented in the
# README (detection through pdsh and ssh keep-alives, then a teardown on every node).
EXIT_BOUND_S = {"rank": 30, "node": 60}


def launch(cluster, run_id, steps, save_every, *extra, preset="zero2", follow=False):
    for n in cluster.names:
        cluster.exec(n, f"rm -rf {RUNS}/{run_id}", check=False)
    r = cluster.playbook("launch.yml", "-e", f"preset={preset}", "-e", f"run_id={run_id}",
                         "-e", f"follow={str(follow).lower()}",
                         "-e", json.dumps({"dsc_train_config": dict(TINY, steps=steps, save_every=save_every)}),
                         *extra)
    assert r.returncode == 0, r.output[-5000:]
    return r


def wait(cond, timeout, what, every=0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def complete_steps(cluster, node, run_id):
    r = cluster.exec(node, f"cd {RUNS}/{run_id}/checkpoints 2>/dev/null && ls -d step*/COMPLETE "
                           "| sed 's/step//; s,/COMPLETE,,'", check=False)
    return {int(x) for x in r.stdout.split()}


def wait_checkpoint(cluster, run_id, step, timeout=300):
    wait(lambda: all(step in complete_steps(cluster, n, run_id) for n in cluster.names), timeout,
         f"checkpoint step{step} of {run_id} on every node", every=1)


def procs(cluster, node, run_id):
    r = cluster.exec(node, f"/opt/dscluster/bin/dsc-runctl procs {run_id}", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def rank_pids(cluster, node, run_id):
    return [p["pid"] for p in procs(cluster, node, run_id) or []
            if "-m train.run" in p["cmd"] and "deepspeed.launcher" not in p["cmd"]]


def nothing_left(cluster, nodes, run_id):
    return all(procs(cluster, n, run_id) == [] and
               cluster.exec(n, "pgrep -f '[t]rain.run|[d]eepspeed.launcher' || true").stdout.strip() == ""
               for n in nodes)


def run_status(cluster, run_id):
    return json.loads(cluster.exec(cluster.master, f"/opt/dscluster/bin/dsc-runctl status {RUNS}/{run_id} {run_id}").stdout)


def test_killed_rank_ends_the_run_everywhere_and_resume_continues(provisioned, cluster):
    run_id, worker = "f-kill", cluster.names[1]
    try:
        launch(cluster, run_id, 100000, 5)
        wait_checkpoint(cluster, run_id, 5)
        victim = wait(lambda: rank_pids(cluster, worker, run_id), 30, "a rank on the worker")[0]
        t0 = time.time()
        cluster.exec(worker, f"kill -9 {victim}")
        wait(lambda: nothing_left(cluster, cluster.names, run_id), EXIT_BOUND_S["rank"],
             "every process of the run to exit")
        elapsed = time.time() - t0
        print(f"\nkill -9 of a rank on {worker} -> last process of the run gone: {elapsed:.1f} s")
        st = wait(lambda: (s := run_status(cluster, run_id))["state"] == "failed" and s, 30, "state failed")
        assert st["failed_node"] == worker and "killed by SIGKILL" in st["first_error"], st
        shown = cluster.playbook("status.yml", "-e", f"run_id={run_id}")
        assert f"run {run_id}: failed" in shown.output and f"a rank on {worker} was killed by SIGKILL" in shown.output
        saved = max(set.intersection(*(complete_steps(cluster, n, run_id) for n in cluster.names)))
        res = cluster.playbook("resume.yml", "-e", f"run_id={run_id}", "-e", "follow=true",
                               "-e", json.dumps({"dsc_entry_args": ["--set", f"steps={saved + 3}"]}))
        assert res.returncode == 0, res.output[-4000:]
        summary = json.loads(cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/summary.json").stdout)
        assert summary["start_step"] == saved and summary["steps"] == saved + 3
    finally:
        cluster.playbook("stop.yml", "-e", f"run_id={run_id}")


def test_dead_worker_ends_the_run_on_the_master(provisioned, cluster):
    run_id, worker = "f-down", cluster.names[1]
    try:
        launch(cluster, run_id, 100000, 5)
        wait_checkpoint(cluster, run_id, 5)
        t0 = time.time()
        subprocess.run(["podman", "stop", "-t", "0", "dsc-" + worker], check=True, capture_output=True)
        wait(lambda: nothing_left(cluster, [cluster.master], run_id), EXIT_BOUND_S["node"],
             "every process of the run on the master to exit")
        elapsed = time.time() - t0
        print(f"\nworker container stopped -> last process on the master gone: {elapsed:.1f} s")
        st = wait(lambda: (s := run_status(cluster, run_id))["state"] == "failed" and s, 30, "state failed")
        assert st["failed_node"] == worker and f"connection to {worker} was lost" in st["first_error"], st
        shown = cluster.playbook("status.yml", "-e", f"run_id={run_id}")
        assert f"run {run_id}: failed" in shown.output and f"{worker}: unreachable" in shown.output, shown.output[-3000:]
    finally:
        subprocess.run(["podman", "start", "dsc-" + worker], check=False, capture_output=True)
        testcluster.wait_ssh([h for h in cluster.info["hosts"] if h["name"] == worker])
        # The node is back as after a reboot: provision.yml restores what lived in memory (the
        # firewall's rules), and nothing of the run survived on it.
        again = cluster.playbook("provision.yml")
        assert again.returncode == 0, again.output[-4000:]
        assert nothing_left(cluster, cluster.names, run_id)
        cluster.playbook("stop.yml", "-e", f"run_id={run_id}")


def test_run_survives_a_dropped_connection_and_a_second_launch_needs_replace(provisioned, cluster):
    run_id = "f-drop"
    try:
        launch(cluster, run_id, 100000, 1000)
        wait(lambda: run_status(cluster, run_id)["last"], 120, "a first logged step")
        # Drop every SSH session from the control node (Ansible's persistent ones included).
        for n in cluster.names:
            cluster.exec(n, "pkill -f '[s]shd: root' || true")
        before = run_status(cluster, run_id)["last"]["step"]
        wait(lambda: run_status(cluster, run_id)["last"]["step"] > before + 2, 60, "steps after the drop")
        st = cluster.playbook("status.yml", "-e", f"run_id={run_id}")
        assert st.returncode == 0 and f"run {run_id}: running" in st.output, st.output[-3000:]
        second = cluster.playbook("launch.yml", "-e", "run_id=f-second", "-e", "dry_run=true")
        assert second.returncode != 0 and f"Run {run_id} is active" in second.output
        assert "-e replace=true" in second.output
        replaced = launch(cluster, "f-second", 100000, 1000, "-e", "replace=true")
        assert "Stop the active run being replaced" in replaced.output
        assert nothing_left(cluster, cluster.names, run_id)
        assert wait(lambda: rank_pids(cluster, cluster.names[1], "f-second"), 60, "the new run's ranks")
        stop = cluster.playbook("stop.yml", "-e", "run_id=f-second")
        assert stop.returncode == 0 and nothing_left(cluster, cluster.names, "f-second")
    finally:
        cluster.playbook("stop.yml", "-e", f"run_id={run_id}")
        cluster.playbook("stop.yml", "-e", "run_id=f-second")


def _hold_port(cluster, port):
    code = (f"import socket,time; s=socket.socket(); s.bind(('0.0.0.0', {port})); s.listen(1); "
            f"open('/tmp/hold{port}','w').close(); time.sleep(600)")
    cluster.exec(cluster.master, f"rm -f /tmp/hold{port}; (nohup python3 -c \"{code}\" >/dev/null 2>&1 &); "
                                 f"for i in $(seq 50); do test -f /tmp/hold{port} && break; sleep 0.1; done")


def test_busy_master_port_takes_the_next_and_an_exhausted_range_says_so(provisioned, cluster):
    _hold_port(cluster, 29500)
    try:
        r = launch(cluster, "f-port", 3, 1000, follow=True)
        assert cluster.exec(cluster.master, f"cat {RUNS}/f-port/master_port").stdout.strip() == "29501"
        assert "--master_port=29501" in cluster.exec(cluster.master, f"cat {RUNS}/f-port/launcher.log").stdout
        assert "launch will take 29501" in r.output  # the preflight warning
        narrow = ["-e", "dsc_master_port_last=29500", "-e", "run_id=f-full", "-e", "dry_run=true"]
        checked = cluster.playbook("launch.yml", *narrow)
        assert checked.returncode != 0 and "every port 29500-29500 is in use on node1" in checked.output
        unchecked = cluster.playbook("launch.yml", *narrow[:-2], "-e", "preflight=false")
        assert unchecked.returncode != 0
        assert "Every master port from 29500 to 29500 is in use on node1" in unchecked.output
    finally:
        cluster.exec(cluster.master, "pkill -f 'time.sleep\\(600\\)'", check=False)


WATCHER = r"""
import glob, json, os, signal, subprocess, sys, time
run, after = sys.argv[1], int(sys.argv[2])
procs = lambda: [p["pid"] for p in json.loads(subprocess.check_output(
    ["/opt/dscluster/bin/dsc-runctl", "procs", os.path.basename(run)]))]
pids = []
while not pids:
    pids, _ = procs(), time.sleep(0.2)
seen = set()
while True:
    for d in glob.glob(run + "/checkpoints/step*"):
        step = int(d.rsplit("step", 1)[1])
        if step > after and not os.path.exists(d + "/COMPLETE"):
            for pid in pids + procs():
                try:
                    os.kill(pid, signal.SIGSTOP)  # frozen mid-write, as a stop would catch it
                except ProcessLookupError:
                    pass
            print(step, flush=True)
            sys.exit(0)
    time.sleep(0.0005)
"""


def test_stop_during_a_checkpoint_write_resumes_from_the_previous_one(provisioned, cluster):
    run_id = "f-ckpt"
    try:
        launch(cluster, run_id, 100000, 4)
        wait_checkpoint(cluster, run_id, 8)
        watcher = cluster.exec(cluster.master, f"timeout 120 python3 -c '{WATCHER}' {RUNS}/{run_id} 8", timeout=150)
        frozen_at = int(watcher.stdout.split()[-1])
        stop = cluster.playbook("stop.yml", "-e", f"run_id={run_id}")
        assert stop.returncode == 0, stop.output[-3000:]
        assert nothing_left(cluster, cluster.names, run_id)
        complete = set.intersection(*(complete_steps(cluster, n, run_id) for n in cluster.names))
        dirs = {int(x) for x in cluster.exec(cluster.master, f"ls {RUNS}/{run_id}/checkpoints | sed 's/step//'")
                .stdout.split() if x.isdigit()}
        half = sorted(dirs - complete)
        assert frozen_at in half, (frozen_at, sorted(dirs), sorted(complete))
        previous = max(s for s in complete if s < frozen_at)
        res = cluster.playbook("resume.yml", "-e", f"run_id={run_id}", "-e", "follow=true",
                               "-e", json.dumps({"dsc_entry_args": ["--set", f"steps={previous + 2}"]}))
        assert res.returncode == 0, res.output[-4000:]
        log = cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/launcher.log").stdout
        assert f"resume: loaded {RUNS}/{run_id}/checkpoints/step{previous} (step {previous})" in log
        print(f"\nstopped while step{frozen_at} was being written; resumed from step{previous}")
    finally:
        cluster.playbook("stop.yml", "-e", f"run_id={run_id}")


def test_max_restarts_relaunches_from_the_latest_checkpoint(provisioned, cluster):
    run_id, worker = "f-restart", cluster.names[1]
    try:
        launch(cluster, run_id, 24, 4, "-e", "max_restarts=2", "-e", "restart_backoff_s=2")
        wait_checkpoint(cluster, run_id, 8)
        victim = wait(lambda: rank_pids(cluster, worker, run_id), 30, "a rank on the worker")[0]
        cluster.exec(worker, f"kill -9 {victim}")
        st = wait(lambda: (s := run_status(cluster, run_id))["state"] in ("finished", "failed") and s, 400,
                  "the restarted run to end", every=2)
        assert st["state"] == "finished" and st["restarts"] == 1, st
        restarts = [json.loads(x) for x in cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/restarts.log").stdout.splitlines()]
        assert len(restarts) == 1 and f"a rank on {worker} was killed by SIGKILL" in restarts[0]["cause"]
        log = cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/launcher.log").stdout
        assert "[dsc-runctl] restart 1/2" in log and "resume: loaded" in log
        summary = json.loads(cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/summary.json").stdout)
        assert summary["steps"] == 24 and summary["start_step"] >= 8
        shown = cluster.playbook("status.yml", "-e", f"run_id={run_id}")
        assert f"run {run_id}: finished (restarts: 1)" in shown.output
        print(f"\nrestarts seen: {st['restarts']}; resumed from step {summary['start_step']}")
    finally:
        cluster.playbook("stop.yml", "-e", f"run_id={run_id}")
