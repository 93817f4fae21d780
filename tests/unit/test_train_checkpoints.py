"""Unit tests for train/checkpoints.py: which checkpoints are pruned, the space the next one needs,
the free-space error, and fsync of a written checkpoint; and train/'s run files named by RunDir.

Pure Python (no torch): train/__init__.py is empty and train/checkpoints.py imports only the stdlib
and the run directory's names (dscnode.rundir).
"""
import ast
import os
import re
import sys
from pathlib import Path

import pytest

from dscnode import records
from dscnode.rundir import RunDir
from train import checkpoints
from train.checkpoints import (BYTES_PER_PARAM, COMPLETE, MARGIN, fsync_tree, latest_complete,
                               mark_complete, needed_bytes, prune, scan, space_problem, to_prune,
                               tree_size)

GIB = 2**30
TRAIN = Path(__file__).resolve().parents[2] / "train"


def make(ckpt, step, complete=True, size=10):
    d = ckpt / f"step{step}"
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x" * size)
    if complete:
        (d / COMPLETE).write_text("{}")
    return d


# --- what to prune ------------------------------------------------------------------------------

def test_keeps_the_newest_complete_ones():
    cps = [(10, True), (20, True), (30, True), (40, True)]
    assert to_prune(cps, keep=2, saved=40) == ["step10", "step20"]
    assert to_prune(cps, keep=3, saved=40) == ["step10"]


def test_keep_one_leaves_only_the_one_just_saved():
    assert to_prune([(10, True), (20, True), (30, True)], keep=1, saved=30) == ["step10", "step20"]


def test_nothing_to_prune_while_there_are_fewer_than_keep():
    assert to_prune([(10, True), (20, True)], keep=3, saved=20) == []
    assert to_prune([(10, True)], keep=1, saved=10) == []


def test_incomplete_older_ones_go_and_do_not_count_towards_keep():
    cps = [(10, True), (20, True), (25, False), (30, True)]
    assert to_prune(cps, keep=3, saved=30) == ["step25"]
    assert to_prune(cps, keep=2, saved=30) == ["step10", "step25"]


def test_newer_ones_are_left_alone_complete_or_not():
    """An earlier attempt's step50 (incomplete, or complete on only some nodes) is not touched,
    and a newer complete one does not push the one just saved or its predecessors out."""
    cps = [(10, True), (20, True), (30, True), (40, False), (50, True)]
    assert to_prune(cps, keep=2, saved=30) == ["step10"]
    assert to_prune(cps, keep=1, saved=30) == ["step10", "step20"]


def test_the_one_just_saved_counts_even_if_the_list_missed_it():
    assert to_prune([(10, True), (20, True)], keep=2, saved=30) == ["step10"]


def test_keep_below_one_is_refused():
    with pytest.raises(ValueError):
        to_prune([(10, True)], keep=0, saved=10)


def test_scan_reads_tags_and_markers_and_ignores_other_names(tmp_path):
    make(tmp_path, 10)
    make(tmp_path, 20, complete=False)
    make(tmp_path, 100)
    (tmp_path / "latest").write_text("step100")
    (tmp_path / "stepfoo").mkdir()
    (tmp_path / "step007").mkdir()
    (tmp_path / "step30").write_text("a file, not a checkpoint")
    assert scan(tmp_path) == [(10, True), (20, False), (100, True)]
    assert scan(tmp_path / "missing") == []
    assert latest_complete(tmp_path) == tmp_path / "step100"  # numeric, not "step100" < "step20"
    assert latest_complete(tmp_path / "missing") is None


def test_prune_removes_on_disk_and_keeps_the_rest(tmp_path):
    for step in (10, 20, 30):
        make(tmp_path, step)
    make(tmp_path, 25, complete=False)
    make(tmp_path, 40, complete=False)
    (tmp_path / "step10" / "sub").mkdir()
    (tmp_path / "step10" / "sub" / "shard.pt").write_bytes(b"y")
    (tmp_path / "latest").write_text("step30")
    removed, failed = prune(tmp_path, keep=2, saved=30)
    assert removed == ["step10", "step25"] and failed == []
    assert sorted(os.listdir(tmp_path)) == ["latest", "step20", "step30", "step40"]


def test_prune_reports_what_it_could_not_remove(tmp_path, monkeypatch):
    for step in (10, 20):
        make(tmp_path, step)

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(checkpoints, "remove", refuse)
    removed, failed = prune(tmp_path, keep=1, saved=20)
    assert removed == [] and [tag for tag, _ in failed] == ["step10"]


def test_remove_takes_the_marker_first_and_tolerates_what_is_already_gone(tmp_path, monkeypatch):
    """Cut short after the marker, a removal leaves an incomplete checkpoint, never a complete one."""
    d = make(tmp_path, 10)

    def cut_short(path, topdown=True):
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoints.os, "walk", cut_short)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.remove(d)
    assert scan(tmp_path) == [(10, False)]
    monkeypatch.undo()
    checkpoints.remove(d)
    assert not d.exists()
    checkpoints.remove(d)  # another node pruned it meanwhile


# --- free space -------------------------------------------------------------------------------

def test_needed_is_the_previous_checkpoint_plus_margin():
    assert needed_bytes(1000, params=10**9) == int(1000 * (1 + MARGIN)) == 1100


def test_needed_without_a_previous_checkpoint_is_the_estimate_plus_margin():
    assert BYTES_PER_PARAM == 16
    assert needed_bytes(None, params=1_000_000) == int(16_000_000 * 1.1)
    assert needed_bytes(0, params=1_000_000) == needed_bytes(None, params=1_000_000)


