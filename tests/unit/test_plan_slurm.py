"""Slurm's configuration as the plan derives it (dscplan.slurm, dsc_slurm_install): slurm.conf's
nodes from the inventory and the probes, the GPUs as gres, cgroup or not, and the refusals of a
partition Slurm would read as more than a name.

    .venv/bin/pytest tests/unit/test_plan_slurm.py -q
"""
import pytest

import dscplan
from tests.unit.plan_helpers import DEFAULTS, PATHS, cluster, plan, probe


def conf_lines(p):
    return p["slurm"]["conf"].splitlines()


def test_off_by_default_and_nothing_rendered():
    p, errors = plan(2)
    assert errors == []
    assert p["slurm"] == {"install": False, "partition": "dsc", "controller": "", "conf": "",
                          "gres_conf": "", "cgroup_conf": ""}


def test_nodes_from_the_inventory_and_the_probe():
    hostvars, groups, probes = cluster(2, dsc_slurm_install=True)
    probes["node1"].update(cpus=64, memory_mib=515000)
    probes["node2"].update(cpus=32, memory_mib=257000)
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert errors == []
    lines = conf_lines(p)
    assert "SlurmctldHost=node1(10.0.0.11)" in lines and "AuthType=auth/munge" in lines
    assert "NodeName=node1 NodeAddr=10.0.0.11 CPUs=64 RealMemory=489250 State=UNKNOWN" in lines
    assert "NodeName=node2 NodeAddr=10.0.0.12 CPUs=32 RealMemory=244150 State=UNKNOWN" in lines
    assert "PartitionName=dsc Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP" in lines
    assert "ProctrackType=proctrack/cgroup" in lines and p["slurm"]["cgroup_conf"].startswith("CgroupPlugin=")
    assert "GresTypes=gpu" not in lines and p["slurm"]["gres_conf"] == ""  # CPU nodes: no gres
    assert p["slurm"]["controller"] == "node1"


def test_gpus_as_gres_the_chosen_ones_only():
    hostvars, groups, probes = cluster(2, slots="auto", dsc_slurm_install=True)
    for h in probes:
        probes[h] = probe(hostvars[h]["dsc_addr"], gpus=4)
    hostvars["node2"]["dsc_gpus"] = [2, 3]
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert errors == []
    lines = conf_lines(p)
    assert "GresTypes=gpu" in lines
    assert any(x.startswith("NodeName=node1 ") and "Gres=gpu:4" in x for x in lines)
    assert any(x.startswith("NodeName=node2 ") and "Gres=gpu:2" in x for x in lines)
    assert p["slurm"]["gres_conf"].splitlines() == [
        *(f"NodeName=node1 Name=gpu File=/dev/nvidia{i}" for i in range(4)),
        "NodeName=node2 Name=gpu File=/dev/nvidia2", "NodeName=node2 Name=gpu File=/dev/nvidia3"]


def test_no_cgroup_for_a_container():
    p, errors = plan(2, dsc_slurm_install=True, dsc_slurm_cgroup=False)
    assert errors == []
    assert "ProctrackType=proctrack/linuxproc" in conf_lines(p) and "TaskPlugin=task/none" in conf_lines(p)
    assert p["slurm"]["cgroup_conf"] == ""


@pytest.mark.parametrize("partition", ["dsc;touch /tmp/x", "a b", "gpu[1-2]", "p,q", "dsc\n", "-x", ""])
def test_a_partition_that_is_more_than_a_name_is_refused(partition):
    p, errors = plan(2, dsc_slurm_partition=partition)
    assert p is None
    assert any(e.startswith("dsc_slurm_partition on host node1 is ") and "Fix: letters" in e for e in errors), errors
