"""Where the suite's time went, from the lines scripts/test.sh, the tests (conftest.py) and the
playbooks (plugins/callback/dsc_timings.py) appended to one file:

    python3 scripts/timings.py .cache/timings.jsonl

Prints the set-up phases, the totals per tier, the container tier's files, the slowest ten tests (set-up + call + tear-down:
a session fixture's cost lands on the first test that asks for it), the playbooks' time by
playbook and by task, and last the outcomes over every tier ("suite: N passed, N failed, ...").
"""
import json
import sys
from collections import defaultdict


def summary(lines):
    rows = [json.loads(x) for x in lines if x.strip()]
    phases = [r for r in rows if r.get("kind") == "phase"]
    tests = [r for r in rows if r.get("kind") == "test"]
    books = [r for r in rows if "playbook" in r]
    out = []
    if phases:
        out.append("set-up and tiers (wall seconds):")
        out += [f"  {r['name']:<34} {r['seconds']:>8.1f}" for r in phases]
        # Some phases overlap (the node image builds while the local tier runs): scripts/test.sh
        # records its own wall time; without it, the phases' sum.
        wall = next((r["seconds"] for r in rows if r.get("kind") == "wall"), None)
        if wall is None:
            out.append(f"  {'all':<34} {sum(r['seconds'] for r in phases):>8.1f}")
        else:
            out.append(f"  {'all, end to end':<34} {wall:>8.1f}")
    tiers = defaultdict(lambda: [0, 0.0])
    for t in tests:
        t["total"] = t.get("setup", 0) + t.get("call", 0) + t.get("teardown", 0)
        tiers[t["tier"]][0] += 1
        tiers[t["tier"]][1] += t["total"]
    if tiers:
        out.append("tests per tier: count, seconds")
        out += [f"  {tier:<10} {n:>5} {s:>9.1f}" for tier, (n, s) in tiers.items()]
        files = defaultdict(float)
        for t in tests:
            if t["tier"] == "container":
                files[t["test"].split("::")[0].rsplit("/", 1)[-1]] += t["total"]
        if files:
            out.append("container tier by file (seconds; scripts/test.sh splits the files between two clusters):")
            out += [f"  {s:>8.1f}  {name}" for name, s in sorted(files.items(), key=lambda x: -x[1])]
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
        count = {k: sum(t.get("outcome") == k for t in tests) for k in ("passed", "failed", "skipped")}
        out.append(f"suite: {count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped")
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        print(summary(f) or "(no timings recorded)")
