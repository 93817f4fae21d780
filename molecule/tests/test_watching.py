"""Watching runs on the container cluster: the follow line with every node's state and a picture
at the end, logs.yml's lines and streamed log, DeepSpeed's monitor and TensorBoard files fetched,
plot.yml over several runs, and a run stalled by a stopped rank: marked, every rank's stack read
(the stopped one named with its node and frame), then (when asked) torn down and restarted to
completion."""
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cluster import PREFIX, TINY, UNTIL_STOPPED, wait

ROOT = Path(__file__).resolve().parents[2]
RUNS = "/opt/dscluster/runs"
PLOTS = ROOT / "runs" / "testcluster" / "plots"
# Short enough for the suite, long enough for several of follow's polls (every 2 s here, users'
# default 5) and log polls (follow_log_every_s, 2 s) while the ranks train: at least 8 s of steps,
# each paced to 0.05 s (train.run's min_step_s).
FOLLOWED_STEPS = 160
FOLLOWED = dict(TINY, steps=FOLLOWED_STEPS, min_step_s=0.05, log_every=5, save_every=1000)
# A stopped rank is a stall after this long without a step (a tiny step takes ~20 ms here).
STALL_S = 8
# The run launch.yml follows, with logs.yml and status.yml following it beside (the `followed` fixture).
FOLLOWED_RUN = "w-follow"


def e(**values):
    return ["-e", json.dumps(values)]


def launch(cluster, run_id, *extra):
    """A run to watch; no launch preflight (seconds of CPU each, covered by test_preflight.py)."""
    for n in cluster.names:
        cluster.exec(n, f"rm -rf {RUNS}/{run_id}", check=False)
    r = cluster.playbook("launch.yml", "-e", f"run_id={run_id}", "-e", "preflight=false", *extra)
    assert r.returncode == 0, r.output[-5000:]
    return r


def is_png(path, min_bytes=20000):
    data = Path(path).read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= min_bytes


@pytest.fixture(scope="module")
def followed(provisioned, cluster, tmp_path_factory):
    """One run (TensorBoard on) followed to its end three ways at once: by launch.yml's own follow
    and, once the run is up, by logs.yml and status.yml, which only read it (one DeepSpeed start
    for the three): {"launch": output, "logs": output, "status": output}."""
    run_id = FOLLOWED_RUN
    (PLOTS / f"{run_id}.png").unlink(missing_ok=True)
    with ThreadPoolExecutor(3) as pool:
        launched = pool.submit(launch, cluster, run_id, "-e", "follow=true", "-e", "follow_every_s=2",
                               "-e", "dsc_tensorboard=true", *e(dsc_train_config=FOLLOWED))
        wait(lambda: launched.done() or cluster.rank_pids(cluster.master, run_id), 300, f"{run_id}'s ranks")
        logs = pool.submit(cluster.playbook, "logs.yml", "-e", f"run_id={run_id}", "-e", "follow=true",
                           "-e", "lines=3", "-e", f"logs_dest={tmp_path_factory.mktemp('logs-follow')}")
        status = pool.submit(cluster.playbook, "status.yml", "-e", f"run_id={run_id}", "-e", "follow=true",
                             "-e", "follow_every_s=2")
        return {"launch": launched.result(), "logs": logs.result(), "status": status.result()}


def test_follow_shows_every_nodes_state_and_ends_with_a_picture(followed, cluster):
    run_id, r = FOLLOWED_RUN, followed["launch"]
    lines = [x for x in r.output.splitlines() if x.startswith(f"run {run_id}: running, step ")]
    assert len(lines) >= 2 and "RETRYING" not in r.output, r.output[-3000:]
    # progress lines, not retry messages: the step counts on from one poll to the next
    steps = [int(x.split("step ")[1].split("/")[0]) for x in lines]
    assert steps == sorted(steps) and steps[0] < steps[-1], lines
    assert f"/{FOLLOWED_STEPS}, loss " in r.output and "elapsed " in r.output
    # while the ranks train both nodes say so, and both nodes' ranks count (one each; at the last
    # step the worker's ranks may be gone first: "ended", while the master's still writes its
    # checkpoint)
    training = [x for x in lines if "ranks alive 2" in x and f"step {FOLLOWED_STEPS}/" not in x]
    assert training and all(f"nodes {cluster.names[0]}:running {cluster.names[1]}:running" in x for x in training), lines
    assert f"Plot: {PLOTS}/{run_id}.png" in r.output and is_png(PLOTS / f"{run_id}.png")


