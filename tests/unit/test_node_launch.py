"""The node helper's launch (node/dscnode launch, rundir) on this machine, run as the built
dsc_node.pyz: write-run (the run's files and code, a used or linked run directory refused), start
(the master port after the launcher, the exit code recorded, refused while a run is active), and
the run's secrets file (0600 beside the run, gone with it, never a run). Real processes, no
container.

    .venv/bin/pytest tests/unit/test_node_launch.py -q
"""
import base64
import io
import json
import time
import os
import shutil
import socket
import tarfile

import pytest

from dscnode import launch, probe, records, rundir
from tests.unit.node_helpers import helper, wait_for, launcher_script


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


def test_a_resume_clears_the_last_attempts_end_on_every_node(tmp_path):
    """A worker of a stopped or failed run keeps the exit code the master's supervisor wrote to
    it; its ranks would train under that "failed" for the whole resumed run. The resume's write
    clears it, as the master's supervisor clears its own."""
    run = tmp_path / "r1"
    run.mkdir()
    for name, text in (("exit_code", "1\n"), ("failure.json", "{}"), ("ranks.started", "")):
        (run / name).write_text(text)
    assert records.status(run, "r1")["state"] == "failed"
    assert helper("write-run", run, "--resume", stdin=json.dumps({"files": {}})).returncode == 0
    assert sorted(p.name for p in run.iterdir()) == ["code"]
    assert records.status(run, "r1")["state"] == "not started"  # until its ranks start again


@pytest.mark.parametrize("name", ["../evil.py", "/tmp/evil.py"])
def test_write_run_refuses_code_that_leaves_its_folder(tmp_path, name):
    spec = {"files": {}, "code": archive({name: "x"}), "code_dest": str(tmp_path / "r" / "code")}
    r = helper("write-run", tmp_path / "r", stdin=json.dumps(spec))
    assert r.returncode == 4 and "refused code archive entries" in r.stdout
    assert not (tmp_path / "evil.py").exists()


def test_write_run_refuses_file_names_with_a_path(tmp_path):
    r = helper("write-run", tmp_path / "r", stdin=json.dumps({"files": {"../x": "y"}}))
    assert r.returncode == 4 and not (tmp_path / "x").exists()


def test_write_run_refuses_a_run_directory_that_is_a_symbolic_link(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r1").symlink_to(victim)
    out = launch.write_run(str(tmp_path / "runs" / "r1"), {"files": {"hostfile": "x"}})
    assert out["ok"] is False and "is a symbolic link" in out["error"] and list(victim.iterdir()) == []
    assert probe.links(tmp_path / "runs") == ["r1"]


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


def test_start_answers_with_the_config_the_launch_message_shows(tmp_path):
    root = tmp_path / "runs"
    (root / "r").mkdir(parents=True)
    (root / "r" / "launch.json").write_text(json.dumps({"preset": "zero2", "dsc_ds_config_mode": "none"}))
    r = helper("start", root / "r", "r", "--run-root", root, "--ports", 29840, 29850, "--",
               launcher_script(tmp_path, "exit 0"))
    assert r.returncode == 0 and json.loads(r.stdout)["config"] == "its own ZeRO stage"
    assert wait_for(root / "r" / "exit_code")


def test_secrets_are_written_0600_beside_the_run_dir_never_in_it(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    r = helper("write-secrets", run_dir, stdin=json.dumps({"HF_TOKEN": "hf_abc"}))
    assert r.returncode == 0 and json.loads(r.stdout) == {"ok": True, "names": ["HF_TOKEN"]}
    path = tmp_path / "runs" / ".secrets" / "r1.json"
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert not any("hf_abc" in p.read_text() for p in run_dir.rglob("*") if p.is_file())


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


def test_a_stop_kills_the_attempts_launcher_first_whatever_its_name_and_the_run_reads_stopped(tmp_path):
    """DeepSpeed's runner exits 0 when the pdsh it waits on dies of a signal. Stopped by its
    recorded pid (launcher.child) before anything else, a launcher no name pattern knows (here a
    script that, as the runner does, turns its child's death by a signal into exit 0; a wrapper
    that execs deepspeed.real is one) cannot record the stopped run as finished."""
    root = tmp_path / "runs"
    (root / "w").mkdir(parents=True)
    runner = launcher_script(tmp_path, "trap 'true' TERM\nsleep 60 & wait $!\nexit 0")
    started = helper("start", root / "w", "w", "--run-root", root, "--ports", 29820, 29830, "--", runner)
    assert started.returncode == 0, started.stderr
    assert wait_for(root / "w" / "launcher.child")
    time.sleep(0.5)  # the script is in its wait
    stopped = json.loads(helper("stop", "w", "--grace", 2, "--run-dir", root / "w").stdout)
    assert stopped["left"] == 0
    assert wait_for(root / "w" / "exit_code")
    assert (root / "w" / "exit_code").read_text().strip() == "-9"
    assert records.status(root / "w", "w")["state"] == "stopped"
