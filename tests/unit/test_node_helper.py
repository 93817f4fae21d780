"""The node helper (node/dscnode, run as the built dsc_node.pyz) on this machine: run files, the
launch lock and the active run, free ports, status states and failure parsing. Real processes, no
container.

    .venv/bin/pytest tests/unit/test_node_helper.py -q
"""
import base64
import io
import json
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

import dscplan
from dscnode import checks, entry, launch, probe, procs, records, rundir, supervisor

ROOT = Path(__file__).resolve().parents[2]
HELPER = dscplan.node_helper(ROOT)[0]  # the file the nodes run, built as the plan builds it


def helper(*args, stdin=None, env=None):
    return subprocess.run([sys.executable, str(HELPER), *map(str, args)], input=stdin, text=True,
                          capture_output=True, timeout=60, env=env)


def archive(files):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return base64.b64encode(buf.getvalue()).decode()


def test_write_run_writes_files_and_code_then_refuses_a_used_dir(tmp_path):
    run = tmp_path / "runs" / "r1"
    spec = {"files": {"hostfile": "a slots=1\n", "run_id": "r1\n"},
            "code": archive({"train.py": "print(1)\n"}), "code_dest": str(run / "code")}
    r = helper("write-run", run, stdin=json.dumps(spec))
    assert r.returncode == 0, r.stderr
    assert (run / "hostfile").read_text() == "a slots=1\n" and (run / "code" / "train.py").exists()
    (run / rundir.RunDir.LOG).write_text("started\n")
    again = helper("write-run", run, stdin=json.dumps(spec))
    assert again.returncode == 4 and "already holds a run" in again.stdout
    assert helper("write-run", run, "--resume", stdin=json.dumps({"files": {}})).returncode == 0


@pytest.mark.parametrize("name", ["../evil.py", "/tmp/evil.py"])
def test_write_run_refuses_code_that_leaves_its_folder(tmp_path, name):
    spec = {"files": {}, "code": archive({name: "x"}), "code_dest": str(tmp_path / "r" / "code")}
    r = helper("write-run", tmp_path / "r", stdin=json.dumps(spec))
    assert r.returncode == 4 and "refused code archive entries" in r.stdout
    assert not (tmp_path / "evil.py").exists()


def test_write_run_refuses_file_names_with_a_path(tmp_path):
    r = helper("write-run", tmp_path / "r", stdin=json.dumps({"files": {"../x": "y"}}))
    assert r.returncode == 4 and not (tmp_path / "x").exists()


def test_free_port_skips_a_port_in_use():
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen(1)
    busy = s.getsockname()[1]
    try:
        assert checks.free_port(busy, busy) is None
        assert checks.free_port(busy, busy + 1) in (busy + 1, None)
    finally:
        s.close()


def test_the_preflight_listener_counts_connections_and_goes_at_a_release():
    """preflight's TCP check on loopback: a node's connection is seen; a release (sent once every
    node's attempt has ended) ends the listener at once, not at its timeout, and is not a node."""
    port = checks.free_port(29600, 29700)
    out = {}
    listener = threading.Thread(target=lambda: out.update(checks.listen({"port": port, "expect": 2, "seconds": 30})))
    t0 = time.time()
    listener.start()
    time.sleep(0.3)
    assert checks.connect({"host": "127.0.0.1", "port": port, "timeout": 3})["ok"]
    assert checks.connect({"host": "127.0.0.1", "port": port, "timeout": 3, "release": True})["ok"]
    listener.join(10)
    assert not listener.is_alive() and time.time() - t0 < 5
    assert out == {"port": port, "seen": ["127.0.0.1"]}


def test_pid_alive_reads_dead_and_other_users_processes(tmp_path):
    pid_file = tmp_path / "pid"
    pid_file.write_text(str(os.getpid()))
    assert procs.pid_alive(pid_file) == os.getpid()
    pid_file.write_text("1")  # init: alive; EPERM for a non-root reader is still alive
    assert procs.pid_alive(pid_file) == 1
    dead = subprocess.Popen(["true"])
    dead.wait()
    pid_file.write_text(str(dead.pid))
    assert procs.pid_alive(pid_file) is None
    pid_file.write_text("garbage")
    assert procs.pid_alive(pid_file) is None


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


@pytest.mark.parametrize("line,expect", [
    ("node2: [2026] [INFO] [launch.py:335] Process 7 exits with return code = -9", ("node2", "signal", "a rank on node2 was killed by SIGKILL")),
    ("node1: [INFO] exits with return code = 3", ("node1", "exit", "ranks on node1 exited with code 3")),
    ("pdsh@node1: node2: ssh exited with exit code 255", ("node2", "lost", "the connection to node2 was lost (node down or sshd gone)")),
    ("node1: [INFO] exits with return code = 0", None),
    ("some other line", None),
])
def test_failure_lines_from_deepspeed_and_pdsh(line, expect):
    ev = supervisor.failure_event(line)
    if expect is None:
        assert ev is None
    else:
        assert (ev["node"], ev["kind"], supervisor.describe(ev)) == expect


def wait_for(path, seconds=20):
    deadline = time.time() + seconds
    while time.time() < deadline and not path.exists():
        time.sleep(0.1)
    return path.exists()


