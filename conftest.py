"""Every tier's time, where it goes: each test's set-up, call and tear-down seconds appended to
$DSC_TIMINGS (scripts/suite.py sets it; scripts/timings.py prints the slowest ten and the totals
per tier at the end of every run and keeps them in .cache/suite-times.jsonl). The container
tier's playbooks add their own lines there (plugins/callback/dsc_timings.py)."""
import json
import os
import time
from pathlib import Path

# molecule/default/tests: the verify step of test_molecule.py (inside the container tier).
TIERS = {"tests/unit": "unit", "tests/local": "local", "molecule/tests": "container",
         "molecule/default/tests": "molecule verify"}
_seen = {}
# Under pytest-xdist a worker's reports reach the controller, which runs this hook for them again:
# the controller alone writes them (a worker's config carries its workerinput).
_worker = False


def pytest_configure(config):
    global _worker
    _worker = hasattr(config, "workerinput")


def _tier(nodeid):
    return next((tier for prefix, tier in TIERS.items() if nodeid.startswith(prefix)), "other")


def pytest_runtest_logreport(report):
    path = os.environ.get("DSC_TIMINGS")
    if not path or _worker:
        return
    row = _seen.setdefault(report.nodeid, {"kind": "test", "tier": _tier(report.nodeid), "test": report.nodeid})
    row[report.when] = round(report.duration, 2)
    if report.failed:
        row["outcome"] = "failed"
    if report.when == "teardown":
        row.setdefault("outcome", "skipped" if report.skipped or "call" not in row else "passed")
        row["end"] = round(time.time(), 1)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(_seen.pop(report.nodeid)) + "\n")
