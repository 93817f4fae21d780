"""A run's processes on this node (node/dscnode procs): pid files with start times, a worker's live
ranks, stop (here and through pdsh, naming who stopped it), commands run as the env's owner, and
torch's op-build locks. Real processes, no container.

    .venv/bin/pytest tests/unit/test_node_procs.py -q
"""
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dscnode import procs, records
from tests.unit.node_helpers import helper


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


def test_a_pid_file_names_one_process_never_a_later_one_with_the_same_number(tmp_path):
    pid_file = tmp_path / "launcher.pid"
    procs.write_pid(pid_file, os.getpid())
    assert procs.pid_alive(pid_file) == os.getpid()
    pid, started = pid_file.read_text().split()
    pid_file.write_text(f"{pid} {int(started) - 1}\n")  # the number reused by a later process
    assert procs.pid_alive(pid_file) is None
    pid_file.write_text(f"{pid}\n")  # written before start times were kept
    assert procs.pid_alive(pid_file) == os.getpid()


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
    printed = "node3: {\"a\": 1}\nnode2: {}\npdsh@node1: node9: ssh exited with exit code 255\nnode3: more\n"
    monkeypatch.setattr(procs.subprocess, "run", lambda argv, **kw: seen.append(argv) or
                        subprocess.CompletedProcess(argv, 0, printed, ""))
    by = "a launch with replace=true (run r2)"
    got = procs.on_others(["node1", "node2", "node3"], "stop", "r1", "--grace", 5, "--by", by)
    (argv,) = seen
    assert argv[:2] == ["pdsh", "-R"] and argv[argv.index("-w") + 1] == "node2,node3"
    assert shlex.split(argv[-1])[1:] == ["stop", "r1", "--grace", "5", "--by", by]
    # what each node printed, by pdsh's prefix (pdsh's own lines are no node's)
    assert got == {"node3": '{"a": 1}\nmore\n', "node2": "{}\n"}


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


def test_a_young_lock_made_while_the_stopped_runs_processes_lived_is_stale_at_once(tmp_path):
    """Every rank takes each JIT op's lock while it loads it, built or not: a run stopped at its
    start leaves a young lock that would hang the next run for good. Made after the stopped run's
    first process started (`since`), with no builder in its directory, it goes; an older one
    waits its minute."""
    (tmp_path / "fused_adam").mkdir()
    (tmp_path / "fused_adam" / "lock").write_text("")
    child = subprocess.Popen(["sleep", "30"])
    try:
        since = procs.started_at(child.pid)
        assert since is not None and abs(since - time.time()) < 5
    finally:
        child.kill()
        child.wait()
    assert [x["stale"] for x in procs.jit_locks(tmp_path)] == [False]
    assert [x["stale"] for x in procs.jit_locks(tmp_path, since=since + 60)] == [False]  # older than the run
    assert procs.remove_stale_locks(tmp_path, since=since - 5) == [str(tmp_path / "fused_adam" / "lock")]


def compilers_running():
    """Whether a process named as a compiler (procs.BUILDERS) runs on this machine now."""
    names = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            pass
    return any(name in procs.BUILDERS for name in names)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root (CI runs as root)")
def test_jit_locks_are_read_as_the_training_user_without_running_an_interpreter(tmp_path):
    """As root the check drops to the training user in a forked child: root's own interpreter
    (here this test's, which 'nobody' may not be able to run) is never executed as that user."""
    ext = Path(tempfile.mkdtemp(prefix="dsc-ext-"))
    try:
        (ext / "cpu_adam").mkdir()
        (ext / "cpu_adam" / "lock").write_text("")
        for path, mode in ((ext, 0o755), (ext / "cpu_adam", 0o755), (ext / "cpu_adam" / "lock", 0o644)):
            path.chmod(mode)  # whatever this process's umask
        old = time.time() - 600
        os.utime(ext / "cpu_adam" / "lock", (old, old))
        # Stale, unless a compiler the user cannot see into runs on this machine meanwhile (a
        # build elsewhere, e.g. beside this suite): then the lock is kept, as it would be there.
        for _ in range(20):
            before = compilers_running()
            found = procs.jit_locks_as(str(ext), "nobody")
            if before == compilers_running():
                break
        assert [(Path(x["path"]).parent.name, x["stale"]) for x in found] == [("cpu_adam", not before)]
        ext.chmod(0o700)  # what the user cannot read is reported, not taken for "no locks"
        assert procs.jit_locks_as(str(ext), "nobody") == [
            {"path": str(ext), "error": f"{ext}: Permission denied"}]
    finally:
        shutil.rmtree(ext)
