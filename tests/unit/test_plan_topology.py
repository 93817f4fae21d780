"""The nodes as the plan orders and checks them (dscplan.topology): the master, GPUs and slots, the
GPUs chosen per node, training addresses (IPv4, one node's), one machine under two names, an
unreachable node, and the firewall each node gets (the other firewall refused at provision).

    .venv/bin/pytest tests/unit/test_plan_topology.py -q
"""
import pytest

import dscplan
from tests.unit.plan_helpers import DEFAULTS, PATHS, probe, cluster, plan


def test_master_group_moves_a_node_to_rank_zero():
    hostvars, groups, probes = cluster(3)
    groups["master"] = ["node3"]
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert errors == [] and p["node_names"] == ["node3", "node1", "node2"]


def test_gpus_give_cuda_bf16_and_the_arch_list():
    hostvars, groups, probes = cluster(2, slots="auto")
    for h in probes:
        probes[h] = probe(hostvars[h]["dsc_addr"], gpus=4, cap="9.0")
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, full_run=True)
    assert errors == []
    assert p["world_size"] == 8 and p["accelerator"] == "cuda" and p["cuda_arch_list"] == "9.0"
    assert p["node_env"]["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert p["run"]["ds_config"]["bf16"] == {"enabled": True}


def test_duplicate_address_and_address_held_by_no_interface():
    hostvars, groups, probes = cluster(2)
    hostvars["node2"]["dsc_addr"] = "10.0.0.11"
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert any("dsc_addr on host node2 is 10.0.0.11, the same as on host node1" in e for e in errors)
    assert any("dsc_addr on host node2 is 10.0.0.11, which no interface there holds" in e for e in errors)


@pytest.mark.parametrize("node1,needle", [
    ({"dsc_addr": "node1.lab.example"}, "dsc_addr on host node1 is 'node1.lab.example', a host name, not an IPv4 address"),
    ({"dsc_addr": None, "ansible_host": "gpu1.lab"},
     "dsc_addr on host node1 is unset and ansible_host, which stands for it, is 'gpu1.lab', a host name"),
    ({"dsc_addr": None}, "dsc_addr on host node1 is unset, and so is ansible_host: the inventory name 'node1' stands for it, a host name"),
    ({"dsc_addr": "fd89:77::11"}, "dsc_addr on host node1 is 'fd89:77::11', an IPv6 address: IPv6 training addresses are not supported yet"),
    ({"dsc_addr": "fe80::1%eth0"}, "an IPv6 address: IPv6 training addresses are not supported yet"),
    ({"dsc_addr": "::ffff:10.0.0.11"}, "are not supported yet (the probe, NCCL's interface and the rendezvous are IPv4 here; the firewall covers both families). Fix: set dsc_addr to the node's IPv4 address on the training network, e.g. 10.0.0.11 (10.0.0.11 here)."),
    ({"dsc_addr": "0.0.0.0"}, "dsc_addr on host node1 is '0.0.0.0', not the address of one node"),
    ({"dsc_addr": "224.0.0.1"}, "not the address of one node"),
    ({"dsc_addr": "10.0.0.300"}, "dsc_addr on host node1 is '10.0.0.300', not an IPv4 address. Fix: set dsc_addr"),
])
def test_a_training_address_is_an_ipv4_address_of_one_node(node1, needle):
    """Host names and IPv6 passed the plan and failed in the firewall filter after other roles
    had changed the nodes: refused by the plan now, before any node changes, saying which."""
    hostvars, groups, probes = cluster(2)
    hostvars["node1"].update(node1)
    hostvars["node1"] = {k: v for k, v in hostvars["node1"].items() if v is not None}
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, full_run=True)
    assert p is None and any(needle in e and "Fix:" in e for e in errors), errors


def test_status_plans_around_an_unreachable_node():
    hostvars, groups, probes = cluster(2, slots="auto")
    probes["node1"] = probe("10.0.0.11", gpus=1)
    del probes["node2"]
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {},
                                  probe_errors={"node2": "Failed to connect to the host via ssh"})
    assert errors == [] and not p["node"]["node2"]["reachable"] and p["node"]["node1"]["reachable"]
    # preflight's unreachable row reads why from the plan
    assert (p["node"]["node2"]["probe_error"], p["node"]["node1"]["probe_error"]) == (
        "Failed to connect to the host via ssh", "")


def test_one_machine_under_two_names_is_refused():
    hostvars, groups, probes = cluster(2)
    for h in hostvars:
        hostvars[h]["ansible_host"] = "192.0.2.7"
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert any("ansible_host on host node2 is 192.0.2.7 (port 22), the same machine as host node1" in e
               for e in errors), errors