def test_logs_fetches_monitor_and_tensorboard_files_and_prints_each_nodes_last_lines(followed, cluster, tmp_path):
    run_id = FOLLOWED_RUN  # TensorBoard on
    r = cluster.playbook("logs.yml", "-e", f"run_id={run_id}", "-e", f"logs_dest={tmp_path}", "-e", "lines=5")
    assert r.returncode == 0, r.output[-3000:]
    master = tmp_path / run_id / cluster.names[0]
    assert (master / "launcher.log").stat().st_size > 0 and (master / "metrics.jsonl").exists()
    assert (master / "monitor" / "ds" / "Train_Samples_lr.csv").read_text().startswith("step,lr")
    assert list((master / "tensorboard" / "ds").glob("events.out.tfevents.*")), list(master.rglob("*"))
    for node in cluster.names:
        assert f"== {node} (last 5 lines)" in r.output, r.output[-3000:]


def test_logs_follow_streams_the_log_until_the_run_ends(followed, cluster):
    r = followed["logs"]
    assert r.returncode == 0, r.output[-3000:]
    assert cluster.run_status(FOLLOWED_RUN)["state"] == "finished"
    streamed = [x for x in r.output.splitlines() if x.startswith(f"{cluster.names[0]}: ") and "step " in x]
    assert len(streamed) >= 2, r.output[-3000:]
    assert "Process" in r.output and "exits successfully" in r.output  # the log's end came through
    assert "RETRYING" not in r.output


def test_status_follows_a_running_run_to_its_end(followed, cluster):
    r = followed["status"]
    assert r.returncode == 0, r.output[-3000:]
    lines = [x for x in r.output.splitlines() if x.startswith(f"run {FOLLOWED_RUN}: running, step ")]
    assert lines and "RETRYING" not in r.output, r.output[-3000:]
    assert cluster.run_status(FOLLOWED_RUN)["state"] == "finished" and f"Plot: {PLOTS}/{FOLLOWED_RUN}.png" in r.output


def test_a_stopped_rank_is_marked_stalled_named_with_its_stack_and_clears_when_it_continues(provisioned, cluster, figures):
    run_id, worker = "w-stall-mark", cluster.names[1]
    launch(cluster, run_id, "-e", f"dsc_stall_timeout_s={STALL_S}",
           *e(dsc_train_config=dict(TINY, **UNTIL_STOPPED, log_every=10, save_every=100000)))
    try:
        wait(lambda: (cluster.run_status(run_id).get("last") or {}).get("step"), 300, "the first steps")
        victim = wait(lambda: cluster.rank_pids(worker, run_id), 30, "a rank on the worker")[0]
        cluster.exec(worker, f"kill -STOP {victim}")
        stopped_at = time.time()
        wait(lambda: (s := cluster.run_status(run_id))["state"] == "stalled" and s, 60, "the stall mark")
        assert time.time() - stopped_at < STALL_S + 20  # the set time, plus the polls
        rank = int(cluster.exec(worker, f"tr '\\0' '\\n' < /proc/{victim}/environ | sed -n 's/^RANK=//p'",
                                user="dstrain").stdout)
        odd = f"rank {rank} on {worker} (stopped) in "
        # The supervisor read every rank's stack at the mark (py-spy on each node, the worker's
        # through pdsh); status shows where they are, the stopped rank first.
        shown = cluster.playbook("status.yml", "-e", f"run_id={run_id}")
        assert f"run {run_id}: stalled" in shown.output and "where each rank is, at the stall:" in shown.output
        for n in cluster.names:  # the worker, whose ranks live, is stalled with the run
            assert f"{n}: stalled, ranks alive 1" in shown.output, shown.output[-3000:]
        lines = shown.output.split("where each rank is, at the stall:")[1].splitlines()
        assert odd in lines[1], lines[:4]
        # On demand: read again now, saved in the run directory on each node.
        asked = cluster.playbook("status.yml", "-e", f"run_id={run_id}", "-e", "stacks=true")
        assert asked.returncode == 0, asked.output[-3000:]
        lines = asked.output.split("where each rank is (stacks/ in the run directory on each node):")[1].splitlines()
        assert odd in lines[1] and lines[2].strip(" \"'-,").startswith("rank") and cluster.master in lines[2], lines[:4]
        assert f"is stopped (SIGSTOP, a debugger, a frozen cgroup): kill -CONT {victim} there" in lines[3], lines[:4]
        figures("stacks", stalled=shown.output.split("at the stall:")[1].splitlines()[1:4], asked=lines[1:4])
        for n in cluster.names:
            saved = cluster.exec(n, f"ls {RUNS}/{run_id}/stacks/").stdout.split()
            assert sum(f.endswith(f"-{n}.json") for f in saved) >= 1, (n, saved)
        cluster.exec(worker, f"kill -CONT {victim}")
        wait(lambda: cluster.run_status(run_id)["state"] == "running", 60, "steps again")
    finally:
        cluster.exec(worker, "pkill -CONT -f 'entry --module train.run' || true", check=False)
        cluster.playbook("stop.yml", "-e", f"run_id={run_id}")


