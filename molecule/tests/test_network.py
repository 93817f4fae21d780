"""Name resolution, SSH trust, the firewall's scope and the ranks' environment."""
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def test_master_port_reachable_from_cluster_not_from_outsider(provisioned, cluster):
    master_ip = cluster.info["hosts"][0]["ip"]
    listener = subprocess.Popen(["podman", "exec", "dsc-" + cluster.master, "python3", "-c",
                                 "import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
                                 "s.bind(('0.0.0.0', 29500)); s.listen(8); time.sleep(30)"])
    try:
        time.sleep(1.5)
        ok = cluster.exec(cluster.names[1], f"nc -z -w 3 {master_ip} 29500", check=False)
        assert ok.returncode == 0, ok.stderr
        out = subprocess.run(["podman", "exec", cluster.info["outsider"]["name"], "nc", "-z", "-w", "3",
                              master_ip, "29500"], capture_output=True, text=True)
        assert out.returncode != 0, "the outsider reached the master port"
    finally:
        listener.kill()
        # The listener inside the container outlives its podman exec client: end it, or it holds
        # the master port into the next test.
        cluster.exec(cluster.master, "pkill -f '[t]ime.sleep.30.' || true")


def test_ssh_from_control_node_still_works_after_firewall(provisioned, cluster):
    p = subprocess.run([str(Path(sys.executable).parent / "ansible"), "-i", str(cluster.inventory),
                        "cluster", "-m", "ansible.builtin.ping"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.count("SUCCESS") == len(cluster.names), p.stdout + p.stderr


def test_firewall_rules_in_place(provisioned, cluster):
    for node in cluster.names:
        st = cluster.exec(node, "ufw status").stdout
        assert "Status: active" in st
        assert "29500:29510/tcp" in st and "DENY" in st
        for h in cluster.info["hosts"]:
            assert h["ip"] in st


def test_no_host_key_checking_is_disabled_anywhere():
    bad = subprocess.run(["git", "grep", "-n", "-I", "-E",
                          "StrictHostKeyChecking[= ]+no|UserKnownHostsFile[= ]*/dev/null|host_key_checking *= *(false|False)",
                          "--", ".", ":!molecule/tests/test_network.py"], cwd=ROOT, capture_output=True, text=True)
    assert bad.stdout == "", bad.stdout
