"""Per-GPU memory of a DeepSpeed training step, predicted from the model's shape (standard library only).

The one place for the formula: train/run.py imports it on the nodes (train/ travels with every run),
plugins/module_utils/dscplan/memory.py imports this file on the control node (the plan, -e preset=auto).
docs/memory.md has the derivation and the measured check (bench/gpu_memory.py on one H200).

What is predicted is the peak of torch.cuda.max_memory_allocated() over a training step, as a sum
of parts (bytes per GPU):

  model_states   DeepSpeed's own estimator, in closed form (deepspeed 0.19.8:
                 stage_1_and_2.estimate_zero2_model_states_mem_needs,
                 stage3.estimate_zero3_model_states_mem_needs; DeepSpeed has none for stages 0/1:
                 the ZeRO paper's split, as train/run.py always reported).
  states_adjust  what is resident at the peak minus that estimate. The estimate counts gradients
                 (16-bit and the fp32 copy) that DeepSpeed allocates only during the backward's
                 tail or the optimizer step, when the activations are already freed; ZeRO-3's
                 estimate leaves out the 16-bit parameter partitions and has 4 bytes per parameter
                 of the largest layer instead.
  zero_buffers   what DeepSpeed allocates besides the states, from the ds_config: ZeRO-3's
                 reduce bucket (preallocated), gathered ZeRO-3 parameters, the offload staging
                 buffer, ZeRO-1/2's reduce buckets where the peak falls after the first gradient.
  activations    tensors saved for backward by each transformer block (Korthikanti et al. 2022,
                 s*b*h*(34 + 5*a*s/h) bytes/layer in 16-bit with dropout; 32 without dropout;
                 the attention-score term only where scores are materialised; the MLP's
                 term by its activation function: ACTIVATIONS), the final LayerNorm's, and the
                 small fp32 per-token statistics.
  accumulation   with gradient accumulation, what a later micro-step's backward finds still
                 allocated (measured on one and two H200s, ZeRO-1/2, optimizer on the GPU): ZeRO-2
                 its 16-bit gradient partition; ZeRO-1 the whole 16-bit gradients and its reduce
                 buckets. Not measured, so not counted: ZeRO-0/3 and the offload presets.
  logits         the output layer's logits at the start of the backward: the fp32 log-softmax
                 output, its incoming gradient and its outgoing gradient (3 x s*b*V*4 bytes when
                 the model casts logits to fp32, as train/model.py does).
  overhead       a constant fitted on the H200 measurement (cuBLAS workspaces, the batch, the loss
                 and other small tensors).

The peak is taken as the largest of three moments of a step: "backward" (all activations live and
the cross-entropy's backward running), "first-gradient" (the first parameter gradient arrives and
ZeRO-1/2 allocate their reduce buckets) and "step" (activations freed, the gradients, their
flattened copy and the fp32 copy allocated: about DeepSpeed's estimate).

Not covered: the CUDA context, NCCL's buffers and the caching allocator's fragmentation (they are
outside max_memory_allocated; reserved over allocated as measured: docs/memory.md), pipeline/tensor
parallelism, MoE, fused or chunked cross-entropy, torch.compile's own buffers, CPU memory other
than DeepSpeed's estimate.
"""
from __future__ import annotations

import argparse
import json
import re

from train.config import SIZES

GiB = 2 ** 30

# Fitted on one H200 (the 1.42 B GPT, 19 peaks: bench/results/gpu/memory and the earlier launch.yml
# runs of bench/results/gpu): the median of measured max_memory_allocated minus the prediction
# without it (range 62-85 MiB). See docs/memory.md.
OVERHEAD_BYTES = 65 * 2 ** 20

# DeepSpeed's defaults for the settings the buffers depend on (deepspeed/runtime/zero/config.py)
# and the values of the repo's templates/ds_config presets (overlap_comm and contiguous_gradients
# on, 5e8-element reduce buckets, 1e9 live ZeRO-3 parameters).
REDUCE_BUCKET_SIZE = 500_000_000
STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ATTENTIONS = ("sdpa", "eager")