def launcher_script(tmp_path, body):
    """A stand-in for DeepSpeed's launcher: start puts --master_port N right after it."""
    path = tmp_path / f"launcher-{abs(hash(body))}.sh"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_start_records_port_and_exit_code_and_refuses_while_a_run_is_active(tmp_path):
    root = tmp_path / "runs"
    (root / "long").mkdir(parents=True)
    (root / "short").mkdir()
    env = dict(os.environ)
    first = helper("start", root / "long", "long", "--run-root", root, "--ports", 29800, 29810, "--",
                   launcher_script(tmp_path, "sleep 30"), env=env)
    assert first.returncode == 0, first.stderr
    started = json.loads(first.stdout)
    assert started["started"] and 29800 <= started["port"] <= 29810
    assert (root / "long" / "master_port").read_text().strip() == str(started["port"])
    try:
        second = helper("start", root / "short", "short", "--run-root", root, "--ports", 29800, 29810,
                        "--", launcher_script(tmp_path, "exit 0"), env=env)
        assert second.returncode == 4 and json.loads(second.stdout)["active"]["run_id"] == "long"
        assert not (root / "short" / "launcher.log").exists()
        # The same run id again (two launches racing past the plan), even with replace: refused.
        again = helper("start", root / "long", "long", "--run-root", root, "--ports", 29800, 29810,
                       "--replace", "--", launcher_script(tmp_path, "exit 0"), env=env)
        assert again.returncode == 4 and "run long is already running" in json.loads(again.stdout)["error"]
    finally:
        stopped = json.loads(helper("stop", "long", "--grace", 2, "--run-dir", root / "long").stdout)
    assert stopped["left"] == 0 and (root / "long" / "stopped").exists()
    # The supervisor outlived its launcher (the command after "--" matches the runner pattern)
    # and recorded how the run ended.
    assert (root / "long" / "exit_code").exists()
    assert not (root / "long" / "launcher.pid").exists()
    third = helper("start", root / "short", "short", "--run-root", root, "--ports", 29800, 29810,
                   "--", launcher_script(tmp_path, "echo hello; exit 3"), env=env)
    assert third.returncode == 0
    assert wait_for(root / "short" / "exit_code")
    assert (root / "short" / "exit_code").read_text().strip() == "3"
    log = (root / "short" / "launcher.log").read_text()
    assert "hello" in log
    assert records.status(root / "short", "short")["state"] == "failed"


def test_start_puts_the_chosen_port_after_the_launcher(tmp_path):
    root = tmp_path / "runs"
    (root / "r").mkdir(parents=True)
    launcher = launcher_script(tmp_path, 'echo ARGS "$@"')
    r = helper("start", root / "r", "r", "--run-root", root, "--ports", 29820, 29830, "--",
               launcher, "--hostfile", "h", "train.py")
    assert r.returncode == 0
    assert wait_for(root / "r" / "exit_code")
    port = json.loads(r.stdout)["port"]
    assert f"ARGS --master_port {port} --hostfile h train.py" in (root / "r" / "launcher.log").read_text()


def test_start_with_the_masters_port_takes_it_even_while_it_is_held(tmp_path):
    """no_ssh mode: a node other than the master is given the port the master took; only the
    master's rank 0 listens there, so that it is held (here, on this host) changes nothing."""
    root = tmp_path / "runs"
    (root / "r").mkdir(parents=True)
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        taken = held.getsockname()[1]
        r = helper("start", root / "r", "r", "--run-root", root, "--port", taken, "--",
                   launcher_script(tmp_path, 'echo ARGS "$@"'), "train.py")
    assert r.returncode == 0 and json.loads(r.stdout)["port"] == taken
    assert wait_for(root / "r" / "exit_code")
    assert f"ARGS --master_port {taken} train.py" in (root / "r" / "launcher.log").read_text()


def test_probe_reports_interfaces_and_runs(tmp_path):
    (tmp_path / "r1").mkdir()
    out = json.loads(helper("probe", "--run-root", tmp_path).stdout)
    assert "lo" in out["interfaces"] and isinstance(out["gpus"], list) and out["cpus"] >= 1
    assert [r["id"] for r in out["runs"]] == ["r1"]


def test_a_worker_with_live_ranks_is_running_and_records_the_exit(tmp_path):
    """A worker has no launcher of its own: its ranks (found by the run's id) say it runs; the
    supervisor's write-exit gives it the run's end."""
    # A stand-in for a node's launch.py (its command line names it) with one rank, which has a
    # DataLoader-like worker of its own: one rank alive, not two.
    worker = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
    launcher = ("import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]])", worker)
    rank = subprocess.Popen([sys.executable, "-c", launcher[0], launcher[1], "deepspeed.launcher.launch"],
                            env=dict(os.environ, DSC_RUN_ID="w-run"))
    try:
        deadline = time.time() + 10
        while time.time() < deadline and len(procs.procs("w-run")) < 3:
            time.sleep(0.1)
        st = records.status(tmp_path, "w-run")
        assert st["state"] == "running" and st["ranks_alive"] == 1 and st["processes"] == 3
        (tmp_path / "ext" / "cpu_adam").mkdir(parents=True)
        (tmp_path / "ext" / "cpu_adam" / "lock").write_text("")  # left by a rank killed mid-build
        os.utime(tmp_path / "ext" / "cpu_adam" / "lock", (time.time() - 600,) * 2)
        stopped = json.loads(helper("stop", "w-run", "--grace", 2, "--run-dir", tmp_path,
                                    "--ext-dir", tmp_path / "ext").stdout)
        assert stopped == {"found": 3, "left": 0, "left_pids": [],
                           "removed_locks": [str(tmp_path / "ext" / "cpu_adam" / "lock")]}
    finally:
        rank.kill()
    assert helper("write-exit", tmp_path, 0).returncode == 0
    assert records.status(tmp_path, "w-run")["state"] == "finished"


def test_the_envs_python_runs_as_its_owner_never_as_root():
    """versions() runs the env's python as the env's owner: a .pth planted there by the training
    user must not run as root (here: any user's id instead of root's)."""
    rc, out, _ = procs.run(["id", "-u"], user="nobody")
    expected = str(__import__("pwd").getpwnam("nobody").pw_uid) if os.geteuid() == 0 else str(os.geteuid())
    assert rc == 0 and out.strip() == expected


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


