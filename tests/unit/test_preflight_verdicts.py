"""The control node's verdicts and tables (plugins/filter/): preflight rows from what nodes
report, runs.yml's table, follow's lines and how a followed run ended, logs.yml's headers."""
import json
from pathlib import Path

import pytest

import dscplan
from dscnode import checks
from plugins.callback import dsc_progress
from plugins.filter import cluster
from plugins.filter import preflight
from tests.unit.plan_helpers import DEFAULTS, PATHS
from tests.unit.plan_helpers import cluster as plan_cluster

ROOT = Path(__file__).resolve().parents[2]


def cluster_filters():
    return cluster


def progress_callback():
    return dsc_progress


def test_iperf_totals_become_gbit_per_s():
    out = {"rc": 0, "stdout": json.dumps({"end": {"sum_received": {"bits_per_second": 16.55e9},
                                                  "sum_sent": {"retransmits": 650}}})}
    assert preflight.iperf_result(out, "node2") == {"to": "node2", "gbps": 16.55, "retransmits": 650}


@pytest.mark.parametrize("result,needle", [
    ({"rc": 0, "stdout": json.dumps({"start": {}, "end": {}, "error": "the server has terminated"})},
     "the server has terminated"),
    ({"rc": 1, "stdout": "", "stderr": "iperf3: error - unable to connect to server: Connection refused"},
     "unable to connect"),
    ({"rc": 0, "stdout": "not json"}, "not json"),
    (None, "exit None"),
])
def test_an_iperf_hiccup_is_an_error_text_not_a_crash(result, needle):
    r = preflight.iperf_result(result, "node2")
    assert r["gbps"] is None and needle in r["error"]


def test_iperf_missing_says_so():
    assert preflight.iperf_result({}, "node2", installed=False)["error"] == "iperf3 is not installed"


@pytest.mark.parametrize("configured,interfaces,status", [
    ("", {"eth0": ["10.0.0.11"], "lo": ["127.0.0.1"]}, "PASS"),
    ("eth9", {"eth0": ["10.0.0.11"]}, "FAIL"),
    ("eth0", {"eth0": ["10.0.0.99"]}, "FAIL"),
    ("=eth0", {"eth0": ["10.0.0.11"], "eth01": []}, "PASS"),
    ("", {"eth0": ["10.0.0.99"]}, "FAIL"),
])
def test_interface_verdicts(configured, interfaces, status):
    assert preflight.interface_verdict("node1", "10.0.0.11", interfaces, configured)[0] == status


@pytest.mark.parametrize("addr,configured,status", [
    ("127.0.0.2", "lo", "PASS"), ("127.0.0.2", "", "PASS"), ("10.0.0.12", "lo", "FAIL")])
def test_loopback_answers_on_all_of_127_8(addr, configured, status):
    """Two nodes on one host: the loopback interface holds 127.0.0.1 and answers on 127.0.0.2."""
    assert preflight.interface_verdict("node2", addr, {"lo": ["127.0.0.1"]}, configured)[0] == status


def test_the_rank_network_row_shows_each_nodes_own_settings_and_warns_of_an_rdma_port_down():
    hostvars, groups, probes = plan_cluster(n=2)
    probes["node2"]["interfaces"] = {"lo": ["127.0.0.1"], "ens5": ["10.0.0.12"]}
    ib = {"device": "mlx5_0", "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand"}
    for name in probes:
        probes[name].update(infiniband=True, rdma=[ib, dict(ib, device="mlx5_1", state="DOWN")])
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, now="20261130-000000")
    assert errors == []
    status, detail, fix = preflight.rank_network_verdict(p["node"]["node2"], p)
    assert status == "WARN" and detail.startswith(
        "NCCL_SOCKET_IFNAME=ens5, GLOO_SOCKET_IFNAME=ens5, NCCL_IB_HCA=mlx5_0:1 (this node's own: "
        "GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME differ between nodes)")
    assert "mlx5_1/1 DOWN (InfiniBand)" in detail and "mlx5_1 port 1 is DOWN" in fix and "ibstat mlx5_1" in fix
    for name in probes:
        probes[name].update(rdma=[ib])
    p, _ = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, now="20261130-000000")
    assert preflight.rank_network_verdict(p["node"]["node1"], p) == (
        "PASS", "NCCL_SOCKET_IFNAME=eth0, GLOO_SOCKET_IFNAME=eth0, NCCL_IB_HCA=mlx5_0:1 (this node's own: "
        "GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME differ between nodes); RDMA mlx5_0/1 ACTIVE (InfiniBand)", "")