# The MLP's activation function: how many tensors of the MLP's width (s*b*I elements, 16-bit) the
# activation keeps for backward, counting its input (fc's output) and its output (the down
# projection's input, which that Linear keeps) where something keeps them. Names are transformers'
# ACT2FN keys (an HF config's activation_function / hidden_act); "gelu" is torch's F.gelu, as
# train/model.py's MLP runs it. Counted from autograd's saved tensors of each definition
# (transformers 4.57's activations.py; checked with torch.autograd.graph.saved_tensors_hooks in
# bf16) and, for gelu_new, measured on one H200 (docs/benchmarks.md):
#   one fused op (F.gelu, F.gelu(approximate="tanh"), F.silu, F.mish, leaky_relu, relu6, prelu):
#     the op keeps its input, the next Linear its output: 2.
#   relu, tanh, sigmoid (backward from the output alone) and linear (identity): the output only: 1.
#   gelu_new (NewGELUActivation; gelu_accurate and gelu_python_tanh are the same ops):
#     0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3))))
#       pow(x, 3)               keeps x                          (fc's output: 1)
#       0.044715 * .., x + .., sqrt(2/pi) * ..   a scalar product or a sum keeps nothing
#       tanh(u)                 keeps its output t               (2)
#       1 + t                   keeps nothing; its result c is kept by the product below (3)
#       0.5 * x                 keeps nothing; its result m is kept by the product below (4)
#       m * c                   keeps both operands (m, c: counted above)
#       its output              kept by the down projection      (5)
#     5 tensors of 4h where a fused GELU keeps 2: 3 more, 12*h 16-bit values per token and layer.
#     The H200 measurement: 2.25 GiB more per sequence than the fused count, in both attentions,
#     = 24 layers x 2048 tokens x 8192 (4h) x 2 bytes x k, so k = 3 (12 s*h tensors per layer).
#   gelu_python (x * 0.5 * (1 + erf(x / sqrt(2)))): erf keeps x/sqrt(2), the product x*0.5 and
#     1+erf, and the output: x itself is kept by nothing: 4.
#   gelu_fast (0.5 * x * (1 + tanh(x * 0.7978845608 * (1 + 0.044715 * x * x)))): the product
#     (0.044715*x)*x keeps 0.044715*x and x, (x*0.798)*(1+..) keeps both, tanh its output, the last
#     product 0.5*x and 1+tanh, and the output: 8.
#   quick_gelu (x * sigmoid(1.702 * x)): x, the sigmoid's output, the output: 3.
#   gelu_10 (clip(gelu(x), -10, 10)): x, gelu's output (clip's input), the output: 3.
#   relu2 (square(relu(x))), laplace (0.5 * (1 + erf((x - mu) / ..))): an inner tensor and the output: 2.
# A gated MLP (Llama's SwiGLU: down(act(gate(x)) * up(x))) keeps the up projection's output and
# the product besides: the count + 2 (SiLU: 4, as measured for the gated MLPs counted before).
ACTIVATIONS = {
    "gelu": 2, "gelu_pytorch_tanh": 2, "silu": 2, "swish": 2, "mish": 2, "leaky_relu": 2, "relu6": 2,
    "prelu": 2, "relu2": 2, "laplace": 2,
    "relu": 1, "tanh": 1, "sigmoid": 1, "linear": 1,
    "gelu_new": 5, "gelu_accurate": 5, "gelu_python_tanh": 5, "gelu_python": 4, "gelu_fast": 8,
    "quick_gelu": 3, "gelu_10": 3,
}
# What a model that names no activation is counted with where it matters (a user's model): the
# composed tanh GELU of GPT-2's configs (GPT2Config's default), which keeps 3 tensors more than a
# fused one.
ASSUMED_ACTIVATION = "gelu_new"


# --- the model's shape ----------------------------------------------------------------------------

