"""preflight.yml on the container cluster: a healthy cluster passes with measurements, and each
injected fault is caught by name, with the node and a fix. Every fault is undone in `finally`."""
import json

import pytest

import cluster as testcluster
from cluster import PINS

DS_VERSION_FILE = "/opt/dscluster/env/lib/python3.11/site-packages/deepspeed/git_version_info_installed.py"


def preflight(cluster, tmp_path, *args, full=False):
    r = cluster.playbook("preflight.yml", "-e", f"preflight_full={str(full).lower()}",
                         "-e", f"preflight_report_dir={tmp_path}", *args)
    report = tmp_path / "preflight-testcluster-latest.json"
    r.report = json.loads(report.read_text()) if report.exists() else None
    return r


def rows(report, check, status=None):
    return [r for r in report["checks"] if r["check"] == check and (status is None or r["status"] == status)]


def test_healthy_cluster_passes_with_network_figures(provisioned, cluster, tmp_path, figures):
    # iperf3 for 1 s a pair, not 3: a rate is all this asserts (the two ends share this machine's cores)
    r = preflight(cluster, tmp_path, "-e", "preflight_iperf_seconds=1", full=True)
    assert r.returncode == 0, r.output[-6000:]
    rep = r.report
    assert rep["summary"]["fail"] == 0 and rep["summary"]["warn"] == 0, \
        [x for x in rep["checks"] if x["status"] != "PASS"]
    for check in ("reachable", "ssh from master", "names", "env and versions", "slots", "driver", "disk",
                  "tcp to master port", "firewall", "interface", "clock", "iperf3", "op build locks",
                  "helper owner", "root paths"):
        assert {x["node"] for x in rows(rep, check)} == set(cluster.names), check
    assert rows(rep, "master port", "PASS") and rows(rep, "inventory", "PASS")
    iperf = rep["measured"]["iperf3"]
    assert {v["to"] for v in iperf.values()} == set(cluster.names) and all(v["gbps"] > 0 for v in iperf.values())
    ar = rep["measured"]["allreduce"]
    assert ar["world_size"] == 2 and ar["backend"] == "gloo" and ar["busbw_gbps_max"] > 0
    # nccl-tests' definition: busbw = algbw x 2(n-1)/n, which is algbw itself for two ranks.
    assert all(abs(x["busbw_gbps"] - x["algbw_gbps"]) < 1e-3 for x in ar["rows"])
    figures("preflight", iperf3_gbit_s={k: v["gbps"] for k, v in iperf.items()},
            allreduce_busbw_gb_s={x["bytes"]: x["busbw_gbps"] for x in ar["rows"]})
    assert len(rep["checks"]) == 38 and "38 passed, 0 warnings, 0 failed" in r.output
    network = {x["node"]: x["detail"] for x in rows(rep, "rank network", "PASS")}
    assert network == {n: "NCCL_SOCKET_IFNAME=eth0, GLOO_SOCKET_IFNAME=eth0" for n in cluster.names}, network
    # The all-reduce's run directory is not left behind to be taken for a training run.
    left = cluster.exec(cluster.master, "ls /opt/dscluster/runs | grep -c '^preflight-' || true").stdout.strip()
    assert left == "0"


def _caught(r, check, node, needle, status="FAIL", figures=None, fault=""):
    assert r.report is not None, r.output[-4000:]
    hits = [x for x in rows(r.report, check, status) if x["node"] == node]
    assert hits, (check, node, status, r.report["checks"])
    assert needle in hits[0]["detail"], hits[0]
    assert hits[0]["fix"], hits[0]
    assert f"{check}".ljust(5) in r.output and needle in r.output  # in the table, not only the JSON
    if figures:
        figures("preflight fault", fault=fault, check=check, node=node, status=status,
                detail=hits[0]["detail"], fix=hits[0]["fix"])
    return hits[0]


def test_sshd_stopped_on_a_worker(provisioned, cluster, tmp_path, figures):
    worker = cluster.names[1]
    cluster.exec(worker, "pkill -x sshd", check=False)
    try:
        r = preflight(cluster, tmp_path)
        assert r.returncode != 0
        _caught(r, "reachable", worker, f"Ansible cannot reach {worker}", figures=figures, fault="sshd stopped on a worker")
        _caught(r, "ssh from master", worker, f"dstrain@{cluster.master} cannot ssh to {worker}", figures=figures, fault="sshd stopped on a worker")
    finally:
        testcluster.start_sshd(worker)


