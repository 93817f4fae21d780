"""Loss and throughput against step, one line per run, as a PNG (matplotlib, on the control node).

    python3 dsc_plot.py OUT.png < {"run id": [{step, loss, tokens_per_s | samples_per_s}, ...], ...}

plot.yml and launch.yml's follow feed it the node helper's `history` of each run (train.run's
metrics.jsonl or any script's progress.jsonl). Prints {path, runs, points} as JSON.
"""
from __future__ import annotations

import json
import os
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


def plot(histories, out_path):
    import matplotlib  # noqa: PLC0415 - only where a picture is drawn
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after use("Agg")
    fig, (loss_ax, rate_ax) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    points, rates = 0, set()
    for run_id, rows in histories.items():
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
    rate_ax.set_xlabel("step")
    rate_ax.grid(True, alpha=0.3)
    fig.tight_layout()
    # Written beside and renamed over: two followers of one run (launch.yml's and status.yml's)
    # draw the same picture when it ends, and neither may leave the other's half-written file.
    part = f"{out_path}.{os.getpid()}.part"
    fig.savefig(part, dpi=100, format="png")
    plt.close(fig)
    os.replace(part, out_path)
    return {"path": str(out_path), "runs": list(histories), "points": points}


if __name__ == "__main__":
    print(json.dumps(plot(json.load(sys.stdin), sys.argv[1])))