def test_tree_size_counts_regular_files_only(tmp_path):
    d = make(tmp_path, 10, size=1000)
    (d / "sub").mkdir()
    (d / "sub" / "optim.pt").write_bytes(b"z" * 24)
    (d / "link").symlink_to(d / "sub" / "optim.pt")
    assert tree_size(d) == 1000 + 24 + 2  # the "{}" marker


def test_enough_space_is_no_problem():
    assert space_problem("step400", "/runs/x/checkpoints", "node2", free=2 * GIB, needed=GIB, keep=3) is None
    assert space_problem("step400", "/runs/x/checkpoints", "node2", free=GIB, needed=GIB, keep=3) is None


def test_the_space_error_names_node_path_sizes_and_fix():
    msg = space_problem("step400", "/runs/x/checkpoints", "node2", free=int(0.3 * GIB),
                        needed=int(1.2 * GIB), keep=3)
    assert msg.startswith("checkpoint step400 needs 1.2 GiB at /runs/x/checkpoints on node2, "
                          "0.3 GiB free. Fix: ")
    assert "keep_checkpoints (now 3)" in msg and "bigger disk" in msg and "\n" not in msg
    small = space_problem("step10", "/mnt/small", "node1", free=5 * 2**20, needed=58 * 2**20, keep=2)
    assert "needs 0.057 GiB" in small and "0.0049 GiB free" in small


def test_the_space_error_is_what_the_node_helper_shows_as_first_error(tmp_path):
    """The node helper's first_error (dscnode.records) takes the first exception line of the
    launcher log, as pdsh prefixes it with the node: the whole message survives its 400-character
    cut."""
    msg = space_problem("step400", "/var/lib/dsc/runs/20240101-120000-abcdef/checkpoints", "node2",
                        free=int(0.3 * GIB), needed=int(1.2 * GIB), keep=3)
    log = tmp_path / "launcher.log"
    log.write_text("node1: step 399/1000 loss 3.2\n"
                   "node2: Traceback (most recent call last):\n"
                   'node2:   File "/x/train/run.py", line 229, in check_space\n'
                   f"node2: RuntimeError: {msg}\n"
                   f"node1: RuntimeError: {msg}\n"
                   "node2: [launch.py] exits with return code = 1\n")
    error, trace = records.first_error(log)
    assert error == f"node2: RuntimeError: {msg}"
    assert trace[0].endswith("Traceback (most recent call last):")


# --- durability -------------------------------------------------------------------------------

def test_fsync_tree_syncs_every_file_and_directory(tmp_path, monkeypatch):
    d = make(tmp_path, 10)
    (d / "zero" / "deep").mkdir(parents=True)
    (d / "zero" / "deep" / "optim.pt").write_bytes(b"o")
    (d / "zero" / "rank1.pt").write_bytes(b"r")
    (d / "link").symlink_to(d / "zero" / "rank1.pt")
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real(fd)))
    fsync_tree(d)
    want = {os.lstat(p).st_ino for p in [d, d / "zero", d / "zero" / "deep", d / COMPLETE,
                                          d / "mp_rank_00_model_states.pt",
                                          d / "zero" / "deep" / "optim.pt", d / "zero" / "rank1.pt"]}
    assert set(synced) == want and len(synced) == len(want)
    assert synced[-1] == os.lstat(d).st_ino  # the tag directory itself last


def test_mark_complete_fsyncs_the_marker_then_renames_then_fsyncs_the_directory(tmp_path, monkeypatch):
    d = make(tmp_path, 10, complete=False)
    events = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.fstat(fd).st_ino)),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", os.path.basename(b))),
                                                    real_rename(a, b)))
    mark_complete(d, '{"step": 10}', "node1")
    marker = d / COMPLETE
    assert marker.read_text() == '{"step": 10}'
    assert events == [("fsync", marker.stat().st_ino), ("rename", COMPLETE), ("fsync", d.stat().st_ino)]
    assert sorted(os.listdir(d)) == [COMPLETE, "mp_rank_00_model_states.pt"]  # no tmp left


def test_a_directory_fsync_the_filesystem_refuses_is_tolerated(tmp_path, monkeypatch):
    def einval(fd):
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(os, "fsync", einval)
    checkpoints.fsync_path(tmp_path, directory=True)
    (tmp_path / "f").write_text("x")
    with pytest.raises(OSError):
        checkpoints.fsync_path(tmp_path / "f")


def test_no_torch_imported():
    assert "torch" not in sys.modules and "deepspeed" not in sys.modules


# --- the run's files, by RunDir's names ---------------------------------------------------------

FILE_NAME = re.compile(r"[\w.-]+\.(json|jsonl|log|csv|txt|pid)")


def literals(path):
    """(line, text) of each string literal in a module, docstrings left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_train_names_every_run_file_through_rundir():
    """train/ writes into the run directory only by RunDir's names (the node helper reads them
    there): a literal file name, or one of RunDir's names spelled out, fails here."""
    names = {v: k for k, v in vars(RunDir).items() if k.isupper() and isinstance(v, str)}
    found = []
    for path in sorted(TRAIN.glob("*.py")):
        for line, text in literals(path):
            name = text.rsplit("/", 1)[-1]
            if name in names:
                found.append(f"train/{path.name}:{line}: {text!r}: use RunDir.{names[name]}")
            elif FILE_NAME.fullmatch(name):
                found.append(f"train/{path.name}:{line}: {text!r}: add it to RunDir and use that")
    assert found == [], "\n".join(found)


def test_the_scan_catches_a_literal_run_file_name(tmp_path):
    (tmp_path / "m.py").write_text('"""metrics.jsonl in a docstring is fine."""\n'
                                   'A = "losses.jsonl"\nB = run_dir / "summary.json"\nC = f"{d}/checkpoints"\n')
    texts = [text for _, text in literals(tmp_path / "m.py")]
    assert texts == ["losses.jsonl", "summary.json", "/checkpoints"]
