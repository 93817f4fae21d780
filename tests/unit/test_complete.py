"""Which checkpoint tag a load without one takes (dscnode.complete): the newest complete on every
node, from the marks the entry shim writes after each save. The shim's patch itself runs on two
"nodes" of this machine in tests/local/test_train.py."""
import io
import json
import os

import pytest

from dscnode import cli, complete, supervisor


def marked(folder, *tags, folders=None):
    folder.mkdir(parents=True, exist_ok=True)
    for t in tags:
        complete.mark(folder, t)
    for t in folders if folders is not None else tags:
        (folder / t).mkdir(exist_ok=True)
    return complete.tags(folder)


def test_the_newest_tag_on_every_node_is_agreed(tmp_path):
    a = marked(tmp_path / "a", "global_step4", "global_step8", "global_step12")
    b = marked(tmp_path / "b", "global_step4", "global_step8")  # cut short at 12: no mark
    assert complete.agreed([a, b]) == complete.agreed([b, a]) == "global_step8"
    assert complete.agreed([a, a]) == "global_step12"


def test_a_tag_saved_again_is_the_newest_and_a_removed_folder_is_no_checkpoint(tmp_path):
    assert marked(tmp_path / "a", "last", "best", "last") == ["best", "last"]
    # retention removed global_step4's folder: its mark alone is no checkpoint
    assert marked(tmp_path / "b", "global_step4", "global_step8", folders=["global_step8"]) == ["global_step8"]


def test_no_common_tag_and_no_marks_are_told_apart(tmp_path):
    a = marked(tmp_path / "a", "global_step4")
    b = marked(tmp_path / "b", "global_step8")
    assert complete.agreed([a, b]) == ""  # marks, none complete everywhere: start without one
    assert complete.tags(tmp_path / "none") is None
    assert complete.agreed([None, None]) is None  # saved without the shim: DeepSpeed's own latest


def test_only_the_tail_of_a_long_mark_file_is_read(tmp_path):
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / complete.MARKS).write_text("".join(f"global_step{i}\n" for i in range(20000)))
    (folder / "global_step19999").mkdir()
    (folder / "global_step3").mkdir()  # only in the file's head
    assert complete.tags(folder) == ["global_step19999"]


def checkpoint(root, name, tag=None, trainer_state=False):
    """An HF-style checkpoint folder as a node holds it, in the Trainer's order: training_args.bin
    with the model, DeepSpeed's tag (marked by the shim once its save returned), and
    trainer_state.json where the Trainer got to write it. No tag: a folder only begun."""
    path = root / name
    path.mkdir(parents=True)
    if tag:
        (path / complete.TRAINER_ARGS).write_text("args")
        (path / tag).mkdir()
        complete.mark(path, tag)
    if trainer_state:
        (path / complete.TRAINER_STATE).write_text("{}")
    return path


def pick(pattern, *nodes):
    """What {latest:GLOB} takes on these nodes (the first the supervisor's), and what it passed over."""
    return complete.newest_everywhere([supervisor.match_states(pattern, n) for n in nodes], [n.name for n in nodes])


def test_latest_takes_the_newest_checkpoint_complete_on_every_node(tmp_path):
    """The master holds checkpoint-40 whole; the worker's was cut short (nothing of it finished,
    then the Trainer's state alone missing): {latest:} takes checkpoint-20, complete on both."""
    master, worker = tmp_path / "master", tmp_path / "worker"
    for node in (master, worker):
        checkpoint(node / "out", "checkpoint-20", "global_step20", trainer_state=True)
    checkpoint(master / "out", "checkpoint-40", "global_step40", trainer_state=True)
    checkpoint(worker / "out", "checkpoint-40")
    assert list(supervisor.match_states("out/checkpoint-*", master)) == ["out/checkpoint-40", "out/checkpoint-20"]
    assert pick("out/checkpoint-*", master, worker) == (
        "out/checkpoint-20", ["out/checkpoint-40 (worker: DeepSpeed's part not marked complete)"])
    # the worker's DeepSpeed part finished but not the Trainer's state: still not complete there
    (worker / "out" / "checkpoint-40" / complete.TRAINER_ARGS).write_text("args")
    (worker / "out" / "checkpoint-40" / "global_step40").mkdir()
    complete.mark(worker / "out" / "checkpoint-40", "global_step40")
    assert pick("out/checkpoint-*", master, worker) == (
        "out/checkpoint-20", ["out/checkpoint-40 (worker: no trainer_state.json)"])
    (worker / "out" / "checkpoint-40" / complete.TRAINER_STATE).write_text("{}")
    assert pick("out/checkpoint-*", master, worker) == ("out/checkpoint-40", [])
    # alone (no other node reached: one node, or each node its own supervisor), the master's own
    argv = ["run_clm.py", "--resume_from_checkpoint", "{latest:out/checkpoint-*}"]
    assert supervisor.resolve_latest(argv, master)[-1] == "out/checkpoint-40"


