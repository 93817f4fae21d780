"""A user's own DeepSpeed script (bench/gpu_user_auto.sh runs it through launch.yml -e preset=auto
and by hand): transformers' GPT2LMHeadModel from a config (24 x 2048, 16 heads, 50257-token
vocabulary, sequence 2048, random init, dropout as GPT2Config's defaults, model in train mode),
synthetic tokens, deepspeed.initialize with the --deepspeed_config it is given (bf16, the batch
sizes from there), engine(input_ids, labels=...).loss, engine.backward, engine.step.

config.json beside it says the same model for preset=auto (attn_implementation eager, as
--attn's default); --attn sdpa runs PyTorch's scaled_dot_product_attention instead.
Prints one line at the end: RESULT {json} with tokens/s over the last --timed optimizer steps and
torch.cuda.max_memory_allocated() after step 3 and at the end (bytes)."""
import argparse
import json
import os
import time

import deepspeed
import torch
from transformers import GPT2Config, GPT2LMHeadModel

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
p.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
p.add_argument("--steps", type=int, default=12)
p.add_argument("--timed", type=int, default=8, help="optimizer steps timed at the end")
p.add_argument("--seq", type=int, default=2048)
p = deepspeed.add_config_arguments(p)
a = p.parse_args()

deepspeed.init_distributed()
local = int(os.environ.get("LOCAL_RANK", a.local_rank))
torch.cuda.set_device(local)
config = GPT2Config(n_layer=24, n_embd=2048, n_head=16, vocab_size=50257, n_positions=2048,
                    attn_implementation=a.attn)
with torch.device("cuda", local):  # random init on the GPU (the same model, built faster)
    model = GPT2LMHeadModel(config)
model.train()
engine, _, _, _ = deepspeed.initialize(args=a, model=model, model_parameters=model.parameters())
mb, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
gen = torch.Generator(device=engine.device).manual_seed(1234 + engine.global_rank)

t0, peak3, loss = None, None, None
for step in range(1, a.steps + 1):
    if step == a.steps - a.timed + 1:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
    for _ in range(accum):
        ids = torch.randint(0, config.vocab_size, (mb, a.seq), device=engine.device, generator=gen)
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    if step == 3:
        peak3 = torch.cuda.max_memory_allocated()
torch.cuda.synchronize()
elapsed = time.perf_counter() - t0
world = engine.world_size if hasattr(engine, "world_size") else 1
tokens = a.timed * accum * mb * a.seq * world
if engine.global_rank == 0:
    print("RESULT " + json.dumps({
        "attn": a.attn, "stage": engine.zero_optimization_stage(), "micro_batch": mb, "grad_accum": accum,
        "world": world, "steps": a.steps, "timed_steps": a.timed, "seconds": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 1), "loss": round(float(loss), 4),
        "max_allocated_step3": peak3, "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(), "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
    }), flush=True)