@pytest.mark.parametrize("cuda,driver,status", [("13.0", "580.65.06", "PASS"), ("13.0", "570.1", "FAIL"),
                                                ("12.8", "525.60.13", "PASS"), ("cpu", "", "PASS")])
def test_driver_verdicts(cuda, driver, status):
    assert preflight.driver_verdict(cuda, driver)[0] == status


def test_runs_table_lines():
    filters = cluster_filters()
    row = {"id": "r1", "config": "preset zero2", "state": "finished", "step": 20, "loss": 5.123456,
           "tokens_per_s": 15020.4, "samples_per_s": None, "started": 0, "duration_s": 75.5, "restarts": 1}
    lines = filters.runs_table([row, dict(row, id="r2", tokens_per_s=None, samples_per_s=12.34,
                                          config="ZeRO stage 3"),
                                dict(row, id="r3", tokens_per_s=None, step=None, loss=None,
                                     config="its own ZeRO stage")])
    assert lines[0] == "run | config | state | step | loss | throughput | started (UTC) | duration | restarts"
    assert lines[1] == "r1 | preset zero2 | finished | 20 | 5.123 | 15,020 tokens/s | 1970-01-01 00:00 | 0:01:15 | 1"
    assert lines[2] == "r2 | ZeRO stage 3 | finished | 20 | 5.123 | 12.3 samples/s | 1970-01-01 00:00 | 0:01:15 | 1"
    assert lines[3] == "r3 | its own ZeRO stage | finished | - | - | - | 1970-01-01 00:00 | 0:01:15 | 1"


def test_follow_prints_a_progress_line_not_a_retry_message():
    """The ETA at the last logged pace (0.5 s a step, 300 steps to go), whenever the run started
    (a resumed run's start is its first launch); every node's ranks alive."""
    cb = progress_callback()
    nodes = {"node1": {"state": "running", "ranks_alive": 1}, "node2": {"state": "running", "ranks_alive": 2},
             "node3": {"state": "running", "ranks_alive": 1}}
    status = {"run_id": "r1", "host": "node1", "state": "running", "started": 1000.0, "total_steps": 400,
              "ranks_alive": 1, "restarts": 0, "nodes": nodes,
              "last": {"step": 100, "loss": 5.2345, "tokens_per_s": 15020.4, "step_time_s": 0.5}}
    assert cb.progress_line(json.dumps(status), now=1100.0) == (
        "run r1: running, step 100/400, loss 5.234, 15,020 tokens/s, elapsed 0:01:40, ETA 0:02:30, "
        "ranks alive 4, nodes node1:running node2:running node3:running")
    assert cb.progress_line("not a status") is None and cb.progress_line('{"changed": false}') is None


def test_follow_shows_no_total_and_no_eta_where_the_run_has_no_known_total():
    """A user's script whose total the node helper does not know (its status says none): the
    step alone. Without the other nodes' states (no_ssh mode) the count is named as the master's."""
    cb = progress_callback()
    status = {"run_id": "own", "host": "node1", "state": "running", "started": 1000.0, "total_steps": None,
              "ranks_alive": 1, "restarts": 0, "last": {"step": 600, "loss": 2.0, "samples_per_s": 12.5,
                                                        "step_time_s": 0.2}}
    assert cb.progress_line(json.dumps(status), now=1100.0) == (
        "run own: running, step 600, loss 2, 12.5 samples/s, elapsed 0:01:40, ranks alive 1 on node1")


