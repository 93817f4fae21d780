"""dscnode.copies: a node's part of a node-local checkpoint sent, kept as another node's copy and put
back, through the built node helper as the supervisor pipes it (here between two folders of this
machine; the container tier's test_launch.py copies between nodes over ssh)."""
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

from dscnode import complete, copies
from dscnode.rundir import RunDir
from tests.unit.node_helpers import HELPER, helper


def part(save_dir, tag, files, marked=True):
    """A node's part of checkpoint `tag` in save_dir: its files (name -> bytes), marked complete."""
    for name, data in files.items():
        path = save_dir / tag / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    if marked:
        complete.mark(save_dir, tag)
    return save_dir / tag


def relay(*args_pair):
    send, receive = args_pair
    return copies.relay([sys.executable, str(HELPER), *send], [sys.executable, str(HELPER), *receive])


def tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_ring_keeps_each_nodes_part_on_the_next_and_the_last_on_the_first():
    assert copies.ring(["node1", "node2", "node3"]) == {"node1": "node2", "node2": "node3", "node3": "node1"}
    assert copies.ring(["node1", "node2"]) == {"node1": "node2", "node2": "node1"}
    assert copies.ring(["node1"]) == {}  # one node: nowhere else to keep it


def test_a_part_is_kept_beside_the_keepers_own_and_put_back_whole_on_a_wiped_node(tmp_path):
    worker, master = tmp_path / "worker" / "ckpt", tmp_path / "master" / "ckpt"
    own = {"zero_pp_rank_1_mp_rank_00_optim_states.pt": os.urandom(5000), "sub/extra.bin": b"x" * 10,
           RunDir.COMPLETE: b'{"step": 20}'}
    part(worker, "step20", own)
    (worker / "step20" / copies.PARTS / "node3").mkdir(parents=True)  # a copy it keeps: not its part
    (worker / "step20" / copies.PARTS / "node3" / "other.pt").write_bytes(b"not mine")
    (worker / "step20" / "link.pt").symlink_to("/etc/passwd")  # no link is sent
    part(master, "step20", {"zero_pp_rank_0_mp_rank_00_optim_states.pt": b"m"})

    got, error = relay(["part-send", worker, "step20"], ["part-receive", master, "step20", "--from", "node2"])
    assert error == "" and got == {"files": 3, "bytes": sum(map(len, own.values()))}
    kept = master / "step20" / copies.PARTS / "node2"
    assert tree(kept) == own
    assert json.loads(helper("part-held", master).stdout) == {"tags": ["step20"], "copies": {"step20": ["node2"]}}

    shutil.rmtree(worker)  # the worker's disk replaced
    got, error = relay(["part-send", master, "step20", "--copy-of", "node2"], ["part-receive", worker, "step20"])
    assert error == "" and got["files"] == 3
    assert tree(worker / "step20") == own and complete.tags(worker) == ["step20"]
    assert not [p for p in worker.iterdir() if p.name.startswith(".")], "no temporary folder is left"


def test_a_part_not_marked_complete_is_not_sent_and_nothing_is_kept(tmp_path):
    part(tmp_path / "w", "step5", {"a.pt": b"a"}, marked=False)
    part(tmp_path / "m", "step5", {"b.pt": b"b"})
    got, error = relay(["part-send", tmp_path / "w", "step5"], ["part-receive", tmp_path / "m", "step5", "--from", "w"])
    assert got is None and "is not marked complete on this node" in error
    assert not (tmp_path / "m" / "step5" / copies.PARTS).exists()


def hostile_tar(name, kind=tarfile.REGTYPE):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        if kind == tarfile.SYMTYPE:
            info.linkname = "/etc/shadow"
        data = b"evil"
        info.size = len(data) if kind == tarfile.REGTYPE else 0
        tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return buf.getvalue()


@pytest.mark.parametrize("name,kind", [("../../outside", tarfile.REGTYPE), ("/tmp/abs", tarfile.REGTYPE),
                                       ("ok/../../../x", tarfile.REGTYPE), ("l.pt", tarfile.SYMTYPE),
                                       (".dsc_parts/node9/x", tarfile.REGTYPE), ("fifo", tarfile.FIFOTYPE)])
def test_a_stream_with_anything_but_files_inside_the_part_is_refused_and_leaves_nothing(tmp_path, name, kind):
    save = tmp_path / "node" / "ckpt"
    part(save, "step5", {"a.pt": b"a"})
    before = tree(tmp_path)
    r = subprocess.run([sys.executable, str(HELPER), "part-receive", save, "step5", "--from", "node2"],
                       input=hostile_tar(name, kind), capture_output=True, timeout=60)
    assert r.returncode != 0 and b"is refused (not a regular file inside its part)" in r.stderr
    assert tree(tmp_path) == before and not (tmp_path / "outside").exists()


