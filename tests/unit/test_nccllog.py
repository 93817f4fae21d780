"""Which transport NCCL chose, read from its INFO lines (dscnode.nccllog) as NCCL printed them in
logs posted to public issues (tests/fixtures/nccl/, each file's first line its source), and
preflight's row for each node (plugins/filter/preflight.py)."""
import os
from pathlib import Path

import pytest

from dscnode import entry, nccllog
from plugins.filter import cluster as filters
from plugins.filter import preflight

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nccl"


def read(name):
    return nccllog.read(FIXTURES / name)


@pytest.mark.parametrize("name,network,devices,channels,gdr,said", [
    ("ib-bound.log", "IB", ["mlx5_10:1/IB", "mlx5_11:1/IB", "mlx5_12:1/IB", "mlx5_13:1/IB"], {}, None,
     "NET/IB over mlx5_10:1/IB, mlx5_11:1/IB, mlx5_12:1/IB, mlx5_13:1/IB chosen; no channel left the node (one node)"),
    ("ib-gdr-channels.log", "IB", [], {"IB/GDRDMA": 2}, True, "NET/IB with GPUDirect RDMA"),
    ("ib-no-gdr-channels.log", "IB", [], {"IB": 4}, False, "NET/IB without GPUDirect RDMA (through host memory)"),
    ("socket-bound.log", "Socket", ["lo:127.0.0.1"], {}, None,
     "NET/Socket over lo:127.0.0.1 chosen; no channel left the node (one node)"),
    ("socket-channels.log", "Socket", [], {"Socket": 2}, False, "NET/Socket"),
    # captured on one H100: NCCL 2.28.9 tries IB first ("NET/IB : Using [RO]; OOB eth0", then
    # "Failed to initialize NET plugin IB"), which is no IB device bound
    ("h100-shim-one-node.log", "Socket", ["eth0:192.0.2.2"], {}, None,
     "NET/Socket over eth0:192.0.2.2 chosen; no channel left the node (one node)"),
    # NCCL 2.4 bound sockets first, then IB, and printed no "Using network" line
    ("socket-then-ib.log", "IB", ["mlx5_0:1/IB"], {}, None,
     "NET/IB over mlx5_0:1/IB chosen; no channel left the node (one node)"),
])
def test_the_transport_of_each_log(name, network, devices, channels, gdr, said):
    t = nccllog.transport(read(name))
    assert (t["network"], t["devices"], t["channels"]) == (network, devices, channels)
    assert t["gdr"] is gdr  # None: no channel left the node
    assert nccllog.summary(t) == said


def test_no_line_says_so():
    assert nccllog.summary(nccllog.transport([])) == \
        "no NCCL network line (NCCL not used, or its INFO lines were not kept)"


def node(name, rdma=()):
    return {"name": name, "rdma": [{"device": d, "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand"}
                                   for d in rdma]}


def transport_of(name):
    t = nccllog.transport(read(name))
    return dict(t, summary=nccllog.summary(t))


def test_preflight_warns_where_a_node_with_rdma_sent_over_sockets_or_without_gpudirect():
    ar = {"transport": {"0": transport_of("ib-gdr-channels.log"), "1": transport_of("socket-channels.log"),
                        "2": transport_of("ib-no-gdr-channels.log")}}
    rows = preflight.transport_rows(ar, [node("n1", ["mlx5_0"]), node("n2", ["mlx5_0"]), node("n3", ["mlx5_0"])])
    assert [(r["node"], r["status"]) for r in rows] == [("n1", "PASS"), ("n2", "WARN"), ("n3", "WARN")]
    assert rows[0]["detail"] == "NET/IB with GPUDirect RDMA"
    assert "n2 has ACTIVE RDMA ports (mlx5_0/1) that NCCL left unused" in rows[1]["fix"]
    assert "nvidia-peermem" in rows[2]["fix"]
    # sockets on a node without RDMA: what it has
    assert preflight.transport_rows({"transport": {"0": transport_of("socket-channels.log")}}, [node("n1")])[0]["status"] \
        == "PASS"
    assert preflight.transport_rows({"rows": []}, [node("n1")]) == []  # gloo: no NCCL, no row


