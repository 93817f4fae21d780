"""Where a run's ranks are (dscnode.stacks): py-spy's JSON read, each rank's place, and the summary
that names the odd ranks with their node, the stopped ones first. py-spy itself reads real ranks
in the container test (molecule/tests/test_watching.py).

    .venv/bin/pytest tests/unit/test_node_stacks.py -q
"""
import json

from dscnode import stacks
from dscnode.rundir import RunDir

C10D = "torch/distributed/distributed_c10d.py"


def frame(name, file, line):
    return {"name": name, "file": file, "line": line}


def rank(n, state="sleeping", *fs, error=None):
    return {"rank": n, "local_rank": n % 2, "pid": 1000 + n, "state": state,
            **({"error": error} if error else {"frames": list(fs)})}


WAITING = [frame("wrapper", "torch/distributed/c10d_logger.py", 83), frame("all_reduce", C10D, 2806),
           frame("allreduce_bucket", "deepspeed/runtime/engine.py", 2461)]
FORWARD = [frame("_call_impl", "torch/nn/modules/module.py", 1786), frame("forward", "train/run.py", 88)]


def test_py_spys_json_gives_the_main_threads_frames_innermost_first():
    dump = json.dumps([
        {"thread_name": "Thread-1", "frames": [{"name": "wait", "short_filename": "threading.py", "line": 331}]},
        {"thread_name": "MainThread", "frames": [
            {"name": "all_reduce", "filename": f"/env/lib/python3.11/site-packages/{C10D}",
             "short_filename": C10D, "line": 2806, "locals": None},
            {"name": "<module>", "filename": "/runs/r/code/train.py", "short_filename": "train.py", "line": 9}]}])
    assert stacks.frames(dump) == [frame("all_reduce", C10D, 2806), frame("<module>", "train.py", 9)]
    assert stacks.frames("[]") == []


def test_a_ranks_place_is_its_innermost_frame_that_passes_nothing_on():
    assert stacks.place(rank(0, "sleeping", *WAITING)) == f"all_reduce ({C10D}:2806)"
    assert stacks.place(rank(1, "stopped", *FORWARD)) == "forward (train/run.py:88)"
    assert stacks.place(rank(2, error="Permission denied")) == "stack not read (Permission denied)"
    assert stacks.place(rank(3)) == "no Python frame"


def test_the_stopped_rank_is_named_first_with_its_node_then_where_the_others_wait():
    reports = [{"node": "node1", "ranks": [rank(0, "sleeping", *WAITING), rank(1, "sleeping", *WAITING)]},
               {"node": "node2", "ranks": [rank(2, "sleeping", *WAITING), rank(3, "stopped", *FORWARD)]}]
    assert stacks.summary(reports) == [
        "rank 3 on node2 (stopped) in forward (train/run.py:88)",
        f"ranks 0-2 on node1, node2 in all_reduce ({C10D}:2806)",
        "fix: rank 3 on node2 is stopped (SIGSTOP, a debugger, a frozen cgroup): kill -CONT 1003 there "
        "lets the run go on; stop.yml ends it"]


def test_among_equal_groups_the_one_in_a_collective_is_where_the_others_wait():
    backward = [frame("backward", "torch/_tensor.py", 647)]
    reports = [{"node": "node1", "ranks": [rank(0, "sleeping", *WAITING)]},
               {"node": "node2", "ranks": [rank(1, "running", *backward)]}]
    assert stacks.summary(reports) == ["rank 1 on node2 in backward (torch/_tensor.py:647)",
                                       f"rank 0 on node1 in all_reduce ({C10D}:2806)",
                                       "fix: the other ranks wait in all_reduce for rank 1: its stack (stacks/ "
                                       "in the run directory) shows what holds it (I/O, a data loader, a hang "
                                       "in its own code); stop.yml, then resume.yml from the last checkpoint"]
    reports[1]["ranks"] = [rank(1, "sleeping", *WAITING)]
    assert stacks.summary(reports)[1:] == [
        "fix: every rank waits in the same collective: a peer that left it or a network fault; "
        "NCCL_DEBUG=INFO (dsc_nccl_debug) and preflight.yml's measurements name more"]


def test_a_stopped_rank_in_the_common_frame_is_still_named_and_unread_ranks_say_why():
    reports = [{"node": "node1", "ranks": [rank(0, "sleeping", *WAITING), rank(1, "stopped", *WAITING)]},
               {"node": "node2", "ranks": [rank(2, "sleeping", *WAITING), rank(4, "sleeping", *WAITING),
                                           rank(3, error="py-spy is not at /env/bin/py-spy")]}]
    assert stacks.summary(reports)[:3] == [
        f"rank 1 on node1 (stopped) in all_reduce ({C10D}:2806)",
        "rank 3 on node2: stack not read (py-spy is not at /env/bin/py-spy)",
        f"ranks 0, 2, 4 on node1, node2 in all_reduce ({C10D}:2806)"]
    reports[0]["ranks"][1]["state"] = "sleeping"
    assert stacks.summary(reports)[-1] == "fix: py-spy is not at /env/bin/py-spy"
    assert stacks.summary([{"node": "node1", "ranks": []}]) == ["no rank of the run is alive on the nodes read"]
    # a node whose report is not a report (pdsh's own error, a helper that could not look)
    assert stacks.summary([{"node": "node2", "ranks": [], "error": "ssh: connect to host node2: refused"},
                           reports[0]])[0] == "node2: stacks not read (ssh: connect to host node2: refused)"


def test_at_a_stall_the_summary_goes_to_the_log_and_into_stalled_json(tmp_path, capsys):
    """No rank of this run id is alive here and the run has one node (no pdsh): the summary says
    so, kept beside the stall's record and saved in stacks/."""
    (tmp_path / RunDir.STALLED).write_text(json.dumps({"step": 3, "since": 1.0, "limit_s": 8.0}) + "\n")
    lines = stacks.at_stall(str(tmp_path), "no-such-run-0", ["node1"], "/nonexistent/py-spy")
    assert lines == ["no rank of the run is alive on the nodes read"]
    assert json.loads((tmp_path / RunDir.STALLED).read_text()) == {"step": 3, "since": 1.0, "limit_s": 8.0,
                                                                   "stacks": lines}
    assert "[dsc_node]   no rank of the run is alive" in capsys.readouterr().out
    (saved,) = (tmp_path / RunDir.STACKS).iterdir()
    assert saved.name.endswith("-node1.json") and json.loads(saved.read_text())["ranks"] == []
