"""plugins/module_utils/dsc_plot.py: a real PNG from runs' histories (matplotlib, no node); a resumed run's
replayed steps drawn once, in step order."""
import json
import subprocess
import sys
from pathlib import Path

import dsc_plot

ROOT = Path(__file__).resolve().parents[2]


def test_two_runs_make_one_png_with_both(tmp_path):
    histories = {
        "zero2-a": {"steps": [{"step": s, "loss": 5 - s / 10, "tokens_per_s": 1000 + s} for s in range(1, 30)],
                    "ranks": []},
        "own-clm": {"steps": [{"step": s, "loss": 6 - s / 20, "samples_per_s": 12.5} for s in range(1, 20)]
                    + [{"step": 20, "loss": None}], "ranks": []},
    }
    out = tmp_path / "runs.png"
    r = subprocess.run([sys.executable, str(ROOT / "plugins" / "module_utils" / "dsc_plot.py"), str(out)],
                       input=json.dumps(histories), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"path": str(out), "runs": ["zero2-a", "own-clm"], "points": 48, "panels": 2}
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000  # a real picture, not an empty frame
    assert [f.name for f in tmp_path.iterdir()] == ["runs.png"]  # written beside, renamed over: no part left


def load_plot():
    return dsc_plot


def test_a_resumed_runs_replayed_steps_draw_one_line_in_step_order_with_the_latest_records():
    """Stopped at step 120, resumed from the checkpoint at 100: the metrics hold 1..120 then
    101..200. One point per step, in step order; a step logged twice takes its latest value."""
    first = [{"step": s, "loss": 10.0 - s / 100, "tokens_per_s": 1000} for s in range(1, 121)]
    resumed = [{"step": s, "loss": 9.0 - s / 100, "tokens_per_s": 2000} for s in range(101, 201)]
    steps, losses = load_plot().series(first + resumed, "loss")
    assert steps == list(range(1, 201))
    assert losses[99] == 10.0 - 100 / 100 and losses[100] == 9.0 - 101 / 100 and losses[119] == 9.0 - 120 / 100
    # the latest record of a step counts even where it lacks the value (no older value instead)
    assert load_plot().series([{"step": 1, "loss": 2.0}, {"step": 1, "loss": None}], "loss") == ([], [])


def test_a_resumed_run_plots_each_step_once(tmp_path):
    history = [{"step": s, "loss": 5 - s / 100} for s in range(1, 121)] + \
              [{"step": s, "loss": 4 - s / 100} for s in range(101, 201)]
    out = tmp_path / "resumed.png"
    r = subprocess.run([sys.executable, str(ROOT / "plugins" / "module_utils" / "dsc_plot.py"), str(out)],
                       input=json.dumps({"resumed": {"steps": history, "ranks": []}}), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["points"] == 200


def test_each_ranks_compute_is_drawn_where_the_ranks_times_were_gathered(tmp_path):
    """A third panel, a line per rank: its step time outside collectives, per window (ranks.jsonl)."""
    windows = [{"step": 10 * k, "ranks": [{"rank": 0, "node": "node1", "compute_s": 0.1},
                                          {"rank": 1, "node": "node2", "compute_s": 0.29 if k > 3 else 0.1}]}
               for k in range(1, 9)]
    assert dsc_plot.rank_series(windows)["node2 rank 1"][1][-1] == 0.29
    out = tmp_path / "ranks.png"
    r = subprocess.run([sys.executable, str(ROOT / "plugins" / "module_utils" / "dsc_plot.py"), str(out)],
                       input=json.dumps({"slow": {"steps": [{"step": s, "loss": 1.0} for s in range(1, 81)], "ranks": windows}}),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["panels"] == 3 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # 16 ranks: the median and the 7 whose compute peaked highest, not 16 lines
    many = [{"step": 10 * k, "ranks": [{"rank": r, "node": f"node{r // 8 + 1}", "compute_s": 0.1 + r / 1000}
                                       for r in range(16)]} for k in range(1, 4)]
    drawn = dsc_plot.rank_series(many)
    assert list(drawn) == ["median"] + [f"node2 rank {r}" for r in range(15, 8, -1)], list(drawn)
    assert drawn["median"] == ([10, 20, 30], [0.1 + 8 / 1000] * 3)