def gpu_cluster(gpus_per_node, selections):
    hostvars, groups, probes = cluster(len(selections), slots="auto")
    for i, (h, chosen) in enumerate(zip(groups["cluster"], selections, strict=True)):
        probes[h] = probe(f"10.0.0.{11 + i}", gpus=gpus_per_node)
        if chosen is not None:
            hostvars[h]["dsc_gpus"] = chosen
    return hostvars, groups, probes


def test_gpus_chosen_per_node_reach_the_launcher_as_include():
    hostvars, groups, probes = gpu_cluster(4, [[1, 3], None])
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, full_run=True)
    assert errors == []
    assert p["world_size"] == 6 and p["node"]["node1"]["gpu_ids"] == [1, 3]
    cmd = p["run"]["commands"]["node1"]
    assert cmd[cmd.index("--include") + 1] == "node1:1,3@node2:0,1,2,3"
    # DeepSpeed counts a node's GPUs from 0 in the hostfile; --include picks 1 and 3 of them.
    assert dscplan.parse_hostfile(p["run"]["files"]["hostfile"]) == [("node1", 4), ("node2", 4)]


def test_no_include_without_a_selection():
    hostvars, groups, probes = gpu_cluster(2, [None, None])
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, full_run=True)
    assert errors == [] and "--include" not in p["run"]["commands"]["node1"]


@pytest.mark.parametrize("chosen,slots,needle", [
    ([0, 7], "auto", "dsc_gpus on host node1 names GPU 7, which nvidia-smi does not report there (it has [0, 1, 2, 3])"),
    ([0, 0], "auto", "dsc_gpus on host node1 is [0, 0]. Fix: a list of distinct GPU indices"),
    (["a"], "auto", "dsc_gpus on host node1 is ['a']"),
    ([0, 1], 3, "dsc_slots on host node1 is 3 but dsc_gpus chooses 2 GPUs"),
])
def test_a_bad_gpu_selection_is_refused(chosen, slots, needle):
    hostvars, groups, probes = gpu_cluster(4, [chosen, None])
    hostvars["node1"]["dsc_slots"] = slots
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert p is None and any(needle in e for e in errors), errors


def firewalled(os_ids=("debian",), ufw=False, firewalld=False, firewall=True, **settings):
    """A plan made for provision.yml (firewall=True) on nodes whose probe saw this firewall state."""
    hostvars, groups, probes = cluster(**settings)
    for p in probes.values():
        p["firewalls"] = {"os": list(os_ids), "ufw": ufw, "firewalld": firewalld}
    return dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, firewall=firewall)


def test_firewall_settings_reach_the_plan_checked():
    p, errors = firewalled(cluster_network_ssh_sources=["any", "192.0.2.0/24", "2001:db8::1"],
                           cluster_network_firewall_backend="firewalld", firewalld=True)
    assert not errors
    assert p["ssh_sources"] == ["any", "192.0.2.0/24", "2001:db8::1"] and p["firewall"] is True
    assert {n["firewall_backend"] for n in p["nodes"]} == {"firewalld"}
    p, errors = plan()
    assert p["ssh_sources"] == [] and p["firewall"] is True


@pytest.mark.parametrize("os_ids,backend", [(["debian"], "ufw"), (["ubuntu", "debian"], "ufw"),
                                            (["rocky", "rhel", "centos", "fedora"], "firewalld"),
                                            (["fedora"], "firewalld")])
def test_firewall_auto_follows_the_os(os_ids, backend):
    p, errors = firewalled(os_ids, ufw=backend == "ufw", firewalld=backend == "firewalld")
    assert not errors and {n["firewall_backend"] for n in p["nodes"]} == {backend}


def test_ufw_s_state_as_the_probe_read_it_reaches_each_node():
    """ufw.yml's inputs from the probe (no module call per node): IPv6 in the kernel, ufw enabled
    by the site, its two rule files; rule files only where ufw is the node's firewall, and only
    as two texts."""
    hostvars, groups, probes = cluster()
    rules = ["*filter\n### tuple ### allow tcp 22 0.0.0.0/0 any 0.0.0.0/0 in\n", ""]
    seen = {"os": ["debian"], "ufw": True, "firewalld": False, "ipv6": True, "ufw_rules": rules}
    probes["node1"]["firewalls"] = seen
    probes["node2"]["firewalls"] = dict(seen, ipv6=False, ufw=False, ufw_rules=["only one"])
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, firewall=True)
    node = {n["name"]: n for n in p["nodes"]}
    assert not errors and (node["node1"]["ipv6"], node["node1"]["ufw_enabled"], node["node1"]["ufw_rules"]) == (True, True, rules)
    assert (node["node2"]["ipv6"], node["node2"]["ufw_enabled"], node["node2"]["ufw_rules"]) == (False, False, ["", ""])
    for name in probes:
        probes[name]["firewalls"] = dict(seen, os=["rocky", "rhel"], ufw=False, firewalld=True)
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, firewall=True)
    assert not errors and [n["ufw_rules"] for n in p["nodes"]] == [["", ""]] * len(p["nodes"])


