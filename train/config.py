"""Typed run configuration: defaults in one place, a JSON file, then `--set key=value` overrides.

An unknown key or a value of the wrong type is an error that names the key, never ignored.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

# name: (layers, model dim, heads). "gpt-1.3b" is the 1.42 B reference shape (24 x 2048, 16 heads).
SIZES = {
    "tiny": (2, 64, 4),
    "small": (4, 256, 4),
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "1.3b": (24, 2048, 16),
    "8b": (40, 4096, 32),  # 8.47 B: on one 141 GB H200 only with the optimizer on the CPU
    "bert-large": (24, 1024, 16),
}
MODELS = ("gpt", "bert")
DATA = ("synthetic", "text", "array")
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
# Byte-level tokens 0-255 plus [MASK] and [PAD] for the text path.
BYTE_VOCAB = 258


class ConfigError(ValueError):
    """A bad configuration: the message names the key and what is allowed."""


@dataclass
class Config:
    model: str = "gpt"                 # gpt | bert
    size: str = "tiny"                 # a key of SIZES
    vocab_size: int = 0                # 0: 50304 (gpt) / 30522 (bert) for synthetic, 258 for text
    seq_len: int = 128
    data: str = "synthetic"            # synthetic | text | array
    data_path: str = ""                # text file or directory (text), .npy of token ids (array)
    steps: int = 20                    # optimizer steps in total (a resumed run counts on)
    lr: float = 3e-4                   # peak learning rate: run.py sets every param group to its warmup+cosine
                                       # schedule each step, overriding any lr in ds_config's optimizer
    warmup_steps: int = 2
    min_lr_ratio: float = 0.1          # cosine decay floor, as a fraction of lr
    weight_decay: float = 0.01
    seed: int = 1234
    precision: str = "auto"            # auto: ds_config's choice, else bf16 where supported
    activation_checkpointing: bool = False
    compile: bool = False              # torch.compile the blocks
    mask_prob: float = 0.15            # bert: fraction of tokens masked
    log_every: int = 1
    save_every: int = 0                # checkpoint every N steps (0: only at the end)
    save_final: bool = True
    keep_checkpoints: int = 3          # complete checkpoints kept on each node; older ones are removed
                                       # once a newer one is complete (train/checkpoints.py)
    stop_at: int = 0                   # end after this step without a final checkpoint (0: off)
    min_step_s: float = 0.0            # each step lasts at least this long, the rest slept (0: off): a
                                       # long run kept for watching, stop, resume and fault drills
                                       # without using a CPU or GPU it does not need
    run_dir: str = ""                  # where metrics and checkpoints go (default: $DSC_RUN_DIR or cwd)
    checkpoint_dir: str = ""           # default: <run_dir>/checkpoints
    timeout_min: int = 30              # process-group timeout (DEEPSPEED_TIMEOUT overrides)
    estimate_memory: bool = True       # log DeepSpeed's memory estimate before training
    extra: dict = field(default_factory=dict)  # free-form, kept in checkpoints

    def layers_dim_heads(self):
        return SIZES[self.size]

    def effective_vocab(self):
        if self.vocab_size:
            return self.vocab_size
        if self.data == "text":
            return BYTE_VOCAB
        return 50304 if self.model == "gpt" else 30522

    def validate(self):
        def choose(key, allowed):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"config key '{key}' is {getattr(self, key)!r}; allowed: {', '.join(allowed)}")
        choose("model", MODELS)
        choose("size", tuple(SIZES))
        choose("data", DATA)
        choose("precision", PRECISIONS)
        for key in ("seq_len", "steps", "log_every", "keep_checkpoints"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"config key '{key}' must be positive, got {getattr(self, key)}")
        if self.data in ("text", "array") and not self.data_path:
            raise ConfigError(f"config key 'data_path' is required for data={self.data!r}")
        if self.data_path and not os.path.exists(self.data_path):
            raise ConfigError(f"config key 'data_path': {self.data_path} does not exist")
        if self.data == "text" and self.effective_vocab() < BYTE_VOCAB:
            raise ConfigError(f"config key 'vocab_size' must be at least {BYTE_VOCAB} for byte-level text")
        if self.min_step_s < 0:
            raise ConfigError(f"config key 'min_step_s' must be 0 or more, got {self.min_step_s}")
        if not 0.0 < self.mask_prob < 1.0:
            raise ConfigError(f"config key 'mask_prob' must be in (0, 1), got {self.mask_prob}")
        return self

    def to_dict(self):
        return dataclasses.asdict(self)


_TYPES = {f.name: f.type for f in fields(Config)}


def _coerce(key: str, value: Any, from_text: bool) -> Any:
    if key not in _TYPES:
        raise ConfigError(f"unknown config key '{key}'; known keys: {', '.join(sorted(_TYPES))}")
    kind = _TYPES[key]
    if from_text:
        if kind == "str":
            return value
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(f"config key '{key}' expects {kind}, got {value!r}") from None
    ok = {
        "str": lambda v: isinstance(v, str),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "dict": lambda v: isinstance(v, dict),
    }[kind](value)
    if not ok:
        raise ConfigError(f"config key '{key}' expects {kind}, got {value!r} ({type(value).__name__})")
    return float(value) if kind == "float" else value


def load_config(path: str | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> Config:
    """Defaults, then `base` (e.g. a checkpoint's config), then the file, then key=value overrides."""
    values: dict[str, Any] = {}
    for source in (base or {}), (_read(path) if path else {}):
        for key, value in source.items():
            values[key] = _coerce(key, value, from_text=False)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        values[key] = _coerce(key, text, from_text=True)
    return Config(**values).validate()


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object")
    return data
