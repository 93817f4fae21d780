"""Name resolution, SSH trust, the firewall's scope and the ranks' environment."""
import subprocess
import sys
from pathlib import Path

from cluster import SUBNET, SUBNET6

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = SUBNET.rsplit(".", 1)[0] + ".1"  # podman's, the control node as the nodes see it


def test_pdsh_from_master_reaches_every_node_without_prompt(provisioned, cluster):
    nodes = ",".join(cluster.names)
    r = cluster.exec(cluster.master, f"pdsh -R ssh -w {nodes} hostname < /dev/null", user="dstrain")
    answered = sorted(line.split(": ")[1] for line in r.stdout.splitlines())
    assert answered == sorted(cluster.names), r.stdout + r.stderr


def test_every_node_resolves_every_name_to_its_training_address(provisioned, cluster):
    for node in cluster.names:
        for h in cluster.info["hosts"]:
            r = cluster.exec(node, f"getent hosts {h['name']}")
            assert r.stdout.split()[0] == h["ip"]


def test_ssh_from_control_node_still_works_after_firewall(provisioned, cluster):
    p = subprocess.run([str(Path(sys.executable).parent / "ansible"), "-i", str(cluster.inventory),
                        "cluster", "-m", "ansible.builtin.ping"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.count("SUCCESS") == len(cluster.names), p.stdout + p.stderr


def test_firewall_rules_in_place(provisioned, cluster):
    for node in cluster.names:
        st = cluster.exec(node, "ufw status").stdout
        assert "Status: active" in st
        assert "29500:29510/tcp" in st and "DENY" in st
        assert any("29500:29510/tcp (v6)" in line and "DENY" in line and "Anywhere (v6)" in line
                   for line in st.splitlines()), st
        for h in cluster.info["hosts"]:
            assert h["ip"] in st
        # SSH from the control node (as the node sees it: the network's gateway) and the cluster,
        # not from anywhere (cluster_network_ssh_sources is empty).
        ssh = [line for line in st.splitlines() if "# dscluster ssh" in line]
        assert ssh and not any("Anywhere" in line for line in ssh), st
        assert any(f" {GATEWAY} " in line for line in ssh), st


def _numbered(cluster, node):
    """`ufw status numbered` as [(number, line)]."""
    out = cluster.exec(node, "ufw status numbered").stdout
    return [(int(line[1:line.index("]")]), line) for line in out.splitlines() if line.startswith("[")]


def _first(rules, *needles):
    return next((n for n, line in rules if all(x in line for x in needles)), None)


def _outsider_reaches(cluster, addr, v6=False, port=29500, wait_s=3):
    r = subprocess.run(["podman", "exec", cluster.info["outsider"]["name"], "nc", *(["-6"] if v6 else []),
                        "-z", "-w", str(wait_s), addr, str(port)], capture_output=True, text=True)
    return r.returncode == 0


EPHEMERAL = 41234  # a port like those a rank's collectives listen on


def _what_the_outsider_reaches(cluster):
    """{(family, what): reached} for the master's SSH port, a master port and an ephemeral port,
    over IPv4 and IPv6, with a listener on the latter two. The six probes run at once in the
    outsider (a dropped one waits out its 2 s)."""
    h = cluster.info["hosts"][0]
    probes = [(fam, what, h[key], port) for fam, key in (("v4", "ip"), ("v6", "ip6"))
              for what, port in (("ssh", h["port"]), ("master port", 29500), ("ephemeral", EPHEMERAL))]
    script = " ".join(f"(nc {'-6 ' if fam == 'v6' else ''}-z -w 2 {addr} {port} && echo {i} reached) &"
                      for i, (fam, _, addr, port) in enumerate(probes)) + " wait"
    cluster.listen(cluster.master, 29500)
    cluster.listen(cluster.master, EPHEMERAL)
    try:
        r = subprocess.run(["podman", "exec", cluster.info["outsider"]["name"], "sh", "-c", script],
                           capture_output=True, text=True)
    finally:
        cluster.stop_listening(cluster.master)
    reached = {int(line.split()[0]) for line in r.stdout.splitlines() if line.endswith(" reached")}
    return {(fam, what): i in reached for i, (fam, what, _, _) in enumerate(probes)}


# What a site's admin typed on the master after the toolkit's provision (the test network's
# subnets: the outsider's addresses are in them).
STALE = SUBNET.rsplit(".", 1)[0] + ".99"  # an address in no container
SITE_RULES = [
    # The same match as the toolkit's deny: ufw skips the IPv4 half and replaces the toolkit's
    # IPv6 deny with this allow, in place.
    "ufw insert 1 allow 29500:29510/tcp",
    # Ahead of everything, each family: the site's LAN (the outsider's too) to the master ports.
    f"ufw prepend allow from {SUBNET} to any port 29500:29510 proto tcp comment 'site lan'",
    f"ufw prepend allow from {SUBNET6} to any port 29500:29510 proto tcp comment 'site lan'",
    # A rule the toolkit added for a node no longer in the cluster.
    f"ufw allow from {STALE} comment 'dscluster node'",
]
SITE_CLEANUP = [
    f"ufw delete allow from {SUBNET} to any port 29500:29510 proto tcp",
    f"ufw delete allow from {SUBNET6} to any port 29500:29510 proto tcp",
    "ufw delete allow 29500:29510/tcp",
    f"ufw delete allow from {STALE}",
]


def test_an_outsider_reaches_only_what_the_inbound_policy_opens_and_the_toolkits_rules_lead_a_sites(
        provisioned, cluster):
    """docs/firewall.md's promise from an outsider on the cluster's network, over IPv4 and IPv6. By
    default (the toolkit enabled ufw itself, over SSH) inbound is denied: SSH, the master ports and
    a rank's ephemeral port are closed to it, open to the cluster. cluster_network_default_deny
    false keeps a site's allow policy: SSH and the ephemeral port open to everyone, the master
    ports still closed. The site's own rules then put ahead of the toolkit's on the active ufw let
    the outsider reach the master port over IPv4 and IPv6; provision.yml with
    cluster_network_default_deny true (its network part, --tags network: the same cluster_network
    role a whole provision runs) switches the policy to deny again, puts the toolkit's rules first
    again (SSH, the cluster, the master port deny, per family), replaces the site's rule that has
    the same match as its deny, keeps the site's others after its own, and removes its stale rule:
    the outsider reaches nothing, a cluster node the master port."""
    master, worker, h = cluster.master, cluster.names[1], cluster.info["hosts"][0]
    assert "Default: deny (incoming)" in cluster.exec(master, "ufw status verbose").stdout
    reached = _what_the_outsider_reaches(cluster)
    closed = {k: False for k in reached}
    assert len(closed) == 6 and reached == closed, reached
    cluster.listen(master, EPHEMERAL)
    try:
        for port in (h["port"], EPHEMERAL):  # the cluster still reaches both
            assert cluster.exec(worker, f"nc -z -w 3 {h['ip']} {port}", check=False).returncode == 0, port
    finally:
        cluster.stop_listening(master)
    restored = False
    try:
        cluster.exec(master, "ufw default allow incoming")  # a site whose policy is allow
        kept = cluster.playbook("provision.yml", "--tags", "network", "-e", "cluster_network_default_deny=false")
        assert kept.returncode == 0, kept.output[-3000:]
        assert "Default: allow (incoming)" in cluster.exec(master, "ufw status verbose").stdout
        opened = _what_the_outsider_reaches(cluster)
        assert opened == {**closed, ("v4", "ssh"): True, ("v6", "ssh"): True,
                          ("v4", "ephemeral"): True, ("v6", "ephemeral"): True}, opened

        for cmd in SITE_RULES:
            cluster.exec(master, cmd)
        before = _numbered(cluster, master)
        assert _first(before, "site lan") == 1, before
        cluster.listen(master)
        try:
            # The site's rules win: the setup means something.
            assert _outsider_reaches(cluster, h["ip"]), before
            assert _outsider_reaches(cluster, h["ip6"], v6=True), before
        finally:
            cluster.stop_listening(master)

        denied = cluster.playbook("provision.yml", "--tags", "network", "-e", "cluster_network_default_deny=true",
                                  timeout=900)
        assert denied.returncode == 0, denied.output[-5000:]
        restored = True
        # The deletions' loop labels (printed as they are): the site's IPv6 allow, the stale rule.
        assert "same match as a toolkit rule: [" in denied.output and "stale: [" in denied.output, denied.output[-5000:]

        after = _numbered(cluster, master)
        text = "\n".join(line for _, line in after)
        # The toolkit's rules lead each family, in the documented order.
        assert all("# dscluster" in line for n, line in after if n < _first(after, "site lan")), text
        v4 = {"ssh": _first(after, "# dscluster ssh"), "node": _first(after, "# dscluster node"),
              "deny": _first(after, "29500:29510/tcp ", "DENY IN", "# dscluster master ports"),
              "site": _first(after, SUBNET, "site lan")}
        v6 = {"deny": _first(after, "29500:29510/tcp (v6)", "DENY IN", "# dscluster master ports"),
              "site": _first(after, SUBNET6, "site lan")}
        assert None not in v4.values() and None not in v6.values(), text
        assert v4["ssh"] < v4["node"] < v4["deny"] < v4["site"] < v6["deny"] < v6["site"], (v4, v6, text)
        # The site's allow with the deny's match is gone (replaced), the stale rule too.
        assert "ALLOW IN    Anywhere (v6)" not in text and "29500:29510/tcp            ALLOW IN    Anywhere" not in text, text
        assert STALE not in text, text

        assert "Default: deny (incoming)" in cluster.exec(master, "ufw status verbose").stdout
        assert _what_the_outsider_reaches(cluster) == closed  # the site's LAN rules too come after the deny
        cluster.listen(master)
        try:
            ok = cluster.exec(worker, f"nc -z -w 3 {h['ip']} 29500", check=False)
            assert ok.returncode == 0, "a cluster node no longer reaches the master port"
        finally:
            cluster.stop_listening(master)
    finally:
        for cmd in SITE_CLEANUP:
            cluster.exec(master, cmd, check=False)
        if not restored:  # deny again, the toolkit's rules first, for the tests after this one
            cluster.playbook("provision.yml", "--tags", "network", "-e", "cluster_network_default_deny=true")


def test_no_host_key_checking_is_disabled_anywhere():
    bad = subprocess.run(["git", "grep", "-n", "-I", "-E",
                          "StrictHostKeyChecking[= ]+no|UserKnownHostsFile[= ]*/dev/null|host_key_checking *= *(false|False)",
                          "--", ".", ":!molecule/tests/test_network.py"], cwd=ROOT, capture_output=True, text=True)
    assert bad.stdout == "", bad.stdout