def model_shape(layers: int, hidden: int, heads: int, vocab: int, seq_len: int, *, tied: bool = False,
                params: int | None = None, largest_layer_params: int | None = None,
                largest_param: int | None = None, intermediate: int | None = None, gated: bool = False,
                positions: bool = True, activation: str | None = None) -> dict:
    """The shape the prediction needs. Parameter counts default to train/model.py's Transformer:
    token and learned position embeddings, blocks of qkv/proj/fc/out without bias and two
    LayerNorms, a final LayerNorm and an untied output layer (tied=True drops it).
    intermediate: the MLP's width (default 4 x hidden); gated: a gated MLP (Llama's SwiGLU: gate,
    up and down projections); positions=False: no learned position embedding (rotary);
    activation: the MLP's activation, a key of ACTIVATIONS (default: torch's fused F.gelu as
    train/model.py's, silu for a gated MLP; both keep 2 tensors of the MLP's width)."""
    if activation is None:
        activation = "silu" if gated else "gelu"
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: one of {', '.join(sorted(ACTIVATIONS))}")
    inner = int(intermediate) if intermediate else 4 * hidden
    per_layer = 4 * hidden * hidden + (3 if gated else 2) * hidden * inner + 4 * hidden
    if params is None:
        params = vocab * hidden + (seq_len * hidden if positions else 0) + layers * per_layer + 2 * hidden
        params += 0 if tied else vocab * hidden
    biggest = max(vocab * hidden, seq_len * hidden if positions else 0, 4 * hidden * hidden, hidden * inner)
    return {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "seq_len": seq_len,
            "tied": tied, "intermediate": inner, "gated": bool(gated), "activation": activation,
            "params": int(params), "layer_params": per_layer,
            # DeepSpeed's model_to_params: the module with the most parameters of its own.
            "largest_layer_params": int(largest_layer_params if largest_layer_params is not None else biggest),
            # the largest single tensor (ZeRO-1/2 offload's GPU staging buffer is this big).
            "largest_param": int(largest_param if largest_param is not None else biggest)}


def shape_from_config(cfg) -> dict:
    """train.config.Config (or anything with layers_dim_heads(), effective_vocab(), seq_len)."""
    layers, dim, heads = cfg.layers_dim_heads()
    return model_shape(layers, dim, heads, cfg.effective_vocab(), cfg.seq_len)


# --- DeepSpeed's estimators, in closed form ---------------------------------------------------------

def ds_zero2_estimate(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                      additional_buffer_factor=1.5):
    """deepspeed 0.19.8 stage_1_and_2.estimate_zero2_model_states_mem_needs: (cpu, gpu) bytes."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        # 2 = 16-bit params; 18 = 16-bit grads 2 + fp32 grads 4 + fp32 params 4 + Adam m, v 8
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def ds_zero3_estimate(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                      cpu_offload=True, cpu_offload_params=True, zero_init=True,
                      additional_buffer_factor=1.5):
    """deepspeed 0.19.8 stage3.estimate_zero3_model_states_mem_needs: (cpu, gpu, largest layer) bytes."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        # parameters offloaded too: their 16-bit copy (2 bytes) moves to the CPU as well
        per_param = 18 if cpu_offload_params else 16
        gpu_mem = largest_layer_memory + (0 if cpu_offload_params else int(2 * total_params / total_gpus))
        cpu_per_param = per_param * gpus_factor if zero_init else max(4 * num_gpus_per_node, per_param * gpus_factor)
        cpu_mem = total_params * cpu_per_param * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def model_states(params, largest_layer_params, stage, offload_optimizer, offload_param,
                 gpus_per_node, nodes) -> dict:
    """DeepSpeed's model-state estimate per GPU (and per node on the CPU), as train/run.py reports it."""
    world = gpus_per_node * nodes
    if stage == 3:
        cpu, gpu, _ = ds_zero3_estimate(params, largest_layer_params, gpus_per_node, nodes,
                                        cpu_offload=offload_optimizer, cpu_offload_params=offload_param,
                                        zero_init=True)
        how = "estimate_zero3_model_states_mem_needs"
    elif stage == 2:
        cpu, gpu = ds_zero2_estimate(params, gpus_per_node, nodes, cpu_offload=offload_optimizer)
        how = "estimate_zero2_model_states_mem_needs"
    else:
        # DeepSpeed ships no estimator for stages 0/1: the ZeRO paper's 16 bytes/param split.
        gpu = 16 * params if stage == 0 else 4 * params + 12 * params / world
        cpu, how = 0, "zero-paper formula (16 bytes/param)"
    return {"method": how, "params": int(params), "gpu_bytes": int(gpu), "cpu_bytes": int(cpu)}


# --- the ZeRO settings the buffers depend on --------------------------------------------------------