def test_a_run_stopped_on_purpose_ends_follow_saying_who_and_where_a_failed_one_with_its_error():
    run_end = cluster_filters().run_end
    stopped = {"run_id": "r1", "state": "stopped", "stopped_by": "stop.yml", "exit_code": "-9",
               "first_error": None, "last": {"step": 120}}
    assert run_end(stopped) == "Run r1 stopped by stop.yml at step 120."
    assert run_end(dict(stopped, last=None)) == "Run r1 stopped by stop.yml before its first step."
    assert run_end(dict(stopped, stopped_by=None)) == "Run r1 stopped at step 120."
    assert run_end({"run_id": "r1", "state": "finished", "last": {"step": 800}}) == "Run r1 finished at step 800."
    failed = {"run_id": "r1", "state": "failed", "exit_code": "1", "last": {"step": 3},
              "first_error": "node2: ValueError: bad shape", "traceback": ["node2: Traceback (most recent call last):",
                                                                          "node2: ValueError: bad shape"]}
    assert run_end(failed) == ("Run r1 failed: node2: ValueError: bad shape\n"
                               "node2: Traceback (most recent call last):\nnode2: ValueError: bad shape")
    assert run_end(dict(failed, first_error=None, traceback=[])) == \
        "Run r1 failed: no error line in its log (exit code 1)"
    assert run_end({"run_id": "r1", "state": "lost", "exit_code": None}).startswith(
        "Run r1 lost: its supervisor ended without an exit code")


def test_log_headers_name_the_node_and_the_log_its_lines_come_from():
    log_sections = cluster_filters().log_sections
    log = "/opt/dscluster/runs/r1/launcher.log"
    # pdsh mode: every node's lines in the master's log, the runner's own under "launcher"
    pdsh = {"launcher": ["cmd = pdsh ..."], "node1": ["step 1"], "node2": ["step 1", "step 2"]}
    assert log_sections(pdsh, log, "node1") == [
        f"== launcher on node1 (last 1 lines) in node1:{log}", "cmd = pdsh ...",
        f"== node1 (last 1 lines) in node1:{log}", "step 1",
        f"== node2 (last 2 lines) in node1:{log}", "step 1", "step 2"]
    # no_ssh mode: each node's own log
    assert log_sections({"node1": ["a"], "node2": ["b"]}, log) == [
        f"== node1 (last 1 lines) in node1:{log}", "a", f"== node2 (last 1 lines) in node2:{log}", "b"]


def test_a_stale_op_build_lock_fails_preflight_and_names_the_fix():
    stale = {"path": "/c/torch_extensions/fused_adam/lock", "age_s": 900.0, "stale": True}
    status, detail, fix = preflight.lock_verdict("node2", [stale])
    assert status == "FAIL" and "fused_adam/lock (900 s old)" in detail and "on node2 waits" in detail
    assert "stop.yml" in fix
    assert preflight.lock_verdict("node2", [dict(stale, stale=False)])[0] == "PASS"
    assert preflight.lock_verdict("node2", [])[:2] == ("PASS", "no stale op-build lock")


def test_a_node_helper_others_can_write_fails_preflight():
    safe = {"uid": 0, "mode": "0o755", "safe": True}
    assert preflight.owner_verdict({"/usr/local/lib/dscluster/dsc_node.pyz": safe})[0] == "PASS"
    status, detail, fix = preflight.owner_verdict(
        {"/usr/local/lib/dscluster/dsc_node.pyz": {"uid": 1000, "mode": "0o755", "safe": False}})
    assert status == "FAIL" and "owner uid 1000" in detail and "provision.yml" in fix


def test_owners_reads_uid_and_mode(tmp_path):
    f = tmp_path / "helper"
    f.write_text("")
    f.chmod(0o777)
    got = checks.owners([str(f), str(tmp_path / "missing")])
    assert got[str(f)]["mode"] == "0o777" and got[str(f)]["safe"] is False
    assert got[str(tmp_path / "missing")]["safe"] is False


