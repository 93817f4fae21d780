"""Bad input fails in the validation play, before any node is changed, naming variable, host and fix."""
import json

import pytest

CASES = [
    ({"dsc_env_manager": "pip"}, ["dsc_env_manager on host node1", "Fix: one of conda, venv, existing"]),
    ({"dsc_slots": 0}, ["dsc_slots on host node1 is 0", "Fix:"]),
    ({"dsc_slots": -2}, ["dsc_slots on host node2 is -2"]),
    ({"dsc_slots": "many"}, ["dsc_slots on host node1 is 'many'"]),
    ({"dsc_addr": "10.89.77.11"}, ["dsc_addr on host node2 is 10.89.77.11, the same as on host node1"]),
    ({"dsc_install_root": "opt/dscluster"}, ["dsc_install_root on host node1 is 'opt/dscluster', not an absolute path"]),
    ({"dsc_torch_variant": "cu999"}, ["dsc_torch_variant on host node1 is 'cu999'", "cu128"]),
    ({"dsc_wheelhouse": "/nonexistent/wheels"}, ["dsc_wheelhouse on host node1 is '/nonexistent/wheels', which does not exist"]),
    ({"dsc_env_manager": "conda"}, ["dsc_conda_installer_sha256 on host node1 is empty"]),
    ({"dsc_env_manager": "existing"}, ["dsc_existing_python on host node1"]),
    ({"dsc_master_port": 80}, ["dsc_master_port on host node1 is 80"]),
    ({"dsc_master_port": 29510, "dsc_master_port_last": 29500}, ["dsc_master_port_last on host node1 is 29500"]),
    ({"dsc_master_port": "http"}, ["dsc_master_port", "Validation of arguments failed"]),
    ({"dsc_ssh_port": 70000}, ["dsc_ssh_port on host node1 is 70000"]),
    ({"dsc_run_root": "runs"}, ["dsc_run_root on host node1 is 'runs', not an absolute path"]),
    ({"dsc_addr": "10.89.77.300"}, ["dsc_addr on host node1 is '10.89.77.300', not an IPv4 address"]),
    ({"dsc_train_user": "root"}, ["dsc_train_user on host node1 is 'root'", "non-root"]),
    ({"dsc_train_user": "Bad User"}, ["dsc_train_user on host node1 is 'Bad User'"]),
    ({"dsc_torch_version": ">=2.0"}, ["dsc_torch_version on host node1 is '>=2.0', not an exact version"]),
    ({"dsc_deepspeed_version": "latest"}, ["dsc_deepspeed_version on host node1 is 'latest', not an exact version"]),
    ({"dsc_python_version": "python3"}, ["dsc_python_version on host node1 is 'python3'"]),
    ({"dsc_cluster_name": "lab/a"}, ["dsc_cluster_name on host node1 is 'lab/a'"]),
    ({"dsc_slots": "auto"}, ["dsc_slots on host node1 is 'auto' but nvidia-smi found no GPU there"]),
]


@pytest.mark.parametrize("extra,needles", CASES, ids=[next(iter(c[0])) + "=" + str(list(c[0].values())[0]) for c in CASES])
def test_bad_input_is_refused_before_any_change(cluster, extra, needles):
    """provision.yml: the validating play fails, the changing play never starts."""
    r = cluster.playbook("provision.yml", "-e", json.dumps(extra))
    assert r.returncode != 0
    for n in needles:
        assert n in r.output, r.output[-3000:]
    assert "Validate the inventory before any node changes" in r.output
    assert "Make every node identical" not in r.output  # the changing play never started
    assert all(v.get("changed", 0) == 0 for v in r.recap.values()), r.recap


@pytest.mark.parametrize("playbook", ["preflight.yml", "launch.yml", "resume.yml"])
@pytest.mark.parametrize("extra,needle", [
    ({"dsc_slots": 0}, "dsc_slots on host node1 is 0"),
    ({"dsc_master_port": 29510, "dsc_master_port_last": 29500}, "dsc_master_port_last on host node1 is 29500"),
], ids=["slots", "ports"])
def test_every_playbook_validates_first(cluster, playbook, extra, needle):
    r = cluster.playbook(playbook, "-e", json.dumps(extra))
    assert r.returncode != 0 and needle in r.output, r.output[-3000:]
    assert "Check that Ansible reaches the node" not in r.output  # stopped in cluster_model
    assert all(v.get("changed", 0) == 0 for v in r.recap.values()), r.recap
