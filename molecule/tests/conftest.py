"""Fixtures for the container cluster: brought up once per session (molecule/cluster.py), provisioned
once with the project's own playbooks over SSH, and shared by the provision, network and launch
tests. DSC_KEEP_CLUSTER=1 keeps it after the session."""
import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "molecule"))
sys.path.insert(0, str(ROOT / "plugins" / "module_utils"))  # dsc_plan's parsers
import cluster as testcluster  # noqa: E402

# testinfra's ansible backend calls ansible-inventory from PATH.
os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"


@pytest.fixture(scope="session")
def cluster():
    info = testcluster.up(int(os.environ.get("DSC_TEST_NODES", "2")))
    os.environ["ANSIBLE_CONFIG"] = str(ROOT / "ansible.cfg")
    c = testcluster.Cluster(info)
    yield c
    if os.environ.get("DSC_KEEP_CLUSTER") != "1":
        testcluster.down()


@pytest.fixture(scope="session")
def provisioned(cluster):
    first = cluster.playbook("provision.yml")
    assert first.returncode == 0, first.output[-5000:]
    # A second run changing nothing is molecule's idempotence step (test_molecule.py).
    return {"first": first}


FIGURES = Path(os.environ.get("DSC_TEST_FIGURES", ROOT / ".cache" / "test-figures.jsonl"))


@pytest.fixture(scope="session")
def figures():
    """Record what a test measured (times, bandwidths, messages) as one JSON line in
    .cache/test-figures.jsonl; scripts/test.sh prints the file after the run."""
    def record(test, **values):
        FIGURES.parent.mkdir(parents=True, exist_ok=True)
        with FIGURES.open("a") as f:
            f.write(json.dumps({"test": test, "time": round(time.time(), 1), **values}) + "\n")
    return record
