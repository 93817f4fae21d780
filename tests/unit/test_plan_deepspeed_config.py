"""The DeepSpeed config the plan writes (dscplan.deepspeed_config): precision, the batch arithmetic,
presets as files, a user's own config (file, hf and none modes), the monitor, checkpoint and
TensorBoard sections.

    .venv/bin/pytest tests/unit/test_plan_deepspeed_config.py -q
"""
import json

import pytest

import dscplan
from tests.unit.plan_helpers import ROOT, PATHS, plan


@pytest.mark.parametrize("caps,expect", [(["7.0"], "fp16"), (["8.0", "9.0"], "bf16"), ([], "fp32")])
def test_precision_follows_the_oldest_gpu(caps, expect):
    cfg = dscplan.precision("cuda" if caps else "cpu", caps)
    on = [k for k in ("bf16", "fp16") if cfg[k]["enabled"]]
    assert on == ([] if expect == "fp32" else [expect])


@pytest.mark.parametrize("micro,accum,total,world,expect", [
    (2, 0, 0, 4, (2, 1, 8)),
    (2, 4, 0, 4, (2, 4, 32)),
    (2, 0, 32, 4, (2, 4, 32)),
    (0, 4, 32, 4, (2, 4, 32)),
    (2, 4, 32, 4, (2, 4, 32)),
])
def test_batch_arithmetic_derives_the_missing_value(micro, accum, total, world, expect):
    b = dscplan.batch(micro, accum, total, world)
    assert (b["micro_batch"], b["grad_accum"], b["train_batch"]) == expect


@pytest.mark.parametrize("micro,accum,total,world,needle", [
    (2, 4, 30, 4, "batch settings disagree: 2 x 4 x 4 = 32, not 30"),
    (3, 0, 32, 4, "dsc_train_batch 32 is not a multiple of micro-batch x world size = 12"),
    (0, 3, 32, 4, "dsc_train_batch 32 is not a multiple of grad-accum x world size = 12"),
    (0, 0, 0, 4, "no micro-batch"),
    (-1, 0, 0, 4, "cannot be negative"),
    ("x", 0, 0, 4, "whole numbers"),
])
def test_inconsistent_batch_settings_name_the_fix(micro, accum, total, world, needle):
    b = dscplan.batch(micro, accum, total, world)
    assert needle in b["error"] and "Fix" in b["error"]


def test_every_preset_file_merges_into_a_complete_config():
    sizes = {"micro_batch": 1, "grad_accum": 1, "train_batch": 2}
    for name in dscplan.presets(PATHS["templates"]):
        cfg = dscplan.ds_config(PATHS["templates"], name, "cpu", [], sizes, {})
        assert "zero_optimization" in cfg and cfg["train_batch_size"] == 2, name


def test_a_preset_added_as_a_file_is_offered(tmp_path):
    (tmp_path / "ds_config").mkdir()
    for f in (ROOT / "templates" / "ds_config").glob("*.json"):
        (tmp_path / "ds_config" / f.name).write_text(f.read_text())
    (tmp_path / "ds_config" / "mine.json").write_text('{"zero_optimization": {"stage": 1}}')
    assert "mine" in dscplan.presets(tmp_path)


USER_CONFIG = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
               "fp16": {"enabled": True}, "zero_optimization": {"stage": 0}}


def user_file(tmp_path, cfg=USER_CONFIG):
    path = tmp_path / "ds_config.json"
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(path)


def test_file_mode_keeps_the_users_config(tmp_path):
    p, errors = plan(options={"dsc_ds_config_mode": "file", "dsc_ds_config_file": user_file(tmp_path)},
                     full_run=True)
    assert errors == []
    cfg = json.loads(p["run"]["files"]["ds_config.json"])
    # DeepSpeed's csv monitor is added (the user's config has none), and checkpoints are
    # node-local (run directories are per node); nothing else of the toolkit's
    assert cfg.pop("csv_monitor") == {"enabled": True, "job_name": "ds",
                                      "output_path": f"{p['run']['dir']}/monitor/"}
    assert cfg.pop("checkpoint") == {"use_node_local_storage": True}
    assert cfg == USER_CONFIG  # no preset, batch or optimizer of the toolkit's slipped in
    assert "--deepspeed_config" in p["run"]["commands"]["node1"]


def test_file_mode_merges_an_explicit_preset_and_overrides_on_top(tmp_path):
    p, errors = plan(options={"dsc_ds_config_mode": "file", "dsc_ds_config_file": user_file(tmp_path),
                              "preset": "zero2", "dsc_ds_config_overrides": {"gradient_clipping": 0.5}},
                     full_run=True)
    cfg = json.loads(p["run"]["files"]["ds_config.json"])
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["scheduler"]["type"] == "WarmupLR"
    assert cfg["gradient_clipping"] == 0.5 and cfg["optimizer"]["params"]["lr"] == 1e-3


