"""The slow rank named while the run still moves (dscnode.stragglers, the supervisor's SlowRank,
the entry shim's ranktimes.RankTimes, which tests/local/test_train.py runs on real gloo ranks): each rank's
time in collectives against its step, gathered every window; a rank is marked when the others wait
for it in windows in a row, cleared when it catches up, and a run of alike ranks is never marked.

    .venv/bin/pytest tests/unit/test_stragglers.py -q
"""
import json
import sys
import types

from dscnode import ranktimes, stragglers
from dscnode.rundir import RunDir
from dscnode.supervisor import SlowRank
from plugins.callback import dsc_progress
from plugins.filter import cluster


def window(step, compute, step_s=0.5, time=None):
    """A window as rank 0 writes it: each rank's step time and its time in collectives (the rest of
    the step, as the others wait for the slowest); written at `time`, by default a second a step."""
    return {"step": step, "time": step if time is None else time, "ranks": [{"rank": r, "node": f"node{r + 1}", "step_s": step_s, "comm_s": step_s - c,
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


def test_windows_in_a_row_name_a_rank_only_once_they_span_twenty_seconds():
    """A run of short steps fills 3 windows in a second: a rank held up that long (a checkpoint, a
    descheduling) is not named; held up 20 s, it is, since the first of its windows."""
    quick = [window(step, [0.1, 0.4], time=100 + step / 10) for step in range(10, 200, 10)]  # 10 steps a second
    assert stragglers.verdict(quick[:3]) is None and stragglers.verdict(quick) is None  # 1.8 s in all
    held = [window(step, [0.1, 0.4], time=100 + step / 10) for step in range(10, 220, 10)]
    mark = stragglers.verdict(held)
    assert (mark["since_step"], mark["step"], mark["windows"], mark["span_s"]) == (10, 210, 21, 20.0)
    # a window that names nobody starts the count again
    assert stragglers.verdict(held[:10] + [window(110, [0.1, 0.1], time=111)] + held[11:]) is None


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


def test_a_node_slowed_as_a_whole_is_marked_whichever_of_its_ranks_is_slowest():
    """Two nodes of two ranks: node2's CPU is slow, so both its ranks are; which of them comes out
    slowest changes from window to window, and the mark stays on node2. Against its own ranks
    alone neither would stand out: the others are the other node's ranks."""
    def two_by_two(step, computes):
        return {"step": step, "time": step, "ranks": [{"rank": r, "node": f"node{r // 2 + 1}", "step_s": 0.5,
                                         "comm_s": 0.5 - c, "compute_s": c} for r, c in enumerate(computes)]}
    windows = [two_by_two(10, [0.1, 0.1, 0.40, 0.38]), two_by_two(20, [0.1, 0.1, 0.37, 0.41]),
               two_by_two(30, [0.1, 0.1, 0.42, 0.39])]
    mark = stragglers.verdict(windows)
    assert (mark["node"], mark["rank"], mark["since_step"], mark["ratio"]) == ("node2", 2, 10, 4.2)


def test_a_marked_rank_that_sends_no_figures_is_not_said_to_have_caught_up(tmp_path, capsys):
    """Its timing broke (a CUDA error): its entry carries the error, the mark ends, and the log says
    why, not "caught up". Lines that are not a window (a stray value) are passed over."""
    ranks = tmp_path / RunDir.RANKS
    slow = SlowRank(RunDir(tmp_path))
    for step in (10, 20, 30):
        with open(ranks, "a") as f:
            f.write(json.dumps(window(step, [0.1, 0.4])) + "\n[]\n")
    assert slow.check()["rank"] == 1
    broken = {"step": 40, "ranks": [window(40, [0.1])["ranks"][0],
                                    {"rank": 1, "node": "node2", "error": "RuntimeError: CUDA error"}]}
    with open(ranks, "a") as f:
        f.write(json.dumps(broken) + "\n")
    assert slow.check() is None and not (tmp_path / RunDir.SLOW).exists()
    log = capsys.readouterr().out
    assert ("slow rank 1 on node2 sent no figures at step 40, so it is no longer judged: RuntimeError: CUDA error"
            in log) and "caught up" not in log


class FakeEvent:
    """torch.cuda.Event as RankTimes uses it: recorded at a time on the GPU, done or not yet."""
    clock, done = 0.0, set()

    def __init__(self, enable_timing):
        assert enable_timing

    def record(self):
        self.at = FakeEvent.clock

    def query(self):
        return self.at in FakeEvent.done

    def elapsed_time(self, end):
        return (end.at - self.at) * 1000  # milliseconds, as CUDA gives them


def test_gpu_spans_are_read_once_their_events_complete_and_an_error_stops_timing(monkeypatch, capsys):
    """On GPU ranks a span is two CUDA events, read at each optimizer step once the GPU has passed
    them: a span whose end has not completed is kept for the next step, an asynchronous one ends at
    its handle's wait(), and an error reading them stops timing (its events dropped) without
    failing the rank. Timing starts once a whole optimizer step has ended."""
    cuda = types.SimpleNamespace(Event=FakeEvent, is_available=lambda: True)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    times, engine = ranktimes.RankTimes("/nonexistent", 10), types.SimpleNamespace(global_steps=0, global_rank=0)
    times.stepped(engine)  # the first call, after a micro-step: set-up, not timed
    assert not times.timing
    engine.global_steps = 1
    times.stepped(engine)
    assert times.timing and times.cuda
    FakeEvent.clock, FakeEvent.done = 1.0, set()
    start = times.span_start()
    FakeEvent.clock = 1.25
    times.span_end(start)  # a blocking collective: 0.25 s on the GPU
    FakeEvent.clock = 2.0
    handle = ranktimes.TimedHandle(types.SimpleNamespace(wait=lambda: "waited", tag="work"), times, times.span_start())
    FakeEvent.clock = 2.5
    assert handle.wait() == "waited" and handle.wait() == "waited" and handle.tag == "work"  # ends once
    FakeEvent.done = {1.0, 1.25, 2.0}  # the GPU has not reached the second span's end yet
    engine.global_steps = 2
    times.stepped(engine)
    assert times.spans == [(0.0, 0.25)] and len(times.open) == 1 and times.calls == 2
    FakeEvent.done.add(2.5)
    engine.global_steps = 3
    times.stepped(engine)
    assert times.spans == [(0.0, 0.25), (1.0, 1.5)] and times.open == []
    times.open = [(start, types.SimpleNamespace(query=lambda: 1 / 0))]
    engine.global_steps = 4
    times.stepped(engine)
    assert not times.timing and times.open == [] and "ZeroDivisionError" in times.broken
    assert "not timed any more" in capsys.readouterr().err
