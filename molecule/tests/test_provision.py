"""provision.yml on the container cluster: what each node ends with (idempotence: test_molecule.py)."""
import json


from cluster import PINS


def test_version_table_has_a_row_per_node(provisioned, cluster):
    out = provisioned["first"].output
    for name in cluster.names:
        assert f'"{name} | 3.11' in out and f"| {PINS['TORCH_VERSION']}+cpu | cpu | {PINS['DEEPSPEED_VERSION']} |" in out


def test_env_is_identical_and_owned_by_the_training_user(provisioned, cluster):
    seen = set()
    for name in cluster.names:
        host = cluster.host(name)
        assert host.user("dstrain").exists and host.user("dstrain").uid != 0
        env = host.file("/opt/dscluster/env/bin/python")
        assert env.exists and host.file("/opt/dscluster/env").user == "dstrain"
        out = host.run("sudo -u dstrain /opt/dscluster/env/bin/python -c "
                       "'import torch, deepspeed, json; print(json.dumps([torch.__version__, deepspeed.__version__]))'")
        assert out.rc == 0, out.stderr
        seen.add(out.stdout.strip().splitlines()[-1])
    assert seen == {json.dumps([PINS["TORCH_VERSION"] + "+cpu", PINS["DEEPSPEED_VERSION"]])}


def test_ds_report_kept_and_jit_cache_warm(provisioned, cluster):
    for name in cluster.names:
        host = cluster.host(name)
        report = host.file("/opt/dscluster/ds_report.txt")
        assert report.exists and "DeepSpeed general environment info" in report.content_string
        so = host.run("find /opt/dscluster/cache/torch_extensions -name '*.so'").stdout.split()
        assert any("shm_comm" in p for p in so), so
        assert any("fused_adam" in p for p in so), so


def test_base_packages_installed(provisioned, cluster):
    host = cluster.host(cluster.master)
    for pkg in ("pdsh", "tmux", "iperf3", "g++", "ninja-build", "python3-dev"):
        assert host.package(pkg).is_installed, pkg


def test_conda_manager_checks_a_pushed_installer_before_running_it(provisioned, cluster, tmp_path):
    """As far as this machine allows without Miniconda: the air-gapped path pushes the installer to
    every node and refuses it when its sha256 differs (the download path's get_url checks the same
    sha256 itself; installing and creating the env need the real installer)."""
    fake = tmp_path / "Miniconda3-latest-Linux-x86_64.sh"
    fake.write_text("#!/bin/sh\necho 'not Miniconda'\nexit 1\n")
    extra = {"dsc_env_manager": "conda", "dsc_conda_installer_file": str(fake), "dsc_conda_installer_sha256": "0" * 64}
    try:
        r = cluster.playbook("provision.yml", "-e", json.dumps(extra))
        assert r.returncode != 0
        assert "Push the Miniconda installer from the control node" in r.output
        for node in cluster.names:
            assert f"dsc_conda_installer_file on host {node}" in r.output and "not dsc_conda_installer_sha256" in r.output
            cluster.exec(node, "test -f /opt/dscluster/cache/miniconda-installer.sh")
        assert "Install Miniconda in batch mode" not in r.output  # never run
    finally:
        for node in cluster.names:
            cluster.exec(node, "rm -f /opt/dscluster/cache/miniconda-installer.sh", check=False)
