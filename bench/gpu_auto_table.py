"""Every hand-picked DeepSpeed configuration of one transformers model on one GPU: ZeRO stage
0, 1, 2, 3 x micro-batch 1, 2, 4, 8, ... (each dividing the model's global batch, up to a cap;
a stage's ladder stops at its first out-of-memory), peak GPU memory and training speed of each,
so that preset=auto's choice can be set against the best hand-picked one.

    python bench/gpu_auto_table.py --model llama|bert|gpt2 --out FILE.jsonl [--budget 170]
    deepspeed --num_gpus 1 bench/gpu_auto_table.py --model NAME --out FILE.jsonl
    python bench/gpu_auto_table.py --write-configs      (the config.json files only; no GPU)

One process per model (plain python gets RANK=0, WORLD_SIZE=1, MASTER_ADDR/PORT by default),
looping over the configurations. Each: the model built fresh on the GPU from its config
(transformers, random init, model.train()), deepspeed.initialize with the preset's ds_config as
launch.yml composes it (dscplan.deepspeed_config.ds_config: _base.json merged with zeroN.json,
bf16 on compute capability 9.0) + train_batch_size = the global batch,
train_micro_batch_size_per_gpu = mb, gradient_accumulation_steps = global / mb, less its
"checkpoint" key; the template's AdamW (DeepSpeed's FusedAdam, JIT-built once first, timed; torch's
AdamW via "torch_adam" only where that build fails). Synthetic random tokens (labels = input_ids;
BERT's masked-LM labels -100 on 85% of positions), 1 warm-up optimizer step + 2 timed ones.
One JSON line per configuration, flushed as it lands: peak = torch.cuda.max_memory_allocated()
(reset before the model is built), the reserved peak, tokens/s and seconds per optimizer step over
the timed steps, oom and the exception's first line, GPU, versions, the attention the model ran.
A model's loop skips what is left (a line says so) once it passes --budget seconds (or --deadline).
--resume FILE keeps the configurations a FILE of earlier lines has on this GPU (their results
stand; a stage's ladder stops at the OOM recorded there) and runs the rest.

The three models (their config.json, as transformers saves it, in bench/auto_table/NAME/):
  llama  LlamaForCausalLM 20 x 2560, 20 heads (20 kv), MLP 6912, vocab 32000, sequence 2048,
         attn_implementation "eager" set in the script; global batch 32, micro-batch up to 32
  bert   BertForMaskedLM 24 x 1280, 20 heads, MLP 5120, vocab 30522, sequence 512, transformers'
         default attention; global batch 256, micro-batch up to 256
  gpt2   GPT2LMHeadModel 20 x 2304, 18 heads, 1024 positions, vocab 50257, sequence 1024,
         default attention, GPT2Config's dropout; global batch 64, micro-batch up to 64
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

from dscplan.deepspeed_config import ds_config as dscplan_ds_config

ROOT = Path(__file__).resolve().parents[1]
STAGES = (0, 1, 2, 3)

MODELS = {
    "llama": {"config": "LlamaConfig", "cls": "LlamaForCausalLM", "seq": 2048, "global_batch": 32,
              "cap": 64, "mlm": False,
              "kwargs": {"num_hidden_layers": 20, "hidden_size": 2560, "num_attention_heads": 20,
                         "num_key_value_heads": 20, "intermediate_size": 6912, "vocab_size": 32000,
                         "max_position_embeddings": 2048, "attn_implementation": "eager"}},
    "bert": {"config": "BertConfig", "cls": "BertForMaskedLM", "seq": 512, "global_batch": 256,
             "cap": 256, "mlm": True,
             "kwargs": {"num_hidden_layers": 24, "hidden_size": 1280, "num_attention_heads": 20,
                        "intermediate_size": 5120, "vocab_size": 30522,
                        "max_position_embeddings": 512}},
    "gpt2": {"config": "GPT2Config", "cls": "GPT2LMHeadModel", "seq": 1024, "global_batch": 64,
             "cap": 64, "mlm": False,
             "kwargs": {"n_layer": 20, "n_embd": 2304, "n_head": 18, "n_positions": 1024,
                        "vocab_size": 50257}},
}


def ds_config(stage, micro, global_batch, torch_adam=False):
    """The preset zeroN's ds_config as launch.yml composes it on a GPU of compute capability 9.0
    (bf16) with this batch on one GPU, less "checkpoint" (nothing is saved)."""
    sizes = {"micro_batch": micro, "grad_accum": global_batch // micro, "train_batch": global_batch}
    cfg = dscplan_ds_config(ROOT / "templates", f"zero{stage}", "cuda", ["9.0"], sizes, {})
    cfg.pop("checkpoint", None)
    if torch_adam:
        cfg["optimizer"]["params"]["torch_adam"] = True
    return cfg


def ladder(global_batch, cap):
    """1, 2, 4, ... dividing the global batch, up to cap."""
    out, mb = [], 1
    while mb <= min(cap, global_batch):
        if global_batch % mb == 0:
            out.append(mb)
        mb *= 2
    return out


def done_before(path, model, gpu):
    """{(stage, mb): line} of earlier config lines for this model on this GPU."""
    done = {}
    if not path or not Path(path).exists():
        return done
    for text in Path(path).read_text().splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if line.get("what") == "config" and line.get("model") == model and line.get("gpu") == gpu \
                and (line.get("oom") or line.get("tokens_per_s")):
            done[(line["stage"], line["micro_batch"])] = line
    return done


def make_config(name):
    import transformers  # noqa: PLC0415 - torch and DeepSpeed only where a GPU runs it
    spec = MODELS[name]
    config = getattr(transformers, spec["config"])(**spec["kwargs"])
    config.architectures = [spec["cls"]]
    return config


def write_config(name, config, folder):
    where = Path(folder) / name
    where.mkdir(parents=True, exist_ok=True)
    try:
        config.save_pretrained(str(where))
    except Exception:  # noqa: BLE001 - older/newer transformers: the plain JSON writer
        config.to_json_file(str(where / "config.json"))
    return where / "config.json"


def first_line(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


class Table:
    def __init__(self, args):
        import deepspeed  # noqa: PLC0415 - torch and DeepSpeed only where a GPU runs it
        import torch  # noqa: PLC0415 - torch and DeepSpeed only where a GPU runs it
        import transformers  # noqa: PLC0415 - torch and DeepSpeed only where a GPU runs it
        self.torch, self.deepspeed, self.transformers = torch, deepspeed, transformers
        self.args, self.spec = args, MODELS[args.model]
        self.out = open(args.out, "a", buffering=1)
        self.gpu = torch.cuda.get_device_name(0)
        self.common = {"model": args.model, "gpu": self.gpu,
                       "gpu_total_bytes": torch.cuda.get_device_properties(0).total_memory,
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "deepspeed": deepspeed.__version__}
        self.torch_adam = False

    def emit(self, line):
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()
        print(json.dumps(line)[:400], flush=True)

    def jit(self):
        """FusedAdam built (or loaded from TORCH_EXTENSIONS_DIR) once, timed; torch_adam otherwise."""
        t0 = time.perf_counter()
        try:
            from deepspeed.ops.op_builder import FusedAdamBuilder  # noqa: PLC0415 - torch and DeepSpeed only where a GPU runs it
            FusedAdamBuilder().load()
            ok, err = True, None
        except Exception as e:  # noqa: BLE001
            ok, err, self.torch_adam = False, first_line(e), True
        self.emit({"what": "jit", **self.common, "op": "fused_adam", "ok": ok, "error": err,
                   "seconds": round(time.perf_counter() - t0, 2),
                   "optimizer_used": "torch AdamW (torch_adam)" if self.torch_adam else "FusedAdam"})

    def batch(self, micro, gen, vocab):
        torch = self.torch
        ids = torch.randint(0, vocab, (micro, self.spec["seq"]), device="cuda", generator=gen)
        if not self.spec["mlm"]:
            return ids, ids
        drop = torch.rand((micro, self.spec["seq"]), device="cuda", generator=gen) < 0.85
        return ids, ids.masked_fill(drop, -100)

    def run_one(self, stage, micro, state):
        """One configuration; what it holds lives in `state` (the caller frees it, OOM or not)."""
        torch, spec = self.torch, self.spec
        gb = spec["global_batch"]
        accum = gb // micro
        state["phase"] = "build"
        torch.cuda.reset_peak_memory_stats()
        config = make_config(self.args.model)
        with torch.device("cuda", 0):
            state["model"] = getattr(self.transformers, spec["cls"])(config)
        model = state["model"]
        model.train()
        state["attn"] = getattr(model.config, "_attn_implementation", None)
        state["params"] = sum(p.numel() for p in model.parameters())
        state["phase"] = "init"
        cfg = ds_config(stage, micro, gb, self.torch_adam)
        engine, optimizer, _, _ = self.deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg)
        state["engine"], state["optimizer"] = engine, optimizer
        del model, optimizer
        torch.cuda.synchronize()
        state["peak_init"] = torch.cuda.max_memory_allocated()
        state["optimizer_class"] = type(engine.optimizer).__name__
        state["basic_optimizer"] = type(getattr(engine, "basic_optimizer", None)).__name__
        gen = torch.Generator(device="cuda").manual_seed(1234)
        vocab = config.vocab_size

        def opt_step():
            loss = None
            for _ in range(accum):
                ids, labels = self.batch(micro, gen, vocab)
                loss = engine(input_ids=ids, labels=labels).loss
                engine.backward(loss)
                engine.step()
            return loss

        state["phase"] = "warmup"
        t0 = time.perf_counter()
        opt_step()
        torch.cuda.synchronize()
        state["warmup_s"] = time.perf_counter() - t0
        state["peak_warmup"] = torch.cuda.max_memory_allocated()
        state["phase"] = "timed"
        t0 = time.perf_counter()
        for _ in range(self.args.timed):
            loss = opt_step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        state["elapsed"] = elapsed
        state["loss"] = float(loss)
        state["phase"] = "done"

    def cleanup(self, state):
        engine = state.pop("engine", None)
        if engine is not None:
            try:
                engine.destroy()
            except Exception as e:  # noqa: BLE001
                print(f"engine.destroy: {first_line(e)}", flush=True)
        for key in ("model", "optimizer"):
            state.pop(key, None)
        del engine
        gc.collect()
        self.torch.cuda.empty_cache()

    def run(self):
        torch, spec, args = self.torch, self.spec, self.args
        gb, seq = spec["global_batch"], spec["seq"]
        mbs = ladder(gb, spec["cap"])
        todo = [(s, m) for s in STAGES for m in mbs]
        before = done_before(args.resume, args.model, self.gpu)
        start, took = time.perf_counter(), {}
        budget = args.budget
        if args.deadline:  # the wrapper's share of the call for this model
            budget = max(0.0, min(budget, args.deadline - time.time()))
        for stage in STAGES:
            for micro in mbs:
                if (stage, micro) in before:
                    prev = before[(stage, micro)]
                    todo.remove((stage, micro))
                    if prev.get("oom") or prev.get("error"):
                        todo = [c for c in todo if c[0] != stage]
                        break
                    continue
                elapsed = time.perf_counter() - start
                est = took.get((stage - 1, micro), 0.0)
                if elapsed > budget or elapsed + est > budget + args.slack:
                    self.emit({"what": "skipped", **self.common, "after_s": round(elapsed, 1),
                               "budget_s": round(budget, 1),
                               "skipped": [f"zero{s}:mb{m}" for s, m in todo],
                               "reason": f"time guard: the model's loop passed {budget:.0f} s "
                                         f"(or the next configuration, by the same micro-batch "
                                         f"one stage lower, would pass it by {args.slack:.0f} s)"})
                    return
                todo.remove((stage, micro))
                state, t0 = {}, time.perf_counter()
                oom, error = False, None
                alloc_start = torch.cuda.memory_allocated()
                try:
                    self.run_one(stage, micro, state)
                except torch.OutOfMemoryError as e:
                    oom, error = True, first_line(e)
                except Exception as e:  # noqa: BLE001
                    error = first_line(e)
                    oom = "out of memory" in error.lower() or "ALLOC_FAILED" in error
                peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
                self.cleanup(state)
                seconds = time.perf_counter() - t0
                took[(stage, micro)] = seconds
                elapsed = state.get("elapsed")
                tokens = args.timed * gb * seq
                line = {"what": "config", **self.common, "stage": stage, "micro_batch": micro,
                        "grad_accum": gb // micro, "global_batch": gb, "seq_len": seq,
                        "params": state.get("params"), "attn_implementation": state.get("attn"),
                        "optimizer": state.get("optimizer_class"),
                        "basic_optimizer": state.get("basic_optimizer"),
                        "peak_bytes": peak, "peak_gib": round(peak / 2 ** 30, 2),
                        "reserved_peak_bytes": reserved,
                        "reserved_peak_gib": round(reserved / 2 ** 30, 2),
                        "peak_init_bytes": state.get("peak_init"),
                        "peak_warmup_bytes": state.get("peak_warmup"),
                        "tokens_per_s": round(tokens / elapsed, 1) if elapsed else None,
                        "step_s": round(elapsed / args.timed, 3) if elapsed else None,
                        "warmup_s": round(state["warmup_s"], 3) if "warmup_s" in state else None,
                        "timed_steps": args.timed, "loss": state.get("loss"),
                        "oom": oom, "error": error,
                        "phase": state.get("phase") if error else None,
                        "alloc_at_start_bytes": alloc_start,
                        "seconds": round(seconds, 2)}
                self.emit(line)
                if error:  # OOM (or another failure): this stage's ladder ends here
                    todo = [c for c in todo if c[0] != stage]
                    break
        self.emit({"what": "model_done", **self.common, "seconds": round(time.perf_counter() - start, 1)})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS))
    p.add_argument("--out", help="JSON lines, appended")
    p.add_argument("--budget", type=float, default=170.0, help="seconds for the model's loop")
    p.add_argument("--deadline", type=float, help="epoch seconds: the loop's budget ends here too")
    p.add_argument("--slack", type=float, default=20.0, help="how far a configuration may run past")
    p.add_argument("--timed", type=int, default=2, help="timed optimizer steps (after 1 warm-up)")
    p.add_argument("--resume", help="earlier JSON lines: their configurations on this GPU stand")
    p.add_argument("--config-dir", default=str(ROOT / "bench" / "auto_table"))
    p.add_argument("--write-configs", action="store_true", help="write the config.json files, exit")
    p.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher's argument
    args = p.parse_args()
    if args.write_configs:
        for name in MODELS:
            print(write_config(name, make_config(name), args.config_dir))
        return
    if not (args.model and args.out):
        p.error("--model and --out are needed (or --write-configs)")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29611")):
        os.environ.setdefault(key, value)
    import torch  # noqa: PLC0415 - torch and DeepSpeed only where a GPU runs it
    torch.cuda.set_device(0)
    import deepspeed  # noqa: PLC0415 - torch and DeepSpeed only where a GPU runs it
    from deepspeed.utils import logger  # noqa: PLC0415 - torch and DeepSpeed only where a GPU runs it
    logger.setLevel(logging.WARNING)  # one ds_config dump per initialize otherwise
    deepspeed.init_distributed(dist_backend="nccl")
    write_config(args.model, make_config(args.model), args.config_dir)
    table = Table(args)
    table.jit()
    table.run()


if __name__ == "__main__":
    sys.exit(main())
