"""Every preset's ds_config, as the plan renders it for CPU and for GPUs of each precision, through
DeepSpeed's own config classes (the train venv's DeepSpeed, as launch.yml's check runs them on the
master; no container). The container tier keeps one dry-run launch, for the files it writes on
the nodes (molecule/tests/test_launch.py)."""
import json
import os
import subprocess
from pathlib import Path

import pytest

import dscplan

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("DSC_TRAIN_VENV", ROOT / ".cache" / "train-venv"))

pytestmark = pytest.mark.skipif(not (VENV / "bin" / "deepspeed").exists(),
                                reason=f"no train venv at {VENV} (scripts/test.sh builds it)")
TEMPLATES = ROOT / "templates"
# What launch.yml's check runs, over a list of configs: one line per config, "ok" or the error.
CHECK = """
import json, sys
from deepspeed.runtime.config import DeepSpeedConfig
for cfg in json.load(sys.stdin):
    cfg.pop("train_batch_size", None)
    try:
        DeepSpeedConfig(cfg)
        print("ok")
    except Exception as e:
        print(" ".join(f"{type(e).__name__}: {e}".split())[:800])
"""


def test_every_preset_renders_a_config_deepspeed_accepts():
    sizes = {"micro_batch": 4, "grad_accum": 2, "train_batch": 16}
    cases = [(preset, accel, caps) for preset in dscplan.presets(TEMPLATES)
             for accel, caps in (("cpu", []), ("cuda", ["9.0"]), ("cuda", ["7.0"]))]
    assert {c[0] for c in cases} >= {"zero0", "zero1", "zero2", "zero2-offload", "zero3", "zero3-offload"}
    configs = [dscplan.ds_config(TEMPLATES, *case, sizes, {}) for case in cases]
    for (preset, _accel, caps), cfg in zip(cases, configs, strict=True):
        assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 2
        assert cfg["zero_optimization"]["stage"] == int(preset[4]), preset
        assert ("offload_optimizer" in cfg["zero_optimization"]) == preset.endswith("offload"), preset
        assert cfg["bf16"]["enabled"] == (caps == ["9.0"]) and cfg["fp16"]["enabled"] == (caps == ["7.0"]), (preset, caps)
    r = subprocess.run([str(VENV / "bin" / "python"), "-c", CHECK], input=json.dumps(configs), text=True,
                       capture_output=True, timeout=300, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert r.returncode == 0, r.stderr[-3000:]
    verdicts = r.stdout.splitlines()[-len(cases):]
    assert verdicts == ["ok"] * len(cases), list(zip(cases, verdicts, strict=False))  # fewer verdicts where the check failed