def test_a_stall_with_stall_fail_is_torn_down_and_restarted_to_completion(provisioned, cluster):
    run_id, worker, steps, every, ended = "w-stall-fail", cluster.names[1], 200, 50, False
    # Paced (0.05 s a step): after the first checkpoint, 150 steps (7.5 s at least) remain for the stop.
    launch(cluster, run_id, "-e", f"dsc_stall_timeout_s={STALL_S}", "-e", "dsc_stall_fail=true",
           "-e", "max_restarts=1", "-e", "restart_backoff_s=2",
           *e(dsc_train_config=dict(TINY, steps=steps, min_step_s=0.05, log_every=10, save_every=every)))
    try:
        cluster.wait_checkpoint(run_id, every)
        victim = wait(lambda: cluster.rank_pids(worker, run_id), 30, "a rank on the worker")[0]
        cluster.exec(worker, f"kill -STOP {victim}")
        st = wait(lambda: (s := cluster.run_status(run_id))["state"] in ("finished", "failed") and s, 600,
                  "the restarted run to end", every=2)
        assert st["state"] == "finished" and st["restarts"] == 1, st
        ended = True  # its supervisor recorded the end: nothing of the run is left for stop.yml
        restarts = [json.loads(x) for x in
                    cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/restarts.log").stdout.splitlines()]
        assert f"the run stalled: no step for {STALL_S} s after step" in restarts[0]["cause"], restarts
        log = cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/launcher.log").stdout
        assert f"[dsc_node] stalled: no step for {STALL_S} s" in log and "resume: loaded" in log
        assert st["last"]["step"] == steps
    finally:
        cluster.exec(worker, "pkill -CONT -f 'entry --module train.run' || true", check=False)
        if not ended:
            cluster.playbook("stop.yml", "-e", f"run_id={run_id}")


def test_plot_draws_several_runs_in_one_picture(followed, cluster):
    """After the stall runs above: the followed run and the restarted one in one picture."""
    r = cluster.playbook("plot.yml", *e(plot_runs=[FOLLOWED_RUN, "w-stall-fail"]))
    assert r.returncode == 0, r.output[-3000:]
    assert is_png(PLOTS / f"{FOLLOWED_RUN}+w-stall-fail.png")
    bad = cluster.playbook("plot.yml", *e(plot_runs=["w-nope"]))
    assert bad.returncode != 0 and "plot_runs: no run 'w-nope'" in bad.output


SLOW_RUN = "w-slow"
# Windows of 10 steps (the default): a mark after 3 in a row spanning 20 s, cleared at the first
# window the rank has caught up in. Steps unpaced, so that each rank's own work is its CPU's, and longer than the
# tiny model's (sequences of 256), so that a step is more than this busy machine's scheduling.
SLOW_TRAIN = dict(TINY, **dict(UNTIL_STOPPED, min_step_s=0), seq_len=256, save_every=100000)


def _slow_mark(cluster):
    r = cluster.exec(cluster.master, f"cat {RUNS}/{SLOW_RUN}/slow.json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None


def test_a_rank_slowed_mid_run_is_named_while_it_moves_and_cleared_when_it_catches_up(followed, cluster, figures):
    """The run trains unpaced; for as many steps as it then runs slowed, no rank is marked. The
    worker's container is limited to a fifth of a CPU (podman update --cpus): within a few
    windows status names its rank with the others' wait; the limit lifted, the mark clears.
    The runs this module made before it (the followed one, to its end; in the whole module's run
    also two with a rank stopped a while) kept their ranks' times and were never marked."""
    earlier = [f"{RUNS}/{run}" for run in (FOLLOWED_RUN, "w-stall-mark", "w-stall-fail")]
    kept = cluster.exec(cluster.master, "wc -l " + " ".join(f"{d}/ranks.jsonl" for d in earlier), check=False).stdout
    marked = cluster.exec(cluster.master, "grep -l 'slow rank' " + " ".join(f"{d}/launcher.log" for d in earlier),
                          check=False).stdout
    lines = {path: int(n) for n, path in (row.split() for row in kept.splitlines()) if path != "total"}
    assert lines.get(f"{RUNS}/{FOLLOWED_RUN}/ranks.jsonl", 0) > 0 and marked == "", (kept, marked)
    launch(cluster, SLOW_RUN, *e(dsc_train_config=SLOW_TRAIN))
    worker, limited = cluster.names[1], False

    def windows():
        r = cluster.exec(cluster.master, f"cat {RUNS}/{SLOW_RUN}/ranks.jsonl", check=False)
        return [json.loads(x) for x in r.stdout.splitlines() if x.strip()]

    def step():  # the step of the last window written
        return (windows() or [{"step": 0}])[-1]["step"]
    try:
        wait(lambda: len(windows()) >= 6, 180, "six windows of the healthy run")
        healthy = windows()
        assert _slow_mark(cluster) is None, healthy
        cluster.exec(cluster.master, f"! grep -q 'slow rank' {RUNS}/{SLOW_RUN}/launcher.log")
        subprocess.run(["podman", "update", "--cpus", "0.2", PREFIX + worker], check=True, capture_output=True)
        limited, at = True, step()
        mark = wait(lambda: _slow_mark(cluster), 240, f"{worker}'s rank named slow")
        assert (mark["node"], mark["rank"]) == (worker, 1) and mark["ratio"] >= 1.5, mark
        status = cluster.playbook("status.yml", "-e", f"run_id={SLOW_RUN}")
        line = next(x.strip().strip('",') for x in status.output.splitlines() if "slow rank: " in x)
        assert line.startswith(f"slow rank: {worker} rank 1: ") and "x the median compute, the others wait" in line, line
        subprocess.run(["podman", "update", "--cpus", "2", PREFIX + worker], check=True, capture_output=True)
        limited, lifted = False, step()
        wait(lambda: _slow_mark(cluster) is None, 240, "the mark cleared")
        cleared = step()
        log = cluster.exec(cluster.master, f"cat {RUNS}/{SLOW_RUN}/launcher.log").stdout
        assert f"slow rank 1 on {worker} caught up" in log
        marked = next(w["ranks"] for w in windows() if w["step"] == mark["step"])  # the figures named
        figures("slow rank", said=mark["said"], steps_to_verdict=mark["step"] - at, steps_to_clear=cleared - lifted,
                healthy_windows=len(healthy), earlier_runs_unmarked=kept, window=marked, status=line)
    finally:
        if limited:
            subprocess.run(["podman", "update", "--cpus", "2", PREFIX + worker], capture_output=True)
        cluster.playbook("stop.yml", "-e", f"run_id={SLOW_RUN}")
