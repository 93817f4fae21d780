"""The DeepSpeed config: presets, merge, precision, the batch arithmetic, a user's own config file,
and the run directory's monitor sections."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from dscnode.rundir import RunDir

from .problems import is_int

BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
# What HF's Trainer fills in itself from its TrainingArguments ("auto" in its ds_config).
HF_AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto",
           "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
# DeepSpeed's monitor sections: a config with one keeps it (csv_monitor is added otherwise).
MONITORS = ("csv_monitor", "tensorboard", "wandb", "comet")
# fp16 with dynamic loss scaling, for GPUs without bf16 (compute capability below 8.0).
FP16 = {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
        "hysteresis": 2, "min_loss_scale": 1}


def batch(micro, accum, total, world):
    """train_batch = micro x accum x world: derive what is missing (0 = not given), check the rest."""
    try:
        if not all(is_int(v) for v in (micro or 0, accum or 0, total or 0, world)):
            raise ValueError("not a whole number")
        micro, accum, total, world = int(micro or 0), int(accum or 0), int(total or 0), int(world)
    except (TypeError, ValueError):
        return {"error": f"batch settings must be whole numbers (dsc_micro_batch={micro!r}, "
                         f"dsc_grad_accum={accum!r}, dsc_train_batch={total!r}). Fix: numbers, "
                         f"0 for 'derive it'."}
    where = (f"(dsc_micro_batch={micro}, dsc_grad_accum={accum}, dsc_train_batch={total}, "
             f"world size {world}; 0 means not given)")
    if world <= 0:
        return {"error": f"world size is {world}: no slots in the cluster"}
    if micro < 0 or accum < 0 or total < 0:
        return {"error": f"batch settings cannot be negative {where}. Fix: positive numbers, or 0 "
                         f"to derive one."}
    if micro and accum and total:
        if micro * accum * world != total:
            return {"error": f"batch settings disagree: {micro} x {accum} x {world} = "
                             f"{micro * accum * world}, not {total} {where}. Fix: give any two."}
    elif micro and total:
        accum, rem = divmod(total, micro * world)
        if rem or not accum:
            return {"error": f"dsc_train_batch {total} is not a multiple of micro-batch x world "
                             f"size = {micro * world} {where}. Fix: a multiple of it."}
    elif accum and total:
        micro, rem = divmod(total, accum * world)
        if rem or not micro:
            return {"error": f"dsc_train_batch {total} is not a multiple of grad-accum x world "
                             f"size = {accum * world} {where}. Fix: a multiple of it."}
    elif micro:
        accum = accum or 1
    else:
        return {"error": f"no micro-batch {where}. Fix: set dsc_micro_batch to a positive number "
                         f"(and optionally one of dsc_grad_accum, dsc_train_batch)."}
    return {"micro_batch": micro, "grad_accum": accum, "train_batch": micro * accum * world}


def presets(templates_dir):
    """{name: ds_config fragment}: every templates/ds_config/<name>.json but the base."""
    folder = Path(templates_dir) / "ds_config"
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))
            if not p.stem.startswith("_")}


def merge(base, top):
    """Deep merge: mappings merge key by key, anything else in `top` replaces."""
    out = copy.deepcopy(base)
    for key, value in (top or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def precision(accelerator, compute_caps):
    """bf16 from compute capability 8.0 (Ampere) up, fp16 with loss scaling below, fp32 on CPU."""
    if accelerator == "cpu":
        return {"bf16": {"enabled": False}, "fp16": {"enabled": False}}
    if min((float(c) for c in compute_caps), default=0.0) >= 8.0:
        return {"bf16": {"enabled": True}, "fp16": {"enabled": False}}
    return {"bf16": {"enabled": False}, "fp16": dict(FP16)}


def ds_config(templates_dir, preset, accelerator, compute_caps, sizes, overrides):
    base = json.loads((Path(templates_dir) / "ds_config" / "_base.json").read_text())
    cfg = merge(merge(base, presets(templates_dir)[preset]), precision(accelerator, compute_caps))
    cfg = merge(cfg, {"train_micro_batch_size_per_gpu": sizes["micro_batch"],
                      "gradient_accumulation_steps": sizes["grad_accum"],
                      "train_batch_size": sizes["train_batch"]})
    return merge(cfg, overrides)


def _checked_batch(cfg, world, problems, where):
    """Batch arithmetic where the config gives numbers ("auto" values are left to HF)."""
    micro, accum, total = (cfg.get(k) for k in BATCH_KEYS)
    nums = [v for v in (micro, accum, total) if isinstance(v, int) and not isinstance(v, bool)]
    if len(nums) == 3 and micro * accum * world != total:
        problems.add(f"{where}: train_batch_size {total} is not train_micro_batch_size_per_gpu "
                     f"{micro} x gradient_accumulation_steps {accum} x world size {world} = "
                     f"{micro * accum * world}. Fix: give two of them (or 'auto' for HF scripts).")


def compose_config(mode, templates_dir, preset, explicit, accelerator, caps, sizes, overrides,
                   user_config, world, problems):
    """The run's ds_config for a config mode, or None (mode none):
    preset  the preset file + precision by hardware + the batch + overrides (the toolkit's own);
    file    the user's ds_config as the base; a preset given explicitly (-e preset=...), batch
            settings given explicitly and the overrides merged on top;
    hf      like file (or the preset when no file is given) with HF's "auto" values kept: the
            Trainer fills in batch, clipping, precision and its own optimizer;
    none    the script configures DeepSpeed itself."""
    if mode == "none":
        return None
    if mode == "preset":
        return ds_config(templates_dir, preset, accelerator, caps, sizes, overrides)
    if user_config is None:  # hf without a file of the user's
        base = json.loads((Path(templates_dir) / "ds_config" / "_base.json").read_text())
        base.pop("optimizer", None)
        cfg = merge(merge(base, presets(templates_dir)[preset]), HF_AUTO)
        if cfg.get("zero_optimization", {}).get("stage") == 3:  # HF's and accelerate's save_model
            cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    else:
        cfg = copy.deepcopy(user_config)
        if "preset" in explicit:
            cfg = merge(cfg, presets(templates_dir)[preset])
    given = ("dsc_micro_batch", "dsc_grad_accum", "dsc_train_batch")
    if any(k in explicit for k in given) and "error" not in sizes:
        cfg = merge(cfg, {"train_micro_batch_size_per_gpu": sizes["micro_batch"],
                          "gradient_accumulation_steps": sizes["grad_accum"],
                          "train_batch_size": sizes["train_batch"]})
    cfg = merge(cfg, overrides)
    _checked_batch(cfg, world, problems, "dsc_ds_config_file" if user_config is not None else "ds_config")
    return cfg


def read_user_config(path, problems):
    """The user's ds_config.json on the control node, or None with a problem."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as e:
        problems.add(f"dsc_ds_config_file is {path!r}: {e.strerror}. Fix: the path of your "
                     f"ds_config.json on the control node.")
        return None
    except ValueError as e:
        problems.add(f"dsc_ds_config_file {path!r} is not JSON ({e}). Fix: a DeepSpeed config "
                     f"as JSON (DeepSpeed's own format, not HJSON or YAML).")
        return None
    if not isinstance(cfg, dict):
        problems.add(f"dsc_ds_config_file {path!r} holds a {type(cfg).__name__}, not a JSON "
                     f"object. Fix: a DeepSpeed config such as {{\"zero_optimization\": ...}}.")
        return None
    return cfg


def run_sections(config, run_dir, tensorboard, node_local=True):
    """What the toolkit adds to a run's ds_config, whatever its mode: DeepSpeed's csv monitor
    (lr, samples) unless the config has a monitor of its own, TensorBoard when asked (event files
    in the run directory, fetched by logs.yml), and node-local checkpoint storage unless the config
    says otherwise (run directories are per node: each node's local rank 0 saves the shared
    state), or `node_local` is false (dsc_checkpoint_shared_dir: global rank 0 saves it once)."""
    if not any(k in config for k in MONITORS):
        config["csv_monitor"] = {"enabled": True, "output_path": f"{run_dir}/{RunDir.MONITOR}/", "job_name": "ds"}
    if tensorboard:
        config["tensorboard"] = {"enabled": True, "output_path": f"{run_dir}/{RunDir.TENSORBOARD}/", "job_name": "ds"}
    if "use_node_local_storage" not in config.get("checkpoint", {}):
        config["checkpoint"] = dict(config.get("checkpoint", {}), use_node_local_storage=node_local)