def test_a_save_cut_short_on_every_node_at_once_is_passed_over(tmp_path):
    """The stop came after DeepSpeed's part of checkpoint-40 but before the Trainer's state, on
    both nodes alike: judged by what a finished save holds, not by the master's copy."""
    master, worker = tmp_path / "master", tmp_path / "worker"
    for node in (master, worker):
        checkpoint(node / "out", "checkpoint-40", "global_step40")
    # the first save of the run: its training_args.bin says the Trainer wrote it, so its state is due
    assert pick("out/checkpoint-*", master, worker) == (
        None, ["out/checkpoint-40 (master: no trainer_state.json; worker: no trainer_state.json)"])
    for node in (master, worker):
        checkpoint(node / "out", "checkpoint-20", "global_step20", trainer_state=True)
    assert pick("out/checkpoint-*", master, worker)[0] == "out/checkpoint-20"
    argv = ["run_clm.py", "--resume_from_checkpoint", "{latest:out/checkpoint-*}", "--bf16"]
    (master / "out" / "checkpoint-20" / complete.TRAINER_STATE).unlink()
    assert supervisor.resolve_latest(argv, master) == ["run_clm.py", "--bf16"]  # none: the run starts over


def test_checkpoints_no_shim_marked_count_where_they_exist_on_every_node(tmp_path):
    """A script that saves without DeepSpeed's engine: no marks anywhere, a match on every node is it."""
    master, worker = tmp_path / "master", tmp_path / "worker"
    for node, names in ((master, ("step_1", "step_2")), (worker, ("step_1",))):
        for n in names:
            checkpoint(node / "out", n)
    assert pick("out/step_*", master, worker) == ("out/step_1", ["out/step_2 (worker: not there)"])
    assert pick("out/step_*", master) == ("out/step_2", [])


def test_nodes_that_start_alone_agree_on_the_newest_checkpoint_complete_on_all(tmp_path, capsys):
    """no_ssh and slurm: each node's latest-states line (their order as they come), agree-latest
    over all of them, and each node's supervisor starts with what they agreed; a node whose
    answer is missing or not one holds nothing, and a path agreed that is not a match on a node
    is not passed there."""
    master, worker = tmp_path / "master", tmp_path / "worker"
    for node in (master, worker):
        checkpoint(node / "out", "checkpoint-20", "global_step20", trainer_state=True)
    checkpoint(master / "out", "checkpoint-40", "global_step40", trainer_state=True)
    checkpoint(worker / "out", "checkpoint-40")
    lines = [json.dumps(supervisor.latest_states(["out/checkpoint-*"], n, node=n.name)) for n in (worker, master)]
    agreed, nodes = supervisor.agree_latest(lines)
    assert nodes == ["worker", "master"]
    assert agreed["out/checkpoint-*"]["path"] == "out/checkpoint-20"
    assert agreed["out/checkpoint-*"]["said"] == (
        "[dsc_node] {latest:out/checkpoint-*}: out/checkpoint-20, the newest complete on worker, master; "
        "passed over: out/checkpoint-40 (worker: DeepSpeed's part not marked complete)")
    assert supervisor.agree_latest(lines[1:])[0]["out/checkpoint-*"]["path"] == "out/checkpoint-40"  # the master alone
    assert supervisor.agree_latest([lines[1], "srun: error: node2: task 0: Exited", "[]"]) == \
        supervisor.agree_latest(lines[1:])  # a line that is no node's: the CLI refuses the agreement (below)
    argv = ["run_clm.py", "--resume_from_checkpoint", "{latest:out/checkpoint-*}"]
    capsys.readouterr()
    assert supervisor.resolve_latest(argv, master, agreed=agreed)[-1] == "out/checkpoint-20"
    assert capsys.readouterr().out.strip().endswith("(agreed before the start)")
    # agreed elsewhere, not a match here (nor anything outside the code directory): the run starts over
    for elsewhere in ("out/checkpoint-60", "../../etc"):
        told = {"out/checkpoint-*": {"path": elsewhere, "said": ""}}
        assert supervisor.resolve_latest(argv, master, agreed=told) == ["run_clm.py"]
    assert cli.agreed_latest('{"out/checkpoint-*": "out/checkpoint-20"}') is None  # not agree-latest's
    assert cli.agreed_latest(json.dumps(agreed)) == agreed


