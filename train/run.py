"""DeepSpeed training entry point: a GPT-style decoder or a BERT-style MLM, with exact resume.

Single node (one process per GPU, or ranks on CPU with DS_ACCELERATOR=cpu), from the repository
root, with node/ on the import path for the run directory's names (a launch's ranks have them from
the node helper, which runs this module):
    PYTHONPATH=$PWD/node deepspeed --num_gpus 1 --module train.run --deepspeed_config ds_config.json --set size=125m
Multi-node, as launch.yml runs it from the master (same paths on every node):
    deepspeed --hostfile hostfile --master_addr ADDR --master_port 29500 \
        --module train.run --deepspeed_config ds_config.json --config train.json [--resume]

The contract (any script that keeps it can be run by launch.yml):
  - arguments: --deepspeed_config PATH (the rendered ds_config), --resume (continue from the latest
    complete checkpoint), anything else the script wants (here --config FILE and --set key=value);
  - environment: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launcher, plus the
    cluster's .deepspeed_env; DSC_RUN_DIR is the run directory (same path on every node);
  - outputs, in the run directory: metrics.jsonl (one JSON object per logged step),
    summary.json at the end, checkpoints/<tag>/ with a COMPLETE marker once fully written
    (the newest keep_checkpoints complete ones are kept; train/checkpoints.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

# The run directory's names (RunDir): in a rank, dscnode is the node helper that runs this module
# (its entry shim); on the control node, the venv's dscluster.pth lists node/.
from dscnode.rundir import RunDir
from train.checkpoints import (fsync_path, fsync_tree, latest_complete, mark_complete, needed_bytes,
                               prune, space_problem, tree_size)
from train.config import ConfigError, load_config
from train.data import Batches, load_tokens, rank_info
from train.memory import model_states
from train.model import build_model, flops_per_token, largest_layer_params

# Dense bf16/fp16 peak per GPU, for MFU (vendor datasheets).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
              "V100": 125e12}


def parse_args(argv):
    p = argparse.ArgumentParser(description="DeepSpeed GPT/BERT training (see module docstring)")
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="ds_config", default="",
                   help="ds_config.json rendered by launch.yml (default: $DSC_RUN_DIR/ds_config.json)")
    p.add_argument("--config", default="", help="JSON file of training settings (train/config.py)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def choose_precision(ds_cfg: dict, wanted: str, device: str) -> str:
    for key in ("bf16", "fp16"):
        if ds_cfg.get(key, {}).get("enabled"):
            return key
    if wanted != "auto":
        return wanted
    if device == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def memory_estimate(model, stage: int, offload: bool, gpus_per_node: int, nodes: int, cfg=None,
                    ds_cfg=None, micro_batch=None, precision=None) -> dict:
    """DeepSpeed's model-state estimate (bytes per GPU / per node CPU, train/memory.py's
    model_states); with the run's config, also train/memory.py's peak prediction (model states +
    activations + logits, per GPU) as "predicted"."""
    n = sum(p.numel() for p in model.parameters())
    predicted = {}
    if cfg is not None and ds_cfg is not None and micro_batch:
        try:
            from train.memory import predict, shape_from_config  # noqa: PLC0415 - in the try: never fail a run
            shape = dict(shape_from_config(cfg), params=n)
            r = predict(shape, ds_cfg, micro_batch, gpus_per_node * nodes, gpus_per_node,
                        precision=precision if precision in ("bf16", "fp16") else "fp32",
                        activation_checkpointing=cfg.activation_checkpointing)
            predicted = {"predicted": {"method": "train/memory.py", "gpu_bytes": r["total"], "phase": r["phase"],
                                       "parts": r["parts"]}}
        except Exception as e:  # noqa: BLE001 - never fail a run over a prediction
            predicted = {"predicted": {"method": f"unavailable: {e}"}}
    # DeepSpeed's own estimators in closed form (tests/unit/test_memory.py holds them equal to
    # DeepSpeed's), and the ZeRO paper's split for stages 0 and 1, which DeepSpeed has none for.
    largest = largest_layer_params(model) if stage == 3 else 0  # ZeRO-3 gathers a layer at a time
    states = model_states(n, largest, stage, offload, offload and stage == 3, gpus_per_node, nodes)
    return {**states, **predicted}


def lr_at(cfg, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * min(1.0, frac)))


def peak_flops(device: str):
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def shutdown():
    """Leave together and tear the process group down: a rank that exits with collectives'
    threads still alive dies with "terminate called without an active exception"."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def read_configs(args):
    """(cfg, run_dir, ckpt_dir, ds_cfg): the training settings and the DeepSpeed config, or a
    ConfigError naming what is wrong."""
    cfg = load_config(args.config or None, args.set)
    run_dir = Path(cfg.run_dir or os.environ.get("DSC_RUN_DIR") or os.getcwd())
    ckpt_dir = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else run_dir / RunDir.CHECKPOINTS
    ds_path = args.ds_config or str(run_dir / RunDir.DS_CONFIG)
    try:
        ds_cfg = json.loads(Path(ds_path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read the DeepSpeed config {ds_path}: {e}") from e
    return cfg, run_dir, ckpt_dir, ds_cfg


def settle_precision_and_batch(ds_cfg: dict, wanted: str, device: str):
    """(precision, micro_batch, grad_accum), written into ds_cfg as DeepSpeed reads them (the
    train batch left to DeepSpeed: micro_batch x grad_accum x world)."""
    precision = choose_precision(ds_cfg, wanted, device)
    for key in ("bf16", "fp16"):
        ds_cfg.setdefault(key, {})["enabled"] = precision == key
    if precision == "fp16":
        ds_cfg["fp16"].setdefault("loss_scale", 0)  # dynamic loss scaling
        ds_cfg["fp16"].setdefault("loss_scale_window", 1000)
    mb = int(ds_cfg.get("train_micro_batch_size_per_gpu", 1))
    ga = int(ds_cfg.get("gradient_accumulation_steps", 1))
    ds_cfg.setdefault("train_micro_batch_size_per_gpu", mb)
    ds_cfg.setdefault("gradient_accumulation_steps", ga)
    ds_cfg.pop("train_batch_size", None)  # derived by DeepSpeed from mb x ga x world
    return precision, mb, ga


def zero_and_memory_estimate(model, cfg, ds_cfg: dict, world: int, mb: int, precision: str):
    """(ZeRO stage, whether the optimizer is offloaded, memory_estimate's record: {} unless
    cfg.estimate_memory)."""
    zero = ds_cfg.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    offload = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    gpus_per_node = int(os.environ.get("LOCAL_SIZE", 1))
    estimate = memory_estimate(model, stage, offload, gpus_per_node, max(1, world // gpus_per_node),
                               cfg=cfg, ds_cfg=ds_cfg, micro_batch=mb, precision=precision) \
        if cfg.estimate_memory else {}
    return stage, offload, estimate


def resume_step(engine, ckpt_dir: Path, rank: int) -> int:
    """Load the newest checkpoint complete on every node; its step (0 where there is none)."""
    # Node-local disks each hold their own ranks' shards and markers: take the newest step
    # that is complete on every node (the same logic holds on a shared filesystem).
    tag = latest_complete(ckpt_dir)
    newest = torch.tensor([int(tag.name[4:]) if tag else -1], dtype=torch.long, device=engine.device)
    torch.distributed.all_reduce(newest, op=torch.distributed.ReduceOp.MIN)
    if newest.item() < 0:
        if rank == 0:
            print(f"resume: no complete checkpoint in {ckpt_dir}; starting from step 0", flush=True)
        return 0
    tag = ckpt_dir / f"step{newest.item()}"
    _, ckpt_state = engine.load_checkpoint(str(ckpt_dir), tag=tag.name)
    start_step = int(ckpt_state["step"])
    if rank == 0:
        print(f"resume: loaded {tag} (step {start_step})", flush=True)
    return start_step


class Checkpoints:
    """The run's checkpoints under ckpt_dir: each marked complete once every node has it on stable
    storage, the newest cfg.keep_checkpoints kept."""

    def __init__(self, engine, cfg, ckpt_dir: Path, local_rank: int, world: int, n_params: int):
        self.engine, self.cfg, self.ckpt_dir = engine, cfg, ckpt_dir
        self.local_rank, self.world, self.n_params = local_rank, world, n_params
        self.node = os.uname().nodename
        # Who marks each checkpoint complete and prunes: each node's local rank 0 its node's, and
        # global rank 0 alone where every node saves to one shared directory (not node-local).
        self.keeper = local_rank == 0 and (engine.use_node_local_storage() or torch.distributed.get_rank() == 0)

    def check_space(self, tag):
        """Each node's local rank 0 compares the free space at the checkpoint dir with what the
        next checkpoint needs; all ranks agree on the verdict, so that a node short of space
        makes every rank raise together (one raising alone leaves the others waiting in the
        collective save until the timeout)."""
        ckpt_dir = self.ckpt_dir
        problem = None
        if self.local_rank == 0:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            newest = latest_complete(ckpt_dir)
            needed = needed_bytes(tree_size(newest) if newest else None, self.n_params)
            problem = space_problem(tag, ckpt_dir, self.node, shutil.disk_usage(ckpt_dir).free, needed,
                                    self.cfg.keep_checkpoints)
        short = torch.tensor([1 if problem else 0], dtype=torch.long, device=self.engine.device)
        torch.distributed.all_reduce(short, op=torch.distributed.ReduceOp.MAX)
        if short.item():
            problems = [None] * self.world
            torch.distributed.all_gather_object(problems, problem)
            problems = list(dict.fromkeys(p for p in problems if p))
            shutdown()
            more = f" (and {len(problems) - 1} more nodes short of space)" if len(problems) > 1 else ""
            raise RuntimeError(problems[0] + more)

    def save(self, step):
        ckpt_dir, cfg = self.ckpt_dir, self.cfg
        tag = f"step{step}"
        self.check_space(tag)
        self.engine.save_checkpoint(str(ckpt_dir), tag=tag,
                                    client_state={"step": step, "data_position": step,
                                                  "config": cfg.to_dict()})
        torch.distributed.barrier()
        if self.keeper:
            # Written on every node only after every rank has saved and the checkpoint is on
            # stable storage: the marker is what makes a checkpoint "complete"; a write
            # interrupted before it (or lost with the page cache) is never resumed from.
            fsync_tree(ckpt_dir / tag)
            fsync_path(ckpt_dir, directory=True)
            mark_complete(ckpt_dir / tag, json.dumps({"step": step, "time": time.time()}), self.node)
        torch.distributed.barrier()
        if self.keeper:
            # Past the second barrier the marker is on every node: older checkpoints can go.
            removed, failed = prune(ckpt_dir, cfg.keep_checkpoints, step)
            if removed:
                print(f"checkpoint {tag} complete; removed {', '.join(removed)} "
                      f"(keep_checkpoints={cfg.keep_checkpoints})", flush=True)
            for old, e in failed:
                print(f"checkpoint: cannot remove {ckpt_dir / old}: {e}", file=sys.stderr, flush=True)


def train_step(engine, batches, cfg, step: int, ga: int, world: int, device: str):
    """One optimizer step of ga micro-batches: (the loss averaged over the ranks, lr, seconds). A
    paced run (min_step_s) sleeps the rest of the step before the loss's all-reduce, so that every
    rank leaves the step at once: slept after it, a rank held up once (a stop while it slept) would
    start each later step behind the others and look, to the ranks' times (ranktimes.py), like a
    rank the others wait for. The seconds are the step's own, the sleep left out."""
    t0 = time.time()
    lr = lr_at(cfg, step)
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    loss_sum = 0.0
    for k in range(ga):
        x, y = batches.micro_batch(step, k, engine.device)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        loss_sum += loss.detach().float()
    loss_t = torch.as_tensor(loss_sum / ga, device=engine.device, dtype=torch.float32)
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.time() - t0
    if cfg.min_step_s > dt:
        time.sleep(cfg.min_step_s - dt)
    t1 = time.time()
    torch.distributed.all_reduce(loss_t)
    mean_loss = loss_t.item() / world
    return mean_loss, lr, dt + time.time() - t1


def rss_max_gib() -> float:
    """This process's peak resident memory so far, GiB (ru_maxrss is in KiB on Linux)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)


def log_step(metrics, cfg, step, mean_loss, lr, dt, tokens_per_step, fpt, world, peak, device):
    """Rank 0: the step's line in metrics.jsonl and on stdout."""
    tps = tokens_per_step / dt
    # total_steps: the run's end, which status and follow show beside the step
    rec = {"step": step, "total_steps": cfg.steps, "time": round(time.time(), 3),
           "loss": round(mean_loss, 6), "lr": lr, "tokens_per_s": round(tps, 1),
           "samples_per_s": round(tps / cfg.seq_len, 2), "step_time_s": round(dt, 4),
           "tflops": round(tps * fpt / world / 1e12, 4)}
    if peak:
        rec["mfu"] = round(tps * fpt / world / peak, 4)
    if device == "cuda":
        rec["mem_allocated_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        rec["mem_reserved_gib"] = round(torch.cuda.memory_reserved() / 2**30, 2)
    else:
        rec["rss_max_gib"] = rss_max_gib()
    metrics.write(json.dumps(rec) + "\n")
    metrics.flush()
    print(f"step {step}/{cfg.steps} loss {mean_loss:.4f} lr {lr:.2e} "
          f"{tps:,.0f} tok/s {dt*1000:.0f} ms/step", flush=True)


def write_summary(run_dir, *, step, start_step, world, precision, stage, losses, step_times, first_step_s,
                  tokens_per_step, fpt, peak, estimate, device):
    """Rank 0: summary.json and the SUMMARY line (throughput over the steps after the first)."""
    steady = step_times[1:] or step_times
    tps = tokens_per_step / (sum(steady) / len(steady)) if steady else 0.0
    summary = {"steps": step, "start_step": start_step, "world": world, "precision": precision,
               "zero_stage": stage, "final_loss": losses[-1] if losses else None,
               "first_loss": losses[0] if losses else None, "tokens_per_s": round(tps, 1),
               "tflops": round(tps * fpt / world / 1e12, 2),
               "mfu": round(tps * fpt / world / peak, 4) if peak else None,
               "time_to_first_step_s": round(first_step_s or 0, 2),
               "memory_estimate": estimate}
    if device == "cuda":
        summary["peak_mem_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    else:
        summary["rss_max_gib"] = rss_max_gib()
    (run_dir / RunDir.SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    print("SUMMARY " + json.dumps(summary), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg, run_dir, ckpt_dir, ds_cfg = read_configs(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    # DeepSpeed after the configs are read: their errors answer without its start-up.
    import deepspeed  # noqa: PLC0415
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

    t_start = time.time()
    # the total beside the entry shim's first progress lines, before metrics.jsonl has a line
    os.environ["DSC_TOTAL_STEPS"] = str(cfg.steps)
    timeout = datetime.timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", cfg.timeout_min)))
    deepspeed.init_distributed(timeout=timeout)
    rank, world, local_rank = rank_info()
    accel = get_accelerator()
    device = "cuda" if accel.device_name() == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    precision, mb, ga = settle_precision_and_batch(ds_cfg, cfg.precision, device)

    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    if cfg.compile:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    stage, offload, estimate = zero_and_memory_estimate(model, cfg, ds_cfg, world, mb, precision)

    n_params = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(model, cfg)  # before ZeRO-3 partitions the parameters
    optimizer = None
    if "optimizer" not in ds_cfg:
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           optimizer=optimizer, config=ds_cfg)
    start_step = resume_step(engine, ckpt_dir, rank) if args.resume else 0

    tokens = load_tokens(cfg)
    batches = Batches(cfg, tokens, mb, ga, world, rank)
    peak = peak_flops(device)
    tokens_per_step = mb * ga * world * cfg.seq_len
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    metrics = (run_dir / RunDir.METRICS).open("a") if rank == 0 else None
    if rank == 0:
        print(json.dumps({"event": "start", "rank0_host": os.uname().nodename, "world": world,
                          "precision": precision, "zero_stage": stage, "offload": offload,
                          "params": n_params,
                          "memory_estimate": estimate, "start_step": start_step}), flush=True)

    checkpoints = Checkpoints(engine, cfg, ckpt_dir, local_rank, world, n_params)
    losses, step_times, first_step_s = [], [], None
    step = start_step
    while step < cfg.steps:
        mean_loss, lr, dt = train_step(engine, batches, cfg, step, ga, world, device)
        step += 1
        first_step_s = first_step_s or (time.time() - t_start)
        losses.append(mean_loss)
        step_times.append(dt)
        if rank == 0 and (step % cfg.log_every == 0 or step == cfg.steps):
            log_step(metrics, cfg, step, mean_loss, lr, dt, tokens_per_step, fpt, world, peak, device)
        if cfg.stop_at and step >= cfg.stop_at:
            if rank == 0:
                print(f"stop_at={cfg.stop_at}: ending without a final checkpoint", flush=True)
            shutdown()
            return 0
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
            checkpoints.save(step)
    if cfg.save_final and step > start_step:
        checkpoints.save(step)
    if rank == 0:
        write_summary(run_dir, step=step, start_step=start_step, world=world, precision=precision, stage=stage,
                      losses=losses, step_times=step_times, first_step_s=first_step_s,
                      tokens_per_step=tokens_per_step, fpt=fpt, peak=peak, estimate=estimate, device=device)
    shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    # The run is written (summary.json, checkpoints, the last progress line) and the process
    # group is down, yet gloo's worker threads can still abort the interpreter's finalization
    # ("terminate called without an active exception", seen once in ~50 CPU runs; see
    # pytorch/pytorch#179291), which would fail a finished run: leave without finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