@pytest.fixture(scope="module")
def four_faults(provisioned, cluster, tmp_path_factory):
    """One preflight with four faults at once, each its own row from the same probe: more slots
    than the nodes can hold, an interface name no node has, another DeepSpeed version on the
    worker, and the master port on the master closed to the worker by a firewall rule.
    {"run": its result, "slots": the slots asked for, "cpus": the master's CPUs}."""
    worker, pinned = cluster.names[1], PINS["DEEPSPEED_VERSION"]
    cpus = int(cluster.exec(cluster.master, "nproc").stdout)
    env = {"dsc_rank_env": {"NCCL_SOCKET_IFNAME": "eth9", "GLOO_SOCKET_IFNAME": "eth9"}}
    rule = f"INPUT -p tcp -s {cluster.info['hosts'][1]['ip']} --dport 29500 -j DROP"
    cluster.exec(worker, f"sed -i \"s/^version='{pinned}'/version='0.0.1'/\" {DS_VERSION_FILE}")
    cluster.exec(cluster.master, f"iptables -I {rule}")
    try:
        r = preflight(cluster, tmp_path_factory.mktemp("four-faults"), "-e", f"dsc_slots={cpus + 1}",
                      "-e", json.dumps(env))
    finally:
        cluster.exec(cluster.master, f"iptables -D {rule}")
        cluster.exec(worker, f"sed -i \"s/^version='0.0.1'/version='{pinned}'/\" {DS_VERSION_FILE}")
    return {"run": r, "slots": cpus + 1, "cpus": cpus}


def test_master_port_blocked_by_a_firewall_rule(four_faults, cluster, figures):
    r = four_faults["run"]
    assert r.returncode != 0
    _caught(r, "tcp to master port", cluster.names[1], "timed out", figures=figures, fault="master port blocked by a firewall rule")
    assert rows(r.report, "tcp to master port", "PASS")[0]["node"] == cluster.master


def test_different_deepspeed_version_on_one_node(four_faults, cluster, figures):
    r, pinned = four_faults["run"], PINS["DEEPSPEED_VERSION"]
    assert r.returncode != 0
    _caught(r, "env and versions", cluster.names[1], f"deepspeed 0.0.1 here, {pinned} on {cluster.master}", figures=figures, fault="different DeepSpeed version on one node")


def test_more_slots_than_the_node_can_hold(four_faults, cluster, figures):
    r, slots, cpus = four_faults["run"], four_faults["slots"], four_faults["cpus"]
    assert r.returncode != 0
    _caught(r, "slots", cluster.master, f"dsc_slots={slots} CPU ranks but {cluster.master} has {cpus} CPUs", figures=figures, fault="more slots than the node can hold")


def test_wrong_interface_name(four_faults, cluster, figures):
    r = four_faults["run"]
    assert r.returncode != 0
    for node in cluster.names:
        _caught(r, "interface", node, f"interface eth9 (NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME) does not exist on {node}", figures=figures, fault="wrong interface name")


def test_env_missing_on_one_node(provisioned, cluster, tmp_path, figures):
    worker = cluster.names[1]
    # Its python moved away, not the whole env: renaming the image's env copies all of it up
    # into the container's own layer (overlayfs), a minute of this machine's disk.
    cluster.exec(worker, "mv /opt/dscluster/env/bin/python /opt/dscluster/env/bin/python.moved")
    try:
        r = preflight(cluster, tmp_path)
        assert r.returncode != 0
        _caught(r, "env and versions", worker, "/opt/dscluster/env/bin/python does not exist", figures=figures, fault="env missing on one node")
    finally:
        cluster.exec(worker, "mv /opt/dscluster/env/bin/python.moved /opt/dscluster/env/bin/python")


@pytest.fixture(scope="module")
def port_occupied(provisioned, cluster, tmp_path_factory):
    """The fast preflight while another program holds the master port on the master."""
    holder = ("import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
              "s.bind(('0.0.0.0', 29500)); s.listen(1); "
              "open('/tmp/holder.ready','w').close(); time.sleep(120)")
    cluster.exec(cluster.master, f"rm -f /tmp/holder.ready; (nohup python3 -c \"{holder}\" >/dev/null 2>&1 &); "
                                 "for i in $(seq 50); do test -f /tmp/holder.ready && break; sleep 0.1; done; test -f /tmp/holder.ready")
    try:
        return preflight(cluster, tmp_path_factory.mktemp("port-occupied"))
    finally:
        cluster.exec(cluster.master, "pkill -f 'time.sleep\\(120\\)'", check=False)


