"""The suite's own timings (scripts/timings.py): the container tier's files are handed to the
workers longest first by the last run that ran the tier whole and to its end.

    .venv/bin/pytest tests/unit/test_suite_timings.py -q
"""
import json

from scripts import timings


def test_the_file_order_comes_from_the_last_whole_container_tier_not_an_interrupted_or_partial_one(tmp_path):
    history = tmp_path / "suite-times.jsonl"
    whole = {"container_files": {"a.py": 300, "b.py": 100}, "tiers": {"container": {"outcome": "failed (exit 1)"}}}
    runs = [whole,
            {"container_files": {"a.py": 20}, "tiers": {"container": {"outcome": "stopped"}}},  # interrupted
            {"container_files": {"b.py": 90}, "args": ["molecule/tests/test_watching.py"],
             "tiers": {"container": {"outcome": "passed"}}},  # a few files only
            {"container_files": {"a.py": 5}, "tiers": {}}]  # killed before the tier's end was written
    history.write_text("".join(json.dumps(r) + "\n" for r in runs))
    assert timings.last_file_seconds(history) == {"a.py": 300, "b.py": 100}
    assert timings.last_file_seconds(tmp_path / "none.jsonl") == {}
