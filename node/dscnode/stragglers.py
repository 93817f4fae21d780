"""Which rank the others wait for, while the run still moves. Each rank measures, per optimizer
step, its time in collectives (comm_s: the union of its collectives' spans, from call to return
or to the wait of an asynchronous one) and the rest of its step (compute_s = step_s - comm_s: its
own work); the entry shim measures them (ranktimes.RankTimes) and global rank 0 gathers every
rank's figures every window of steps (10 by default) into the run's ranks.jsonl, judged here.

In synchronous training every rank's step lasts as long as the slowest rank's: the others reach
each collective first and wait in it for the slowest, which waits for nobody. So, per window, a
rank is slow when its compute is SLOW_RATIO times the median of the others' and the others spend
WAIT_SHARE of each step or more in collectives beyond its own time in them (their wait for it: a
transfer takes as long for each), in CONSISTENT windows in a row that span MIN_SPAN_S or more; the
mark clears at the first window where it is not so. A run whose ranks are alike is never marked
(the ratio is about 1), nor one bound by its network (every rank waits alike): a slow link or NIC
is not named here, it is doctor.yml's to measure. The others are the ranks of the other nodes, so that a node slowed
as a whole stands out against them.

Why it holds where collectives overlap compute:
- ZeRO-1: the gradients are all-reduced at the step, after the backward: no overlap, the
  measure is exact.
- ZeRO-2 (overlap_comm) and ZeRO-3 (parameters gathered asynchronously ahead of their use,
  gradients reduce-scattered during the backward): a span runs while compute goes on beside it,
  so comm_s counts some compute as communication, on every rank alike (the same model, the same
  buckets). The slow rank's own compute still shows (its spans end as soon as it issues them:
  the others are already there), and the others' spans stretch by exactly their wait for it; the
  union keeps overlapping gathers from counting twice.
- The offload presets: the optimizer step runs on the CPU (DeepSpeed's CPU Adam) outside any
  collective, so a slow CPU shows as compute, where it belongs.
A slowest rank whose compute is measured as 0 (its collectives cover its step) names nothing; the
others' compute is taken as at least a hundredth of their step (FLOOR_SHARE), so that a ratio
stays a number where they wait the whole step.
"""
from __future__ import annotations

import statistics

SLOW_RATIO = 1.5
WAIT_SHARE = 0.2
CONSISTENT = 3  # windows in a row: one or two noisy windows (a rank descheduled a while) name nobody
# ... and the seconds from the first of them to the last: a run of short steps fills 3 windows in a
# second or two, and a rank held up that long (a checkpoint written, a descheduling, the page cache
# flushed) is not the slow rank that costs a run its hours.
MIN_SPAN_S = 20.0
FLOOR_SHARE = 0.01  # the least compute a ratio is taken against, as a share of the step


def median(values):
    """The median (statistics.median), 0.0 of none."""
    values = list(values)
    return statistics.median(values) if values else 0.0


def usable(window):
    """The window's rank entries that carry figures (a rank whose timing broke sends an error)."""
    return [r for r in (window or {}).get("ranks") or []
            if isinstance(r, dict) and all(isinstance(r.get(k), (int, float)) for k in ("step_s", "comm_s", "compute_s"))]


def judge(window):
    """One window's slow rank, or None: {rank, node, ratio, wait_share, compute_s, median_s}.
    `window`: {"ranks": [{rank, node, step_s, comm_s, compute_s}, ...]}, as rank 0 writes it.
    The others are the ranks of the other nodes (those of the same node where there is one node):
    a node slowed as a whole (its CPU, its power) slows all its ranks alike, and against its own
    ranks none would stand out."""
    ranks = usable(window)
    if len(ranks) < 2:
        return None
    slowest = max(ranks, key=lambda r: r["compute_s"])
    others = ([r for r in ranks if r.get("node") != slowest.get("node")]
              or [r for r in ranks if r is not slowest])
    typical = median(r["compute_s"] for r in others)
    # the others' time in collectives beyond the slow rank's own: their wait for it
    wait = median((r["comm_s"] - slowest["comm_s"]) / r["step_s"] for r in others if r["step_s"] > 0)
    if slowest["compute_s"] <= 0:
        return None
    # The others' compute can be all but nothing where their collectives cover their step (they
    # wait the whole of it): a hundredth of a step stands in for less.
    floor = median(r["step_s"] for r in others) * FLOOR_SHARE
    ratio = slowest["compute_s"] / max(typical, floor, 1e-9)
    if ratio < SLOW_RATIO or wait < WAIT_SHARE:
        return None
    return {"rank": slowest["rank"], "node": slowest.get("node"), "ratio": round(ratio, 2),
            "wait_share": round(wait, 3), "compute_s": round(slowest["compute_s"], 4), "median_s": round(typical, 4)}


class Streak:
    """The windows in a row, up to the last one added, that each name a rank of the same node (of a
    node slowed as a whole, which of its ranks is slowest varies): their first window's step and
    time, the last window's, its judgement, how many. Fed one window at a time, oldest first."""

    def __init__(self):
        self.first, self.last, self.count = None, None, 0

    def add(self, window):
        slow = judge(window)
        here = {"step": window.get("step"), "time": window.get("time"), "slow": slow}
        if not slow:
            self.first, self.count = None, 0
        elif self.count and slow["node"] == self.last["slow"]["node"]:
            self.count += 1
        else:
            self.first, self.count = here, 1
        self.last = here

    def mark(self, min_span_s=MIN_SPAN_S):
        """The mark: when the streak is CONSISTENT windows or more and spans min_span_s seconds from
        its first window's time to its last's, the last window's rank and figures, its step, and
        since_step, the step of the streak's first window; None otherwise (never marked, or cleared
        by the last window)."""
        if self.count < CONSISTENT:
            return None
        span = (self.last["time"] or 0) - (self.first["time"] or 0)
        if span < min_span_s:
            return None
        return dict(self.last["slow"], step=self.last["step"], since_step=self.first["step"],
                    windows=self.count, span_s=round(span, 1))


def verdict(windows, min_span_s=MIN_SPAN_S):
    """The mark over these windows (oldest first), as Streak.mark says it."""
    streak = Streak()
    for w in windows or []:
        streak.add(w)
    return streak.mark(min_span_s)


def cleared(mark, window):
    """Why a mark ended, in words, from the window that ended it: the marked node's ranks catching
    up, or sending no figures (their timing broke: the error they sent)."""
    if any(r.get("node") == mark.get("node") for r in usable(window)):
        return f"caught up (step {window.get('step')})"
    errors = {r.get("error") for r in (window or {}).get("ranks") or []
              if isinstance(r, dict) and r.get("node") == mark.get("node") and r.get("error")}
    return (f"sent no figures at step {window.get('step')}, so it is no longer judged"
            + (f": {'; '.join(sorted(map(str, errors)))}" if errors else ""))


def short(mark):
    """The mark in a few words (follow's line, runs.yml's state)."""
    return f"{mark.get('node') or '?'} rank {mark.get('rank')}, {mark['ratio']:.1f}x the median compute"


def said(mark):
    """The mark in words, with the fix to try (status.yml, the run's log)."""
    node, rank = mark.get("node") or "?", mark.get("rank")
    return (f"{node} rank {rank}: {mark['ratio']:.1f}x the median compute, the others wait "
            f"{100 * mark['wait_share']:.0f} % of each step for it (since step {mark.get('since_step')}). "
            f"Fix: look at {node}: its GPU's throttle reasons (nvidia-smi -q -d PERFORMANCE), its CPU "
            f"(other processes, a CPU quota: top), its data loading (disk, workers).")
