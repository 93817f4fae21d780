"""Bad input stops every playbook in its first play (the plan), before any node is changed.
Each check's message is unit-tested (tests/unit/test_plan_*.py); here the playbooks prove that
nothing on the nodes changed and that the changing play never started."""
import json

import pytest

# Each case refused whole in one run: the plan names every problem at once, so each run holds
# several variables (each in one case), and every needle of each must be there. dsc_run_root's
# three values a run each; /var/lib/dpkg as the install root beside another run root (the plan
# names a path once). The argument spec's types and choices fail before the plan: their own run.
CASES = [
    # A trailing newline (a second argument to a command line).
    ({"dsc_run_root": "/opt/dscluster/runs\n", "dsc_slots": 0, "dsc_master_port": 29510, "dsc_master_port_last": 29500,
      "dsc_rank_env": {"NCCL_DEBUG": "WARN$(touch /tmp/pwned)"}},
     ["dsc_run_root on host node1 holds a control character ('\\n')",
      "dsc_slots on host node1 is 0", "dsc_slots on host node2 is 0", "Fix:",
      "dsc_master_port_last on host node1 is 29500",
      "the value of NCCL_DEBUG is 'WARN$(touch /tmp/pwned)'"]),
    # A system directory as a root; a directory of the system's the toolkit did not make (dpkg's
    # maintainer scripts run as root).
    ({"dsc_run_root": "/etc", "dsc_install_root": "/var/lib/dpkg",
      "dsc_pip_index_url": "https://mirror/simple --trusted-host evil;touch /tmp/pwned",
      "cluster_network_ssh_sources": ["10.0.0.1 comment x;touch /tmp/pwned"]},
     ["dsc_run_root on host node1 is '/etc', in the system tree /etc",
      "dsc_install_root on host node1: root writes /var/lib/dpkg, and it exists and is owned by root, not dstrain",
      "dsc_install_root on host node2: root writes /var/lib/dpkg",
      "dsc_pip_index_url on host node1 is 'https://mirror/simple --trusted-host evil;touch /tmp/pwned'",
      "cluster_network_ssh_sources on host node1 is ['10.0.0.1 comment x;touch /tmp/pwned']"]),
    ({"dsc_run_root": "/var/lib/dpkg", "dsc_slurm_install": True, "dsc_slurm_partition": "dsc;touch /tmp/pwned",
      "dsc_slurm_account": "$(touch /tmp/pwned)"},
     ["dsc_run_root on host node1: root writes /var/lib/dpkg, and it exists and is owned by root",
      "dsc_slurm_partition on host node1 is 'dsc;touch /tmp/pwned'",
      "dsc_slurm_account on host node1 is '$(touch /tmp/pwned)'"]),
    ({"dsc_master_port": "http", "cluster_network_firewall_backend": "iptables"},
     ["Validation of arguments failed", "argument 'dsc_master_port' is of type str and we were unable to convert to int",
      "value of cluster_network_firewall_backend must be one of: auto, ufw, firewalld, got: iptables",
      "fatal: [node1]"]),
]


@pytest.mark.parametrize("extra,needles", CASES, ids=[next(iter(c[0])) + "=" + str(list(c[0].values())[0]) for c in CASES])
def test_bad_input_is_refused_before_any_change(cluster, extra, needles):
    """provision.yml: the plan play fails, the changing play never starts."""
    r = cluster.playbook("provision.yml", "-e", json.dumps(extra))
    assert r.returncode != 0
    for n in needles:
        assert n in r.output, r.output[-3000:]
    assert "Plan (validate everything, change nothing)" in r.output
    assert "Make every node identical" not in r.output  # the changing play never started
    assert all(v.get("changed", 0) == 0 for v in r.recap.values()), r.recap
    for node in cluster.names:
        assert cluster.exec(node, "test -e /tmp/pwned", check=False).returncode != 0
        assert cluster.exec(node, "stat -c '%U:%G %a' /var/lib/dpkg").stdout.strip() == "root:root 755"


@pytest.mark.parametrize("playbook", ["preflight.yml", "launch.yml", "resume.yml", "status.yml", "stop.yml", "logs.yml"])
def test_every_playbook_validates_first(cluster, playbook):
    r = cluster.playbook(playbook, "-e", json.dumps({"dsc_slots": 0, "run_id": "../../tmp/x"}))
    assert r.returncode != 0 and "dsc_slots on host node1 is 0" in r.output, r.output[-3000:]
    assert "run_id is '../../tmp/x'" in r.output, r.output[-3000:]
    assert "Record whether the plan's probe reached the node" not in r.output  # stopped in the plan
    assert all(v.get("changed", 0) == 0 for v in r.recap.values()), r.recap


def test_a_launch_with_hostile_values_is_refused_and_nothing_planted_runs(cluster, tmp_path):
    """Shell and template injection through every route of launch.yml at once: each refused by
    name in the plan, nothing changed on any node, no planted command ran anywhere (the control
    node included: a Jinja lookup in -e would run there)."""
    marker = tmp_path / "jinja-ran"
    hostile = {"run_id": "r1;touch /tmp/pwned", "dsc_run_root": "/opt/runs;touch /tmp/pwned",
               "dsc_entry_args": ["--x", "$(touch /tmp/pwned)"],
               "dsc_rank_env": {"NCCL_DEBUG": "WARN\"; touch /tmp/pwned; \""}}
    r = cluster.playbook("launch.yml", "-e", json.dumps(hostile))
    assert r.returncode != 0, r.output[-3000:]
    for needle in ["run_id is 'r1;touch /tmp/pwned'", "dsc_run_root on host node1",
                   "dsc_entry_args holds '$(touch /tmp/pwned)'", "the value of NCCL_DEBUG"]:
        assert needle in r.output, (needle, r.output[-3000:])
    jinja = cluster.playbook("launch.yml", "-e", f"run_id={{{{ lookup('pipe', 'touch {marker}') }}}}")
    assert jinja.returncode != 0 and "run_id holds a Jinja template" in jinja.output, jinja.output[-3000:]
    assert not marker.exists(), "a Jinja lookup in -e ran on the control node"
    for result in (r, jinja):
        assert all(v.get("changed", 0) == 0 for v in result.recap.values()), result.recap
    for node in cluster.names:
        assert cluster.exec(node, "test -e /tmp/pwned", check=False).returncode != 0


def test_a_jinja2_header_in_an_e_value_is_refused_before_it_runs(cluster, tmp_path):
    """A '#jinja2:' header sets its own delimiters: Ansible would run the lookup on the control
    node. Refused in the first play, before any node is reached; the lookup never ran."""
    marker = tmp_path / "header-ran"
    preset = ("#jinja2:variable_start_string:'[%', variable_end_string:'%]'\n"
              f"[% lookup('pipe', 'touch {marker}') %]zero2")
    r = cluster.playbook("launch.yml", "-e", json.dumps({"preset": preset, "dry_run": True}))
    assert r.returncode != 0 and "preset holds a Jinja template" in r.output, r.output[-3000:]
    assert not marker.exists(), "a template in an -e value ran on the control node"
    assert all(v.get("changed", 0) == 0 for v in r.recap.values()), r.recap
