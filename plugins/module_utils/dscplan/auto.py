"""preset=auto: the model's shape (train.run's, an HF config.json, or dsc_model_shape), the predicted
peak per GPU, and the step-down ladder from zero1 to the offload presets."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from train import memory

from . import memory as shapes
from .deepspeed_config import run_sections, batch, compose_config, ds_config, precision
from .problems import Problems, as_bool, is_int

# preset=auto: the candidates, fastest first at one micro-batch (measured on H200s: zero1 and
# zero2 within a few per cent, zero3 slower on two GPUs; offload about 3x slower, the last resort),
# the micro-batches tried (largest first: throughput grew with it), and the room a prediction of
# max_memory_allocated needs (docs/memory.md: reserved ran up to 1.29x allocated; the CUDA context
# and NCCL's buffers are outside the allocator).
AUTO_PRESETS = ("zero1", "zero2", "zero3")
# Offload, faster first. On one GPU ZeRO-3's layer-by-layer parameter prefetch hides the
# host-to-device copies that ZeRO-2 makes of every updated parameter after the CPU step (8.47 B
# model, one H200, micro-batch 8: 5,473 against 5,025 tokens/s; docs/benchmarks.md). With more
# ranks ZeRO-3 adds a parameter all-gather per layer on every pass, so ZeRO-2 goes first there.
AUTO_OFFLOAD = {"one_gpu": ("zero3-offload", "zero2-offload"), "more": ("zero2-offload", "zero3-offload")}
AUTO_MICRO_BATCHES = (32, 16, 8, 4, 2, 1)
AUTO_FACTOR, AUTO_RESERVE_MIB = 1.3, 1536
MODEL_SHAPE_KEYS = ("layers", "hidden", "heads", "vocab", "seq_len")
# What else dsc_model_shape takes (-> a check: the value or None when refused).
MODEL_SHAPE_OPTIONS = ("activation_checkpointing", "attention", "dropout", "attention_dropout", "logits",
                       "tied", "intermediate", "gated", "params", "activation", "config")
LOGITS = ("fp32", "bf16", "fp16")


def _shape_value(key, value):
    """A dsc_model_shape value as the prediction takes it, or None when it is not one."""
    if key in MODEL_SHAPE_KEYS + ("intermediate", "params"):
        return int(value) if is_int(value) and int(value) > 0 else None
    if key in ("activation_checkpointing", "tied", "gated"):
        return value if isinstance(value, bool) else None
    if key in ("dropout", "attention_dropout"):  # a probability, or true/false
        if isinstance(value, bool):
            return value
        return float(value) > 0 if isinstance(value, (int, float)) and 0 <= value < 1 else None
    if key == "attention":
        return shapes.ATTENTION_KINDS.get(str(value))
    if key == "logits":
        return str(value) if str(value) in LOGITS else None
    if key == "activation":  # transformers' ACT2FN name, as an HF config's activation_function
        return str(value) if str(value) in memory.ACTIVATIONS else None
    if key == "config":
        return str(value) if isinstance(value, str) and value and "\n" not in value else None
    return None


def _hf_config(given, entry, s, problems):
    """(an HF config.json's dict, its path) for a user's model: dsc_model_shape.config (relative
    to dsc_code_dir or dsc_data_dir, or absolute), else config.json at the top of dsc_code_dir,
    then of dsc_data_dir (control-node paths); ({}, None) where there is none."""
    data_dir = str(s.get("dsc_data_dir") or "") if s else ""
    roots = [d for d in (entry["code_dir"], data_dir) if d and os.path.isdir(d)]
    named = given.get("config") if isinstance(given, dict) else None
    if named:
        places = [named] if os.path.isabs(named) else [os.path.join(d, named) for d in roots]
        found = next((p for p in places if os.path.isfile(p)), None)
        if not found:
            problems.add(f"dsc_model_shape.config is {named!r}, which is not a file in dsc_code_dir or "
                         f"dsc_data_dir on the control node. Fix: the path of your model's config.json.")
            return {}, None
    else:
        found = next((p for p in (os.path.join(d, "config.json") for d in roots) if os.path.isfile(p)), None)
        if not found:
            return {}, None
    try:
        cfg = json.loads(Path(found).read_text())
    except (OSError, ValueError) as e:
        if named:
            problems.add(f"dsc_model_shape.config {found} cannot be read as JSON: {e}. Fix: the "
                         f"model's config.json (transformers' save_pretrained writes one).")
        return {}, None
    # Only a transformers config counts (another program's config.json says nothing of a model).
    if not isinstance(cfg, dict) or not any(k in cfg for keys in shapes.HF_KEYS.values() for k in keys):
        if named:
            problems.add(f"dsc_model_shape.config {found} names no model size (n_layer or "
                         f"num_hidden_layers, ...). Fix: the model's config.json from transformers.")
        return {}, None
    return cfg, found


def _assume_unsaid(values, assumed, cfg_path):
    """What neither dsc_model_shape nor the HF config said: the larger assumption, set in values
    and said in words in assumed (a wrong guess is safe, not an out-of-memory error)."""
    if "attention" not in values:
        values["attention"] = "eager"
        assumed.append("attention eager (" + ("config.json names no attn_implementation; "
                       "transformers builds most models with sdpa where torch has it, eager otherwise, "
                       "and eager keeps more" if cfg_path
                       else "not given") + "); give dsc_model_shape.attention: sdpa where yours runs "
                       "scaled_dot_product_attention or flash")
    if "dropout" not in values:
        values["dropout"] = True
        assumed.append("dropout on (its masks counted); give dsc_model_shape.dropout: 0 "
                       "where your model has none")
    if "attention_dropout" not in values:
        values["attention_dropout"] = values["dropout"]
    if "logits" not in values:
        values["logits"] = "fp32"
        assumed.append("logits fp32 in the loss (the larger" + ("; config.json's architectures name no causal LM, "
                       "whose transformers loss upcasts them" if cfg_path else "") + "); give "
                       "dsc_model_shape.logits: bf16 where your loss takes 16-bit logits")
    if "activation" not in values:
        values["activation"] = memory.ASSUMED_ACTIVATION
        assumed.append(f"activation {memory.ASSUMED_ACTIVATION} (" + (
                       "config.json names no activation_function or hidden_act" if cfg_path else "not given")
                       + f"; GPT2Config's default, composed of tensor ops that keep "
                       f"{memory.ACTIVATIONS[memory.ASSUMED_ACTIVATION]} tensors of the MLP's width "
                       f"for backward where a fused GELU keeps 2); give dsc_model_shape.activation: gelu "
                       f"(or yours: silu, gelu_pytorch_tanh, ...) where your MLP runs a fused one")
    if "tied" not in values:
        values["tied"] = False
        assumed.append("untied embeddings: an output layer of its own (the larger); give "
                       "dsc_model_shape.tied: true where it shares the embedding's weight")


def _model_shape(opt, entry, problems, s=None):
    """What preset=auto (and the run's predicted peak) knows of the model: {shape, checkpointing,
    attention, dropout, attention_dropout, logits_fp32, assumed: [what was assumed, in words],
    source}; train.run's from dsc_train_config, a script's from dsc_model_shape over its HF
    config.json (dsc_code_dir or dsc_data_dir); None (with a problem) where neither tells it."""
    given = opt.get("dsc_model_shape") or {}
    if not entry["script"] and entry["module"] == "train.run" and not given:
        try:
            shape, ckpt = shapes.train_shape(opt["dsc_train_config"] or {})
        except (ValueError, TypeError) as e:
            problems.add(f"preset=auto: dsc_train_config gives no model: {e}. Fix: train/config.py's keys.")
            return None
        # train/model.py: scaled_dot_product_attention, no dropout, logits cast to fp32
        return {"shape": shape, "checkpointing": ckpt, "attention": "sdpa", "dropout": False,
                "attention_dropout": False, "logits_fp32": True, "assumed": [], "source": "dsc_train_config"}
    fix = ("-e '{\"dsc_model_shape\": {\"layers\": 24, \"hidden\": 2048, \"heads\": 16, "
           "\"vocab\": 50304, \"seq_len\": 2048, \"attention\": \"sdpa\", \"dropout\": 0}}' (yours)")
    if not isinstance(given, dict):
        problems.add(f"dsc_model_shape is {given!r}. Fix: a mapping, e.g. {fix}.")
        return None
    unknown = sorted(set(map(str, given)) - set(MODEL_SHAPE_KEYS + MODEL_SHAPE_OPTIONS))
    bad = sorted(k for k in set(given) - set(unknown) if _shape_value(k, given[k]) is None)
    if unknown or bad:
        problems.add(f"dsc_model_shape is {given!r}: " + "; ".join(
            ([f"unknown keys {unknown}"] if unknown else []) + ([f"bad values for {bad}"] if bad else []))
            + f". Fix: {', '.join(MODEL_SHAPE_KEYS)} (positive whole numbers), and optionally "
            f"attention ({' | '.join(shapes.ATTENTION_KINDS)}), dropout and attention_dropout "
            f"(a probability or true/false), logits ({' | '.join(LOGITS)}), tied, gated and "
            f"activation_checkpointing (true/false), intermediate and params (whole numbers), activation "
            f"(the MLP's, as an HF config's activation_function: "
            f"{' | '.join(sorted(memory.ACTIVATIONS))}), config (the path of an HF config.json).")
        return None
    cfg, cfg_path = _hf_config(given, entry, s, problems)
    values, assumed = shapes.hf_config_shape(cfg) if cfg else ({}, [])
    assumed = [a for a in assumed if a.split()[0] not in given]  # each note names its key first
    values.update({k: _shape_value(k, v) for k, v in given.items() if k != "config"})
    if "dropout" in given and "attention_dropout" not in given:  # dropout: all of it, unless said apart
        values["attention_dropout"] = values["dropout"]
    missing = [k for k in MODEL_SHAPE_KEYS if k not in values]
    if missing:
        told = " or ".join(["dsc_model_shape"] * bool(given) + [cfg_path] * bool(cfg_path))
        problems.add(f"preset=auto for {entry['script'] or entry['module']} needs the model's shape"
                     + (f" ({told} gives no {', '.join(missing)})" if told else "")
                     + f". Fix: {fix}, an HF config.json in dsc_code_dir or dsc_data_dir, or a preset.")
        return None
    _assume_unsaid(values, assumed, cfg_path)
    shape = memory.model_shape(
        *(values[k] for k in MODEL_SHAPE_KEYS), tied=values["tied"], params=values.get("params"),
        intermediate=values.get("intermediate"), gated=bool(values.get("gated")),
        positions=values.get("positions", True), activation=values["activation"])
    return {"shape": shape, "checkpointing": bool(values.get("activation_checkpointing", False)),
            "attention": values["attention"], "dropout": bool(values["dropout"]),
            "attention_dropout": bool(values["attention_dropout"]),
            "logits_fp32": values["logits"] == "fp32", "assumed": assumed,
            "source": "dsc_model_shape" + (f" over {cfg_path}" if cfg_path else "") if given else cfg_path}


def code_fingerprint(code_dir):
    """sha256 of the code directory's files (names and contents, what code_archive packs): the
    same code reads the same, whenever and wherever it was packed; "" where it is not here."""
    digest = hashlib.sha256()
    if not os.path.isdir(code_dir):
        return ""
    for dirpath, dirnames, filenames in os.walk(code_dir):
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", ".git", ".ipynb_checkpoints"))
        for name in sorted(f for f in filenames if not f.endswith(".pyc")):
            path = os.path.join(dirpath, name)
            try:
                data = Path(path).read_bytes() if not os.path.islink(path) else os.readlink(path).encode()
            except OSError:
                continue
            digest.update(os.path.relpath(path, code_dir).encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


def model_key(entry, model):
    """What makes two runs' measured peaks comparable: the same code, entry point and model inputs
    (a corrected dsc_model_shape makes a new key: its earlier error is not applied twice)."""
    inputs = {k: model[k] for k in ("shape", "checkpointing", "attention", "dropout", "attention_dropout",
                                    "logits_fp32")}
    text = json.dumps({"code": code_fingerprint(entry["code_dir"]) or entry["code_dir"],
                       "entry": entry["script"] or entry["module"], "model": inputs}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# A measured peak more than this over the prediction is recorded as such, and a later preset=auto
# of the same code and model scales its predictions by it.
MEASURED_TOLERANCE = 1.05


def _earlier_measured(plan, key):
    """The largest measured-over-predicted ratio (above MEASURED_TOLERANCE) of earlier runs of the
    same key on any node, and those runs' records ({preset, micro_batch, world, measured, ...})."""
    records = [dict(m, node=n.name) for n in plan.nodes for m in n.memory_records or []
               if m.get("key") == key and m.get("ratio")]
    worst = max((m["ratio"] for m in records), default=1.0)
    return (worst if worst > MEASURED_TOLERANCE else 1.0), records


def measured_slope(records):
    """What two measurements of one configuration tell that the formula cannot: from earlier runs
    of the same key that measured the same preset at the same world size at two micro-batches or
    more, {preset, world, micro_batch (the smallest), measured (its peak), per_sample: the peak's
    growth per sample between the smallest and the largest (the activations this model's
    implementation keeps, whatever it is), runs}; the widest such span, or None where none was
    measured twice or the peak did not grow (the optimizer step's peak, not the activations')."""
    peaks = {}
    for m in records:
        if m.get("measured") and is_int(m.get("micro_batch")) and is_int(m.get("world")):
            at = peaks.setdefault((m["preset"], m["world"]), {})
            if m["measured"] > at.get(m["micro_batch"], (0, ""))[0]:
                at[m["micro_batch"]] = (m["measured"], m.get("run_id", "?"))
    best = None
    for (preset, world), at in sorted(peaks.items()):
        low, high = min(at), max(at)
        if high > low and at[high][0] > at[low][0] and (best is None or high - low > best["span"]):
            best = {"preset": preset, "world": world, "micro_batch": low, "measured": at[low][0], "span": high - low,
                    "per_sample": (at[high][0] - at[low][0]) / (high - low), "runs": [at[low][1], at[high][1]],
                    "largest": high}
    return best


def from_slope(slope, need, reference_need, micro_batch):
    """A configuration's peak from a measured slope: the measured peak at the slope's smallest
    micro-batch, the slope's bytes per sample for each sample more (or fewer), and train/memory.py's
    difference between this configuration and the measured one at this micro-batch (the model
    states and ZeRO's buffers: exact where the activations are not)."""
    return int(slope["measured"] + slope["per_sample"] * (micro_batch - slope["micro_batch"]) + need - reference_need)


def predicted_peak(model, config, micro_batch, plan, bits, world=None):
    per_node = max(n.slots for n in plan.nodes)
    world = world or plan.world_size
    return memory.predict(model["shape"], config, micro_batch, world, min(per_node, world), precision=bits,
                              attention=model["attention"], activation_checkpointing=model["checkpointing"],
                              dropout=model["dropout"], attention_dropout=model["attention_dropout"],
                              logits_fp32=model["logits_fp32"])["total"]


def step_down_ladder(candidates, chosen, room_mib):
    """The configurations an out-of-memory error in the first steps steps down to, in auto's own
    order after the chosen one: each the next candidate predicted to fit even when the prediction
    is as far off as the failed one's must have been (its peak passed the memory, room_mib: the
    next must be predicted under (room - reserve) / factor x failed / room)."""
    ladder, last = [chosen], chosen
    for c in candidates[candidates.index(chosen) + 1:]:
        if c["use"] <= last["use"] * (room_mib - AUTO_RESERVE_MIB) / AUTO_FACTOR / room_mib:
            ladder.append(c)
            last = c
    return ladder


def _auto_reason(chosen, candidates, records, ratio, slope, room, model, bits):
    """preset=auto's choice as lines: the chosen configuration's predicted peak against the room,
    the largest ones that did not fit, earlier measurements, the model and what was assumed."""
    tried = [c["line"] for c in candidates[:candidates.index(chosen)]]
    measured = [f"  measured before (run {m['run_id']} on {m['node']}, {m['preset']} micro-batch "
                f"{m['micro_batch']}): {m['measured'] / 2**30:.1f} GiB against the predicted "
                f"{m['predicted'] / 2**30:.1f} GiB (x{m['ratio']:.2f})" for m in records if m["ratio"] > MEASURED_TOLERANCE]
    predicted, use = f"{chosen['predicted'] / 2**30:.1f} GiB", f"{chosen['use'] / 2**30:.1f} GiB per GPU"
    basis = chosen["basis"]
    shown_use = (
        f"{use} (reused: the measured peak of this configuration in an earlier run; train/memory.py "
        f"predicted {predicted})" if basis == "measured" else
        f"{use} (from the peaks measured at {slope['preset']} micro-batch {slope['micro_batch']} and "
        f"{slope['largest']} in runs {' and '.join(slope['runs'])}: {slope['per_sample'] / 2**30:.2f} GiB more per "
        f"sample, with train/memory.py's difference between the two configurations; it predicted {predicted} "
        f"alone)" if basis == "slope" else
        f"{use} (predicted {predicted} by train/memory.py, scaled by the measured x{ratio:.2f})" if basis == "ratio"
        else f"{predicted} per GPU (train/memory.py)")
    want = chosen["use"] / 2**20 * AUTO_FACTOR + AUTO_RESERVE_MIB
    return [f"preset=auto chose {chosen['preset']} at micro-batch {chosen['micro_batch']}: predicted peak "
            f"{shown_use}, x{AUTO_FACTOR} + {AUTO_RESERVE_MIB / 1024:.1f} GiB = {want / 1024:.1f} GiB, within "
            f"{room}."] + [f"  no room: {t}" for t in tried[-6:]] + measured + \
           [f"  model ({model['source']}): {model['shape']['layers']} layers, hidden {model['shape']['hidden']}, "
            f"{model['shape']['heads']} heads, vocab {model['shape']['vocab']}, seq_len {model['shape']['seq_len']}, "
            f"attention {model['attention']}, dropout {'on' if model['dropout'] else 'off'}"
            f"{' (attention dropout on)' if model['attention_dropout'] and not model['dropout'] else ''}, "
            f"activation {model['shape'].get('activation', 'gelu')}, "
            f"logits {'fp32' if model['logits_fp32'] else bits}, {'tied' if model['shape']['tied'] else 'untied'} "
            f"embeddings{', activation checkpointing' if model['checkpointing'] else ''}"] + \
           [f"  assumed: {a}" for a in model["assumed"]]


def auto_preset(plan, opt, options, paths, entry, problems, s=None):
    """preset=auto: the first candidate (AUTO_PRESETS at each micro-batch, largest first, then the
    offload presets in AUTO_OFFLOAD's order for the world size) whose peak per GPU (from earlier
    runs of the same code and model: the same configuration's measured peak, else the slope of one
    configuration measured at two micro-batches, else train/memory.py's prediction scaled by their
    worst measured ratio) x AUTO_FACTOR + AUTO_RESERVE fits the smallest GPU of the cluster (or
    dsc_auto_memory_gib); (preset, micro-batch, the reason as lines, the step-down ladder, the model
    and its key), or Nones."""
    none = None, None, [], [], None
    budget = opt.get("dsc_auto_memory_gib") or 0
    try:
        budget = float(budget)
    except (TypeError, ValueError):
        budget = -1
    if not 0 <= budget < 1e6:
        problems.add(f"dsc_auto_memory_gib is {opt.get('dsc_auto_memory_gib')!r}. Fix: the memory per "
                     f"rank preset=auto plans for, in GiB (e.g. 80), or 0 for the smallest GPU's.")
        return none
    if plan.accelerator != "cuda" and not budget:
        problems.add("preset=auto chooses by GPU memory and the cluster has CPU nodes. Fix: name a "
                     "preset (-e preset=zero2), or give the memory per rank it may plan for "
                     "(-e dsc_auto_memory_gib=N: on CPU nodes the ranks share the host's memory).")
        return none
    sizes = [n.gpu_memory_mib for n in plan.nodes]
    if not budget and not all(sizes):
        problems.add("preset=auto: nvidia-smi did not report the GPUs' memory on every node. Fix: "
                     "name a preset, or give -e dsc_auto_memory_gib=N.")
        return none
    model = _model_shape(opt, entry, problems, s)
    if model is None:
        return none
    if budget:
        smallest, where = budget * 1024, "dsc_auto_memory_gib"
    else:
        smallest = min(sizes)
        where = next(n.name for n in plan.nodes if n.gpu_memory_mib == smallest)
    key = model_key(entry, model)
    ratio, records = _earlier_measured(plan, key)
    slope = measured_slope(records)
    fixed = "dsc_micro_batch" in options
    micro_batches = [int(opt["dsc_micro_batch"])] if fixed and is_int(opt["dsc_micro_batch"]) else AUTO_MICRO_BATCHES
    caps = [c for n in plan.nodes for c in n.compute_caps]
    dtype = precision(plan.accelerator, caps)
    bits = "bf16" if dtype["bf16"]["enabled"] else "fp16" if dtype["fp16"]["enabled"] else "fp32"
    overrides = opt["dsc_ds_config_overrides"] if isinstance(opt["dsc_ds_config_overrides"], dict) else {}
    candidates, chosen = [], None
    # On CPU nodes the offload presets would move states into the same memory: not candidates.
    offload = AUTO_OFFLOAD["one_gpu" if plan.world_size == 1 else "more"] if plan.accelerator == "cuda" else ()
    for group in (AUTO_PRESETS, offload):
        for mb in micro_batches:
            sizes_mb = batch(mb, opt["dsc_grad_accum"] if "dsc_grad_accum" in options else None,
                             opt["dsc_train_batch"] if "dsc_train_batch" in options else None, plan.world_size)
            if "error" in sizes_mb:
                continue
            for name in group:
                config = ds_config(paths["templates"], name, plan.accelerator, caps, sizes_mb, overrides)
                need = predicted_peak(model, config, mb, plan, bits)
                same = [m["measured"] for m in records if (m.get("preset"), m.get("micro_batch"), m.get("world"))
                        == (name, mb, plan.world_size) and m.get("measured")]
                if same:
                    use, basis, how = max(same), "measured", f", measured {max(same) / 2**30:.1f} GiB"
                elif slope:
                    measured_config = ds_config(paths["templates"], slope["preset"], plan.accelerator, caps, sizes_mb,
                                                overrides)
                    use = from_slope(slope, need, predicted_peak(model, measured_config, mb, plan, bits, slope["world"]), mb)
                    basis, how = "slope", f", from the measured slope {use / 2**30:.1f} GiB"
                else:
                    use, basis = int(need * ratio), "ratio" if ratio > 1 else "formula"
                    how = f" x{ratio:.2f} measured = {use / 2**30:.1f} GiB" if ratio > 1 else ""
                want = use / 2**20 * AUTO_FACTOR + AUTO_RESERVE_MIB
                c = {"preset": name, "micro_batch": mb, "batch": sizes_mb, "predicted": int(need), "use": use,
                     "basis": basis, "fits": want <= smallest,
                     "line": f"{name} micro-batch {mb}: predicted {need / 2**30:.1f} GiB{how}, wants {want / 1024:.1f} GiB"}
                candidates.append(c)
                if c["fits"] and chosen is None:
                    chosen = c
    room = f"{where}: {smallest / 1024:.1f} GiB" if budget else f"the smallest GPU ({where}: {smallest / 1024:.1f} GiB)"
    if chosen is None:
        problems.add(f"preset=auto: nothing fits {room}, "
                     f"not even {candidates[-1]['line'] if candidates else 'micro-batch 1'}. Fix: more GPUs, activation "
                     f"checkpointing, a shorter sequence, or a smaller model.")
        return none
    ladder = step_down_ladder(candidates, chosen, smallest)
    reason = _auto_reason(chosen, candidates, records, ratio, slope, room, model, bits)
    return chosen["preset"], chosen["micro_batch"], reason, ladder, dict(model, key=key, bits=bits)


def memory_record(plan, opt, entry, s, config, model, resume):
    """memory.json: the run's predicted peak per GPU (train/memory.py) for its configuration, with
    the key that a later preset=auto of the same code and model looks its measured peak up by;
    None where the model or the batch is not known (a script without a shape, HF's "auto"), on CPU
    nodes, and on resume (the run keeps its own)."""
    if resume or config is None or plan.accelerator != "cuda" or plan.world_size is None:
        return None
    micro = config.get("train_micro_batch_size_per_gpu")
    if not is_int(micro) or not is_int(config.get("gradient_accumulation_steps", 1)):
        return None
    if model is None:
        try:
            model = _model_shape(opt, entry, Problems(), s)  # quietly: a preset needs no shape
        except (ValueError, TypeError, KeyError):
            model = None
        if model is None:
            return None
        dtype = precision(plan.accelerator, [c for n in plan.nodes for c in n.compute_caps])
        model = dict(model, key=model_key(entry, model),
                     bits="bf16" if dtype["bf16"]["enabled"] else "fp16" if dtype["fp16"]["enabled"] else "fp32")
    try:
        predicted = predicted_peak(model, config, int(micro), plan, model["bits"])
    except (ValueError, KeyError, TypeError):
        return None
    return {"key": model["key"], "preset": str(opt["preset"]), "micro_batch": int(micro),
            "world": plan.world_size, "predicted": int(predicted), "tolerance": MEASURED_TOLERANCE,
            "assumed": model["assumed"]}


def ladder_record(plan, launcher_why, opt, options, paths, mode, ladder, overrides, user_config, run_dir, auto,
                  node_local=True):
    """auto.json for the supervisor: preset=auto's ladder (the chosen configuration first), each
    step with its ds_config (written to a file of its own: run._ladder_files), predicted peak and batch; the steps are said in auto's lines. None
    (and said why) where an out-of-memory error cannot step down (`launcher_why`: the launch
    mode's reason, launchers.Launcher.step_down_why)."""
    if len(ladder) < 2:
        if ladder:
            auto.append("  no step down: nothing below it is predicted to fit when this prediction is "
                        "wrong enough to run out of memory")
        return None
    why = launcher_why or (f"dsc_ds_config_mode {mode} (the script sets its own batch)"
                           if mode not in ("preset", "file") else "")
    if why:
        auto.append(f"  no step down after an out-of-memory error: {why}")
        return None
    caps = [c for n in plan.nodes for c in n.compute_caps]
    steps = []
    for c in ladder:
        cfg = compose_config(mode, paths["templates"], c["preset"], set(options) | {"dsc_micro_batch"},
                             plan.accelerator, caps, c["batch"], overrides, user_config,
                             plan.world_size, Problems())
        if cfg is None:
            return None
        run_sections(cfg, run_dir, as_bool(opt["dsc_tensorboard"]), node_local=node_local)
        steps.append({"preset": c["preset"], "micro_batch": c["micro_batch"],
                      "grad_accum": c["batch"]["grad_accum"], "train_batch": c["batch"]["train_batch"],
                      "predicted": c["predicted"], "ds_config": cfg})
    auto.append("  an out-of-memory error in the first steps steps down to: " + ", then ".join(
        f"{c['preset']} micro-batch {c['micro_batch']}" for c in ladder[1:]))
    return {"ladder": steps}