def zero_settings(preset) -> dict:
    """A preset name of templates/ds_config (zero0..zero3, -offload: optimizer offload, and for
    ZeRO-3 parameter offload too, with the templates' buffer sizes) or a merged ds_config dict."""
    if isinstance(preset, str):
        m = re.fullmatch(r"zero([0-3])(-offload)?", preset)
        if not m:
            raise ValueError(f"preset {preset!r}: expected zero0..zero3 with an optional -offload, "
                             f"or a ds_config dict")
        stage, off = int(m.group(1)), bool(m.group(2))
        return {"stage": stage, "offload_optimizer": off, "offload_param": off and stage == 3,
                "overlap_comm": True, "contiguous_gradients": True,
                "reduce_bucket_size": REDUCE_BUCKET_SIZE, "max_live_parameters": STAGE3_MAX_LIVE_PARAMETERS}
    zero = dict(preset.get("zero_optimization") or {})
    stage = int(zero.get("stage", 0))

    def offloaded(key):
        return (zero.get(key) or {}).get("device", "none") not in ("none", None)
    overlap = zero.get("overlap_comm")
    return {"stage": stage, "offload_optimizer": offloaded("offload_optimizer"),
            "offload_param": offloaded("offload_param") and stage == 3,
            "overlap_comm": bool(stage == 3 if overlap is None else overlap),
            "contiguous_gradients": bool(zero.get("contiguous_gradients", True)),
            "reduce_bucket_size": int(float(zero.get("reduce_bucket_size", REDUCE_BUCKET_SIZE))),
            "max_live_parameters": int(float(zero.get("stage3_max_live_parameters", STAGE3_MAX_LIVE_PARAMETERS)))}


# --- activations ---------------------------------------------------------------------------------

def activation_bytes(shape: dict, micro_batch: int, precision: str = "bf16", attention: str = "sdpa",
                     checkpointing: bool = False, dropout: bool = False,
                     attention_dropout: bool | None = None) -> dict:
    """Bytes saved for backward at the end of the forward (logits apart).

    Per block (train/model.py's Block), in elements of s*b*h: the block input (LayerNorm 1's
    input) 1, LayerNorm 1's output (qkv's input) 1, the qkv output (q, k, v as saved by attention)
    3, the attention output (proj's input) 1, the residual sum (LayerNorm 2's input) 1, LayerNorm
    2's output (fc's input) 1, fc's output (GELU's input) 4, GELU's output (out's input) 4: 16,
    i.e. 32*s*b*h bytes in 16-bit: Korthikanti et al.'s 34 less their two dropout masks (1 byte
    each; dropout=True adds them back). Plain softmax attention ("eager") also keeps the
    probabilities, a*s*s*b elements (with dropout also the mask and the dropped-out copy: 5 bytes
    in 16-bit, their 5*a*s/h term); scaled_dot_product_attention ("sdpa": flash, memory-efficient
    or cuDNN kernels) keeps only a fp32 log-sum-exp per row. Small fp32 terms: two LayerNorms'
    mean and rstd per token. With activation checkpointing (each block, non-reentrant), a block
    keeps only its input, and one block at a time is recomputed in the backward.
    A MLP of another width (shape's intermediate I) saves 2*I/h elements (fc's and GELU's
    outputs), a gated one 4*I/h (gate, up, the activation and their product) in place of the 8.
    An activation other than a fused one (shape's activation: ACTIVATIONS) keeps its own number
    of I-wide tensors in place of the 2 (gelu_new: 5, so 20h where a fused GELU keeps 8h).
    attention_dropout (default: dropout) is the dropout on the attention probabilities apart from
    the residual ones (HF's attn_pdrop against resid_pdrop)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention {attention!r}: one of {', '.join(ATTENTIONS)}")
    p = PRECISION_BYTES[precision]
    s, b, h, a, L = shape["seq_len"], micro_batch, shape["hidden"], shape["heads"], shape["layers"]
    sbh = s * b * h
    inner = shape.get("intermediate") or 4 * h
    kept = ACTIVATIONS[shape.get("activation") or ("silu" if shape.get("gated") else "gelu")]
    mlp = (kept + (2 if shape.get("gated") else 0)) * inner
    per_layer = (8 * h + mlp) * p * s * b + (2 * sbh if dropout else 0) + 16 * s * b
    if attention_dropout is None:
        attention_dropout = dropout
    if attention == "eager":
        per_layer += a * s * s * b * ((2 * p + 1) if attention_dropout else p)
    else:
        per_layer += 4 * a * s * b
    stored = L * p * sbh if checkpointing else L * per_layer
    return {"per_layer": per_layer,
            "layers": stored,
            # one block recomputed at a time in the backward (checkpointing only)
            "recompute": per_layer if checkpointing else 0,
            # final LayerNorm: its input and its output (the output layer's input); token ids
            # (embedding) and targets (cross-entropy), int64
            "head": 2 * p * sbh + 16 * s * b}


def logits_bytes(shape: dict, micro_batch: int, precision: str = "bf16", logits_fp32: bool = True) -> int:
    """The cross-entropy's backward, the first thing the backward runs: the saved log-softmax
    output, the gradient arriving from nll_loss and the one log-softmax's backward writes, each
    s*b*V in the loss's precision (fp32 where the model casts logits with .float())."""
    ce = 4 if logits_fp32 else PRECISION_BYTES[precision]
    return 3 * ce * shape["seq_len"] * micro_batch * shape["vocab"]


