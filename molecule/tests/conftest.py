"""Fixtures for the container cluster: brought up once per session (molecule/cluster.py), provisioned
once with the project's own playbooks over SSH, and shared by the provision, network and launch
tests. DSC_KEEP_CLUSTER=1 keeps it after the session. Under pytest-xdist (the suite runs this tier
with -n 2) each worker is a session of its own with a cluster of its own (cluster_index): these
fixtures run once per worker, and nothing here starts before a test asks for it, so collecting
starts no container."""
import json
import os
import sys
import time
from pathlib import Path

import pytest

import cluster as testcluster

ROOT = Path(__file__).resolve().parents[2]

# testinfra's ansible backend calls ansible-inventory from PATH.
os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"


@pytest.fixture(scope="session")
def node_image():
    """(tag, output): the provisioned node image, made once from the bare image through
    provision.yml on one node (or reused from an earlier suite while nothing it reads changed)."""
    return testcluster.provisioned_image()


@pytest.fixture(scope="session")
def cluster(node_image):
    info = testcluster.up(int(os.environ.get("DSC_TEST_NODES", "2")), image=node_image[0])
    os.environ["ANSIBLE_CONFIG"] = str(ROOT / "ansible.cfg")
    c = testcluster.Cluster(info)
    yield c
    if os.environ.get("DSC_KEEP_CLUSTER") != "1":
        testcluster.down()


@pytest.fixture(scope="session")
def provisioned(cluster, node_image):
    """The cluster made one by provision.yml: every node from the image, then the cluster's own
    names, SSH trust and firewall. "bare" is the image's provision from the bare image (installs,
    DeepSpeed's ops built); "cluster" this one. Molecule's idempotence step (test_molecule.py)
    is a further run that must change nothing. The nodes after the first join without DeepSpeed's
    ops (their JIT cache emptied): the provision ships the first node's build to them."""
    for node in cluster.names[1:]:
        cluster.exec(node, f"rm -rf {testcluster.EXT_DIR}/*")
    r = cluster.playbook("provision.yml")
    assert r.returncode == 0, r.output[-5000:]
    return {"bare": node_image[1], "cluster": r.output}


# test_molecule.py's idempotence run must follow the `provisioned` fixture's provision with nothing
# run on the cluster between (the other files change what provision checks: test_own_scripts
# installs requirements into the env, test_trust plants and removes files in it): its test goes
# ahead of every other in the collection. Under xdist the workers take the files in the
# collection's order where --no-loadscope-reorder says so (scripts/suite.py does), so the first
# worker starts on its own cluster with it.
def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name != "test_molecule.py")


_started = []  # the tests this session (under xdist: this worker, on its own cluster) set up, in order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _started.append(item.nodeid)


@pytest.fixture
def earlier_tests(request):
    """The tests this session ran on its cluster before the one asking."""
    return _started[:_started.index(request.node.nodeid)]


FIGURES = Path(os.environ.get("DSC_TEST_FIGURES", ROOT / ".cache" / "test-figures.jsonl"))


@pytest.fixture(scope="session")
def figures():
    """Record what a test measured (times, bandwidths, messages) as one JSON line in
    .cache/test-figures.jsonl (both workers append to it); the suite prints it after the run."""
    def record(test, **values):
        FIGURES.parent.mkdir(parents=True, exist_ok=True)
        with FIGURES.open("a") as f:
            f.write(json.dumps({"test": test, "time": round(time.time(), 1), **values}) + "\n")
    return record
