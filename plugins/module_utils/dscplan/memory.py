"""Per-GPU memory prediction for the plan (control node): train/memory.py's formula, with the
model's shape from train.run's config or from an HF config.json.

The formula lives in one place, train/memory.py, because train/ is what runs on the nodes (a copy
of train/ travels with every run) and train/run.py prints the same prediction there. This module
is imported as `train.memory` (pure Python: no torch, no DeepSpeed) wherever it is needed:

    from train import memory
    shape = memory.model_shape(layers=24, hidden=2048, heads=16, vocab=50304, seq_len=2048)
    memory.predict(shape, "zero2", micro_batch=8, world=1, gpus_per_node=1)["total"]

This module adds only the shapes the plan reads from configs: train_shape, hf_config_shape.

See train/memory.py for the parts and docs/memory.md for the measured check.
"""
from __future__ import annotations

from train import config
from train import memory as _memory


def train_shape(train_config: dict) -> tuple[dict, bool]:
    """(shape, activation checkpointing) of train.run's model for a dsc_train_config (its
    defaults for what is not given; train/config.py). ValueError names an
    unknown key or size."""
    known = {f.name for f in config.fields(config.Config)}
    unknown = sorted(set(train_config) - known)
    if unknown:
        raise ValueError(f"unknown dsc_train_config keys {unknown}")
    cfg = config.Config(**train_config)
    if cfg.size not in config.SIZES:
        raise ValueError(f"dsc_train_config size {cfg.size!r} is not one of {', '.join(config.SIZES)}")
    return _memory.shape_from_config(cfg), bool(cfg.activation_checkpointing)


# --- a user's model, from an HF config.json -------------------------------------------------------

# transformers' config.json names, per quantity (GPT-2 first, then Llama-style and BERT-style).
HF_KEYS = {
    "layers": ("n_layer", "num_hidden_layers", "num_layers"),
    "hidden": ("n_embd", "hidden_size", "d_model"),
    "heads": ("n_head", "num_attention_heads"),
    "vocab": ("vocab_size",),
    "seq_len": ("n_positions", "max_position_embeddings", "n_ctx"),
    "intermediate": ("n_inner", "intermediate_size"),
}
HF_RESID_DROPOUT = ("resid_pdrop", "embd_pdrop", "hidden_dropout_prob", "hidden_dropout", "dropout",
                    "residual_dropout", "embd_dropout")
HF_ATTN_DROPOUT = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")
# The MLP's activation (transformers' ACT2FN name): GPT-2/GPT-J/GPT-Neo's activation_function, Gemma's
# hidden_activation (which its MLP reads first), BERT/Llama's hidden_act.
HF_ACTIVATION = ("activation_function", "hidden_activation", "hidden_act")
# Attention implementations as the prediction counts them: eager keeps the probabilities (a*s*s
# per sequence), the fused kernels (sdpa, flash, flex) only a log-sum-exp per row.
ATTENTION_KINDS = {"eager": "eager", "sdpa": "sdpa", "flash": "sdpa", "flash_attention_2": "sdpa",
                   "flash_attention_3": "sdpa", "flex_attention": "sdpa"}
# Model types whose MLP is gated (gate, up, down projections: SwiGLU/GeGLU) and whose positions are
# rotary (no learned position embedding).
GATED_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
               "phi3", "olmo", "olmo2", "granite", "cohere", "starcoder2_gated")


def hf_config_shape(cfg: dict) -> tuple[dict, list]:
    """(what an HF config.json says of the prediction's inputs, notes on what it left to an
    assumption): layers, hidden, heads, vocab, seq_len, intermediate, gated, positions, tied,
    activation, attention, dropout, attention_dropout, logits. Keys it does not give are left out
    (the caller's dsc_model_shape or assumption fills them)."""
    out, notes = {}, []
    for name, keys in HF_KEYS.items():
        key = next((k for k in keys if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool)
                    and cfg[k] > 0), None)
        if key:
            out[name] = cfg[key]
            if name == "seq_len":
                notes.append(f"seq_len {cfg[key]} from config.json's {key} (the longest the model "
                             f"takes; give dsc_model_shape.seq_len if you train on shorter sequences)")
    model_type = str(cfg.get("model_type") or "")
    if model_type in GATED_TYPES:
        out["gated"] = True
    if model_type in GATED_TYPES or any(k in cfg for k in ("rope_theta", "rope_scaling", "rotary_dim")):
        out["positions"] = False
    act_key = next((k for k in HF_ACTIVATION if isinstance(cfg.get(k), str) and cfg[k]), None)
    if act_key and cfg[act_key] in _memory.ACTIVATIONS:
        out["activation"] = cfg[act_key]
    elif act_key:
        # not one the prediction knows: the one that keeps the most, said
        costliest = max(_memory.ACTIVATIONS, key=lambda k: _memory.ACTIVATIONS[k])
        out["activation"] = costliest
        notes.append(f"activation {costliest}: config.json's {act_key} is {cfg[act_key]!r}, which the "
                     f"prediction does not know, counted as {costliest} (of those it knows, the one that "
                     f"keeps the most for backward); give dsc_model_shape.activation where you know better")
    # PretrainedConfig's default is true, and save_pretrained leaves a default out of the file.
    out["tied"] = bool(cfg.get("tie_word_embeddings", True))
    impl = cfg.get("_attn_implementation", cfg.get("attn_implementation"))
    if impl in ATTENTION_KINDS:
        out["attention"] = ATTENTION_KINDS[impl]
    elif impl is not None:
        notes.append(f"attention eager: config.json names {impl!r}, counted as eager (the larger)")
        out["attention"] = "eager"

    def probability(keys):
        found = [float(cfg[k]) for k in keys if isinstance(cfg.get(k), (int, float))
                 and not isinstance(cfg.get(k), bool)]
        return max(found) if found else None
    resid, attn = probability(HF_RESID_DROPOUT), probability(HF_ATTN_DROPOUT)
    if resid is not None:
        out["dropout"] = resid > 0
    if attn is not None:
        out["attention_dropout"] = attn > 0
    if resid is not None and attn is None:
        out["attention_dropout"] = resid > 0
    # transformers' causal-LM loss upcasts the logits to fp32 (ForCausalLMLoss), whatever the dtype;
    # other heads' losses (a masked LM's CrossEntropyLoss) take them as they come: left to assume.
    if any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in cfg.get("architectures") or []):
        out["logits"] = "fp32"
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    if dtype not in (None, "bfloat16", "float16"):
        notes.append(f"16-bit training: config.json's torch_dtype is {dtype}, and DeepSpeed's bf16/fp16 casts the model, "
                     f"so the prediction counts 16-bit weights and activations")
    return out, notes
