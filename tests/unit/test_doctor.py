"""doctor.yml's schedule and verdicts (dscnode.pairs, plugins/filter/doctor.py): every pair once
in rounds of disjoint pairs, and the outliers named from the pairs' figures. The measurements
themselves run on the container cluster (molecule/tests/test_doctor.py).

    .venv/bin/pytest tests/unit/test_doctor.py -q
"""
import pytest

from dscnode.pairs import pair_rounds
from dscplan.network import promised
from plugins.filter import doctor

NAMES = ["n1", "n2", "n3", "n4"]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9])
def test_every_pair_once_in_rounds_of_disjoint_pairs(n):
    rounds = pair_rounds(n)
    pairs = [p for one in rounds for p in one]
    assert sorted(pairs) == [(i, j) for i in range(n) for j in range(i + 1, n)]
    assert all(len({x for p in one for x in p}) == 2 * len(one) for one in rounds)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)


def measured(names, slow=(), failed=(), fast=9.0, slow_figure=0.3):
    """What doctor.yml gathers: each node's iperf3 results of the pairs it sent in, and
    train.allreduce's pairs; the pairs in `slow` at slow_figure, in `failed` without iperf3."""
    sent, pairs = [{} for _ in names], []
    for one in doctor.rounds_by_name(names):
        for a, b in one:
            figure = slow_figure if {a, b} in [set(s) for s in slow] else fast
            if {a, b} in [set(f) for f in failed]:
                result = {"to": a, "gbps": None, "error": "unable to connect to server: Connection refused"}
            else:
                result = {"to": a, "gbps": figure * 1.1}
            sent[names.index(b)][f"{a} {b}"] = result
            pairs.append({"nodes": [names.index(a), names.index(b)], "busbw_gbps": figure / 8, "time_us": 1.0})
    return sent, {"pairs": pairs}


def report(names, error="", **faults):
    sent, allreduce = measured(names, **faults)
    return doctor.doctor_report((names, sent, allreduce, error))


def kinds(r):
    return [(f["kind"], f["subject"]) for f in r["findings"]]


def test_a_healthy_cluster_has_no_outlier():
    r = report(NAMES)
    assert kinds(r) == [("none", "cluster")] and not any(p["slow"] for p in r["pairs"])
    assert r["median"]["iperf_gbps"] == pytest.approx(9.9) and r["pairs"][0]["iperf_of_median"] == 1.0


def test_a_node_all_of_whose_pairs_are_slow_is_named_and_a_pair_slow_alone_is_the_link():
    r = report(NAMES, slow=[("n1", "n4"), ("n2", "n4"), ("n3", "n4"), ("n1", "n2")])
    assert kinds(r) == [("node", "n4"), ("link", "n1-n2")]
    node, link = r["findings"]
    assert node["detail"].startswith("every pair with it is slow (n1: iperf3 0.33 Gbit/s = 0.033x the median")
    assert "ip -s link" in node["fix"] and "ping -M do" in link["fix"]
    assert link["detail"].startswith("slow alone (iperf3 0.33 Gbit/s = 0.033x the median") and \
        link["detail"].endswith("n1 and n2 are fast with the other nodes")
    lines = doctor.doctor_table(r)
    assert lines[0] == "pair | iperf3 | all-reduce (busbw) | verdict"
    assert "n1-n4 | 0.33 Gbit/s (0.033x median) | 0.0375 GB/s (0.033x median) | SLOW" in lines
    assert "n1-n3 | 9.9 Gbit/s (1.00x median) | 1.125 GB/s (1.00x median) | ok" in lines
    assert lines[-2].startswith("NODE n4: every pair with it is slow") and lines[-1].startswith("LINK n1-n2")


def test_three_nodes_tell_a_node_from_a_link():
    names = NAMES[:3]
    assert kinds(report(names, slow=[("n1", "n3"), ("n2", "n3")])) == [("node", "n3")]
    assert kinds(report(names, slow=[("n1", "n2")])) == [("link", "n1-n2")]


