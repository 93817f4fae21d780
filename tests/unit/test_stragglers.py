"""The slow rank named while the run still moves (dscnode.stragglers, the supervisor's SlowRank,
the entry shim's RankTimes, which tests/local/test_train.py runs on real gloo ranks): each rank's
time in collectives against its step, gathered every window; a rank is marked when the others wait
for it in windows in a row, cleared when it catches up, and a run of alike ranks is never marked.

    .venv/bin/pytest tests/unit/test_stragglers.py -q
"""
import json

from dscnode import entry, stragglers
from dscnode.rundir import RunDir
from dscnode.supervisor import SlowRank


def window(step, compute, step_s=0.5):
    """A window as rank 0 writes it: each rank's step time and its time in collectives (the rest of
    the step, as the others wait for the slowest)."""
    return {"step": step, "ranks": [{"rank": r, "node": f"node{r + 1}", "step_s": step_s, "comm_s": step_s - c,
                                     "compute_s": c} for r, c in enumerate(compute)]}


def test_a_rank_the_others_wait_for_is_named_with_its_figures():
    w = window(20, [0.1, 0.1, 0.35, 0.1])
    j = stragglers.judge(w)
    assert (j["rank"], j["node"], j["ratio"], j["wait_share"]) == (2, "node3", 3.5, 0.5)
    mark = stragglers.verdict([window(10, [0.1, 0.1, 0.35, 0.1]), w])
    assert mark["since_step"] == 10 and mark["step"] == 20
    said = stragglers.said(mark)
    assert said.startswith("node3 rank 2: 3.5x the median compute, the others wait 50 % of each step for it") and "Fix:" in said


def test_alike_ranks_one_window_or_another_rank_each_time_are_not_marked():
    assert stragglers.judge(window(10, [0.1, 0.11, 0.105, 0.1])) is None  # alike
    assert stragglers.judge(window(10, [0.1, 0.3], step_s=5.0)) is None  # bound by the network: 4 % of a step
    assert stragglers.judge({"ranks": [{"rank": 0, "step_s": 1, "comm_s": 0, "compute_s": 1}]}) is None  # one rank
    assert stragglers.judge(window(10, [0.0, 0.0])) is None  # collectives cover every step: nothing to name
    slow = window(10, [0.1, 0.4])
    assert stragglers.verdict([slow]) is None  # one window is not consistent
    assert stragglers.verdict([window(10, [0.4, 0.1]), window(20, [0.1, 0.4])]) is None  # not the same rank
    assert stragglers.verdict([slow, window(20, [0.1, 0.1])]) is None  # caught up: cleared


def test_the_supervisor_marks_the_slow_rank_and_clears_it_when_it_catches_up(tmp_path, capsys):
    run = RunDir(tmp_path)
    (tmp_path / RunDir.RANKS).write_text(json.dumps(window(10, [0.1, 0.4])) + "\n")  # an earlier attempt's
    slow = SlowRank(run)
    assert slow.check() is None and not (tmp_path / RunDir.SLOW).exists()
    for step, compute in ((20, [0.1, 0.4]), (30, [0.1, 0.4])):
        with open(tmp_path / RunDir.RANKS, "a") as f:
            f.write(json.dumps(window(step, compute)) + "\n")
        mark = slow.check()
    assert mark["rank"] == 1 and json.loads((tmp_path / RunDir.SLOW).read_text())["said"].startswith("node2 rank 1: 4.0x")
    with open(tmp_path / RunDir.RANKS, "a") as f:
        f.write(json.dumps(window(40, [0.1, 0.1])) + "\n")
    assert slow.check() is None and not (tmp_path / RunDir.SLOW).exists()
    log = capsys.readouterr().out
    assert "[dsc_node] slow rank: node2 rank 1" in log and "[dsc_node] slow rank 1 on node2 caught up (step 40)" in log


def test_a_ranks_time_in_collectives_counts_overlapping_spans_once():
    """ZeRO-3 gathers the next parameters while the last gather is still open: their union."""
    assert entry.RankTimes.union([(0.0, 1.0), (0.5, 1.5), (2.0, 2.5), (2.1, 2.2)]) == 2.0
    assert entry.RankTimes.union([]) == 0.0
