"""firewalld as the cluster's firewall (cluster_network_firewall_backend: firewalld, with
default-deny), on two more nodes of the test network that run systemd, dbus and firewalld
(molecule/node-systemd.Containerfile), reached over SSH as the cluster's nodes are:
`provision.yml --tags network` (the plan, the training user and roles/cluster_network alone; no
torch on these nodes). The outsider container is the rest of the site's network."""
import subprocess

import pytest

import cluster as tc

GATEWAY = tc.SUBNET.rsplit(".", 1)[0] + ".1"  # the control node as the nodes see it
NODES = [{"name": f"fwd{i}", "ip": tc.addr(30 + i), "ip6": tc.addr6(30 + i), "port": 22}
         for i in (1, 2)]
FIREWALLD = "cluster_network_firewall_backend: firewalld\ncluster_network_default_deny: true\n"


# An SSH source the first provision lists and the later ones drop (not the outsider's address).
LISTED = f'rule family="ipv4" source address="{tc.addr(99)}" port port="22" protocol="tcp" accept'


@pytest.fixture(scope="module")
def fwd(cluster, tmp_path_factory):
    """The two systemd nodes (the main cluster's network, control key and outsider), their
    inventory, and the first provision.yml --tags network on them, through a view of the same
    nodes that also lists an SSH source (LISTED's address): the later provisions use the plain
    inventory, which drops it (three provisions for what the tests below check, not four)."""
    where = tmp_path_factory.mktemp("firewalld")
    with tc.extra_nodes(NODES, where, lambda c, h: tc.start_systemd(c, h["name"], h["ip"], h["ip6"]),
                        extra=FIREWALLD) as inventory:
        listed = where / "inventory-listed"
        tc.write_inventory(NODES, inv=listed, known_hosts=where / "known_hosts",
                           extra=FIREWALLD + f"cluster_network_ssh_sources: [{tc.addr(99)}]\n")
        first = cluster.playbook("provision.yml", "--tags", "network", inventory=listed)
        yield {"where": where, "inventory": inventory, "first": first}


def _fw(cluster, node, *args):
    return cluster.exec(node, "firewall-cmd " + " ".join(args)).stdout.split()


def _reaches(cluster, container, addr, port, v6=False):
    r = subprocess.run(["podman", "exec", container, "nc", *(["-6"] if v6 else []), "-z", "-w", "3",
                        addr, str(port)], capture_output=True, text=True)
    return r.returncode == 0


def test_firewalld_scopes_the_cluster_and_keeps_ssh_open_from_the_control_node(fwd, cluster):
    first = fwd["first"]
    assert first.returncode == 0, first.output[-5000:]
    assert "Set up the firewall (firewalld)" in first.output
    for h in NODES:
        node = h["name"]
        assert _fw(cluster, node, "--state") == ["running"]
        assert _fw(cluster, node, "--get-default-zone") == ["drop"]
        assert sorted(_fw(cluster, node, "--zone=trusted", "--list-sources")) == sorted(n["ip"] for n in NODES)
        rich = cluster.exec(node, "firewall-cmd --zone=drop --list-rich-rules").stdout
        assert f'source address="{GATEWAY}"' in rich and 'port port="22"' in rich, rich
        assert "29500" not in " ".join(_fw(cluster, node, "--zone=drop", "--list-ports")), \
            "the master ports are open in the default zone"
        assert LISTED in rich, rich


def test_firewalld_master_port_and_ssh_reach_only_from_the_cluster(fwd, cluster):
    master, other = NODES[0], NODES[1]
    cluster.listen(master["name"])
    try:
        assert _reaches(cluster, tc.PREFIX + other["name"], master["ip"], 29500)
        assert not _reaches(cluster, tc.OUTSIDER, master["ip"], 29500), "the outsider reached the master port"
        assert not _reaches(cluster, tc.OUTSIDER, master["ip6"], 29500, v6=True), \
            "the outsider reached the master port over IPv6"
        # default-deny: SSH from the cluster, not from the rest of the network.
        assert _reaches(cluster, tc.PREFIX + other["name"], master["ip"], 22)
        assert not _reaches(cluster, tc.OUTSIDER, master["ip"], 22), "the outsider reached SSH"
    finally:
        cluster.stop_listening(master["name"])


def test_firewalld_removes_what_the_toolkit_added_and_no_longer_wants(fwd, cluster):
    """The SSH source the first provision listed, dropped on the next: its rule goes, the site's
    own rule (added by hand, not recorded) stays; a third run, after the switch to drop, still
    reaches the nodes over SSH and changes nothing."""
    site = f'rule family="ipv4" source address="{tc.addr(98)}" port port="22" protocol="tcp" accept'
    node = NODES[0]["name"]
    cluster.exec(node, f"firewall-cmd --permanent --zone=drop --add-rich-rule='{site}' && firewall-cmd --reload")
    assert LISTED in cluster.exec(node, "firewall-cmd --zone=drop --list-rich-rules").stdout
    r = cluster.playbook("provision.yml", "--tags", "network", inventory=fwd["inventory"])
    assert r.returncode == 0, r.output[-5000:]
    rich = cluster.exec(node, "firewall-cmd --zone=drop --list-rich-rules").stdout
    assert LISTED not in rich and site in rich, rich
    assert f'source address="{GATEWAY}"' in rich, rich
    # permanent too: a reload brings back neither the old rule nor loses the site's
    rich = cluster.exec(node, "firewall-cmd --reload >/dev/null && firewall-cmd --zone=drop --list-rich-rules").stdout
    assert LISTED not in rich and site in rich, rich
    # Everything again: SSH from the control node still works (the playbook connects), and
    # nothing changes.
    again = cluster.playbook("provision.yml", "--tags", "network", inventory=fwd["inventory"])
    assert again.returncode == 0, again.output[-5000:]
    changed = [block.splitlines()[0] for block in again.output.split("TASK [")[1:] if "changed: [" in block]
    assert all(again.recap[h["name"]]["changed"] == 0 for h in NODES), changed


def test_ufw_is_refused_on_nodes_that_run_firewalld(fwd, cluster):
    """Asking for ufw where firewalld runs is refused by provision.yml's plan, naming the host and
    the setting, before any node changes: ufw is not installed and firewalld's zones are as they
    were. The probe saw firewalld from /proc (no firewall-cmd call)."""
    inv = fwd["where"] / "inventory-ufw"
    tc.write_inventory(NODES, inv=inv, known_hosts=fwd["where"] / "known_hosts",
                       extra="cluster_network_firewall_backend: ufw\n")
    before = {h["name"]: cluster.exec(h["name"], "firewall-cmd --list-all-zones").stdout for h in NODES}
    r = cluster.playbook("provision.yml", "--tags", "network", inventory=inv)
    assert r.returncode != 0
    assert "Make every node identical and ready" not in r.output
    assert all(v.get("changed", 0) == 0 for v in r.recap.values()), r.recap
    for h in NODES:
        assert (f"cluster_network_firewall_backend on host {h['name']} is 'ufw', and firewalld is running "
                f"there. Fix: cluster_network_firewall_backend: firewalld") in " ".join(r.output.split()), r.output[-3000:]
        assert cluster.exec(h["name"], "command -v ufw", check=False).returncode != 0
        assert cluster.exec(h["name"], "firewall-cmd --list-all-zones").stdout == before[h["name"]]
