"""What a run has recorded, read on a node (node/dscnode records, rundir): the runs and their table,
status states, the last metrics or any script's progress, the first error with its traceback,
the run's total steps, the config shown, the run files, every node's ranks, the log's tail, run
files never read through a link, a followed run's poll that returns when the run ends, and the
status rows the control node prints from them.

    .venv/bin/pytest tests/unit/test_node_records.py -q
"""
import json
import os
import subprocess
import threading
import time

import pytest

from dscnode import procs, records, rundir
from tests.unit.node_helpers import helper


def test_runs_lists_newest_first_with_active_and_started(tmp_path):
    for name in ("old", "new"):
        (tmp_path / name).mkdir()
    (tmp_path / "new" / rundir.RunDir.PID).write_text(str(os.getpid()))
    (tmp_path / "old" / rundir.RunDir.LOG).write_text("x")
    for i, name in enumerate(["old", "new"]):
        os.utime(tmp_path / name, (1000 + i, 1000 + i))
    os.symlink("/etc", tmp_path / "link")  # never followed
    runs = records.runs(tmp_path)
    assert [r["id"] for r in runs] == ["new", "old"]
    assert runs[0]["active"] and not runs[0]["started"] and runs[1]["started"] and not runs[1]["active"]
    assert procs.active(tmp_path) == {"run_id": "new", "run_dir": str(tmp_path / "new")}


@pytest.mark.parametrize("files,state", [
    ({}, "not started"),
    ({"ranks.started": ""}, "ended"),  # a worker whose ranks are gone, before the exit code comes
    ({"launcher.log": "x", "exit_code": "0\n"}, "finished"),
    ({"launcher.log": "x", "exit_code": "1\n"}, "failed"),
    ({"launcher.log": "x", "exit_code": "-15\n", "stopped": "stopped\n"}, "stopped"),
    ({"launcher.log": "x"}, "lost"),
])
def test_status_states(tmp_path, files, state):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert records.status(tmp_path, "nope-run")["state"] == state