@pytest.fixture
def node_cli():
    """The node helper's CLI run in this process: it sets the umask a node's files are made with
    (0o027), which would otherwise stay for every later test in the process."""
    umask = os.umask(0o022)
    os.umask(umask)
    yield cli.main
    os.umask(umask)


@pytest.mark.parametrize("pattern", ["../out/checkpoint-*", "out/../../etc/*", "out/x;id", "out/$(id)",
                                     "out/checkpoint-*\n", "#jinja2: x", "/etc/*"])
@pytest.mark.parametrize("action", [["matches"], ["latest-states", "out/checkpoint-*"]])
def test_the_node_helpers_matches_refuses_a_glob_latest_would_not_take(tmp_path, pattern, action, capsys, node_cli):
    """`dsc_node.pyz matches` runs what the supervisor sends it through pdsh, and `latest-states`
    what the runs role and slurm's batch job pass it (beside a glob it allows): a glob that
    {latest:GLOB} refuses (leaving the code directory, shell characters, a newline, a Jinja
    header) is refused there too, before any file is looked at."""
    with pytest.raises(SystemExit) as out:
        node_cli([*action, pattern, "--cwd", str(tmp_path)])
    assert f"dsc_node {action[0]}: {pattern!r} is not a glob {{latest:GLOB}} allows" in str(out.value)
    assert capsys.readouterr().out == ""


def test_agree_latest_fails_where_a_node_did_not_say_what_it_holds(tmp_path, monkeypatch, capsys, node_cli):
    """Without a node's line an agreement could take a checkpoint that node lacks: agree-latest
    fails, naming those heard, where fewer nodes said what they hold than the run starts on (a
    node's task failed; or the lines run together, a literal backslash-n between them, as a
    template may join them)."""
    line = json.dumps(supervisor.latest_states(["out/checkpoint-*"], tmp_path, node="node1"))
    for given, heard in ((line + "\\n" + line, "0 node(s) said what they hold (none) in 1 line(s)"),
                         (line + "\nsrun: error: node2: task 1: Exited", "1 node(s) said what they hold (node1) in 2")):
        monkeypatch.setattr("sys.stdin", io.StringIO(given))
        assert node_cli(["agree-latest", "--nodes", "2"]) == 1
        out = capsys.readouterr()
        assert out.out == "" and heard in out.err and "of the 2 the run starts on" in out.err, out.err
    monkeypatch.setattr("sys.stdin", io.StringIO(line + "\n" + line.replace("node1", "node2")))
    assert node_cli(["agree-latest", "--nodes", "2"]) in (0, None)
    assert json.loads(capsys.readouterr().out) == {"out/checkpoint-*": {
        "path": "", "said": "[dsc_node] {latest:out/checkpoint-*}: none complete on every node, the run starts over"}}


def test_a_link_leading_out_of_the_code_directory_is_no_match(tmp_path, capsys, node_cli):
    (tmp_path / "elsewhere" / "checkpoint-9").mkdir(parents=True)
    checkpoint(tmp_path / "code" / "out", "checkpoint-1", "global_step1", trainer_state=True)
    (tmp_path / "code" / "out" / "checkpoint-9").symlink_to(tmp_path / "elsewhere" / "checkpoint-9")
    node_cli(["matches", "out/checkpoint-*", "--cwd", str(tmp_path / "code")])
    assert list(json.loads(capsys.readouterr().out)) == ["out/checkpoint-1"]
