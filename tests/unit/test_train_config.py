"""Unit tests for train/config.py: defaults, JSON file, --set overrides, coercion, validation, derived values.

Pure Python (no torch): train/__init__.py is empty and train/config.py imports only the stdlib.
"""
import dataclasses
import json
import math

import pytest

from train.config import (BYTE_VOCAB, DATA, MODELS, PRECISIONS, SIZES, Config, ConfigError,
                          load_config)


def write_json(tmp_path, data, name="train.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def error_of(*args, **kwargs):
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


# --- defaults ---------------------------------------------------------------------------------

def test_defaults_load_without_file_or_overrides():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg == Config()
    assert (cfg.model, cfg.size, cfg.data, cfg.precision) == ("gpt", "tiny", "synthetic", "auto")
    assert (cfg.seq_len, cfg.steps, cfg.warmup_steps, cfg.log_every) == (128, 20, 2, 1)
    assert cfg.lr == 3e-4 and cfg.min_lr_ratio == 0.1 and cfg.mask_prob == 0.15
    assert cfg.save_final is True and cfg.estimate_memory is True and cfg.compile is False
    assert cfg.extra == {}


def test_none_and_empty_arguments_equal_defaults():
    assert load_config(None, None, None) == load_config("", [], {}) == Config()


def test_default_extra_dict_is_not_shared():
    a, b = Config(), Config()
    a.extra["k"] = 1
    assert b.extra == {}


def test_default_config_validates():
    assert Config().validate() == Config()


def test_to_dict_round_trips_every_field():
    cfg = load_config(overrides=["size=small", "extra={\"note\": \"x\"}"])
    d = cfg.to_dict()
    assert set(d) == {f.name for f in dataclasses.fields(Config)}
    assert d["size"] == "small" and d["extra"] == {"note": "x"}
    assert Config(**d) == cfg


# --- JSON file ----------------------------------------------------------------------------------

def test_json_file_values_are_loaded(tmp_path):
    path = write_json(tmp_path, {"model": "bert", "size": "small", "seq_len": 64, "lr": 1e-3,
                                 "compile": True, "extra": {"run": "a"}})
    cfg = load_config(path)
    assert (cfg.model, cfg.size, cfg.seq_len, cfg.lr, cfg.compile) == ("bert", "small", 64, 1e-3, True)
    assert cfg.extra == {"run": "a"}
    assert cfg.steps == 20  # untouched keys keep their defaults


def test_json_int_for_float_key_becomes_float(tmp_path):
    cfg = load_config(write_json(tmp_path, {"lr": 1, "weight_decay": 0}))
    assert cfg.lr == 1.0 and type(cfg.lr) is float
    assert type(cfg.weight_decay) is float


def test_missing_file_is_a_config_error(tmp_path):
    missing = str(tmp_path / "nope.json")
    msg = error_of(missing)
    assert missing in msg and "does not exist" in msg


def test_invalid_json_is_a_config_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{seq_len: 5")
    msg = error_of(str(path))
    assert str(path) in msg and "not valid JSON" in msg


@pytest.mark.parametrize("payload", [[1, 2], "text", 3, None])
def test_json_file_must_hold_an_object(tmp_path, payload):
    msg = error_of(write_json(tmp_path, payload))
    assert "must hold a JSON object" in msg


def test_unknown_key_in_file_names_the_key(tmp_path):
    msg = error_of(write_json(tmp_path, {"seqlen": 64}))
    assert "unknown config key 'seqlen'" in msg
    assert "seq_len" in msg  # the known keys are listed


@pytest.mark.parametrize("key,value,kind", [
    ("seq_len", "64", "int"),
    ("seq_len", 64.0, "int"),
    ("seq_len", True, "int"),
    ("lr", "1e-3", "float"),
    ("lr", False, "float"),
    ("compile", 1, "bool"),
    ("compile", "true", "bool"),
    ("model", 1, "str"),
    ("extra", [1], "dict"),
])
def test_wrong_type_in_file_names_the_key(tmp_path, key, value, kind):
    msg = error_of(write_json(tmp_path, {key: value}))
    assert f"config key '{key}' expects {kind}" in msg


# --- precedence ---------------------------------------------------------------------------------

def test_set_overrides_win_over_file(tmp_path):
    path = write_json(tmp_path, {"seq_len": 64, "size": "small", "lr": 1e-3})
    cfg = load_config(path, ["seq_len=32", "lr=5e-4"])
    assert cfg.seq_len == 32 and cfg.lr == 5e-4
    assert cfg.size == "small"  # file value kept where not overridden


def test_base_then_file_then_overrides(tmp_path):
    base = {"seq_len": 16, "steps": 5, "size": "small", "seed": 7}
    path = write_json(tmp_path, {"steps": 50, "seed": 8})
    cfg = load_config(path, ["seed=9"], base=base)
    assert (cfg.seq_len, cfg.size) == (16, "small")  # from base only
    assert cfg.steps == 50                             # file beats base
    assert cfg.seed == 9                               # override beats file


def test_base_values_are_checked_like_file_values():
    assert "unknown config key 'bogus'" in error_of(base={"bogus": 1})
    assert "config key 'steps' expects int" in error_of(base={"steps": "5"})


def test_last_override_of_a_key_wins():
    assert load_config(overrides=["steps=3", "steps=4"]).steps == 4


# --- --set coercion -----------------------------------------------------------------------------

def test_set_int():
    cfg = load_config(overrides=["seq_len=256", "seed=0"])
    assert cfg.seq_len == 256 and type(cfg.seq_len) is int and cfg.seed == 0


@pytest.mark.parametrize("text,expected", [("1e-3", 1e-3), ("0.5", 0.5), ("2", 2.0), ("-1.5", -1.5)])
def test_set_float(text, expected):
    cfg = load_config(overrides=[f"lr={text}"])
    assert cfg.lr == expected and type(cfg.lr) is float


@pytest.mark.parametrize("text,expected", [("true", True), ("false", False)])
def test_set_bool(text, expected):
    cfg = load_config(overrides=[f"compile={text}", f"save_final={text}"])
    assert cfg.compile is expected and cfg.save_final is expected


def test_set_str_is_taken_verbatim_not_json_decoded():
    cfg = load_config(overrides=["size=125m", "run_dir=123", "checkpoint_dir=\"q\"", "precision=bf16"])
    assert cfg.size == "125m"
    assert cfg.run_dir == "123"           # would be int 123 if JSON-decoded
    assert cfg.checkpoint_dir == '"q"'    # quotes kept
    assert cfg.precision == "bf16"


def test_set_splits_on_first_equals_only():
    cfg = load_config(overrides=["run_dir=/tmp/a=b"])
    assert cfg.run_dir == "/tmp/a=b"


def test_set_dict():
    cfg = load_config(overrides=['extra={"tag": "exp1", "n": 2}'])
    assert cfg.extra == {"tag": "exp1", "n": 2}


def test_set_key_with_spaces_is_accepted():
    assert load_config(overrides=["steps =7"]).steps == 7


@pytest.mark.parametrize("item,key,kind", [
    ("seq_len=abc", "seq_len", "int"),
    ("seq_len=1.5", "seq_len", "int"),
    ("seq_len=1e3", "seq_len", "int"),
    ("seq_len=true", "seq_len", "int"),
    ("seq_len=", "seq_len", "int"),
    ("lr=fast", "lr", "float"),
    ("lr=true", "lr", "float"),
    ("lr=\"0.1\"", "lr", "float"),
    ("compile=True", "compile", "bool"),   # JSON spelling only: True/yes/1 are rejected
    ("compile=yes", "compile", "bool"),
    ("compile=1", "compile", "bool"),
    ("extra=[1,2]", "extra", "dict"),
    ("extra=x", "extra", "dict"),
])
def test_set_wrong_type_names_the_key(item, key, kind):
    msg = error_of(overrides=[item])
    assert f"config key '{key}' expects {kind}" in msg


def test_set_unknown_key_names_the_key():
    msg = error_of(overrides=["learning_rate=0.1"])
    assert "unknown config key 'learning_rate'" in msg
    assert "lr" in msg.split("known keys:")[1]


def test_set_without_equals_is_an_error():
    msg = error_of(overrides=["steps"])
    assert "'steps'" in msg and "not key=value" in msg


# --- validation: choices ------------------------------------------------------------------------

@pytest.mark.parametrize("key,bad,allowed", [
    ("model", "llama", MODELS),
    ("size", "7b", tuple(SIZES)),
    ("data", "web", DATA),
    ("precision", "fp8", PRECISIONS),
])
def test_bad_choice_names_key_and_allowed_values(key, bad, allowed):
    msg = error_of(overrides=[f"{key}={bad}"])
    assert f"config key '{key}' is '{bad}'" in msg
    for choice in allowed:
        assert choice in msg


def test_choices_are_case_sensitive():
    assert "config key 'model'" in error_of(overrides=["model=GPT"])


@pytest.mark.parametrize("key,value", [
    ("model", "bert"), ("size", "bert-large"), ("size", "1.3b"), ("precision", "fp32"),
    ("precision", "fp16"),
])
def test_every_allowed_choice_loads(key, value):
    assert getattr(load_config(overrides=[f"{key}={value}"]), key) == value


def test_bad_choice_in_file_is_rejected_too(tmp_path):
    assert "config key 'size'" in error_of(write_json(tmp_path, {"size": "huge"}))


# --- validation: ranges -------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["seq_len", "steps", "log_every"])
@pytest.mark.parametrize("value", [0, -1])
def test_must_be_positive(key, value):
    msg = error_of(overrides=[f"{key}={value}"])
    assert f"config key '{key}' must be positive, got {value}" in msg


@pytest.mark.parametrize("key", ["seq_len", "steps", "log_every"])
def test_one_is_positive(key):
    assert getattr(load_config(overrides=[f"{key}=1"]), key) == 1


@pytest.mark.parametrize("value", [0, 1, -0.1, 1.5])
def test_mask_prob_must_be_strictly_between_0_and_1(value):
    msg = error_of(overrides=[f"mask_prob={value}"])
    assert "config key 'mask_prob' must be in (0, 1)" in msg


def test_mask_prob_inside_range_loads():
    assert load_config(overrides=["mask_prob=0.999"]).mask_prob == 0.999


def test_mask_prob_is_checked_for_gpt_too():
    # mask_prob only matters for bert, but validate() checks it whatever the model.
    assert "mask_prob" in error_of(overrides=["model=gpt", "mask_prob=0"])


@pytest.mark.parametrize("data", ["text", "array"])
def test_data_path_required_for_file_data(data):
    msg = error_of(overrides=[f"data={data}"])
    assert "config key 'data_path' is required" in msg and repr(data) in msg


def test_data_path_must_exist(tmp_path):
    missing = tmp_path / "corpus.txt"
    msg = error_of(overrides=["data=text", f"data_path={missing}"])
    assert "config key 'data_path'" in msg and str(missing) in msg and "does not exist" in msg


def test_data_path_existence_checked_even_for_synthetic(tmp_path):
    msg = error_of(overrides=[f"data_path={tmp_path / 'gone.npy'}"])
    assert "config key 'data_path'" in msg


def test_text_data_with_existing_file_loads(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello")
    cfg = load_config(overrides=["data=text", f"data_path={corpus}"])
    assert cfg.data == "text" and cfg.data_path == str(corpus)


def test_array_data_accepts_a_directory_or_file(tmp_path):
    cfg = load_config(overrides=["data=array", f"data_path={tmp_path}"])
    assert cfg.data_path == str(tmp_path)


@pytest.mark.parametrize("vocab", [1, 100, BYTE_VOCAB - 1])
def test_text_vocab_must_cover_bytes(tmp_path, vocab):
    corpus = tmp_path / "c.txt"
    corpus.write_text("x")
    msg = error_of(overrides=["data=text", f"data_path={corpus}", f"vocab_size={vocab}"])
    assert "config key 'vocab_size' must be at least 258" in msg


def test_text_vocab_of_exactly_byte_vocab_loads(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("x")
    cfg = load_config(overrides=["data=text", f"data_path={corpus}", f"vocab_size={BYTE_VOCAB}"])
    assert cfg.effective_vocab() == BYTE_VOCAB


def test_first_failing_check_is_reported():
    # model is checked before size: the message names the first bad key.
    msg = error_of(overrides=["model=x", "size=y"])
    assert "'model'" in msg and "'size'" not in msg


# --- derived values -----------------------------------------------------------------------------

def test_byte_vocab_constant():
    assert BYTE_VOCAB == 256 + 2


@pytest.mark.parametrize("model,data,expected", [
    ("gpt", "synthetic", 50304),
    ("bert", "synthetic", 30522),
    ("gpt", "array", 50304),
    ("bert", "array", 30522),
    ("gpt", "text", BYTE_VOCAB),
    ("bert", "text", BYTE_VOCAB),
])
def test_effective_vocab_defaults(model, data, expected):
    assert Config(model=model, data=data).effective_vocab() == expected


@pytest.mark.parametrize("data", ["synthetic", "text", "array"])
def test_explicit_vocab_size_wins(data):
    assert Config(data=data, vocab_size=1000).effective_vocab() == 1000


def test_gpt_default_vocab_is_padded_to_a_multiple_of_64():
    assert Config(model="gpt").effective_vocab() % 64 == 0


def test_sizes_table_shapes():
    assert SIZES["tiny"] == (2, 64, 4)
    assert SIZES["small"] == (4, 256, 4)
    assert SIZES["125m"] == (12, 768, 12)
    assert SIZES["350m"] == (24, 1024, 16)
    assert SIZES["1.3b"] == (24, 2048, 16)
    assert SIZES["bert-large"] == (24, 1024, 16)


@pytest.mark.parametrize("size", list(SIZES))
def test_every_size_has_heads_dividing_dim(size):
    layers, dim, heads = SIZES[size]
    assert layers > 0 and heads > 0 and dim % heads == 0


@pytest.mark.parametrize("size", list(SIZES))
def test_layers_dim_heads_follows_size(size):
    assert load_config(overrides=[f"size={size}"]).layers_dim_heads() == SIZES[size]


@pytest.mark.parametrize("size,billions", [("125m", 0.125), ("350m", 0.35), ("1.3b", 1.3)])
def test_named_sizes_are_roughly_their_parameter_count(size, billions):
    # 12 * layers * dim^2 (blocks) + vocab * dim (token embedding; the untied head adds as much
    # again, which is how "1.3b" becomes the 1.42 B of the SIZES comment): within 15% of the name.
    layers, dim, _ = SIZES[size]
    params = 12 * layers * dim ** 2 + 50304 * dim
    assert math.isclose(params / 1e9, billions, rel_tol=0.15), params


def test_a_paced_run_takes_no_negative_pace():
    assert load_config().min_step_s == 0.0
    assert load_config(overrides=["min_step_s=0.1"]).min_step_s == 0.1
    assert "config key 'min_step_s' must be 0 or more, got -1.0" in error_of(overrides=["min_step_s=-1"])
