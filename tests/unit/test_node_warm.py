"""Provision's warm-up answering from its record (dscnode.warm): a complete answer is reused, without
importing torch, only while nothing it depended on changed: the ops asked, the GPUs and driver, the
build's environment, the env's packages and each op library's mtime. The warm-up itself, with
torch and real op builds, is tests/local/test_warm.py.

    .venv/bin/pytest tests/unit/test_node_warm.py -q
"""
import hashlib
import json
import os
import sys

import pytest

from dscnode import warm
from dscnode.probe import recorded_ops

OPS = ["FusedAdamBuilder"]
OUT = {"torch_probe": {"torch": "2.13.0+cpu", "cuda_build": None, "cuda_available": False, "gpus": 0},
       "ops": ["fused_adam"], "built": ["fused_adam"], "awaits": [],
       "versions": {"python": "3.11.2", "torch": "2.13.0+cpu", "cuda": "cpu", "deepspeed": "0.19.8", "nccl": "-", "gpus": 0},
       "report_current": False, "recorded": False}


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A JIT cache with one built op, its record, and the kept ds_report written for its versions."""
    ext = tmp_path / "ext"
    (ext / "fused_adam").mkdir(parents=True)
    (ext / "fused_adam" / "fused_adam.so").write_bytes(b"\x7fELF")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    for name in warm.BUILD_ENV[1:]:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "ds_report.txt").write_text(f"# versions: {json.dumps(OUT['versions'])}\nreport\n")
    keep(tmp_path / "warm.json", key(), str(ext), OUT)
    return tmp_path


def keep(path, key, ext, out):
    """Root's copy of a warm-up's record (roles/deepspeed writes it from the answer's `record`)."""
    path.write_text(json.dumps(warm.new_record(key, ext, out)))


def key(**changes):
    """The key warm() forms for OPS on a CPU node with this interpreter's packages, but `changes`."""
    paths = warm.sysconfig.get_paths()
    args = {"ops": OPS, "gpus_expected": 0, "driver": "", "site_packages": sorted({paths["purelib"], paths["platlib"]})}
    return warm.warm_key(**dict(args, **changes))


def again(node, ops=OPS, gpus=0, driver=""):
    return warm.warm(ops, str(node / "ds_report.txt"), gpus, False, str(node / "warm.json"), driver)


def test_an_unchanged_node_is_answered_from_the_record_without_torch(node):
    imported = "torch" in sys.modules
    out = again(node)
    assert out == dict(OUT, built=[], report_current=True, recorded=True, record=None)
    assert ("torch" in sys.modules) == imported


@pytest.mark.parametrize("change", [
    {"ops": ["FusedAdamBuilder", "CPUAdamBuilder"]}, {"gpus_expected": 1}, {"driver": "580.95"},
    {"site_packages": []},
])
def test_a_changed_ask_gpu_driver_or_env_is_not_answered_from_the_record(node, change):
    assert warm.recorded(node / "warm.json", key(), str(node / "ext")) is not None
    assert warm.recorded(node / "warm.json", key(**change), str(node / "ext")) is None


def test_a_build_variable_or_a_rebuilt_or_missing_library_voids_the_record(node, monkeypatch):
    lib = node / "ext" / "fused_adam" / "fused_adam.so"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert warm.recorded(node / "warm.json", key(), str(node / "ext")) is None
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    st = lib.stat()
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert warm.recorded(node / "warm.json", key(), str(node / "ext")) is None
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert warm.recorded(node / "warm.json", key(), str(node / "ext")) is not None
    lib.unlink()
    assert warm.recorded(node / "warm.json", key(), str(node / "ext")) is None


def test_a_package_installed_removed_or_reinstalled_changes_the_state(tmp_path):
    site = tmp_path / "site-packages"
    (site / "deepspeed-0.19.8.dist-info").mkdir(parents=True)
    before = warm.packages_state([site])
    (site / "extra.pth").write_text("")
    added = warm.packages_state([site])
    (site / "extra.pth").unlink()
    assert warm.packages_state([site]) == before != added
    st = (site / "deepspeed-0.19.8.dist-info").stat()
    os.utime(site / "deepspeed-0.19.8.dist-info", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert warm.packages_state([site]) != before


@pytest.mark.parametrize("text", ["", "{", "[]", json.dumps({"key": {}, "libs": {}}),
                                  json.dumps({"key": None, "libs": [], "out": {"ops": 1}})])
def test_a_broken_or_foreign_record_is_ignored(node, text):
    (node / "warm.json").write_text(text)
    assert warm.recorded(node / "warm.json", key(), str(node / "ext")) is None


def test_the_record_names_each_library_by_its_sha256(node):
    """What the probe counts as the toolkit's build (dscnode.probe.recorded_ops) is the library
    whose sha256 root kept from the warm-up."""
    rec = json.loads((node / "warm.json").read_text())
    assert rec["libs"]["fused_adam"]["sha256"] == hashlib.sha256(b"\x7fELF").hexdigest()
    assert recorded_ops(str(node / "ext"), str(node / "warm.json")) == ["fused_adam"]


def test_an_answer_that_awaited_an_op_is_not_reused(node):
    ext = str(node / "ext")
    keep(node / "warm.json", key(), ext, dict(OUT, awaits=["fused_adam"]))
    assert warm.recorded(node / "warm.json", key(), ext) is None