def test_a_nodes_ranks_merge_into_one_transport():
    """A node with more GPUs than NICs: its rank 0's channels stay inside it, another rank's leave."""
    inside = nccllog.transport(["n:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read"])
    merged = nccllog.merge([dict(nccllog.transport(read("ib-bound.log")), channels={}), inside,
                            nccllog.transport(read("ib-gdr-channels.log"))])
    assert merged["network"] == "IB" and merged["channels"] == {"IB/GDRDMA": 2} and merged["gdr"] is True
    assert nccllog.summary(merged).startswith("NET/IB over mlx5_10:1/IB") and merged["devices"][0] == "mlx5_10:1/IB"


def rank_file(folder, name, fixture, mtime):
    """A rank's debug file as the entry shim has NCCL write it (nccl/<host>-<pid>.log)."""
    path = folder / name
    path.write_bytes((FIXTURES / fixture).read_bytes())
    os.utime(path, (mtime, mtime))
    return path


def test_status_reads_the_current_attempts_files_and_their_last_warn(tmp_path):
    """The last attempt's ranks spoke InfiniBand; this attempt's speak sockets and one warned.
    Files of an earlier attempt (older than its ranks' start) are not read; links are refused."""
    rank_file(tmp_path, "gpu-a-100.log", "ib-gdr-channels.log", 1000)
    rank_file(tmp_path, "gpu-a-200.log", "socket-channels.log", 2000)
    rank_file(tmp_path, "gpu-a-201.log", "socket-warn.log", 2001)
    (tmp_path / "gpu-a-202.log").symlink_to(FIXTURES / "ib-bound.log")
    r = nccllog.node_report(tmp_path, 1999, [])
    assert r == {"summary": "NET/Socket", "status": "PASS", "fix": "", "warn":
                 "socketStartConnect: Connect to 10.0.0.2<45763> failed : Software caused connection abort"}
    ib = [{"device": "mlx5_0", "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand"}]
    judged = nccllog.node_report(tmp_path, 1999, ib)
    assert judged["status"] == "WARN" and judged["fix"].startswith("this node has ACTIVE RDMA ports (mlx5_0/1)")
    assert nccllog.node_report(tmp_path, 3000, []) is None  # no file of this attempt
    assert nccllog.node_report(tmp_path / "none", 0, []) is None
    row = filters.status_row({"host": "gpu-a", "state": "failed", "nccl": r})
    assert row.endswith(", NCCL NET/Socket; last NCCL WARN: socketStartConnect: Connect to 10.0.0.2<45763> "
                        "failed : Software caused connection abort")
    assert ", NCCL NET/Socket (WARN: this node has ACTIVE RDMA ports" in filters.status_row({"host": "gpu-a", "nccl": judged})
    assert "NCCL" not in filters.status_row({"host": "cpu-a", "nccl": None})


@pytest.mark.parametrize("env,kept", [
    ({"DS_ACCELERATOR": "cuda", "NCCL_DEBUG": "WARN"}, True),   # the plan's default
    ({}, True),                                                 # a rank outside the plan, on a GPU
    ({"DS_ACCELERATOR": "cpu", "NCCL_DEBUG": "WARN"}, False),   # gloo: no NCCL
    ({"DS_ACCELERATOR": "cuda", "NCCL_DEBUG": "INFO"}, False),  # a level set on purpose prints where asked
    ({"DS_ACCELERATOR": "cuda", "NCCL_DEBUG_FILE": "/x/%h.log"}, False),
])
def test_the_entry_shim_keeps_nccls_init_lines_only_where_the_level_is_the_default(tmp_path, env, kept):
    before = dict(env)
    entry.keep_nccl_lines(env, tmp_path / "nccl")
    assert (env == dict(before, **nccllog.debug_env(tmp_path / "nccl"))) if kept else env == before
    assert (tmp_path / "nccl").is_dir() is kept