def test_root_paths_row_fails_on_a_planted_link_naming_the_path_and_the_fix():
    def chain(*entries):
        return [dict({"path": p, "kind": k, "uid": 0 if u == "root" else 1000, "user": u, "mode": "0o755"},
                     **({"target": t[0]} if t else {})) for p, k, u, *t in entries]
    clean = [{"var": "dsc_install_root", "path": "/opt/dscluster", "role": "made",
              "chain": chain(("/", "dir", "root"), ("/opt", "dir", "root"), ("/opt/dscluster", "dir", "dstrain"))}]
    assert preflight.root_paths_verdict("node1", clean, "dstrain")[0] == "PASS"
    planted = clean + [{"var": "dsc_run_root", "path": "/opt/dscluster/runs", "role": "user",
                        "chain": chain(("/", "dir", "root"), ("/opt", "dir", "root"),
                                       ("/opt/dscluster", "dir", "dstrain"),
                                       ("/opt/dscluster/runs", "link", "dstrain", "/etc"))}]
    status, detail, fix = preflight.root_paths_verdict("node1", planted, "dstrain")
    assert status == "FAIL" and "/opt/dscluster/runs is a link to /etc owned by dstrain" in detail
    assert "dsc_run_root on host node1" in detail and fix.startswith("remove the link (rm /opt/dscluster/runs")
    assert preflight.root_paths_verdict("node1", None, "dstrain")[0] == "WARN"
    # A shared dataset (dsc_data_shared: the only data dir preflight checks) is read, never
    # written: a root-owned one passes (the plan checks a synced data dir at launch).
    shared = clean + [{"var": "dsc_data_dir", "path": "/data/shared", "role": "user",
                       "chain": chain(("/", "dir", "root"), ("/data", "dir", "root"), ("/data/shared", "dir", "root"))}]
    assert preflight.root_paths_verdict("node1", shared, "dstrain")[0] == "PASS"


def test_follow_and_status_say_a_jit_op_build_is_the_wait_before_the_first_step():
    """While the ranks compile a DeepSpeed op (its first use on the node), follow's line and
    status.yml's row say so, with how long so far, instead of a run that seems to hang."""
    filters = cluster_filters()
    note = ("building DeepSpeed op cpu_adam (first use on this node: compiled once, can take minutes; "
            "deepspeed_warm_ops with CPUAdamBuilder builds it at provision)")
    status = {"run_id": "r1", "host": "node1", "state": "running", "started": 1000.0, "total_steps": None,
              "ranks_alive": 2, "restarts": 0, "last": None,
              "op_build": {"ops": ["cpu_adam"], "since": 1030.0, "note": note}}
    assert progress_callback().progress_line(json.dumps(status), now=1100.0) == (
        f"run r1: running, {note}, 0:01:10 so far, elapsed 0:01:40, ranks alive 2 on node1")
    assert filters.status_row(status).endswith(f"memory - GiB, {note}")
    assert "building" not in filters.status_row(dict(status, op_build=None))


def _slurm_reads(unmunge=0, slurmd=0, sinfo=None, err="Invalid credential"):
    def one(name, rc, out=""):
        return {"item": {"name": name}, "rc": rc, "stdout": out if rc == 0 else "",
                "stderr": "" if rc == 0 else f"{name}: Error: {err}"}
    results = [one("unmunge", unmunge), one("slurmd", slurmd)]
    results.append(one("sinfo", 0, sinfo) if sinfo is not None else {"item": {"name": "sinfo"}, "skipped": True})
    return {"results": results}


SLURM_CLUSTER = {"master": "node1", "slurm": {"install": True, "partition": "dsc"},
                 "nodes": [{"name": "node1", "gpus": 4, "gpu_ids": []}, {"name": "node2", "gpus": 4, "gpu_ids": [0, 1]}]}