def test_two_nodes_cannot_tell_and_say_so():
    (finding,) = report(NAMES[:2])["findings"]
    assert finding["kind"] == "none" and "a third node tells a slow node from a slow link" in finding["fix"]


def test_a_failed_measurement_is_slow_with_its_error_and_a_node_that_never_joined_is_named():
    r = report(NAMES, failed=[("n2", "n3")])
    assert kinds(r) == [("link", "n2-n3")]
    assert "iperf3 failed: unable to connect to server: Connection refused" in r["findings"][0]["detail"]
    sent, _ = measured(NAMES)
    error = "Run doctor-1 failed: ranks on n3 exited with code 1; first error: n3: RuntimeError: Connection refused"
    r = doctor.doctor_report((NAMES, sent, None, error))
    join = r["findings"][0]
    assert (join["kind"], join["subject"]) == ("join", "n3") and join["detail"].startswith("failed to join: Run doctor-1 failed")
    assert all(p["allreduce_gbps"] is None and p["allreduce_error"] == error for p in r["pairs"])


def records(names, mbps=10_000, rdma=None):
    """The plan's node records as far as the promise reads them: the training interface's stated
    speed, and RDMA ports."""
    return [{"name": n, "link_mbps": mbps, "rdma": rdma or []} for n in names]


def test_a_cluster_slow_alike_is_named_against_what_its_interfaces_state():
    # every pair at 0.4 Gbit/s (as tc's htb shapes every node's eth0) on interfaces stating 10 Gbit/s
    sent, allreduce = measured(NAMES, fast=0.4 / 1.1)
    r = doctor.doctor_report((NAMES, sent, allreduce, "", records(NAMES)))
    assert kinds(r) == [("network", "cluster")], r["findings"]
    assert r["findings"][0]["detail"].startswith("every pair below 40% of what its interfaces state (n1-n4: iperf3 "
                                                 "0.4 Gbit/s = 0.04x the slower interface's stated 10 Gbit/s")
    assert "ethtool" in r["findings"][0]["fix"]
    assert kinds(doctor.doctor_report((NAMES, sent, allreduce, ""))) == [("none", "cluster")]  # no promise: no verdict


def test_two_nodes_are_judged_against_their_interfaces():
    names = NAMES[:2]
    sent, allreduce = measured(names, fast=0.4 / 1.1)
    assert kinds(doctor.doctor_report((names, sent, allreduce, "", records(names)))) == [("network", "cluster")]
    sent, allreduce = measured(names, fast=9.0)
    (finding,) = doctor.doctor_report((names, sent, allreduce, "", records(names)))["findings"]
    assert finding["kind"] == "none" and "iperf3 9.9 Gbit/s = 0.99x the stated 10" in finding["detail"]


@pytest.mark.parametrize("mbps,rdma,promise", [
    (10_000, None, {"iperf_gbps": 10.0, "allreduce_gbps": None}),
    (400_000, None, {"iperf_gbps": None, "allreduce_gbps": None}),  # TCP cannot fill it: not judged by iperf3
    (None, None, {"iperf_gbps": None, "allreduce_gbps": None}),
    (100_000, [{"state": "ACTIVE", "rate_gbps": 200.0}, {"state": "DOWN", "rate_gbps": 400.0}],
     {"iperf_gbps": 100.0, "allreduce_gbps": 25.0}),  # 4X HDR: 200 Gbit/s = 25 GB/s of bus bandwidth
])
def test_what_a_pair_promises(mbps, rdma, promise):
    a, b = records(["a", "b"], mbps, rdma)
    assert promised(a, b, "nccl") == promise
    assert promised(a, b, "gloo")["allreduce_gbps"] is None  # gloo, on CPU, is not held to the RDMA rate
    # the slower side is what the pair promises: 1 Gbit/s beside anything TCP can judge
    assert promised(a, dict(b, link_mbps=1000))["iperf_gbps"] == (1.0 if mbps else None)
