"""The slow rank named while the run still moves (dscnode.stragglers, the supervisor's SlowRank,
the entry shim's ranktimes.RankTimes, which tests/local/test_train.py runs on real gloo ranks): each rank's
time in collectives against its step, gathered every window; a rank is marked when the others wait
for it in windows in a row, cleared when it catches up, and a run of alike ranks is never marked.

    .venv/bin/pytest tests/unit/test_stragglers.py -q
"""
import json

from dscnode import ranktimes, stragglers
from dscnode.rundir import RunDir
from dscnode.supervisor import SlowRank
from plugins.callback import dsc_progress
from plugins.filter import cluster


def window(step, compute, step_s=0.5):
    """A window as rank 0 writes it: each rank's step time and its time in collectives (the rest of
    the step, as the others wait for the slowest)."""
    return {"step": step, "ranks": [{"rank": r, "node": f"node{r + 1}", "step_s": step_s, "comm_s": step_s - c,
                                     "compute_s": c} for r, c in enumerate(compute)]}


def test_a_rank_the_others_wait_for_is_named_with_its_figures():
    w = window(20, [0.1, 0.1, 0.35, 0.1])
    j = stragglers.judge(w)
    assert (j["rank"], j["node"], j["ratio"], j["wait_share"]) == (2, "node3", 3.5, 0.5)
    mark = stragglers.verdict([window(step, [0.1, 0.1, 0.35, 0.1]) for step in (0, 10)] + [w])
    assert mark["since_step"] == 0 and mark["step"] == 20
    said = stragglers.said(mark)
    assert said.startswith("node3 rank 2: 3.5x the median compute, the others wait 50 % of each step for it") and "Fix:" in said


def test_alike_ranks_one_window_or_another_rank_each_time_are_not_marked():
    assert stragglers.judge(window(10, [0.1, 0.11, 0.105, 0.1])) is None  # alike
    assert stragglers.judge(window(10, [0.1, 0.3], step_s=5.0)) is None  # bound by the network: 4 % of a step
    assert stragglers.judge({"ranks": [{"rank": 0, "step_s": 1, "comm_s": 0, "compute_s": 1}]}) is None  # one rank
    assert stragglers.judge(window(10, [0.0, 0.0])) is None  # collectives cover every step: nothing to name
    assert stragglers.judge(window(10, [0.0, 0.3]))["ratio"] == 60.0  # the others wait all along: against 1 % of a step
    slow = window(10, [0.1, 0.4])
    assert stragglers.verdict([slow, slow]) is None  # two windows are not consistent enough
    assert stragglers.verdict([slow, window(20, [0.4, 0.1]), slow]) is None  # not the same rank
    assert stragglers.verdict([slow, slow, window(30, [0.1, 0.1])]) is None  # caught up: cleared


def test_the_supervisor_marks_the_slow_rank_and_clears_it_when_it_catches_up(tmp_path, capsys):
    """Marked after 3 windows, kept with the step it was first marked at, not cleared by a line
    rank 0 is still writing, cleared by a window where it caught up; follow's line and runs.yml's
    state name it in a few words."""
    run = RunDir(tmp_path)
    ranks = tmp_path / RunDir.RANKS

    def add(text):
        with open(ranks, "a") as f:
            f.write(text)
    add(json.dumps(window(10, [0.1, 0.4])) + "\n")  # an earlier attempt's
    slow = SlowRank(run)
    assert slow.check() is None and not (tmp_path / RunDir.SLOW).exists()
    for step in (20, 30, 40, 50):
        add(json.dumps(window(step, [0.1, 0.4])) + "\n")
        mark = slow.check()
    assert (mark["rank"], mark["since_step"], mark["step"]) == (1, 20, 50)
    written = json.loads((tmp_path / RunDir.SLOW).read_text())
    assert written["said"].startswith("node2 rank 1: 4.0x") and "(since step 20)" in written["said"]
    assert written["short"] == "node2 rank 1, 4.0x the median compute"
    status = {"run_id": "r", "state": "running", "last": {"step": 50}, "slow": written}
    assert dsc_progress.progress_line(json.dumps(status), now=0).endswith(", slow: node2 rank 1, 4.0x the median compute")
    row = {"id": "r", "state": "running", "started": 0, "duration_s": 1, "restarts": 0, "slow": written}
    assert " | running (slow: node2 rank 1, 4.0x the median compute) | " in cluster.runs_table([row])[1]
    add(json.dumps(window(60, [0.1, 0.1]))[:40])  # half a line: rank 0 is writing it
    assert slow.check()["rank"] == 1
    add(json.dumps(window(60, [0.1, 0.1]))[40:] + "\n")
    assert slow.check() is None and not (tmp_path / RunDir.SLOW).exists()
    log = capsys.readouterr().out
    assert log.count("[dsc_node] slow rank: node2 rank 1") == 1 and "[dsc_node] slow rank 1 on node2 caught up (step 60)" in log


def test_a_ranks_time_in_collectives_counts_overlapping_spans_once():
    """ZeRO-3 gathers the next parameters while the last gather is still open: their union."""
    assert ranktimes.RankTimes.union([(0.0, 1.0), (0.5, 1.5), (2.0, 2.5), (2.1, 2.2)]) == 2.0
    assert ranktimes.RankTimes.union([]) == 0.0