@pytest.mark.parametrize("kw,message", [
    ({"firewalld": True}, "cluster_network_firewall_backend on host node1 is 'auto' (ufw on debian), and "
                          "firewalld is running there. Fix: cluster_network_firewall_backend: firewalld"),
    ({"ufw": True, "cluster_network_firewall_backend": "firewalld"},
     "cluster_network_firewall_backend on host node2 is 'firewalld', and ufw is running there. Fix: "
     "cluster_network_firewall_backend: ufw (the site's firewall), or stop ufw, or "
     "cluster_network_firewall: false"),
    ({"os_ids": ["arch"]}, "cluster_network_firewall_backend on host node1 is 'auto', and auto knows no "
                           "firewall for its OS (arch). Fix: ufw or firewalld"),
])
def test_provision_refuses_a_firewall_it_would_not_manage_alone(kw, message):
    p, errors = firewalled(**kw)
    assert p is None and any(e.startswith(message) for e in errors), errors
    # the other playbooks, or the firewall left to the site: no refusal
    assert firewalled(firewall=False, **kw)[1] == []
    assert firewalled(cluster_network_firewall=False, **kw)[1] == []


IB = {"device": "mlx5_0", "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand"}
ROCE = {"device": "mlx5_2", "port": 1, "state": "ACTIVE", "link_layer": "Ethernet", "gid_index": 3}


def network_plan(probes_of, **settings):
    hostvars, groups, probes = cluster(n=3, **settings)
    for name, change in probes_of.items():
        probes[name].update(change)
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, now="20261130-000000")
    assert errors == []
    return p["rank_env"], {n["name"]: n["network_env"] for n in p["nodes"]}


def test_each_node_gets_its_own_interface_when_the_names_differ():
    same, _ = network_plan({})
    assert same["NCCL_SOCKET_IFNAME"] == same["GLOO_SOCKET_IFNAME"] == "eth0"
    assert not any(k.startswith("DSC_NODE_") for k in same)
    # node2 holds its address on ens5: every node's ranks take their own (the entry shim, by
    # CROSS_RANK), not a list of every name, which would let a node pick another's
    env, own = network_plan({"node2": {"interfaces": {"lo": ["127.0.0.1"], "ens5": ["10.0.0.12"],
                                                      "eth0": ["192.168.9.2"]}}})
    assert "NCCL_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in env
    assert env["DSC_NODE_NCCL_SOCKET_IFNAME"] == env["DSC_NODE_GLOO_SOCKET_IFNAME"] == "eth0/ens5/eth0"
    assert own["node2"] == {"NCCL_SOCKET_IFNAME": "ens5", "GLOO_SOCKET_IFNAME": "ens5"}
    # dsc_rank_env's value wins on every node
    env, own = network_plan({"node2": {"interfaces": {"lo": ["127.0.0.1"], "ens5": ["10.0.0.12"]}}},
                            dsc_rank_env={"NCCL_SOCKET_IFNAME": "=bond0"})
    assert env["NCCL_SOCKET_IFNAME"] == "=bond0" and "DSC_NODE_NCCL_SOCKET_IFNAME" not in env
    assert env["DSC_NODE_GLOO_SOCKET_IFNAME"] == "eth0/ens5/eth0" and "NCCL_SOCKET_IFNAME" not in own["node2"]


def test_rdma_ports_give_nccl_its_hcas_and_roce_its_gid_index():
    down = dict(IB, device="mlx5_1", state="DOWN")
    env, own = network_plan({n: {"infiniband": True, "rdma": [IB, down]} for n in ("node1", "node2", "node3")})
    assert env["NCCL_IB_HCA"] == "mlx5_0:1" and env["NCCL_IB_DISABLE"] == "0"  # the port that is down left out
    assert "NCCL_IB_GID_INDEX" not in env
    env, own = network_plan({"node1": {"infiniband": True, "rdma": [ROCE]},
                             "node2": {"infiniband": True, "rdma": [ROCE]},
                             "node3": {"infiniband": True, "rdma": [dict(ROCE, device="mlx5_0", gid_index=1)]}})
    assert env["DSC_NODE_NCCL_IB_HCA"] == "mlx5_2:1/mlx5_2:1/mlx5_0:1" and env["DSC_NODE_NCCL_IB_GID_INDEX"] == "3/3/1"
    assert own["node3"]["NCCL_IB_GID_INDEX"] == "1"
    env, _ = network_plan({})
    assert "NCCL_IB_HCA" not in env and env["NCCL_IB_DISABLE"] == "1"
