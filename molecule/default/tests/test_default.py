"""molecule verify: every node provisioned alike (pytest-testinfra, one run per node)."""
import json
from pathlib import Path

ENV = "/opt/dscluster/env"
PINS = dict(line.split("=", 1) for line in
            (Path(__file__).resolve().parents[3] / "requirements" / "pins.env").read_text().splitlines()
            if line.strip() and not line.startswith("#"))


def test_training_user_owns_the_env(host):
    assert host.user("dstrain").exists and host.user("dstrain").uid != 0
    assert host.file(ENV).user == "dstrain"


def test_torch_and_deepspeed_import_with_the_pinned_versions(host):
    # as the training user, as its ranks import them (root never runs the env: test_privilege.py)
    out = host.check_output(f"sudo -u dstrain {ENV}/bin/python -c 'import json, torch, deepspeed; "
                            "print(json.dumps([torch.__version__, deepspeed.__version__]))'")
    assert json.loads(out.strip().splitlines()[-1]) == [PINS["TORCH_VERSION"] + "+cpu", PINS["DEEPSPEED_VERSION"]]


def test_ds_report_kept_and_jit_cache_warm(host):
    assert host.file("/opt/dscluster/ds_report.txt").contains("DeepSpeed C++/CUDA extension op report")
    built = host.run("find /opt/dscluster/cache/torch_extensions -name '*.so'").stdout
    assert "fused_adam.so" in built and "deepspeed_shm_comm.so" in built


def test_base_packages_installed(host):
    for pkg in ("pdsh", "tmux", "iperf3", "g++", "ninja-build", "python3-dev"):
        assert host.package(pkg).is_installed, pkg