@pytest.mark.parametrize("save_dir,tag", [("relative/ckpt", "step1"), ("/a/../etc", "step1"), ("/ck pt", "step1"),
                                          ("/ckpt;id", "step1"), ("/ckpt", "a/b"), ("/ckpt", ".."), ("/ckpt", "$(id)"),
                                          ("/ckpt\n", "step1"), ("/ckpt", "step1\n"), ("/ckpt", "#jinja2: x")])
def test_save_dirs_and_tags_a_command_line_would_need_quoted_are_refused(save_dir, tag):
    with pytest.raises(SystemExit) as out:
        copies.checked(save_dir, tag)
    assert "is refused: it must be an absolute path" in str(out.value)


def test_the_copier_copies_a_save_once_the_run_moved_on_at_its_pace_and_the_last_at_the_end(tmp_path, monkeypatch):
    """A save is copied once the run has logged a later step (the script has written what it
    adds after DeepSpeed's save by then); a copy starts no sooner than its predecessor's time /
    DUTY after that one started, the newest waiting save is taken and older waiting ones skipped;
    the attempt's last save is copied once it has ended, whatever the pace (finish)."""
    run = RunDir(tmp_path)
    copied, logged = [], {"step": 0}

    def keep(save, hosts, record):
        copied.append((save["tag"], round(time.time() - t0, 2)))
        time.sleep(0.2)
    monkeypatch.setattr(copies, "keep_copies", keep)

    def save(step):
        with open(run / RunDir.SAVES, "a") as f:
            f.write(json.dumps({"save_dir": "/ckpt", "tag": f"step{step}", "step": step}) + "\n")
        logged["step"] = step
    save(0)  # before this supervisor: not its to copy
    copier = copies.Copier(run, ["node1", "node2"], logged_step=lambda: logged["step"])
    copier.DUTY = 0.25  # a copy of 0.2 s: the next no sooner than 0.8 s after it started
    t0 = time.time()
    save(1)
    copier.poll()
    assert copied == []  # the script may still be writing its part
    logged["step"] = 2
    copier.poll()
    for step in (3, 4):
        time.sleep(0.3)
        save(step)
        logged["step"] = step + 1
        copier.poll()
    assert [tag for tag, _ in copied] == ["step1"]
    while time.time() - t0 < 1.2:
        copier.poll()
        time.sleep(0.05)
    save(5)  # the attempt's last: no later step is logged
    copier.finish(timeout=10)
    assert [tag for tag, _ in copied] == ["step1", "step4", "step5"]
    assert copied[1][1] >= 0.8 and copied[2][1] < copied[1][1] + 0.8, copied  # the last: unpaced
    assert not copies.Copier(run, ["node1"]).enabled  # one node: nowhere else to keep a part


def test_a_save_to_a_shared_directory_is_never_copied_nor_put_back(tmp_path, monkeypatch):
    """dsc_checkpoint_shared_dir: the entry shim records each save as not node-local; the copier
    takes none of them and restore asks no node (every node reads the one copy)."""
    run = RunDir(tmp_path)
    monkeypatch.setattr(copies, "keep_copies", lambda *a: pytest.fail("a shared save was copied"))
    monkeypatch.setattr(copies, "survey", lambda *a: pytest.fail("restore asked the nodes"))
    copier = copies.Copier(run, ["node1", "node2"], logged_step=lambda: 9)
    with open(run / RunDir.SAVES, "a") as f:
        f.write(json.dumps({"save_dir": "/shared/r1", "tag": "step1", "step": 1, "node_local": False}) + "\n")
    copier.finish(timeout=2)
    copies.restore(run, ["node1", "node2"])
    assert copies.saves(run) and not copies.node_local_saves(run)


def test_the_shared_directory_check_finds_the_masters_mark_only_where_the_directory_is_the_same(tmp_path):
    """shared-dir: the master's mark (a new token each time) is seen through the same directory,
    not in another one (a node that mounts nothing there); removed after; a link or a mark that
    is no token is refused."""
    shared, elsewhere = tmp_path / "shared" / "ckpt", tmp_path / "local"
    token = json.loads(helper("shared-dir", shared, "--mark").stdout)["token"]
    assert shared.is_dir() and (shared / f".dsc_shared_{token}").read_text() == token + "\n"
    assert json.loads(helper("shared-dir", shared, "--seen", token).stdout) == {"seen": True}
    assert copies.shared_dir(str(elsewhere), seen=token, wait_s=0.2) == {"seen": False}
    assert json.loads(helper("shared-dir", shared, "--mark").stdout)["token"] != token
    helper("shared-dir", shared, "--unmark", token)
    assert not (shared / f".dsc_shared_{token}").exists()
    (tmp_path / "link").symlink_to(shared)
    for args in ([tmp_path / "link", "--mark"], [shared, "--seen", "../x"], [shared, "--seen", "a" * 31]):
        r = helper("shared-dir", *args)
        assert r.returncode != 0 and "is refused" in r.stderr, (args, r.stderr)