def test_slurm_rows_pass_with_the_key_slurmd_state_and_gpus():
    rows = preflight.slurm_rows(SLURM_CLUSTER, {
        "node1": _slurm_reads(sinfo="node1|idle|gpu:4|none\nnode2|allocated|gpu:2(S:0)|none"),
        "node2": _slurm_reads()})
    assert [(r["check"], r["node"], r["status"]) for r in rows] == [
        ("munge", "node1", "PASS"), ("slurm", "node1", "PASS"), ("munge", "node2", "PASS"), ("slurm", "node2", "PASS")]
    assert rows[3]["detail"] == "slurmd answers; allocated in partition dsc, gres gpu:2"


def test_slurm_rows_name_the_bad_key_the_stopped_slurmd_the_down_node_and_the_gpu_count():
    rows = preflight.slurm_rows(SLURM_CLUSTER, {
        "node1": _slurm_reads(sinfo="node1|down*|gpu:4|Not responding\nnode2|idle|gpu:4|none"),
        "node2": _slurm_reads(unmunge=1, slurmd=1, err="Connection refused")})
    by = {(r["check"], r["node"]): r for r in rows}
    assert by[("slurm", "node1")]["detail"] == "down* in partition dsc: Not responding"
    assert "scontrol update nodename=node1 state=resume" in by[("slurm", "node1")]["fix"]
    assert by[("munge", "node2")]["status"] == "FAIL" and "unmunge: unmunge: Error" in by[("munge", "node2")]["detail"]
    assert by[("slurm", "node2")]["detail"].startswith("slurmd does not answer: slurmd: Error: Connection refused")
    assert "systemctl status slurmd on node2" in by[("slurm", "node2")]["fix"]
    rows = preflight.slurm_rows(SLURM_CLUSTER, {"node1": _slurm_reads(sinfo="node1|idle|gpu:4|none\nnode2|idle|gpu:4|none"),
                                                "node2": _slurm_reads()})
    assert [r["detail"] for r in rows if r["status"] == "FAIL"] == ["Slurm gives gpu:4, the plan 2 (nvidia-smi, dsc_gpus)"]


def test_slurm_rows_a_node_slurmctld_does_not_list_and_a_controller_that_does_not_answer():
    rows = preflight.slurm_rows(SLURM_CLUSTER, {"node1": _slurm_reads(sinfo="node1|idle|gpu:4|none"),
                                                "node2": _slurm_reads()})
    assert [(r["detail"], r["fix"]) for r in rows if r["status"] == "FAIL"] == [
        ("slurmctld does not list node2 in partition dsc", "provision.yml --tags slurm (slurm.conf from the inventory)")]
    # A site's own Slurm (slurm mode without dsc_slurm_install): the site's configuration is the fix.
    site = dict(SLURM_CLUSTER, slurm={"install": False, "partition": "dsc"})
    rows = preflight.slurm_rows(site, {"node1": _slurm_reads(sinfo="node1|idle|gpu:4|none"), "node2": _slurm_reads()})
    assert [r["fix"] for r in rows if r["status"] == "FAIL"] == [
        "the site's slurm.conf must list node2 (the inventory's name) in partition dsc"]
    down = _slurm_reads(sinfo="")
    down["results"][2] = {"item": {"name": "sinfo"}, "rc": 1, "stdout": "",
                          "stderr": "sinfo: error: Unable to contact slurm controller (connect failure)"}
    rows = preflight.slurm_rows(SLURM_CLUSTER, {"node1": down, "node2": _slurm_reads()})
    assert rows[0]["status"] == "FAIL" and "Unable to contact slurm controller" in rows[0]["detail"]
    assert "systemctl status slurmctld on node1" in rows[0]["fix"]
    assert [r["check"] for r in rows[1:]] == ["munge", "munge"]  # no slurm row without slurmctld's answer