def test_secrets_are_written_0600_beside_the_run_dir_never_in_it(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    r = helper("write-secrets", run_dir, stdin=json.dumps({"HF_TOKEN": "hf_abc"}))
    assert r.returncode == 0 and json.loads(r.stdout) == {"ok": True, "names": ["HF_TOKEN"]}
    path = tmp_path / "runs" / ".secrets" / "r1.json"
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert not any("hf_abc" in p.read_text() for p in run_dir.rglob("*") if p.is_file())


def test_the_entry_shim_runs_a_script_or_module_as_python_would_with_the_secrets(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    helper("write-secrets", run_dir, stdin=json.dumps({"HF_TOKEN": "hf_abc"}))
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    show = ("import json, os, sys\n"
            "print(json.dumps({'argv': sys.argv[1:], 'name': __name__, 'path0': sys.path[0],"
            " 'token': os.environ.get('HF_TOKEN'), 'flag': os.environ.get('DSC_SECRETS')}))\n")
    (code / "train.py").write_text(show)
    (code / "pkg" / "__init__.py").write_text("")
    (code / "pkg" / "run.py").write_text(show)
    env = dict(os.environ, DSC_RUN_DIR=str(run_dir), DSC_SECRETS="1")
    for target in (["--script", str(code / "train.py")], ["--module", "pkg.run"]):
        # as DeepSpeed's launcher starts it: --local_rank=N right after the program
        r = subprocess.run([sys.executable, str(HELPER), "--local_rank=0", "entry", *target, "--lr", "1"],
                           cwd=code, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out == {"argv": ["--local_rank=0", "--lr", "1"], "name": "__main__", "path0": str(code),
                       "token": "hf_abc", "flag": None}
    (tmp_path / "runs" / ".secrets" / "r1.json").unlink()
    r = subprocess.run([sys.executable, str(HELPER), "entry", "--script", str(code / "train.py")],
                       cwd=code, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "the run's secrets" in r.stderr and "Fix: resume with dsc_secrets given again" in r.stderr


@pytest.mark.parametrize("end,code", [("", 0), ("sys.exit(0)", 0), ("sys.exit(3)", 3),
                                      ("raise ValueError('boom')", 1)])
def test_a_finished_script_leaves_after_its_threads_and_atexit_handlers(tmp_path, end, code):
    """After the script returns (or exits 0) the shim joins its non-daemon threads, runs its
    atexit handlers and flushes, then leaves without interpreter finalization; a failure keeps
    its own exit code and traceback."""
    (tmp_path / "train.py").write_text(
        "import atexit, sys, threading, time\n"
        "def later():\n"
        "    time.sleep(0.5)\n"
        "    open('thread.txt', 'w').write('done')\n"
        "threading.Thread(target=later).start()\n"
        "atexit.register(lambda: open('atexit.txt', 'w').write(open('thread.txt').read()))\n"
        "class Finalized:\n"  # what interpreter finalization would run: module teardown
        "    def __del__(self):\n"
        "        sys.__stderr__.write('finalized')\n"
        "import json; json.kept = Finalized()\n"
        "print('unflushed', end='')\n"
        f"{end}\n")
    r = subprocess.run([sys.executable, str(HELPER), "entry", "--script", "train.py"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == code, r.stderr
    assert r.stdout == "unflushed" and (tmp_path / "atexit.txt").read_text() == "done"
    assert ("ValueError: boom" in r.stderr) is (code == 1)
    assert ("finalized" in r.stderr) is (code != 0)


def test_status_reads_any_scripts_progress_when_there_are_no_metrics(tmp_path):
    run = tmp_path / "r1"
    run.mkdir()
    (run / "progress.jsonl").write_text(json.dumps({"step": 4, "loss": 2.5, "lr": 1e-3}) + "\n"
                                        + json.dumps({"step": 8, "loss": 2.1, "lr": 1e-3}) + "\n")
    assert records.status(run, "r1")["last"]["step"] == 8
    (run / "metrics.jsonl").write_text(json.dumps({"step": 9, "loss": 2.0, "tokens_per_s": 10}) + "\n")
    assert records.status(run, "r1")["last"]["tokens_per_s"] == 10  # train.run's own, richer


def test_latest_checkpoint_placeholder_takes_the_highest_step_or_drops_the_option(tmp_path):
    for name in ("checkpoint-9", "checkpoint-40", "checkpoint-100x", "other"):
        (tmp_path / "out" / name).mkdir(parents=True)
    argv = ["deepspeed", "run.py", "--resume_from_checkpoint", "{latest:out/checkpoint-*}"]
    assert supervisor.resolve_latest(argv, tmp_path)[-1] == "out/checkpoint-100x"
    (tmp_path / "out" / "checkpoint-100x").rmdir()
    assert supervisor.resolve_latest(argv, tmp_path)[-2:] == ["--resume_from_checkpoint", "out/checkpoint-40"]
    assert supervisor.resolve_latest(argv, tmp_path / "nothing") == ["deepspeed", "run.py"]


def test_latest_checkpoint_never_takes_a_name_with_a_line_end(tmp_path):
    """A checkpoint name the training user made with a newline (pdsh's runner passes arguments
    unquoted: a second command) is never chosen; a placeholder with one is not a placeholder."""
    (tmp_path / "out" / "checkpoint-9").mkdir(parents=True)
    for name in ("checkpoint-99\n", "checkpoint-98\r", "checkpoint-97\ntouch"):
        (tmp_path / "out" / name).mkdir()
    argv = ["run.py", "--resume_from_checkpoint", "{latest:out/checkpoint-*}"]
    assert supervisor.resolve_latest(argv, tmp_path)[-1] == "out/checkpoint-9"
    assert supervisor.resolve_latest(["{latest:out/checkpoint-*}\n"], tmp_path) == ["{latest:out/checkpoint-*}\n"]


def test_a_run_without_a_new_step_for_the_limit_is_stalled_until_the_next_step(tmp_path):
    run = rundir.RunDir(tmp_path)
    progress = tmp_path / "progress.jsonl"

    def step(n):
        with progress.open("a") as f:
            f.write(json.dumps({"step": n, "loss": 1.0}) + "\n")
    watch = supervisor.Stall(run, timeout_s=0, min_s=5)
    assert watch.check(100.0) is None  # no step yet (start-up, op builds): nothing judged
    step(1)
    assert watch.check(101.0) is None
    step(3)
    assert watch.check(103.0) is None and watch.limit() == 10  # 10 x the median 1 s/step, over min_s
    assert watch.check(112.0) is None
    stalled = watch.check(113.5)
    assert stalled == {"step": 3, "since": 103.0, "limit_s": 10.0}
    assert json.loads((tmp_path / "stalled.json").read_text())["step"] == 3
    step(4)
    assert watch.check(114.0) is None and not (tmp_path / "stalled.json").exists()
    assert supervisor.Stall(run, timeout_s=30).limit() == 30
    restarted = supervisor.Stall(run, timeout_s=0, min_s=5)  # a restart: step 4 is the last attempt's
    assert restarted.check(200.0) is None and restarted.check(300.0) is None
    step(2)
    assert restarted.check(301.0) is None and restarted.check(306.5)["step"] == 2
    assert supervisor.describe({"kind": "stall", "limit_s": 10.0, "step": 3}) == \
        "the run stalled: no step for 10 s after step 3"


def test_after_import_patches_a_module_once_on_its_first_import(tmp_path):
    (tmp_path / "pkg_after").mkdir()
    (tmp_path / "pkg_after" / "__init__.py").write_text("")
    (tmp_path / "pkg_after" / "engine.py").write_text("class Engine:\n    def step(self):\n        return 'original'\n")
    seen = []

    def patch(module):
        seen.append(module.__name__)
        module.Engine.step = lambda self: "patched"
    finder = entry.AfterImport({"pkg_after.engine": patch})
    sys.path.insert(0, str(tmp_path))
    sys.meta_path.insert(0, finder)
    try:
        from pkg_after.engine import Engine  # noqa: PLC0415 - the import is what is tested
        import pkg_after.engine  # noqa: F401, PLC0415 - a second import: no second patch
        assert Engine().step() == "patched" and seen == ["pkg_after.engine"]
    finally:
        sys.meta_path.remove(finder)
        sys.path.remove(str(tmp_path))


def test_a_pid_file_names_one_process_never_a_later_one_with_the_same_number(tmp_path):
    pid_file = tmp_path / "launcher.pid"
    procs.write_pid(pid_file, os.getpid())
    assert procs.pid_alive(pid_file) == os.getpid()
    pid, started = pid_file.read_text().split()
    pid_file.write_text(f"{pid} {int(started) - 1}\n")  # the number reused by a later process
    assert procs.pid_alive(pid_file) is None
    pid_file.write_text(f"{pid}\n")  # written before start times were kept
    assert procs.pid_alive(pid_file) == os.getpid()


def test_an_op_build_lock_is_stale_only_when_old_and_no_builder_works_in_its_directory(tmp_path):
    held, left = tmp_path / "fused_adam", tmp_path / "cpu_adam"
    for d in (held, left):
        d.mkdir()
        (d / "lock").write_text("")
    old = time.time() - 600
    os.utime(left / "lock", (old, old))
    os.utime(held / "lock", (old, old))
    young = tmp_path / "shm_comm"
    young.mkdir()
    (young / "lock").write_text("")
    builder = subprocess.Popen(["sleep", "30"], cwd=held)  # as ninja runs in the op's directory
    try:
        locks = {Path(x["path"]).parent.name: x["stale"] for x in procs.jit_locks(tmp_path)}
        assert locks == {"fused_adam": False, "cpu_adam": True, "shm_comm": False}
        assert procs.remove_stale_locks(tmp_path) == [str(left / "lock")]
        assert (held / "lock").exists() and (young / "lock").exists() and not (left / "lock").exists()
    finally:
        builder.kill()
        builder.wait()
    assert procs.jit_locks(tmp_path / "none") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root (CI runs as root)")
def test_jit_locks_are_read_as_the_training_user_without_running_an_interpreter(tmp_path):
    """As root the check drops to the training user in a forked child: root's own interpreter
    (here this test's, which 'nobody' may not be able to run) is never executed as that user."""
    ext = Path(tempfile.mkdtemp(prefix="dsc-ext-"))
    try:
        ext.chmod(0o755)
        (ext / "cpu_adam").mkdir(mode=0o755)
        (ext / "cpu_adam" / "lock").write_text("")
        old = time.time() - 600
        os.utime(ext / "cpu_adam" / "lock", (old, old))
        found = procs.jit_locks_as(str(ext), "nobody")
        assert [(Path(x["path"]).parent.name, x["stale"]) for x in found] == [("cpu_adam", True)]
        ext.chmod(0o700)  # what the user cannot read is reported, not taken for "no locks"
        assert procs.jit_locks_as(str(ext), "nobody") == [
            {"path": str(ext), "error": f"{ext}: Permission denied"}]
    finally:
        shutil.rmtree(ext)


def test_write_run_refuses_a_run_directory_that_is_a_symbolic_link(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r1").symlink_to(victim)
    out = launch.write_run(str(tmp_path / "runs" / "r1"), {"files": {"hostfile": "x"}})
    assert out["ok"] is False and "is a symbolic link" in out["error"] and list(victim.iterdir()) == []
    assert probe.links(tmp_path / "runs") == ["r1"]


def test_the_exit_code_is_recorded_on_a_disk_too_full_for_a_new_file(tmp_path, monkeypatch):
    run = rundir.RunDir(tmp_path)
    supervisor.reserve_exit(run)

    def full(path, text):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(supervisor, "write_atomic", full)
    supervisor.record_exit(run, -9)
    assert (tmp_path / "exit_code").read_text() == "-9\n" and not (tmp_path / ".exit_code.reserve").exists()
    assert records.status(tmp_path, "r-full")["exit_code"] == "-9"


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


@pytest.mark.parametrize("release,ufw_conf,comms,want", [
    ('ID=debian\n', "ENABLED=yes\n", ["sshd", "bash"], {"os": ["debian"], "ufw": True, "firewalld": False}),
    ('ID="rocky"\nID_LIKE="rhel centos fedora"\n', "", ["systemd", "firewalld"],
     {"os": ["rocky", "rhel", "centos", "fedora"], "ufw": False, "firewalld": True}),
    ('ID=ubuntu\nID_LIKE=debian\n', "# ENABLED=yes\nENABLED=no\n", ["firewalld-helper"],
     {"os": ["ubuntu", "debian"], "ufw": False, "firewalld": False}),
    (None, None, [], {"os": [], "ufw": False, "firewalld": False}),
])
def test_the_probe_reads_the_running_firewall_from_files(tmp_path, release, ufw_conf, comms, want):
    """The probe's firewall view (the plan refuses the other firewall from it): /etc/os-release,
    ufw's ENABLED in /etc/ufw/ufw.conf, and a process named firewalld in /proc."""
    if release is not None:
        (tmp_path / "etc" / "ufw").mkdir(parents=True)
        (tmp_path / "etc" / "os-release").write_text(release)
        (tmp_path / "etc" / "ufw" / "ufw.conf").write_text(ufw_conf)
    for pid, comm in enumerate(comms, start=1):
        (tmp_path / "proc" / str(pid)).mkdir(parents=True)
        (tmp_path / "proc" / str(pid) / "comm").write_text(comm + "\n")
    assert probe.firewalls(tmp_path) == want


def test_a_secrets_file_is_kept_beside_its_run_goes_with_it_and_is_never_a_run(tmp_path):
    """The run's secrets stay (0600) for resume and restarts; .secrets is never listed as a run
    (resume without run_id took it for the newest); the probe says which runs have them; a
    secrets file whose run directory is gone is removed at the next write-secrets or start."""
    root = tmp_path / "runs"
    for run_id in ("r1", "r2"):
        (root / run_id).mkdir(parents=True)
        helper("write-secrets", root / run_id, stdin=json.dumps({"WANDB_API_KEY": "k-" + run_id}))
    assert oct((root / ".secrets" / "r1.json").stat().st_mode & 0o777) == "0o600"
    assert oct((root / ".secrets").stat().st_mode & 0o777) == "0o700"
    listed = records.runs(root)
    assert sorted(r["id"] for r in listed) == ["r1", "r2"] and all(r["secrets"] for r in listed)
    assert [r["id"] for r in records.runs_table(root)] != [] and ".secrets" not in [r["id"] for r in records.runs_table(root)]
    shutil.rmtree(root / "r1")
    (root / "r3").mkdir()
    helper("write-secrets", root / "r3", stdin=json.dumps({"WANDB_API_KEY": "k-r3"}))
    assert sorted(p.name for p in (root / ".secrets").iterdir()) == ["r2.json", "r3.json"]
    shutil.rmtree(root / "r2")
    assert rundir.prune_secrets(root) == ["r2"]
    assert [r["secrets"] for r in records.runs(root)] == [True]
    os.unlink(root / ".secrets" / "r3.json")
    os.symlink("/etc/hostname", root / ".secrets" / "r3.json")  # planted: not a secrets file
    assert [r["secrets"] for r in records.runs(root)] == [False]


def test_the_probe_reports_who_owns_an_existing_interpreter_and_the_plan_judges_it(tmp_path):
    """probe --existing-python: owner and mode of the interpreter, every directory above it as
    written and as resolved (a venv's bin/python links to its base), and its lib directories,
    read with lstat; the plan runs it as root only when all are root's and none is writable by
    group or others, else as its one owner, else refuses."""
    env = tmp_path / "opt" / "env"
    (env / "bin").mkdir(parents=True)
    (env / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    (env / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    for d in (tmp_path, tmp_path / "opt", env, env / "bin", env / "lib"):
        d.chmod(0o755)
    py = str(env / "bin" / "python")
    out = json.loads(helper("probe", "--existing-python", py).stdout)["existing_python"]
    paths = [e["path"] for e in out["entries"]]
    assert paths[:1] == ["/"] and py in paths and os.path.realpath(sys.executable) in paths
    assert str(env / "lib" / "python3.11" / "site-packages") in paths
    assert next(e for e in out["entries"] if e["path"] == py)["kind"] == "link"
    me = __import__("pwd").getpwuid(os.geteuid()).pw_name
    owner, problem = dscplan.existing_owner("node1", py, out)
    assert problem is None and owner == ("root" if os.geteuid() == 0 else me)
    (env / "lib" / "python3.11" / "site-packages").chmod(0o775)
    owner, problem = dscplan.existing_owner("node1", py, probe.path_owners(py))
    assert owner is None and f"{env}/lib/python3.11/site-packages is writable by group (mode 775" in problem
    (env / "lib" / "python3.11" / "site-packages").chmod(0o755)
    if os.geteuid() == 0:  # a user's env: run as that user only
        nobody = pwd.getpwnam("nobody")
        for d in (env, env / "bin"):
            os.chown(d, nobody.pw_uid, nobody.pw_gid)
        assert dscplan.existing_owner("node1", py, probe.path_owners(py)) == ("nobody", None)
    assert "error" in probe.path_owners(str(tmp_path / "none" / "bin" / "python"))


def test_each_rank_records_its_peak_after_its_first_steps_and_status_sets_it_against_the_prediction(tmp_path, monkeypatch):
    """The entry shim's engine hook: every rank (not only rank 0) appends its
    max_memory_allocated after each of its first 3 optimizer steps with the configuration it ran;
    status and runs set the largest against memory.json's prediction and say when it is over by
    more than 5 %, with the ratio."""
    run = tmp_path / "r1"
    run.mkdir()
    gib = 2 ** 30
    (run / "memory.json").write_text(json.dumps({"key": "k1", "preset": "zero1", "micro_batch": 16, "world": 2,
                                                 "predicted": 50 * gib, "tolerance": 1.05}))

    class Engine:
        def __init__(self, rank):
            self.global_rank, self.global_steps, self.device = rank, 0, None

        def backward(self, loss):
            return loss

        def step(self):
            self.global_steps += 1

        def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True):  # noqa: B006
            return None
    peaks = {0: 60 * gib, 1: 72 * gib}
    monkeypatch.setattr(entry, "peak_allocated", lambda engine: peaks[engine.global_rank])
    watch = entry.EngineWatch(run / "progress.jsonl", measured=run / "memory.jsonl")
    watch.patch(Engine)
    for rank in (0, 1):
        engine = Engine(rank)
        for _ in range(5):
            engine.step()
    lines = [json.loads(x) for x in (run / "memory.jsonl").read_text().splitlines()]
    assert [(m["rank"], m["step"]) for m in lines] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert all((m["preset"], m["micro_batch"]) == ("zero1", 16) for m in lines)
    mem = records.status(run, "r1")["memory"]
    assert (mem["predicted"], mem["measured"], mem["ratio"], mem["over"], mem["ranks"]) == (50 * gib, 72 * gib, 1.44, True, 2)
    assert mem["note"].startswith("measured 72.00 GiB per GPU against the predicted 50.00 GiB (x1.44): over the "
                                  "prediction by 44 %")
    assert next(r for r in records.runs(tmp_path) if r["id"] == "r1")["memory"]["key"] == "k1"
    # after a step down, the measured peaks of the earlier configuration are not this one's
    (run / "memory.json").write_text(json.dumps({"key": "k1", "preset": "zero2", "micro_batch": 8, "world": 2,
                                                 "predicted": 30 * gib}))
    mem = records.status(run, "r1")["memory"]
    assert mem["measured"] is None and mem["ratio"] is None and not mem["over"]
    # off the GPU nothing is recorded
    monkeypatch.undo()
    assert entry.peak_allocated(Engine(0)) is None or "torch" in sys.modules


def ladder(run, micro_batches=(16, 8, 4)):
    steps = [{"preset": f"zero{i + 1}", "micro_batch": mb, "grad_accum": 64 // mb, "train_batch": 64,
              "predicted": mb * 2 ** 30, "ds_config": {"train_micro_batch_size_per_gpu": mb}}
             for i, mb in enumerate(micro_batches)]
    (run / "auto.json").write_text(json.dumps({"ladder": steps, "index": 0}))
    (run / "ds_config.json").write_text(json.dumps(steps[0]["ds_config"]))
    (run / "memory.json").write_text(json.dumps({"key": "k", "preset": "zero1", "micro_batch": 16, "predicted": 1}))
    (run / "launch.json").write_text(json.dumps({"preset": "zero1", "dsc_micro_batch": 16, "dsc_train_batch": 64}))


def test_an_out_of_memory_error_in_the_first_steps_steps_down_preset_autos_ladder(tmp_path):
    """The supervisor (max_restarts 0): a rank's torch.OutOfMemoryError at micro-batch 16 and 8
    does not fail the run: each attempt steps down the ladder (ds_config, memory.json and
    launch.json on this node), is recorded with its cause and shown by status; micro-batch 4
    trains and the run finishes with the configuration that trained in its launch record."""
    root = tmp_path / "runs"
    run = root / "auto1"
    run.mkdir(parents=True)
    ladder(run)
    script = launcher_script(tmp_path, 'if grep -q \'"train_micro_batch_size_per_gpu": 4\' "$DSC_RUN_DIR/ds_config.json"; '
                                       'then echo trained; exit 0; fi\n'
                                       'echo "node1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"\n'
                                       'echo "node1: [launch] exits with return code = 1"; exit 1')
    started = helper("start", run, "auto1", "--run-root", root, "--ports", 29820, 29830, "--", script)
    assert started.returncode == 0, started.stderr
    assert wait_for(run / "exit_code", 30)
    assert (run / "exit_code").read_text().strip() == "0", (run / "launcher.log").read_text()
    downs = [json.loads(x) for x in (run / "step_downs.jsonl").read_text().splitlines()]
    assert [(d["preset"], d["micro_batch"], d["next"]["micro_batch"]) for d in downs] == [("zero1", 16, 8), ("zero2", 8, 4)]
    assert all("torch.OutOfMemoryError" in d["cause"] for d in downs)
    assert json.loads((run / "launch.json").read_text())["dsc_micro_batch"] == 4
    assert json.loads((run / "launch.json").read_text())["preset"] == "zero3"
    assert json.loads((run / "memory.json").read_text())["micro_batch"] == 4
    assert json.loads((run / "auto.json").read_text())["index"] == 2
    st = records.status(run, "auto1")
    assert st["state"] == "finished" and st["restarts"] == 0 and len(st["step_downs"]) == 2
    assert "stepping down to zero2 micro-batch 8" in (run / "launcher.log").read_text()


def test_no_step_down_for_another_error_a_run_past_its_first_steps_or_a_spent_ladder(tmp_path):
    run = rundir.RunDir(tmp_path)
    ladder(tmp_path)
    assert not supervisor.step_down(run, [], None, 1)  # not out of memory
    (tmp_path / "progress.jsonl").write_text(json.dumps({"step": 4}) + "\n")
    assert not supervisor.step_down(run, [], "torch.OutOfMemoryError: CUDA out of memory", 1)  # trained already
    (tmp_path / "progress.jsonl").write_text(json.dumps({"step": 2}) + "\n")
    assert supervisor.step_down(run, [], "node1: torch.OutOfMemoryError: CUDA out of memory", 1)
    assert supervisor.step_down(run, [], "node1: torch.OutOfMemoryError: CUDA out of memory", 1)
    assert not supervisor.step_down(run, [], "node1: torch.OutOfMemoryError: CUDA out of memory", 1)  # spent
    assert len(records.step_downs(tmp_path)) == 2
    # a worker applies the step the supervisor sends it
    out = helper("step-down", tmp_path, 1)
    assert json.loads(out.stdout) == {"ok": True, "preset": "zero2", "micro_batch": 8}
    assert json.loads((tmp_path / "ds_config.json").read_text())["train_micro_batch_size_per_gpu"] == 8


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


def test_probe_reports_each_root_path_and_its_chain_with_links_never_followed(tmp_path):
    """The probe's root_paths: every path root creates or writes into, each directory above it
    read with lstat; a planted link is reported with its target and the chain stops there."""
    victim = tmp_path / "victim"
    victim.mkdir()
    root = tmp_path / "inst"
    root.mkdir()
    (root / "cache").symlink_to(victim)
    out = json.loads(helper("probe", "--run-root", root / "runs", "--install-root", root,
                            "--data-dir", tmp_path / "data", "--train-user", "nobody-here").stdout)
    by_path = {e["path"]: e for e in out["root_paths"]}
    cache = by_path[f"{root}/cache"]
    assert cache["var"] == "dsc_install_root" and cache["role"] == "user"
    assert [c["path"] for c in cache["chain"]][-2:] == [str(root), f"{root}/cache"]
    assert cache["chain"][-1]["kind"] == "link" and cache["chain"][-1]["target"] == str(victim)
    ext = by_path[f"{root}/cache/torch_extensions"]["chain"]
    assert ext[-1]["path"] == f"{root}/cache" and ext[-1]["kind"] == "link"  # never followed below
    assert by_path[str(root)]["role"] == "made" and by_path[str(root)]["chain"][-1]["kind"] == "dir"
    assert by_path[f"{root}/runs"]["chain"][-1]["kind"] == "missing"
    assert by_path[str(tmp_path / "data")]["var"] == "dsc_data_dir"
    assert by_path["/usr/local/lib/dscluster"]["role"] == "root"
    assert not any(e["var"] == "dsc_train_user" for e in out["root_paths"])  # no such user: no home


def test_root_paths_name_the_ssh_files_of_the_training_users_home():
    paths = {e["path"]: e["var"] for e in probe.root_paths("/opt/d/", "/opt/d/runs", "", "/home/u")}
    assert paths["/opt/d"] == "dsc_install_root" and paths["/opt/d/runs"] == "dsc_run_root"
    assert {p for p, v in paths.items() if v == "dsc_train_user"} == {
        "/home/u/.ssh", "/home/u/.ssh/authorized_keys", "/home/u/.ssh/id_ed25519",
        "/home/u/.ssh/known_hosts", "/home/u/.ssh/config"}


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


class FakeEngine:
    """What the entry shim reads of DeepSpeed's engine: rank, steps, samples, ZeRO stage."""

    def __init__(self, rank=0, stage=3):
        self.global_rank, self.global_steps, self.global_samples, self.stage = rank, 0, 0, stage
        self.device = None

    def zero_optimization_stage(self):
        return self.stage

    def get_lr(self):
        return [1e-3]

    def backward(self, loss):
        return loss

    def step(self):
        self.global_steps += 1
        self.global_samples += 8

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True):  # noqa: B006
        return None


class FakeLoss:
    def __init__(self, value):
        self.value = value

    def detach(self):
        return self

    def float(self):
        return self

    def __add__(self, other):
        return FakeLoss(self.value + other.value)

    def item(self):
        return self.value


def trainer_callback_module():
    """transformers.trainer_callback as the entry shim sees it: a CallbackHandler whose
    on_train_begin HF's Trainer calls once state.max_steps is set."""
    class CallbackHandler:
        def on_train_begin(self, args, state, control):
            return control
    return type("module", (), {"CallbackHandler": CallbackHandler})


def test_the_entry_shim_logs_hf_trainers_total_and_the_pace_and_records_the_engines_zero_stage(tmp_path):
    class Engine(FakeEngine):
        pass
    watch = entry.EngineWatch(tmp_path / "progress.jsonl", every=0)
    watch.patch(Engine)
    module = trainer_callback_module()
    watch.watch_trainer(module)
    Engine(rank=1, stage=2)
    assert not (tmp_path / "engine.json").exists()  # global rank 0's alone
    engine = Engine(rank=0, stage=3)
    assert json.loads((tmp_path / "engine.json").read_text())["zero_stage"] == 3
    engine.backward(FakeLoss(2.0))
    engine.step()
    state = type("TrainerState", (), {"max_steps": 500})()
    assert module.CallbackHandler().on_train_begin(None, state, "control") == "control"
    for loss in (1.5, 1.0):
        engine.backward(FakeLoss(loss))
        engine.step()
    lines = [json.loads(x) for x in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [(x["step"], x.get("total_steps"), x["loss"]) for x in lines] == [(1, None, 2.0), (2, 500, 1.5), (3, 500, 1.0)]
    assert lines[0]["step_time_s"] is None and lines[1]["step_time_s"] >= 0  # the first holds start-up
    # a Trainer that trains by epochs of an unknown length (max_steps 0) gives no total
    watch.total_steps = None
    module.CallbackHandler().on_train_begin(None, type("TrainerState", (), {"max_steps": 0})(), None)
    assert watch.total_steps is None


def test_the_entry_shim_takes_a_scripts_own_total_from_the_environment(tmp_path, monkeypatch):
    """train.run sets DSC_TOTAL_STEPS: follow shows step N/total from the first progress line,
    before its metrics.jsonl has one."""
    class Engine(FakeEngine):
        pass
    watch = entry.EngineWatch(tmp_path / "progress.jsonl", every=0)
    watch.patch(Engine)
    engine = Engine(rank=0, stage=0)
    monkeypatch.setenv(entry.EngineWatch.TOTAL_ENV, "400")
    engine.backward(FakeLoss(2.0))
    engine.step()
    monkeypatch.setenv(entry.EngineWatch.TOTAL_ENV, "")
    engine.backward(FakeLoss(1.0))
    engine.step()
    lines = [json.loads(x) for x in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [x.get("total_steps") for x in lines] == [400, None]
    assert records.status(tmp_path, "own")["total_steps"] is None  # the newest line has none


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


def test_start_answers_with_the_config_the_launch_message_shows(tmp_path):
    root = tmp_path / "runs"
    (root / "r").mkdir(parents=True)
    (root / "r" / "launch.json").write_text(json.dumps({"preset": "zero2", "dsc_ds_config_mode": "none"}))
    r = helper("start", root / "r", "r", "--run-root", root, "--ports", 29840, 29850, "--",
               launcher_script(tmp_path, "exit 0"))
    assert r.returncode == 0 and json.loads(r.stdout)["config"] == "its own ZeRO stage"
    assert wait_for(root / "r" / "exit_code")


def test_a_stop_on_purpose_names_who_stopped_it(tmp_path):
    """stop.yml's stop (--by stop.yml): the marker names it, status says it with the last step;
    a replacing launch's teardown names the new run on every node."""
    run = tmp_path / "r1"
    run.mkdir()
    (run / "launcher.log").write_text("x\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 7, "loss": 1.0}) + "\n")
    out = json.loads(helper("stop", "r1-not-running", "--grace", 0, "--run-dir", run, "--by", "stop.yml").stdout)
    assert out["left"] == 0 and (run / "stopped").read_text() == "stop.yml\n"
    (run / "exit_code").write_text("-15\n")  # what the supervisor records after the stop
    st = records.status(run, "r1-not-running")
    assert (st["state"], st["stopped_by"], st["last"]["step"]) == ("stopped", "stop.yml", 7)
    (run / "stopped").write_text("stopped\n")  # a marker that names no one (an earlier helper's)
    assert records.status(run, "r1-not-running")["stopped_by"] is None
    procs.teardown("r1-not-running", ["node1"], str(run), by="a launch with replace=true (run r2)")
    assert records.status(run, "r1-not-running")["stopped_by"] == "a launch with replace=true (run r2)"


def test_pdsh_gets_the_helpers_command_as_one_shell_line_each_argument_quoted(monkeypatch):
    """pdsh hands the other nodes' shells one line: a stop's --by with spaces and parentheses
    (a replacing launch's) must arrive as one argument, not as shell syntax."""
    seen = []
    monkeypatch.setattr(procs.subprocess, "run", lambda argv, **kw: seen.append(argv))
    by = "a launch with replace=true (run r2)"
    procs.on_others(["node1", "node2", "node3"], "stop", "r1", "--grace", 5, "--by", by)
    (argv,) = seen
    assert argv[:2] == ["pdsh", "-R"] and argv[argv.index("-w") + 1] == "node2,node3"
    assert shlex.split(argv[-1])[1:] == ["stop", "r1", "--grace", "5", "--by", by]


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


FAKE_OP_BUILDER = '''import json, os


class OpBuilder:
    """DeepSpeed's OpBuilder as the entry shim sees it: jit_load compiles the op into the node's
    JIT cache (here: writes its .so), after reading what the run has recorded meanwhile."""

    def __init__(self, name):
        self.name, self.seen = name, None

    def jit_load(self, verbose=True):
        records = os.path.join(os.environ["DSC_RUN_DIR"], "op_builds.jsonl")
        self.seen = [json.loads(x) for x in open(records)] if os.path.exists(records) else []
        if self.name == "broken":
            raise RuntimeError("ninja: build stopped")
        folder = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], self.name)
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, self.name + ".so"), "w").close()
        return "module " + self.name
'''


def test_each_rank_records_the_jit_op_builds_it_waits_on_and_status_says_so(tmp_path, monkeypatch):
    """A first use on this node (no .so in TORCH_EXTENSIONS_DIR): the shim, through its import
    hook on DeepSpeed's builder module, records the build's start before it compiles and its end
    after, failed or not; an op already in the cache only loads, unrecorded. Status reports an op
    building while a live process of the run started it, once however many ranks wait on it."""
    code, run, ext = tmp_path / "code", tmp_path / "run", tmp_path / "ext"
    (code / "deepspeed" / "ops" / "op_builder").mkdir(parents=True)
    run.mkdir()
    for pkg in ("deepspeed", "deepspeed/ops", "deepspeed/ops/op_builder"):
        (code / pkg / "__init__.py").write_text("")
    (code / "deepspeed" / "ops" / "op_builder" / "builder.py").write_text(FAKE_OP_BUILDER)
    (code / "train.py").write_text(
        "import json\n"
        "from deepspeed.ops.op_builder.builder import OpBuilder\n"
        "class CPUAdamBuilder(OpBuilder):\n"
        "    pass\n"
        "first = CPUAdamBuilder('cpu_adam')\n"
        "assert first.jit_load() == 'module cpu_adam'\n"
        "again = CPUAdamBuilder('cpu_adam')\n"
        "again.jit_load()\n"
        "try:\n"
        "    CPUAdamBuilder('broken').jit_load()\n"
        "except RuntimeError:\n"
        "    pass\n"
        "print(json.dumps({'first': first.seen, 'again': again.seen}))\n")
    env = dict(os.environ, DSC_RUN_DIR=str(run), TORCH_EXTENSIONS_DIR=str(ext), RANK="1")
    r = subprocess.run([sys.executable, str(HELPER), "entry", "--script", str(code / "train.py")],
                       cwd=code, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    (start,) = seen["first"]  # while cpu_adam compiled: its start, recorded
    assert (start["op"], start["builder"], start["event"], start["rank"]) == ("cpu_adam", "CPUAdamBuilder", "start", "1")
    assert records.op_build(run, set()) is None  # its process is gone
    lines = [json.loads(x) for x in (run / rundir.RunDir.OP_BUILDS).read_text().splitlines()]
    assert len(seen["again"]) == 2  # loaded from the cache: nothing recorded
    assert [(x["op"], x["event"], x.get("ok")) for x in lines] == [
        ("cpu_adam", "start", None), ("cpu_adam", "end", True), ("broken", "start", None), ("broken", "end", False)]
    # Two ranks of a live run wait on one build: one op, since the first started; a dead
    # process's start without an end counts for nothing.
    (run / rundir.RunDir.OP_BUILDS).write_text("".join(json.dumps(x) + "\n" for x in [
        dict(start, pid=101, time=1000.0), dict(start, pid=102, time=1002.0), dict(start, pid=103, op="fused_adam"),
        {"op": "cpu_adam", "event": "end", "pid": 102}]))
    build = records.op_build(run, {101, 102, 104})
    assert build == {"ops": ["cpu_adam"], "since": 1000.0, "note": (
        "building DeepSpeed op cpu_adam (first use on this node: compiled once, can take minutes; "
        "deepspeed_warm_ops with CPUAdamBuilder builds it at provision)")}
    monkeypatch.setattr(records, "procs", lambda run_id: [{"pid": 101, "cmd": "python -u dsc_node.pyz entry", "ppid": 1}])
    assert records.status(run, "r1")["op_build"] == build
    (run / rundir.RunDir.OP_BUILDS).unlink()
    assert records.status(run, "r1")["op_build"] is None