def test_master_port_occupied_names_the_next_free_one(port_occupied, cluster, figures):
    r = port_occupied
    assert r.returncode == 0, r.output[-4000:]  # a warning, not a failure: launch moves on
    _caught(r, "master port", cluster.master, "29500 is in use on node1; launch will take 29501", "WARN", figures=figures, fault="master port occupied")
    tcp = rows(r.report, "tcp to master port", "PASS")
    assert len(tcp) == 2 and all(":29501 connects" in x["detail"] for x in tcp)


def test_launch_runs_the_fast_checks_first_and_can_skip_them(provisioned, cluster, tmp_path):
    env = json.dumps({"dsc_rank_env": {"NCCL_SOCKET_IFNAME": "eth9", "GLOO_SOCKET_IFNAME": "eth9"},
                      "preflight_report_dir": str(tmp_path)})
    r = cluster.playbook("launch.yml", "-e", env, "-e", "dry_run=true", "-e", "run_id=pf-refused")
    assert r.returncode != 0 and "Preflight failed" in r.output and "-e preflight=false" in r.output
    assert "Start DeepSpeed" not in r.output and "Write the run's files and code on every node" not in r.output
    skipped = cluster.playbook("launch.yml", "-e", env, "-e", "dry_run=true", "-e", "preflight=false",
                               "-e", "run_id=pf-skipped")
    assert "Preflight failed" not in skipped.output
    assert "Write the run's files and code on every node" in skipped.output, skipped.output[-3000:]


# No test node has a GPU: the worker gets an nvidia-smi that answers as a node with one H100 does,
# its XML a real H100's (tests/fixtures/gpu/h100-capture.xml) with a row remapping pending (the one
# edit), so that the plan sees a GPU there and the gate reads a fault on it.
FAKE_NVIDIA_SMI = """#!/bin/sh
case "$*" in
  *--query-gpu=*) echo "0, 9.0, 580.159.04, 81559" ;;
  "-q -x") cat /usr/local/share/dsc-test-gpu.xml ;;
esac
"""


def test_a_gpu_fault_refuses_the_launch_before_any_rank_starts(provisioned, cluster, tmp_path):
    worker = cluster.names[1]
    xml = (testcluster.ROOT / "tests/fixtures/gpu/h100-capture.xml").read_text()
    (tmp_path / "gpu.xml").write_text(xml.replace("<remapped_row_pending>No", "<remapped_row_pending>Yes", 1))
    (tmp_path / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    cluster.copy_to(worker, tmp_path / "gpu.xml", "/usr/local/share/dsc-test-gpu.xml")
    cluster.copy_to(worker, tmp_path / "nvidia-smi", "/usr/local/bin/nvidia-smi")
    cluster.exec(worker, "chmod 755 /usr/local/bin/nvidia-smi")
    try:
        r = cluster.playbook("launch.yml", "-e", "run_id=pf-gpu", "-e", f"preflight_report_dir={tmp_path}")
        assert r.returncode != 0 and "Preflight failed" in r.output, r.output[-4000:]
        assert f"{worker}" in r.output and "GPU 0: a memory row remapping or page retirement waits for a reset" \
            in r.output and "nvidia-smi -r -i 0" in r.output, r.output[-4000:]
        assert "Write the run's files and code on every node" not in r.output
        for n in cluster.names:  # no rank started: the run's directory was never made
            cluster.exec(n, "test ! -e /opt/dscluster/runs/pf-gpu")
    finally:
        cluster.exec(worker, "rm -f /usr/local/bin/nvidia-smi /usr/local/share/dsc-test-gpu.xml")


def test_report_is_valid_json_with_one_row_per_check_and_node(port_occupied):
    """The JSON report of a fast preflight that passes (the occupied port's: a WARN, exit 0)."""
    r = port_occupied
    assert r.returncode == 0, r.output[-3000:]
    rep = r.report
    assert rep["mode"] == "fast" and rep["measured"]["allreduce"] is None
    keys = [(x["check"], x["node"]) for x in rep["checks"]]
    assert len(keys) == len(set(keys))
    assert all(x["status"] in ("PASS", "WARN", "FAIL") for x in rep["checks"])