def test_status_reads_the_last_metrics_and_the_failure(tmp_path):
    (tmp_path / "launcher.log").write_text("node2: [INFO] exits with return code = -9\nTraceback (most recent call last):\n")
    (tmp_path / "exit_code").write_text("1\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    (tmp_path / "failure.json").write_text(json.dumps({"node": "node2", "message": "a rank on node2 was killed by SIGKILL"}))
    st = records.status(tmp_path, "nope-run")
    assert st["last"] == {"step": 2, "loss": 1.5} and st["failed_node"] == "node2"
    assert st["first_error"] == ("a rank on node2 was killed by SIGKILL; first error: Traceback (most "
                                 "recent call last):")


LOG = """node1: step 1/9 loss 2.0
node2: Traceback (most recent call last):
node2:   File "train.py", line 10, in <module>
node2:     main()
node1: step 2/9 loss 1.9
node2:   File "train.py", line 7, in main
node2:     raise ValueError("bad shape (3, 4)")
node2: [rank1]: ValueError: bad shape (3, 4)
node2: [INFO] [launch.py:335] exits with return code = 1
"""


def test_the_first_exception_of_the_latest_attempt_with_its_node_and_traceback(tmp_path):
    log = tmp_path / "launcher.log"
    log.write_text("node1: RuntimeError: the first attempt's error\n[dsc_node] restart 1/2\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write(LOG)
    error, trace = records.first_error(log, offset)
    assert error == "node2: [rank1]: ValueError: bad shape (3, 4)"
    assert trace[0] == "node2: Traceback (most recent call last):" and trace[-1] == error
    assert not any(line.startswith("node1") for line in trace) and len(trace) == 6
    assert records.first_error(log)[0] == "node1: RuntimeError: the first attempt's error"
    (tmp_path / "attempt.json").write_text(json.dumps({"attempt": 2, "offset": offset}))
    (tmp_path / "exit_code").write_text("1\n")
    st = records.status(tmp_path, "nope-run")
    assert st["state"] == "failed" and st["first_error"] == error and st["traceback"] == trace


def test_the_traceback_keeps_its_header_when_the_launchers_log_lines_interleave(tmp_path):
    """pdsh copies a node's stdout and stderr as each line is ready: on a busy node the
    launcher's log lines land inside the rank's traceback. They are left out, and a long
    traceback keeps its header and its last lines."""
    frames = [f'node2:   File "m{k}.py", line {k}, in f{k}' for k in range(30)]
    info = [f"node2: [2026-12-02 06:32:15,79{k}] [INFO] [launch.py:145:main] {k} NCCL_DEBUG=WARN"
            for k in range(9)]
    mixed = ["node2: Traceback (most recent call last):"]
    for k, frame in enumerate(frames):
        mixed += [frame] + info[k:k + 1]
    log = tmp_path / "launcher.log"
    log.write_text("\n".join(mixed + ["node2: ValueError: bad shape (3, 4) on rank 1"]) + "\n")
    error, trace = records.first_error(log)
    assert error == "node2: ValueError: bad shape (3, 4) on rank 1"
    assert trace[0] == "node2: Traceback (most recent call last):" and len(trace) == 20
    assert trace[1:] == frames[-18:] + [error]


def test_run_files_leave_out_code_and_checkpoints(tmp_path):
    for name in ("launcher.log", "metrics.jsonl", "monitor/csv/loss.csv", "code/train.py",
                 "checkpoints/step10/COMPLETE", "exit_code.tmp"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert records.run_files(tmp_path) == ["launcher.log", "metrics.jsonl", "monitor/csv/loss.csv"]


def test_runs_table_has_a_row_per_run_newest_first(tmp_path):
    for i, (name, files) in enumerate([("old", {"run_id": "old\n", "launcher.log": "x", "exit_code": "0\n",
                                               "metrics.jsonl": '{"step": 5, "loss": 1.5, "tokens_per_s": 900}\n',
                                               "launch.json": '{"preset": "zero3"}'}),
                                       ("own", {"run_id": "own\n", "launcher.log": "x", "exit_code": "0\n",
                                                "progress.jsonl": '{"step": 3, "loss": 2.0, "samples_per_s": 12.5}\n'}),
                                       ("new", {"run_id": "new\n", "launcher.log": "x", "exit_code": "1\n"})]):
        (tmp_path / name).mkdir()
        for f, text in files.items():
            (tmp_path / name / f).write_text(text)
        os.utime(tmp_path / name / "run_id", (1000 + i, 1000 + i))
    rows = records.runs_table(tmp_path)
    assert [(r["id"], r["state"], r["config"], r["step"]) for r in rows] == [
        ("new", "failed", None, None), ("own", "finished", None, 3), ("old", "finished", "preset zero3", 5)]
    # train.run's tokens/s and another script's samples/s stay apart: the table shows each's unit
    assert [(r["tokens_per_s"], r["samples_per_s"]) for r in rows] == [(None, None), (None, 12.5), (900, None)]


def test_status_reads_any_scripts_progress_when_there_are_no_metrics(tmp_path):
    run = tmp_path / "r1"
    run.mkdir()
    (run / "progress.jsonl").write_text(json.dumps({"step": 4, "loss": 2.5, "lr": 1e-3}) + "\n"
                                        + json.dumps({"step": 8, "loss": 2.1, "lr": 1e-3}) + "\n")
    assert records.status(run, "r1")["last"]["step"] == 8
    (run / "metrics.jsonl").write_text(json.dumps({"step": 9, "loss": 2.0, "tokens_per_s": 10}) + "\n")
    assert records.status(run, "r1")["last"]["tokens_per_s"] == 10  # train.run's own, richer


def test_run_files_are_never_read_through_a_planted_link(tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text('{"root": "only"}')
    (tmp_path / "launch.json").symlink_to(secret)
    (tmp_path / "launcher.pid").symlink_to(tmp_path / "pid")
    (tmp_path / "pid").write_text(f"{os.getpid()}\n")
    assert rundir.read_json(tmp_path / "launch.json") is None
    assert procs.pid_alive(tmp_path / "launcher.pid") is None
    (tmp_path / "real.json").write_text('{"a": 1}')
    assert rundir.read_json(tmp_path / "real.json") == {"a": 1}


def test_a_total_only_where_the_run_knows_it_and_never_below_the_step(tmp_path):
    """train.run's metrics carry its config's steps; a user's script's progress carries none (the
    run's train.json, which such a script never reads, says nothing: no "step 600/20"); a total
    below the step is not the run's."""
    (tmp_path / "train.json").write_text(json.dumps({"steps": 20}))
    (tmp_path / "progress.jsonl").write_text(json.dumps({"step": 600, "loss": 2.0}) + "\n")
    assert records.status(tmp_path, "own")["total_steps"] is None
    (tmp_path / "progress.jsonl").write_text(json.dumps({"step": 600, "total_steps": 1000}) + "\n")
    assert records.status(tmp_path, "own")["total_steps"] == 1000  # HF's Trainer said it
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 155, "total_steps": 800}) + "\n")
    assert records.status(tmp_path, "train")["total_steps"] == 800
    assert records.total_steps({"step": 30, "total_steps": 20}) is None
    assert records.total_steps({"step": 20, "total_steps": 20}) == 20 and records.total_steps(None) is None


def test_the_config_shown_is_the_preset_only_where_the_preset_is_the_config(tmp_path):
    """dsc_ds_config_mode preset: the preset; none, hf, file: the ZeRO stage the run's engine
    reported, "its own" before it has; the launch's start answer and runs.yml say the same."""
    run = tmp_path / "r1"
    run.mkdir()
    (run / "launch.json").write_text(json.dumps({"preset": "zero2", "dsc_ds_config_mode": "preset"}))
    assert records.status(run, "r1")["config"] == "preset zero2"
    for mode in ("none", "hf", "file"):
        (run / "launch.json").write_text(json.dumps({"preset": "zero2", "dsc_ds_config_mode": mode}))
        (run / "engine.json").unlink(missing_ok=True)
        assert records.status(run, "r1")["config"] == "its own ZeRO stage", mode
        (run / "engine.json").write_text(json.dumps({"zero_stage": 3}))
        assert records.status(run, "r1")["config"] == "ZeRO stage 3", mode
    (run / "run_id").write_text("r1\n")
    assert records.runs_table(tmp_path)[0]["config"] == "ZeRO stage 3"
    assert records.config_label(rundir.RunDir(tmp_path / "none")) is None


def test_follow_counts_every_nodes_ranks(tmp_path, monkeypatch):
    """status --hosts: this node's state and ranks, and each other node's from its own status
    through pdsh (a node with 2 ranks counts 2); a node that does not answer counts none."""
    calls = []

    def pdsh(cmd, **kwargs):
        calls.append(cmd)
        out = "".join(f"{n}: " + json.dumps({"state": "running", "ranks_alive": k}) + "\n"
                      for n, k in (("node2", 2), ("node3", 1)))
        return subprocess.CompletedProcess(cmd, 0, stdout=out + "node4: garbage\n", stderr="")
    monkeypatch.setattr(records.subprocess, "run", pdsh)
    own = {"state": "running", "ranks_alive": 1}
    nodes = records.node_states(tmp_path, "r1", ["node1", "node2", "node3", "node4"], own)
    assert nodes == {"node1": {"state": "running", "ranks_alive": 1}, "node2": {"state": "running", "ranks_alive": 2},
                     "node3": {"state": "running", "ranks_alive": 1},
                     "node4": {"state": "unreachable", "ranks_alive": 0}}
    assert calls[0][calls[0].index("-w") + 1] == "node2,node3,node4"
    assert sum(n["ranks_alive"] for n in nodes.values()) == 4


def test_the_log_tail_names_its_file_and_keeps_the_launchers_own_lines_apart(tmp_path):
    (tmp_path / "launcher.log").write_text("[INFO] cmd = pdsh -w node1,node2\nnode1: step 1\nnode2: step 1\n"
                                           "pdsh@node1: node2: ssh exited with exit code 255\n")
    tail = records.log_tail(tmp_path, "r1", lines=5, hosts=["node1", "node2"])
    assert tail["log"] == str(tmp_path / "launcher.log")
    assert tail["nodes"] == {"launcher": ["[INFO] cmd = pdsh -w node1,node2",
                                          "pdsh@node1: node2: ssh exited with exit code 255"],
                             "node1": ["step 1"], "node2": ["step 1"]}


def test_status_rows_show_the_peak_against_the_prediction_and_each_step_down():
    from plugins.filter import cluster as filters  # noqa: PLC0415 - the control node's filters, for this test alone
    gib = 2 ** 30
    st = {"host": "node1", "state": "running", "ranks_alive": 1, "last": {"step": 3},
          "memory": {"predicted": 50 * gib, "measured": 72 * gib, "ratio": 1.44, "over": True},
          "step_downs": [{"attempt": 1, "preset": "zero1", "micro_batch": 16, "at_step": None,
                          "cause": "node1: torch.OutOfMemoryError: CUDA out of memory",
                          "next": {"preset": "zero2", "micro_batch": 8}}]}
    assert filters.status_row(st).endswith(", peak per GPU measured 72.0 of predicted 50.0 GiB (x1.44, OVER)")
    assert filters.step_down_lines(st) == [
        "step down 1: zero1 micro-batch 16 ran out of memory (node1: torch.OutOfMemoryError: CUDA out of memory); "
        "then zero2 micro-batch 8"]
    assert filters.status_row(dict(st, memory=None)).endswith("memory - GiB")


def test_a_worker_of_a_stalled_run_is_stalled_with_it():
    """Only the master's supervisor marks a stall: a worker whose ranks run reads as stalled while
    the master does, in status.yml's rows and follow's node states alike."""
    from plugins.filter import cluster as filters  # noqa: PLC0415 - the control node's filters, for this test alone
    worker = {"host": "node2", "state": "running", "ranks_alive": 1, "last": {}}
    assert filters.status_row(worker, "stalled").startswith("node2: stalled, ranks alive 1")
    assert filters.status_row(worker, "running").startswith("node2: running, ")
    assert records.in_attempt(dict(worker, state="failed"), "stalled")["state"] == "failed"


@pytest.mark.parametrize("action", ["status", "log"])
def test_a_followed_polls_wait_returns_when_the_run_ends_and_not_before(tmp_path, action):
    """--wait S: up to S seconds while the run's supervisor lives (running all through: after S),
    at once when it has ended or ends meanwhile."""
    def timed(*extra):
        t0 = time.monotonic()
        r = helper(action, tmp_path, "r1", *extra)
        assert r.returncode == 0, r.stderr
        return time.monotonic() - t0, json.loads(r.stdout)

    supervisor = subprocess.Popen(["sleep", "30"])
    (tmp_path / rundir.RunDir.PID).write_text(f"{supervisor.pid}\n")
    try:
        took, out = timed("--wait", "1.5")
        assert 1.5 <= took < 10 and out.get("state", "running") == "running", (took, out)
    finally:
        supervisor.kill()
        supervisor.wait()
    took, _ = timed("--wait", "20")  # ended before the poll
    assert took < 10, took
    supervisor = subprocess.Popen(["sleep", "2"])
    threading.Thread(target=supervisor.wait, daemon=True).start()  # reaped as init reaps it on a node
    (tmp_path / rundir.RunDir.PID).write_text(f"{supervisor.pid}\n")
    took, _ = timed("--wait", "60")  # ends during the poll
    assert 2 <= took < 15, took
