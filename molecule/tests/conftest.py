"""Fixtures for the container cluster: brought up once per session (molecule/cluster.py), provisioned
once with the project's own playbooks over SSH, and shared by the provision, network and launch
tests. DSC_KEEP_CLUSTER=1 keeps it after the session."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "molecule"))
import cluster as testcluster  # noqa: E402

VENV_BIN = Path(sys.executable).parent
# testinfra's ansible backend calls ansible-inventory from PATH.
os.environ["PATH"] = f"{VENV_BIN}:{os.environ['PATH']}"


def recap(output):
    """{host: {ok, changed, failed, ...}} from a PLAY RECAP."""
    out = {}
    for m in re.finditer(r"^(\S+)\s+:\s+(.*)$", output.split("PLAY RECAP")[-1], re.M):
        out[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return out


class Cluster:
    def __init__(self, info):
        self.info = info
        self.inventory = testcluster.STATE / "inventory"
        self.names = [h["name"] for h in info["hosts"]]
        self.master = self.names[0]

    def playbook(self, name, *args, timeout=1800):
        env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_FORCE_COLOR="0",
                   PATH=f"{VENV_BIN}:{os.environ['PATH']}")
        r = subprocess.run([str(VENV_BIN / "ansible-playbook"), "-i", str(self.inventory), name, *args],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        r.recap = recap(r.stdout)
        r.output = r.stdout + r.stderr
        return r

    def exec(self, node, cmd, user=None, check=True, timeout=120):
        """A command inside a node's container (test inspection, not how the toolkit reaches nodes)."""
        argv = ["podman", "exec"] + (["--user", user] if user else []) + [
            testcluster.PREFIX + node, "bash", "-lc", cmd]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, CONTAINERS_CONF=os.environ["CONTAINERS_CONF"]))
        if check:
            assert r.returncode == 0, f"{node}: {cmd}: {r.stdout}{r.stderr}"
        return r

    def host(self, node):
        import testinfra
        return testinfra.get_host(f"ansible://{node}?ansible_inventory={self.inventory}")


@pytest.fixture(scope="session")
def cluster():
    info = testcluster.up(int(os.environ.get("DSC_TEST_NODES", "2")))
    os.environ["ANSIBLE_CONFIG"] = str(ROOT / "ansible.cfg")
    c = Cluster(info)
    yield c
    if os.environ.get("DSC_KEEP_CLUSTER") != "1":
        testcluster.down()


@pytest.fixture(scope="session")
def provisioned(cluster):
    first = cluster.playbook("provision.yml")
    assert first.returncode == 0, first.output[-5000:]
    second = cluster.playbook("provision.yml")
    assert second.returncode == 0, second.output[-5000:]
    return {"first": first, "second": second}
