"""Slurm installed by the toolkit (dsc_slurm_install, roles/slurm) on two more nodes of the test
network that run systemd (molecule/node-systemd.Containerfile), behind the toolkit's firewalld,
reached over SSH as the cluster's nodes are: `provision.yml --tags network,slurm` (the plan, the
training user, the firewall and Slurm alone; no torch on these nodes). The containers give slurmd
no cgroup tree of its own: dsc_slurm_cgroup false (proctrack/linuxproc)."""
import hashlib
import json
import subprocess
from pathlib import Path

import pytest

import cluster as tc

NODES = [{"name": f"slu{i}", "ip": tc.addr(50 + i), "ip6": tc.addr6(50 + i), "port": 22} for i in (1, 2)]
SLURM = ("cluster_network_firewall_backend: firewalld\n"
         "dsc_slurm_install: true\n"
         "dsc_slurm_cgroup: false\n")
KEY = Path.home() / ".dscluster" / "keys" / "testcluster" / "munge.key"


@pytest.fixture(scope="module")
def slurm_nodes(cluster, tmp_path_factory):
    """The two systemd nodes, their inventory, and the first provision.yml --tags network,slurm."""
    where = tmp_path_factory.mktemp("slurm")
    containers = [tc.PREFIX + h["name"] for h in NODES]
    pub = (tc.STATE / "id_ed25519.pub").read_text()
    try:
        for h in NODES:
            tc.start_systemd(tc.PREFIX + h["name"], h["name"], h["ip"], h["ip6"])
        known = [f"{h['ip']} {tc.authorize(tc.PREFIX + h['name'], pub)}" for h in NODES]
        (where / "known_hosts").write_text("\n".join(known) + "\n")
        tc.write_inventory(NODES, inv=where / "inventory", known_hosts=where / "known_hosts", extra=SLURM)
        tc.wait_ssh(NODES, known_hosts=where / "known_hosts")
        first = cluster.playbook("provision.yml", "--tags", "network,slurm", inventory=where / "inventory")
        yield {"inventory": where / "inventory", "first": first}
    finally:
        tc.sh("podman", "rm", "-f", "-t", "0", *containers, check=False)


def test_provision_installs_slurm_that_runs_a_step_on_every_node(slurm_nodes, cluster):
    first = slurm_nodes["first"]
    assert first.returncode == 0, first.output[-6000:]
    assert "TASK [slurm : Run one job step on every node as the training user]" in first.output
    nodes = cluster.exec("slu1", "sinfo --noheader --Node --format '%N %P %T'").stdout.split("\n")
    assert sorted(n.split() for n in nodes if n) == [["slu1", "dsc*", "idle"], ["slu2", "dsc*", "idle"]]
    # One munge key: made once on the control node, readable by its owner alone there and on the
    # nodes, and what one node signs the other verifies.
    assert KEY.stat().st_mode & 0o777 == 0o400
    digest = hashlib.sha256(KEY.read_bytes()).hexdigest()
    for h in NODES:
        key = cluster.exec(h["name"], "stat -c '%U:%G %a' /etc/munge/munge.key && sha256sum /etc/munge/munge.key")
        assert key.stdout.split()[:3] == ["munge:munge", "400", digest], key.stdout
    credential = cluster.exec("slu1", "munge -n").stdout
    assert subprocess.run(["podman", "exec", "-i", tc.PREFIX + "slu2", "unmunge"], input=credential,
                          capture_output=True, text=True).returncode == 0
    conf = [cluster.exec(h["name"], "cat /etc/slurm/slurm.conf").stdout for h in NODES]
    cpus = cluster.exec("slu2", "nproc").stdout.strip()
    assert conf[0] == conf[1] and f"NodeName=slu2 NodeAddr={NODES[1]['ip']} CPUs={cpus} " in conf[0]
    # A job of the training user's, through the firewall, on both nodes at once.
    step = cluster.exec("slu1", "cd /tmp && runuser -u dstrain -- srun --nodes 2 --ntasks-per-node 1 "
                                "sh -c 'echo $SLURMD_NODENAME $(id -un)'")
    assert sorted(step.stdout.splitlines()) == ["slu1 dstrain", "slu2 dstrain"], step.stdout


def test_a_second_provision_changes_nothing(slurm_nodes, cluster):
    again = cluster.playbook("provision.yml", "--tags", "network,slurm", inventory=slurm_nodes["inventory"])
    assert again.returncode == 0, again.output[-5000:]
    changed = [block.splitlines()[0] for block in again.output.split("TASK [")[1:] if "changed: [" in block]
    assert all(again.recap[h["name"]]["changed"] == 0 for h in NODES), changed


def test_preflight_names_the_node_whose_slurmd_is_stopped(slurm_nodes, cluster):
    """preflight's fast checks (no all-reduce: these nodes have no env, whose rows fail too)."""
    cluster.exec("slu2", "systemctl stop slurmd")
    try:
        r = cluster.playbook("preflight.yml", "-e", "preflight_full=false", inventory=slurm_nodes["inventory"])
    finally:
        cluster.exec("slu2", "systemctl start slurmd")
    assert r.returncode != 0 and "Preflight failed" in r.output, r.output[-4000:]
    report = json.loads((Path.home() / ".dscluster" / "reports" / "preflight-testcluster-latest.json").read_text())
    rows = {(x["check"], x["node"]): (x["status"], x["detail"]) for x in report["checks"]}
    assert rows[("munge", "slu1")][0] == rows[("munge", "slu2")][0] == "PASS", rows
    assert rows[("slurm", "slu1")] == ("PASS", "slurmd answers; idle in partition dsc"), rows
    assert rows[("slurm", "slu2")][0] == "FAIL" and rows[("slurm", "slu2")][1].startswith("slurmd does not answer"), rows
    assert "systemctl status slurmd on slu2" in r.output
