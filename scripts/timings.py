"""Where the suite's time went. A suite run (scripts/suite.py) writes its raw lines to
.cache/timings.jsonl: its steps' seconds, each test's set-up, call and tear-down (conftest.py) and
each playbook's tasks (plugins/callback/dsc_timings.py). At its end it prints summary() of them and
appends record() of them, one JSON line per run, to .cache/suite-times.jsonl, the suite's measured
times (never committed).

    python3 scripts/timings.py                 # the last run's summary again
    python3 scripts/timings.py --runs [N]      # the last N runs (default 20), one line each
    python3 scripts/timings.py --durations > molecule/tests/durations.json
                                               # each container test file's seconds in the last whole
                                               # run: the order a fresh clone's workers take them in

Standard library only: the suite's runner imports it before any venv exists.
"""
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RAW = ROOT / ".cache" / "timings.jsonl"
HISTORY = ROOT / ".cache" / "suite-times.jsonl"
OUTCOMES = ("passed", "failed", "skipped")


def load(path):
    """The JSON lines of a file; none where it does not exist."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _tests(rows):
    tests = [dict(r) for r in rows if r.get("kind") == "test"]
    for t in tests:
        t["total"] = round(t.get("setup", 0) + t.get("call", 0) + t.get("teardown", 0), 2)
    return tests


def _file_seconds(tests, tier):
    """{test file: its tests' seconds} of one tier. A session fixture's cost (a cluster's start
    and provision) lands on the first test that asks for it, so on the first file of each worker."""
    files = defaultdict(float)
    for t in tests:
        if t["tier"] == tier:
            files[t["test"].split("::")[0]] += t["total"]
    return {f: round(s, 1) for f, s in sorted(files.items(), key=lambda x: -x[1])}


def record(rows, **meta):
    """One run as one JSON object: `meta` (when, commit, tiers, status), the wall seconds, each
    step's seconds, each tier's seconds and outcomes, the container tier's seconds by file (the
    next run's order of files) and the ten slowest tests."""
    steps = [r for r in rows if r.get("kind") == "phase"]
    tests = _tests(rows)
    books = [r for r in rows if "playbook" in r]
    tiers = {}
    for s in steps:
        if s["name"].endswith(" tier"):
            tier = s["name"].removesuffix(" tier")
            tiers[tier] = {"seconds": s["seconds"], "outcome": s.get("outcome")}
            tiers[tier].update({k: sum(t["tier"] == tier and t.get("outcome") == k for t in tests) for k in OUTCOMES})
    return {**meta,
            "seconds": next((r["seconds"] for r in rows if r.get("kind") == "wall"), None),
            "steps": {s["name"]: {"start": s.get("start"), "seconds": s["seconds"]} for s in steps},
            "tiers": tiers,
            "container_files": _file_seconds(tests, "container"),
            "slowest": [{"test": t["test"], "seconds": t["total"], "setup": t.get("setup", 0)}
                        for t in sorted(tests, key=lambda t: -t["total"])[:10]],
            "playbooks": {"runs": len(books), "seconds": round(sum(b["seconds"] for b in books), 1)}}


def last_file_seconds(history=None):
    """{test file: seconds} of the container tier in the last run that ran it whole, to its end
    (empty before any; a run interrupted within the tier holds only the files it reached):
    scripts/suite.py hands the files to its workers longest first."""
    for run in reversed(load(history or HISTORY)):
        outcome = str(((run.get("tiers") or {}).get("container") or {}).get("outcome"))
        if run.get("container_files") and not run.get("args") and outcome.startswith(("passed", "failed")):
            return run["container_files"]
    return {}


def summary(rows):
    """The end of a run's output: the steps (when each started and how long it took), the tests
    per tier, the container tier by file, the slowest ten tests, the playbooks' time by playbook
    and by task, and last the outcomes over every tier."""
    steps = [r for r in rows if r.get("kind") == "phase"]
    tests = _tests(rows)
    books = [r for r in rows if "playbook" in r]
    out = []
    if steps:
        out.append("steps: started at, seconds (wall; they overlap)")
        out += [f"  {r['name']:<44} {r.get('start', 0):>7.1f} {r['seconds']:>8.1f}  {r.get('outcome', '')}"
                for r in sorted(steps, key=lambda r: r.get("start", 0))]
        wall = next((r["seconds"] for r in rows if r.get("kind") == "wall"), None)
        if wall is not None:
            out.append(f"  {'all, end to end':<44} {'':>7} {wall:>8.1f}")
    if tests:
        tiers = defaultdict(lambda: [0, 0.0])
        for t in tests:
            tiers[t["tier"]][0] += 1
            tiers[t["tier"]][1] += t["total"]
        out.append("tests per tier: count, seconds")
        out += [f"  {tier:<16} {n:>5} {s:>9.1f}" for tier, (n, s) in tiers.items()]
        files = _file_seconds(tests, "container")
        if files:
            out.append("container tier by file (seconds; the next run hands them to the workers longest first):")
            out += [f"  {s:>8.1f}  {name}" for name, s in files.items()]
        out.append("slowest ten tests (set-up + call + tear-down, seconds):")
        for t in sorted(tests, key=lambda t: -t["total"])[:10]:
            out.append(f"  {t['total']:>7.1f}  (set-up {t.get('setup', 0):.1f}) {t['test']}")
    if books:
        by_book, by_task = defaultdict(lambda: [0, 0.0]), defaultdict(float)
        for b in books:
            by_book[b["playbook"]][0] += 1
            by_book[b["playbook"]][1] += b["seconds"]
            for task, s in b["tasks"].items():
                by_task[task] += s
        out.append(f"playbooks: {len(books)} runs, {sum(b['seconds'] for b in books):.1f} s")
        out += [f"  {name:<16} {n:>4} runs {s:>8.1f} s" for name, (n, s) in sorted(by_book.items(), key=lambda x: -x[1][1])]
        out.append("tasks with the most time over all playbook runs (seconds):")
        out += [f"  {s:>8.1f}  {task}" for task, s in sorted(by_task.items(), key=lambda x: -x[1])[:15]]
    if tests:
        count = {k: sum(t.get("outcome") == k for t in tests) for k in OUTCOMES}
        out.append(f"suite: {count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped")
    return "\n".join(out)


def runs_table(runs):
    """One line per recorded run: when, commit, status, wall seconds, each tier's seconds."""
    out = [f"{'when':<20} {'commit':<12} {'status':<7} {'wall s':>7}  tiers (seconds)"]
    for r in runs:
        tiers = ", ".join(f"{name} {t['seconds']:.0f}" for name, t in r.get("tiers", {}).items())
        wall = f"{r['seconds']:.0f}" if r.get("seconds") is not None else "-"
        out.append(f"{r.get('time', '?'):<20} {r.get('commit', '?'):<12} {r.get('status', '?'):<7} {wall:>7}  {tiers}")
    return "\n".join(out)


def main(argv):
    if argv[:1] == ["--runs"]:
        print(runs_table(load(HISTORY)[-int(argv[1]) if len(argv) > 1 else -20:]))
    elif argv[:1] == ["--durations"]:  # molecule/tests/durations.json, from the last whole run
        seconds = last_file_seconds()
        print(json.dumps({f: round(t) for f, t in sorted(seconds.items(), key=lambda kv: -kv[1])}, indent=1))
    else:
        print(summary(load(argv[0] if argv else RAW)) or "(no timings recorded)")


if __name__ == "__main__":
    main(sys.argv[1:])
