"""Loss and throughput against step, one line per run, and each rank's compute per step where the
ranks' times were gathered, as a PNG (matplotlib, on the control node).

    python3 dsc_plot.py OUT.png < {"run id": {"steps": [{step, loss, tokens_per_s | samples_per_s}, ...],
                                              "ranks": [{step, ranks: [{rank, node, compute_s}]}, ...]}, ...}

plot.yml and launch.yml's follow feed it the node helper's `history` of each run (train.run's
metrics.jsonl or any script's progress.jsonl, and ranks.jsonl). Prints {path, runs, points, panels} as JSON.
"""
from __future__ import annotations

import json
import os
import statistics
import sys


def series(rows, key):
    """(steps, values) of `key` in step order. A resumed run logs again the steps between its
    checkpoint and where it stopped (metrics 1..120, then 101..200): for a step logged more than
    once the latest record counts, so the line never runs backwards."""
    latest = {r["step"]: r for r in rows if isinstance(r, dict) and r.get("step") is not None}
    points = [(step, r[key]) for step, r in sorted(latest.items()) if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def rate_key(rows):
    """tokens/s where the run logs it (train.run), else samples/s (any script)."""
    return "tokens_per_s" if any(r.get("tokens_per_s") is not None for r in rows) else "samples_per_s"


RANK_LINES = 8  # ranks drawn one line each; with more, the median and the RANK_LINES - 1 slowest at their peak


def rank_series(windows):
    """{label "node rank N": (steps, compute seconds per step)} from the ranks' windows: each
    rank's step time outside collectives, the line that stands out for a slow rank. With more
    than RANK_LINES ranks, a "median" line and the ranks whose compute was highest at some window."""
    out = {}
    for w in windows or []:
        for r in (w or {}).get("ranks") or []:
            if isinstance(r, dict) and isinstance(r.get("compute_s"), (int, float)):
                steps, values = out.setdefault(f"{r.get('node', '?')} rank {r.get('rank')}", ([], []))
                steps.append(w.get("step"))
                values.append(r["compute_s"])
    if len(out) <= RANK_LINES:
        return out
    by_step = {}
    for steps, values in out.values():
        for step, value in zip(steps, values, strict=True):
            by_step.setdefault(step, []).append(value)
    median = {step: statistics.median_high(v) for step, v in by_step.items()}
    slowest = sorted(out, key=lambda label: max(out[label][1]), reverse=True)[:RANK_LINES - 1]
    return {"median": (list(median), list(median.values())), **{label: out[label] for label in slowest}}


def plot(histories, out_path):
    import matplotlib  # noqa: PLC0415 - only where a picture is drawn
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after use("Agg")
    ranks = {run_id: rank_series(h.get("ranks")) for run_id, h in histories.items()}
    panels = 3 if any(ranks.values()) else 2
    fig, axes = plt.subplots(panels, 1, figsize=(9, 3.5 * panels), sharex=True)
    loss_ax, rate_ax = axes[0], axes[1]
    points, rates = 0, set()
    for run_id, history in histories.items():
        rows = history.get("steps") or []
        steps, losses = series(rows, "loss")
        loss_ax.plot(steps, losses, label=run_id, linewidth=1.2)
        key = rate_key(rows)
        rates.add(key)
        steps_r, values = series(rows, key)
        rate_ax.plot(steps_r, values, label=run_id, linewidth=1.2)
        points += len(steps)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("loss and throughput against step")
    loss_ax.grid(True, alpha=0.3)
    loss_ax.legend(fontsize="small")
    rate_ax.set_ylabel(" / ".join(k.replace("_per_s", "/s") for k in sorted(rates)) or "throughput")
    rate_ax.grid(True, alpha=0.3)
    if panels == 3:
        for run_id, series_of in ranks.items():
            for label, (steps, values) in series_of.items():
                axes[2].plot(steps, values, label=f"{run_id}: {label}" if len(ranks) > 1 else label, linewidth=1.0)
        axes[2].set_ylabel("compute s per step\n(outside collectives)")
        axes[2].grid(True, alpha=0.3)
        axes[2].legend(fontsize="x-small", ncol=2)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    # Written beside and renamed over: two followers of one run (launch.yml's and status.yml's)
    # draw the same picture when it ends, and neither may leave the other's half-written file.
    part = f"{out_path}.{os.getpid()}.part"
    fig.savefig(part, dpi=100, format="png")
    plt.close(fig)
    os.replace(part, out_path)
    return {"path": str(out_path), "runs": list(histories), "points": points, "panels": panels}


if __name__ == "__main__":
    print(json.dumps(plot(json.load(sys.stdin), sys.argv[1])))
