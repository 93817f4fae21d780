"""Per-GPU memory prediction for the plan (control node): train/memory.py, loaded by its path.

The formula lives in one place, train/memory.py, because train/ is what runs on the nodes (a copy
of train/ travels with every run) and train/run.py prints the same prediction there. This module
loads that file under a private name (no sys.path change, no torch, no DeepSpeed) and re-exports
it, so that `import dsc_memory` works wherever `import dsc_plan` does:

    shape = dsc_memory.model_shape(layers=24, hidden=2048, heads=16, vocab=50304, seq_len=2048)
    dsc_memory.predict(shape, "zero2", micro_batch=8, world=1, gpus_per_node=1)["total"]

See train/memory.py for the parts and docs/memory.md for the measured check.
"""
from __future__ import annotations

import importlib.util
import os
import sys

_NAME = "dsc_train_memory"
_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "train", "memory.py")


def _load_file(name, path):
    """A file of train/ as a module under a private name (loaded once)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.normpath(path))
        if spec is None or spec.loader is None:
            raise ImportError(f"dsc_memory: cannot load {os.path.normpath(path)}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def train_shape(train_config: dict) -> tuple[dict, bool]:
    """(shape, activation checkpointing) of train.run's model for a dsc_train_config (its
    defaults for what is not given; train/config.py, loaded by its path). ValueError names an
    unknown key or size."""
    config = _load_file("dsc_train_config", os.path.join(os.path.dirname(_PATH), "config.py"))
    known = {f.name for f in config.fields(config.Config)}
    unknown = sorted(set(train_config) - known)
    if unknown:
        raise ValueError(f"unknown dsc_train_config keys {unknown}")
    cfg = config.Config(**train_config)
    if cfg.size not in config.SIZES:
        raise ValueError(f"dsc_train_config size {cfg.size!r} is not one of {', '.join(config.SIZES)}")
    return _memory.shape_from_config(cfg), bool(cfg.activation_checkpointing)


_memory = _load_file(_NAME, _PATH)
GiB = _memory.GiB
OVERHEAD_BYTES = _memory.OVERHEAD_BYTES
model_shape = _memory.model_shape
shape_from_config = _memory.shape_from_config
ds_zero2_estimate = _memory.ds_zero2_estimate
ds_zero3_estimate = _memory.ds_zero3_estimate
model_states = _memory.model_states
zero_settings = _memory.zero_settings
activation_bytes = _memory.activation_bytes
logits_bytes = _memory.logits_bytes
predict = _memory.predict

__all__ = ["train_shape", "GiB", "OVERHEAD_BYTES", "model_shape", "shape_from_config", "ds_zero2_estimate",
           "ds_zero3_estimate", "model_states", "zero_settings", "activation_bytes", "logits_bytes",
           "predict"]