def test_slurm_queue_numbers_the_pending_jobs_in_slurms_order():
    lines = cluster.slurm_queue(["7|dsc-a|RUNNING|None|dstrain", "9|dsc-c|PENDING|Priority|bob",
                                 "8|dsc-b|PENDING|Resources|dstrain", ""], "dsc")
    assert lines == ["Slurm queue, partition dsc: 1 running, 2 pending",
                     "  running: job 7 dsc-a (dstrain)",
                     "  1. job 9 dsc-c (bob), waiting for Priority",
                     "  2. job 8 dsc-b (dstrain), waiting for Resources"]


def test_a_pair_whose_server_did_not_start_is_not_measured_and_says_who_holds_the_port():
    held = {"listening": False, "error": "port 5201 on node2: another process listens on it already; "
                                         "it is held by a process of eve. Fix: end that process"}
    out = preflight.iperf_result({"skipped": True}, "node2", True, held)
    assert out["gbps"] is None and out["error"].startswith("port 5201 on node2") and "eve" in out["error"]
    ran = {"rc": 0, "stdout": json.dumps({"end": {"sum_received": {"bits_per_second": 2e9}, "sum_sent": {}}})}
    assert preflight.iperf_result(ran, "node2", True, {"listening": True, "pid": 7})["gbps"] == 2.0


def test_what_ranks_print_is_shown_with_control_sequences_escaped():
    """logs.yml -e follow=true and follow's progress lines print what the training user's ranks
    wrote: an OSC 52 clipboard write, a screen clear or a C1 CSI is shown escaped, never obeyed."""
    cb = progress_callback()
    assert cb.shown("loss 1.0\x1b]52;c;ZXZpbA==\x07\x1b[2J\x9b31m\u2028end\tx") == \
        "loss 1.0\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J\\x9b31m\\u2028end\tx"


def test_iperf3_and_the_all_reduce_are_held_against_what_the_interfaces_state():
    """The probe's stated speeds reach the plan's node records (link_mbps, each RDMA port's rate),
    and preflight's rows hold the measurements against the slower of each pair."""
    hostvars, groups, probes = plan_cluster(n=2)
    for name in probes:
        probes[name]["link_speeds"] = {"eth0": 10000, "lo": 0}
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, now="20261130-000000")
    assert errors == [] and [n["link_mbps"] for n in p["nodes"]] == [10000, 10000]
    records = {n["name"]: n for n in p["nodes"]}
    row = preflight.iperf_row("node1", {"to": "node2", "gbps": 9.41}, records)
    assert (row["status"], row["detail"]) == ("PASS", "node1 -> node2: 9.41 Gbit/s (stated 10)")
    row = preflight.iperf_row("node1", {"to": "node2", "gbps": 0.38}, records)  # every link shaped to 400 Mbit/s
    assert row["status"] == "WARN" and row["detail"].endswith(
        "0.38 Gbit/s, iperf3 0.38 Gbit/s = 0.038x the slower interface's stated 10 Gbit/s") and "ethtool" in row["fix"]
    # InfiniBand HDR on both: the all-reduce's bus bandwidth against 200 Gbit/s = 25 GB/s
    hdr = {"device": "mlx5_0", "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand", "rate_gbps": 200.0}
    nodes = [dict(n, rdma=[hdr]) for n in p["nodes"]]
    ar = {"world_size": 16, "backend": "nccl", "busbw_gbps_max": 4.1, "rows": [{"bytes": 1 << 30, "busbw_gbps": 4.1}]}
    assert preflight._allreduce_rows(dict(ar, backend="gloo"), nodes)[0]["status"] == "PASS"  # CPU: not held to it
    (row,) = preflight._allreduce_rows(ar, nodes)
    assert row["status"] == "WARN" and "busbw 4.1 GB/s = 0.16x the slower interface's stated 25 GB/s" in row["detail"]
    ar["rows"][-1]["busbw_gbps"] = 22.9
    assert preflight._allreduce_rows(ar, nodes)[0]["status"] == "PASS"
    assert preflight._allreduce_rows(dict(ar, rows=[{"bytes": 1 << 30, "busbw_gbps": 0.4}]), p["nodes"])[0]["status"] \
        == "PASS"  # no RDMA stated: only the median judges it (doctor.yml)
