"""What root reads where the training user writes, with that user hostile: every file of a run
directory (and the lock files the probe hashes) replaced by a FIFO, a 1 TiB sparse file or a link
to a file only root may read. The probe, status, the runs table, the log and the history return in
their usual time, read none of it, and the probe lists each refusal for the plan to name (node,
path, what is wrong); the plan says so and goes on.

    .venv/bin/pytest tests/unit/test_node_hostile_files.py -q
"""
import json
import os
import time

import pytest

import dscplan
from dscnode import probe, records
from dscnode.rundir import LINES_LIMIT, RunDir, Unreadable, open_regular, read_text
from tests.unit.node_helpers import helper
from tests.unit.plan_helpers import DEFAULTS, PATHS, cluster

SECRET = "root-only-secret-3d1f"
TIB = 1 << 40


def plant(path, kind, secret_file):
    """`path` as a hostile user leaves it: a FIFO nobody writes, a sparse file of a terabyte, or
    a link to a file only root may read."""
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(TIB)
    else:
        path.symlink_to(secret_file)


@pytest.fixture
def secret_file(tmp_path):
    f = tmp_path / "root-only"
    f.write_text(json.dumps({"step": 1, "loss": 0.5, "secret": SECRET}) + "\n")
    f.chmod(0o600)
    return f


def test_open_regular_refuses_a_link_a_fifo_and_an_oversized_file_without_blocking(tmp_path, secret_file):
    for kind, why in (("fifo", "a FIFO, not a regular file"), ("sparse", "more than a file of its kind may hold"),
                      ("link", "a symbolic link")):
        path = tmp_path / kind
        plant(path, kind, secret_file)
        started = time.monotonic()
        with pytest.raises(Unreadable, match=why):
            open_regular(path, LINES_LIMIT).close()
        assert time.monotonic() - started < 1
    (tmp_path / "fine").write_text("ok\n")
    assert read_text(tmp_path / "fine") == "ok\n"
    with pytest.raises(FileNotFoundError):
        read_text(tmp_path / "missing")


RUN_FILES = (RunDir.MEASURED, RunDir.MEMORY, RunDir.LAUNCH, RunDir.EXIT, RunDir.RESTARTS, RunDir.STEP_DOWNS,
             RunDir.OP_BUILDS, RunDir.METRICS, RunDir.PROGRESS, RunDir.LOG, RunDir.ATTEMPT, RunDir.FAILURE,
             RunDir.ENGINE, RunDir.STOPPED, RunDir.PID, RunDir.STALLED)


@pytest.mark.parametrize("kind", ["fifo", "sparse", "link"])
def test_every_reader_of_a_run_directory_returns_at_once_and_reads_nothing_planted(tmp_path, secret_file, kind):
    """The probe (as root on every playbook, stop.yml included) and the training user's status,
    runs, log and history: each returns within seconds, shows nothing of the linked file, and
    the probe names each refusal."""
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / RunDir.RUN_ID).write_text("r1\n")
    for name in RUN_FILES:
        plant(run / name, kind, secret_file)
    install = tmp_path / "install"
    install.mkdir()
    for name in probe.LOCK_FILES.values():
        plant(install / name, kind, secret_file)
    outputs = []
    for args in (("probe", "--run-root", tmp_path / "runs", "--install-root", install),
                 ("status", run, "r1"), ("runs", tmp_path / "runs"), ("log", run, "r1", "--lines", "5"),
                 ("history", run)):
        started = time.monotonic()
        r = helper(*args)
        assert r.returncode == 0 and time.monotonic() - started < 20, (args, r.stderr[-2000:])
        assert SECRET not in r.stdout, (args, r.stdout[:2000])
        outputs.append(json.loads(r.stdout))
    refused = {os.path.basename(x["path"]): x["why"] for x in outputs[0]["refused_reads"]}
    assert {RunDir.MEASURED, RunDir.LAUNCH, "lock-wheels.txt", "lock-sdists.txt"} <= set(refused), refused
    assert outputs[0]["installed"]["lock"] == {"wheels": None, "sdists": None}
    assert outputs[1]["state"] in ("failed", "lost", "ended", "not started", "stopped"), outputs[1]

    # The plan names the node, the path and what is wrong, and goes on (a note, not a refusal).
    hostvars, groups, probes = cluster(1)
    probes["node1"]["refused_reads"] = outputs[0]["refused_reads"]
    plan, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert errors == [], errors
    memory = f"{run / RunDir.MEASURED}"
    assert any(n.startswith(f"host node1: {memory} was left unread: {refused[RunDir.MEASURED]}") and "Fix:" in n
               for n in plan["notes"]), plan["notes"]


def test_a_wheelhouse_of_too_many_files_is_not_walked_without_end(tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "WHEELHOUSE_FILES", 5)
    for i in range(6):
        (tmp_path / f"w{i}.whl").write_bytes(b"")
    assert probe.tree_digest(str(tmp_path)) is None


def test_the_memory_summary_reads_a_regular_file_only(tmp_path, secret_file):
    (tmp_path / RunDir.MEMORY).write_text(json.dumps({"predicted": 2**30, "preset": "zero2", "micro_batch": 1}))
    plant(tmp_path / RunDir.MEASURED, "link", secret_file)
    summary = records.memory_summary(tmp_path)
    assert summary["measured"] is None and summary["ranks"] == 0