# --- the prediction ------------------------------------------------------------------------------

def _zero_states(z: dict, N: int, P: int, W: int, p: int, buckets: int) -> tuple:
    """What ZeRO keeps on the GPU: (states, how_states, buffers, how_buf, first_grad_extra, how_extra,
    step_states). states: resident whenever the activations are (after the first optimizer step);
    buffers: ZeRO's own at that moment; first_grad_extra: what the first gradient adds (ZeRO-1/2
    buckets); step_states: the optimizer step's total. N params, P the largest one, W the world,
    p bytes per 16-bit element."""
    stage, off_opt, off_par = z["stage"], z["offload_optimizer"], z["offload_param"]
    mixed = p == 2
    master_adam = (4 if mixed else 0) + 8     # fp32 master copy + Adam's m and v, bytes/param
    fp32_grad = 4 if mixed else 0             # the fp32 gradient partition built for the step
    if stage == 3:
        bucket3 = p * z["reduce_bucket_size"] if z["contiguous_gradients"] else 0
        gather = 0 if (W == 1 and not off_par) else p * min(z["max_live_parameters"], N)
        if off_par:
            states, how_states = 0, "parameters and optimizer on the CPU"
        elif off_opt:
            states, how_states = p * N // W, "16-bit parameter partitions"
        else:
            states = (2 * p + master_adam) * N // W
            how_states = "16-bit parameter and gradient partitions, fp32 master and Adam m, v: " \
                         f"{2 * p + master_adam} bytes/param / world"
        buffers = bucket3 + gather
        how_buf = (f"reduce bucket {z['reduce_bucket_size']:.3g} x {p} B"
                   + (f" + gathered parameters {min(z['max_live_parameters'], N):.3g} x {p} B "
                      "(stage3_max_live_parameters)" if gather else
                      " (one rank: gathering a parameter is a view of its partition)"))
        first_grad_extra, how_extra = p * P, "the largest gradient before it reaches the bucket"
        # the step: the fp32 gradient partition and one fp32 temporary of the largest tensor
        step_states = states + ((fp32_grad * N // W + 4 * P) if not off_opt else 0)
    elif off_opt:  # ZeRO-1/2 with the optimizer on the CPU
        states, how_states = p * N, "16-bit parameters"
        buffers, how_buf = p * P, f"GPU staging buffer for offloaded gradients ({P:.3g} x {p} B)"
        first_grad_extra, how_extra = buckets + p * P, "reduce buckets allocated at the first gradient"
        step_states = states
    else:  # ZeRO-0/1/2
        states = p * N + master_adam * (N if stage == 0 else N // W)
        how_states = f"16-bit parameters + fp32 master and Adam m, v ({master_adam} bytes/param" \
                     + (")" if stage == 0 else " / world)")
        buffers, how_buf = 0, "none live at the activation peak"
        if stage == 0:
            first_grad_extra, how_extra = p * P, "the first gradient"
            step_states = states + p * N + (p + fp32_grad) * N  # grads, flattened copy, fp32 grads
        else:
            first_grad_extra, how_extra = buckets + p * P, "reduce buckets allocated at the first gradient"
            # the step: 16-bit gradient partition, its flattened copy and the fp32 copy (measured
            # 22 bytes/param in all on one GPU; DeepSpeed's estimate counts 20)
            step_states = states + (2 * p + fp32_grad) * N // W
    return states, how_states, buffers, how_buf, first_grad_extra, how_extra, step_states


def _peak_parts(phase: str, phases: dict, gpu_est: int, states: int, buffers: int, first_grad_extra: int,
                accumulation: int, live_acts: int, logits: int, stage: int) -> dict:
    """The peak phase's total in parts: DeepSpeed's estimate of the model states and our adjustment
    to it, ZeRO's buffers, the accumulated gradients, the activations and the logits."""
    if phase == "backward":
        parts = {"model_states": gpu_est, "states_adjust": states - gpu_est, "zero_buffers": buffers,
                 "accumulation": accumulation, "activations": live_acts, "logits": logits}
    elif phase == "first-gradient":
        parts = {"model_states": gpu_est, "states_adjust": states - gpu_est,
                 "zero_buffers": buffers + first_grad_extra, "accumulation": accumulation,
                 "activations": phases[phase] - states - buffers - accumulation - first_grad_extra,
                 "logits": 0}
    else:
        parts = {"model_states": gpu_est, "states_adjust": phases["step"] - gpu_est
                 - (buffers if stage == 3 else 0),
                 "zero_buffers": buffers if stage == 3 else 0, "accumulation": 0, "activations": 0,
                 "logits": 0}
    return parts


def _activations_how(shape: dict, micro_batch: int, p: int, act: dict, attention: str, dropout: bool,
                     ckpt: bool) -> str:
    """The activations' part of the peak in words (activation_bytes' terms)."""
    s, b, h = shape["seq_len"], micro_batch, shape["hidden"]
    activation = shape.get("activation") or ("silu" if shape.get("gated") else "gelu")
    inner = shape.get("intermediate") or 4 * h
    # elements per token and hidden unit saved per block: 8 outside the MLP, the MLP's own
    elements = 8 + (ACTIVATIONS[activation] + (2 if shape.get("gated") else 0)) * inner / h
    return (f"{s}x{b}x{h} tokens x hidden: " +
            (f"{shape['layers']} layers x {act['per_layer']} B ({elements:g} x {p} B/element saved per "
             f"block, attention {attention}, activation {activation}"
             + (", dropout" if dropout else "") + ")"
             if not ckpt else
             f"checkpointing: {shape['layers']} block inputs x {p} B + one block recomputed")
            + f" + final LayerNorm {act['head']} B")


def predict(shape: dict, preset, micro_batch: int, world: int, gpus_per_node: int, *,
            precision: str = "bf16", attention: str = "sdpa", activation_checkpointing: bool = False,
            dropout: bool = False, logits_fp32: bool = True, overhead: int = OVERHEAD_BYTES,
            grad_accum: int | None = None, attention_dropout: bool | None = None) -> dict:
    """Peak torch.cuda.max_memory_allocated() per GPU of a training step, with its parts.

    shape: model_shape(...); preset: a preset name or the merged ds_config; world: ranks in all;
    gpus_per_node: ranks per node; grad_accum: micro-steps per optimizer step (default: the
    ds_config's gradient_accumulation_steps, else 1). Returns total (bytes), parts (bytes, summing to total), how
    (a line per part), phase (the moment of the peak) and phases (each moment's total),
    model_states (DeepSpeed's estimate, GPU and CPU), inputs."""
    if micro_batch < 1 or world < 1 or gpus_per_node < 1:
        raise ValueError("micro_batch, world and gpus_per_node must be positive")
    z = zero_settings(preset)
    nodes = max(1, -(-world // gpus_per_node))
    W, N, P = world, shape["params"], shape["largest_param"]
    p = PRECISION_BYTES[precision]
    est = model_states(N, shape["largest_layer_params"], z["stage"], z["offload_optimizer"],
                       z["offload_param"], gpus_per_node, nodes)
    act = activation_bytes(shape, micro_batch, precision, attention, activation_checkpointing, dropout,
                           attention_dropout)
    logits = logits_bytes(shape, micro_batch, precision, logits_fp32)
    buckets = (2 if z["overlap_comm"] else 1) * p * z["reduce_bucket_size"] if z["contiguous_gradients"] else 0
    stage, off_opt, off_par = z["stage"], z["offload_optimizer"], z["offload_param"]

    states, how_states, buffers, how_buf, first_grad_extra, how_extra, step_states = \
        _zero_states(z, N, P, W, p, buckets)

    if grad_accum is None:
        grad_accum = int(preset.get("gradient_accumulation_steps", 1)) if isinstance(preset, dict) else 1
    accumulation, how_accum = 0, "none (one micro-step per optimizer step)"
    if grad_accum > 1 and stage in (1, 2) and not off_opt:
        accumulation = p * N // W if stage == 2 else p * N + buckets
        how_accum = ("the 16-bit gradient partition" if stage == 2 else
                     "the 16-bit gradients and the reduce buckets") + \
            f", kept across the {grad_accum} micro-steps"

    live_acts = act["layers"] + act["head"]
    phases = {
        "backward": states + buffers + accumulation + live_acts + logits,
        "first-gradient": states + buffers + accumulation + live_acts + act["recompute"] + first_grad_extra,
        "step": step_states + (buffers if stage == 3 else 0),
    }
    phase = max(phases, key=lambda k: phases[k])
    parts = _peak_parts(phase, phases, est["gpu_bytes"], states, buffers, first_grad_extra, accumulation,
                        live_acts, logits, stage)
    parts["overhead"] = int(overhead)
    parts = {k: int(v) for k, v in parts.items()}
    total = sum(parts.values())
    ckpt = activation_checkpointing
    how = {
        "model_states": f"{est['method']}(params={N}, gpus_per_node={gpus_per_node}, nodes={nodes}"
                        + (f", largest_layer={shape['largest_layer_params']}" if stage == 3 else "")
                        + f", offload_optimizer={off_opt}" + (f", offload_param={off_par}" if stage == 3 else "")
                        + ")",
        "states_adjust": (f"resident at the peak ({phase}): {how_states}" if phase != "step" else
                          "at the optimizer step: the states plus the 16-bit gradients, their "
                          "flattened copy and the fp32 copy")
                         + "; minus DeepSpeed's estimate",
        "zero_buffers": how_buf + (f"; + {how_extra}" if phase == "first-gradient" else ""),
        "accumulation": how_accum if phase != "step" else "not counted at the step",
        "activations": (_activations_how(shape, micro_batch, p, act, attention, dropout, ckpt)
                        if phase != "step" else "freed at the step"),
        "logits": (f"3 x s*b*V x {4 if logits_fp32 else p} B (log-softmax output, its gradient in and out)"
                   if phase == "backward" else "not live at this phase"),
        "overhead": "constant fitted on one H200 (docs/memory.md)",
    }
    return {"total": total, "total_gib": round(total / GiB, 2), "phase": phase,
            "phases": {k: int(v) + int(overhead) for k, v in phases.items()},
            "parts": parts, "how": how,
            "model_states": est,
            "inputs": {"preset": preset if isinstance(preset, str) else "ds_config", "zero": z,
                       "micro_batch": micro_batch, "grad_accum": grad_accum, "world": world, "gpus_per_node": gpus_per_node,
                       "precision": precision, "attention": attention,
                       "activation_checkpointing": ckpt, "dropout": dropout,
                       "attention_dropout": dropout if attention_dropout is None else attention_dropout,
                       "logits_fp32": logits_fp32,
                       "shape": dict(shape)}}


def main(argv=None):
    """python -m train.memory --size 1.3b --seq-len 2048 --preset zero2 --micro-batch 8"""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--size", default="1.3b", choices=sorted(SIZES))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--preset", default="zero2")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=1)
    ap.add_argument("--precision", default="bf16", choices=sorted(PRECISION_BYTES))
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--activation", default="gelu", choices=sorted(ACTIVATIONS))
    a = ap.parse_args(argv)
    shape = model_shape(*SIZES[a.size], a.vocab, a.seq_len, activation=a.activation)
    r = predict(shape, a.preset, a.micro_batch, a.world, a.gpus_per_node, precision=a.precision,
                activation_checkpointing=a.checkpointing, grad_accum=a.grad_accum)
    print(json.dumps({k: r[k] for k in ("total_gib", "phase", "parts", "how")}, indent=1))


if __name__ == "__main__":
    main()