@pytest.mark.parametrize("content,needle", [
    ("{not json", "is not JSON"),
    ("[1, 2]", "holds a list, not a JSON object"),
    (dict(USER_CONFIG, train_batch_size=16), "train_batch_size 16 is not train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x world size 4 = 32"),
])
def test_a_bad_user_config_is_refused(tmp_path, content, needle):
    p, errors = plan(options={"dsc_ds_config_mode": "file", "dsc_ds_config_file": user_file(tmp_path, content)},
                     full_run=True)
    assert p is None and any(needle in e and "Fix:" in e for e in errors), errors


def test_missing_user_config_and_unknown_mode_are_refused(tmp_path):
    p, errors = plan(options={"dsc_ds_config_mode": "file", "dsc_ds_config_file": str(tmp_path / "nope.json")},
                     full_run=True)
    assert any("dsc_ds_config_file is" in e and "No such file" in e for e in errors)
    p, errors = plan(options={"dsc_ds_config_mode": "yaml"}, full_run=True)
    assert any("dsc_ds_config_mode is 'yaml'" in e for e in errors)


def test_hf_mode_keeps_auto_values_and_passes_deepspeed(tmp_path):
    p, errors = plan(options={"dsc_ds_config_mode": "hf", "preset": "zero3"}, full_run=True)
    assert errors == []
    cfg = json.loads(p["run"]["files"]["ds_config.json"])
    assert cfg["train_batch_size"] == "auto" and cfg["bf16"] == {"enabled": "auto"}
    assert "optimizer" not in cfg and cfg["zero_optimization"]["stage"] == 3
    cmd = p["run"]["commands"]["node1"]
    assert cmd[cmd.index("--deepspeed") + 1] == f"{p['run']['dir']}/ds_config.json"
    assert "--deepspeed_config" not in cmd


def test_hf_mode_checks_numbers_the_users_file_gives(tmp_path):
    auto = dict(USER_CONFIG, train_batch_size="auto", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps="auto")
    p, errors = plan(options={"dsc_ds_config_mode": "hf", "dsc_ds_config_file": user_file(tmp_path, auto)},
                     full_run=True)
    assert errors == [] and json.loads(p["run"]["files"]["ds_config.json"])["train_batch_size"] == "auto"


def test_none_mode_passes_no_config_and_resume_args_are_a_setting():
    p, errors = plan(options={"dsc_ds_config_mode": "none", "dsc_resume_args": []}, full_run=True)
    assert errors == [] and "ds_config.json" not in p["run"]["files"]
    cmd = p["run"]["commands"]["node1"]
    assert not any(a.startswith("--deepspeed") for a in cmd)
    args = p["run"]["start_args"]["node1"]
    assert args[args.index("--resume-args") + 1] == "[]"


def test_a_users_own_monitor_and_checkpoint_storage_are_kept(tmp_path):
    cfg = dict(USER_CONFIG, tensorboard={"enabled": True, "output_path": "/tmp/tb"})
    p, errors = plan(options={"dsc_ds_config_mode": "file", "dsc_ds_config_file": user_file(tmp_path, cfg)},
                     full_run=True)
    assert errors == []
    out = json.loads(p["run"]["files"]["ds_config.json"])
    assert "csv_monitor" not in out and out["tensorboard"]["output_path"] == "/tmp/tb"
    cfg = dict(USER_CONFIG, checkpoint={"use_node_local_storage": False})  # a shared filesystem
    p, errors = plan(options={"dsc_ds_config_mode": "file", "dsc_ds_config_file": user_file(tmp_path, cfg)},
                     full_run=True)
    assert json.loads(p["run"]["files"]["ds_config.json"])["checkpoint"] == {"use_node_local_storage": False}
    assert "ds_config.json" not in plan(options={"dsc_ds_config_mode": "none"}, full_run=True)[0]["run"]["files"]


def test_tensorboard_is_one_setting_and_needs_a_config_the_toolkit_writes():
    p, errors = plan(options={"dsc_tensorboard": True}, full_run=True)
    assert errors == []
    cfg = json.loads(p["run"]["files"]["ds_config.json"])
    assert cfg["tensorboard"] == {"enabled": True, "job_name": "ds", "output_path": f"{p['run']['dir']}/tensorboard/"}
    assert cfg["csv_monitor"]["enabled"]  # DeepSpeed's csv monitor beside it (status reads neither)
    p, errors = plan(options={"dsc_tensorboard": True, "dsc_ds_config_mode": "none"}, full_run=True)
    assert any("dsc_tensorboard is true but dsc_ds_config_mode is 'none'" in e for e in errors), errors
