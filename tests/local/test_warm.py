"""Provision's warm-up (dscnode.warm, the node helper's `warm`) with the train venv's torch,
DeepSpeed and ninja, on real op builds: a node that is not its kind's source leaves an op it would
have to build for the source to ship ("awaits"), and loads a shipped copy without building it.

    .venv/bin/pytest tests/local/test_warm.py -v
"""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dscnode.warm import op_state
from tests.local.test_train import JIT_CACHE as RANKS_CACHE  # the JIT cache test_train's ranks build into

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("DSC_TRAIN_VENV", ROOT / ".cache" / "train-venv"))

pytestmark = pytest.mark.skipif(not (VENV / "bin" / "deepspeed").exists(),
                                reason=f"no train venv at {VENV} (scripts/test.sh builds it)")


def warm(ext_dir, *args, ops="ShareMemCommBuilder"):
    # PATH: the venv's bin first already (venv_ninja, autouse), as a node's env runs the warm-up
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT / "node"))
    r = subprocess.run([str(VENV / "bin" / "python"), "-m", "dscnode", "warm", f"--ops={ops}",
                        f"--report={ext_dir}/ds_report.txt", "--gpus=0", *args],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.fixture(autouse=True)
def venv_ninja(monkeypatch):
    monkeypatch.setenv("PATH", f"{VENV / 'bin'}:{os.environ['PATH']}")  # op_state's ninja: the venv's


def ranks_build(folder, op):
    """Whether test_train's ranks left `op` built, fresh: then copied into `folder` (no build here)."""
    if (RANKS_CACHE / op).is_dir() and op_state(str(RANKS_CACHE), op) == "fresh":
        shutil.copytree(RANKS_CACHE / op, folder / op, ignore=shutil.ignore_patterns("lock"))
        return True
    return False


def test_a_shipped_op_loads_without_a_build_and_a_missing_one_is_awaited(tmp_path):
    op = "deepspeed_shm_comm"
    source = tmp_path / "source"
    if not ranks_build(source, op):  # the kind's source builds it
        out = warm(source, "--build")
        assert out["built"] == [op] and out["awaits"] == [] and out["ops"] == [op]
    assert op_state(str(source), op) == "fresh"

    # A node that is not its kind's source, with one op shipped (as tar keeps it: files and their
    # times) and one it lacks: the shipped one loaded, not built (its library unchanged); the
    # other left for the shipment, nothing built.
    shutil.copytree(source / op, tmp_path / "node" / op)
    before = (tmp_path / "node" / op / f"{op}.so").stat().st_mtime_ns
    out = warm(tmp_path / "node", ops="ShareMemCommBuilder,FusedAdamBuilder")
    assert out["ops"] == [op, "fused_adam"] and out["awaits"] == ["fused_adam"] and out["built"] == []
    assert (tmp_path / "node" / op / f"{op}.so").stat().st_mtime_ns == before
    assert not (tmp_path / "node" / "fused_adam").exists()
    assert out["versions"]["deepspeed"] and out["torch_probe"]["gpus"] == 0 and out["report_current"] is False

    # What ninja would rebuild (here an object file gone) is not fresh: like a missing op, awaited.
    next((tmp_path / "node" / op).glob("*.o")).unlink()
    assert op_state(str(tmp_path / "node"), op) == "stale"
    assert op_state(str(tmp_path / "none"), op) == "missing"


def test_a_complete_answer_is_recorded_and_reused(tmp_path):
    """The record a complete warm-up gives (root keeps it: roles/deepspeed), read back with
    --record, answers the next one, unchanged (no torch imported: dscnode.warm.recorded; what
    voids it: tests/unit/test_node_warm.py). The warm-up never writes it itself."""
    op = "deepspeed_shm_comm"
    ranks_build(tmp_path, op)  # or built by the first warm-up
    first = warm(tmp_path, "--build", f"--record={tmp_path}/warm.json")
    assert first["recorded"] is False and first["ops"] == [op] and not (tmp_path / "warm.json").exists()
    assert set(first["record"]["libs"][op]) == {"mtime", "sha256"}
    (tmp_path / "warm.json").write_text(json.dumps(first["record"]))
    second = warm(tmp_path, "--build", f"--record={tmp_path}/warm.json")
    assert second == dict(first, built=[], recorded=True, record=None)
