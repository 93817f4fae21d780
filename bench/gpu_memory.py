"""Peak GPU memory of train.run's model per ZeRO preset and micro-batch, against train/memory.py.

On a GPU machine with CUDA torch and DeepSpeed importable (the device image: DeepSpeed and its
missing dependencies installed from carried wheels into PYTHONPATH), from the repository root:

    python bench/gpu_memory.py --out DIR [--configs zero2:8,zero3:4,zero2:8:ckpt ...]

Each configuration runs in a fresh process (peaks are per process, so a few run side by side on
one GPU: as many as the predicted peaks allow, at most two with the optimizer on the CPU):
train.run's main() with the ds_config launch.yml would render (dscplan.ds_config: _base.json +
templates/ds_config/<preset>.json + bf16 + the batch), the 1.42 B GPT ("1.3b", seq 2048), world 1,
3 steps. DeepSpeedEngine.backward/step are wrapped to read torch.cuda's peak counters per phase
(forward, backward, step; reset after each); the run's peak is the largest. FusedAdam and CPUAdam
are JIT-built once first (TORCH_CUDA_ARCH_LIST=9.0). Results: DIR/memory.json, DIR/logs.tgz.

    python bench/gpu_memory.py --report bench/results/gpu/memory/memory.json [--markdown]

prints predicted (train/memory.py as it is now) against measured, and the overhead the data fits.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import dscplan  # pure Python, like train.config and train.memory
from train import memory
from train.config import SIZES

ROOT = Path(__file__).resolve().parents[1]

GiB = 2 ** 30
DEFAULT_CONFIGS = ("zero2-offload:8,zero3-offload:8,zero2:8,zero3:8,zero1:8,zero2:4,zero3:4,zero1:4,"
                   "zero2-offload:4,zero3-offload:4,zero0:8,zero0:4,zero2:8:ckpt")
MODEL = {"size": "1.3b", "seq_len": 2048, "vocab": 50304}
if os.environ.get("DSC_MEM_SMOKE"):  # a CPU smoke test of the script itself (no CUDA: zeros)
    MODEL = {"size": "tiny", "seq_len": 128, "vocab": 50304}
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
       "TORCH_CUDA_ARCH_LIST": "9.0"}


def parse_config(text):
    """preset:micro_batch[:ckpt][:SIZE] (SIZE a key of train.config.SIZES; default MODEL's)."""
    parts = text.split(":")
    return {"name": text, "preset": parts[0], "micro_batch": int(parts[1]),
            "checkpointing": "ckpt" in parts[2:],
            "size": next((x for x in parts[2:] if x in SIZES), MODEL["size"])}


def predicted(c):
    shape = memory.model_shape(*SIZES[c.get("size", MODEL["size"])], MODEL["vocab"], MODEL["seq_len"])
    return memory.predict(shape, c["preset"], c["micro_batch"], 1, 1,
                          activation_checkpointing=c["checkpointing"],
                          precision="bf16" if not os.environ.get("DSC_MEM_SMOKE") else "fp32")


# --- one configuration (child process) -----------------------------------------------------------

def record_phases(torch, deepspeed, engine_class):
    """Wrap deepspeed.initialize and the engine's backward and step to read torch.cuda's peak
    counters after each phase (forward, backward, step; reset after each); returns the list
    the readings go to, one dict per phase ("at": the phase)."""
    marks = []
    cuda = torch.cuda.is_available()

    def mark(at):
        if not cuda:
            marks.append(dict.fromkeys(("allocated", "max_allocated", "reserved", "max_reserved",
                                        "device_used", "device_total"), 0) | {"at": at})
            return
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        marks.append({"at": at, "allocated": torch.cuda.memory_allocated(),
                      "max_allocated": torch.cuda.max_memory_allocated(),
                      "reserved": torch.cuda.memory_reserved(),
                      "max_reserved": torch.cuda.max_memory_reserved(),
                      "device_used": total - free, "device_total": total})
        torch.cuda.reset_peak_memory_stats()

    init, backward, step = deepspeed.initialize, engine_class.backward, engine_class.step

    def initialize(*a, **k):
        r = init(*a, **k)
        mark("init")
        return r

    def wrapped_backward(self, *a, **k):
        mark("forward")
        r = backward(self, *a, **k)
        mark("backward")
        return r

    def wrapped_step(self, *a, **k):
        r = step(self, *a, **k)
        mark("step")
        return r

    deepspeed.initialize = initialize
    engine_class.backward, engine_class.step = wrapped_backward, wrapped_step
    return marks


def measured(c, rc, t0, cfg, marks, train_marks, torch, deepspeed):
    """memory.json's record of one configuration that trained: its peaks per phase and where."""
    cuda = torch.cuda.is_available()
    peak = max(marks, key=lambda m: m["max_allocated"])
    stats = torch.cuda.memory_stats() if cuda else {}
    return {**c, "rc": rc, "seconds": round(time.time() - t0, 1), "ds_config": cfg,
            "max_allocated": max(m["max_allocated"] for m in train_marks),
            "max_reserved": max(m["max_reserved"] for m in train_marks),
            "peak_phase": peak["at"], "init_max_allocated": marks[0]["max_allocated"],
            "resident_after_init": marks[0]["allocated"],
            "resident_after_steps": [m["allocated"] for m in marks if m["at"] == "step"],
            # the CUDA context, NCCL, cuBLAS/cuDNN handles: device memory outside the allocator
            "outside_allocator": max(m["device_used"] - m["reserved"] for m in train_marks),
            "device_total": marks[0]["device_total"],
            "num_alloc_retries": stats.get("num_alloc_retries", 0), "num_ooms": stats.get("num_ooms", 0),
            "marks": marks, "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "deepspeed": deepspeed.__version__}


def child(name, port, out_file, run_root, steps):
    c = parse_config(name)
    os.environ.update(ENV)
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    # After the rank's environment above: torch and DeepSpeed read it (train.run imports torch).
    import torch  # noqa: PLC0415
    import deepspeed  # noqa: PLC0415
    from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: PLC0415

    import train.run  # noqa: PLC0415

    run_dir = Path(run_root) / name.replace(":", "_")
    run_dir.mkdir(parents=True, exist_ok=True)
    sizes = {"micro_batch": c["micro_batch"], "grad_accum": 1, "train_batch": c["micro_batch"]}
    cfg = dscplan.ds_config(str(ROOT / "templates"), c["preset"], "cuda" if torch.cuda.is_available() else "cpu",
                             ["9.0"], sizes, {})
    (run_dir / "ds_config.json").write_text(json.dumps(cfg, indent=1))

    marks = record_phases(torch, deepspeed, DeepSpeedEngine)
    argv = ["--deepspeed_config", str(run_dir / "ds_config.json"),
            "--set", f"size={c['size']}", "--set", f"seq_len={MODEL['seq_len']}",
            "--set", f"steps={steps}", "--set", "save_final=false", "--set", f"run_dir={run_dir}",
            "--set", f"activation_checkpointing={'true' if c['checkpointing'] else 'false'}"]
    t0 = time.time()
    rc = train.run.main(argv)
    train_marks = [m for m in marks if m["at"] != "init"]
    if rc or not train_marks:
        Path(out_file).write_text(json.dumps({**c, "rc": rc, "error": "no training step", "marks": marks}))
        return rc or 1
    result = measured(c, rc, t0, cfg, marks, train_marks, torch, deepspeed)
    Path(out_file).write_text(json.dumps(result, indent=1))
    return rc


# --- the whole measurement ---------------------------------------------------------------------------

def build_ops(logs, configs):
    """JIT-build FusedAdam and CPUAdam (the ones the configurations need) side by side, once."""
    procs = {}
    need = {"CPUAdamBuilder" if "offload" in c["preset"] else "FusedAdamBuilder" for c in configs}
    for op in sorted(need):
        log = open(logs / f"build-{op}.log", "w")
        code = f"from deepspeed.ops.op_builder import {op} as B; B().load(); print('built')"
        procs[op] = (subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, **ENV}), log, time.time())
    out = {}
    for op, (p, log, t0) in procs.items():
        rc = p.wait()
        log.close()
        out[op] = {"rc": rc, "seconds": round(time.time() - t0, 1)}
        print(f"build {op}: rc={rc} {out[op]['seconds']} s", flush=True)
        if rc:
            print((logs / f"build-{op}.log").read_text()[-2000:], flush=True)
    return out


def measure(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError as e:
        smi = f"nvidia-smi: {e}"
    env_info = {"nvidia_smi": smi}
    import torch  # noqa: PLC0415 - measuring only: --report runs without torch
    cuda = torch.cuda.is_available()
    configs = [parse_config(t) for t in args.configs.split(",")]
    env_info["build"] = build_ops(logs, configs) if cuda else "skipped (no CUDA)"
    gpu_total = torch.cuda.mem_get_info()[1] if cuda else 2 ** 50
    for c in configs:
        c["predicted"] = predicted(c)["total"]
    pending, running, results = list(configs), {}, {}
    port = 29700

    def save():
        doc = {"model": MODEL, "steps": args.steps, "env": env_info, "gpu_total": gpu_total,
               "wall_s": round(time.time() - t_start, 1), "results": list(results.values())}
        (out / "memory.json").write_text(json.dumps(doc, indent=1))

    while pending or running:
        now = time.time() - t_start
        for c in list(pending):
            used = sum(r["c"]["predicted"] * 1.1 + 2 * GiB for r in running.values())
            offloads = sum("offload" in r["c"]["preset"] for r in running.values())
            fits = used + c["predicted"] * 1.1 + 2 * GiB <= 0.92 * gpu_total
            if (len(running) >= args.parallel or not fits or now > args.deadline
                    or ("offload" in c["preset"] and offloads >= 2)):
                continue
            port += 1
            res_file = work / f"{c['name'].replace(':', '_')}.json"
            log = open(logs / f"{c['name'].replace(':', '_')}.log", "w")
            p = subprocess.Popen([sys.executable, __file__, "--child", c["name"], "--port", str(port),
                                  "--result", str(res_file), "--work", str(work), "--steps", str(args.steps)],
                                 stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            running[c["name"]] = {"c": c, "p": p, "log": log, "file": res_file, "t0": time.time()}
            pending.remove(c)
            print(f"[{now:6.1f} s] start {c['name']} (predicted {c['predicted'] / GiB:.1f} GiB)", flush=True)
        if now > args.deadline and pending:
            for c in pending:
                results[c["name"]] = {**c, "rc": None, "skipped": "deadline"}
            pending = []
        for name, r in list(running.items()):
            rc = r["p"].poll()
            if rc is None and time.time() - r["t0"] > args.child_timeout:
                r["p"].kill()
                rc = r["p"].wait()
            if rc is None:
                continue
            r["log"].close()
            del running[name]
            try:
                res = json.loads(r["file"].read_text())
            except (OSError, ValueError):
                res = {**r["c"], "rc": rc, "error": (logs / f"{name.replace(':', '_')}.log").read_text()[-3000:]}
            res["predicted"] = r["c"]["predicted"]
            res["interval"] = [round(r["t0"] - t_start, 1), round(time.time() - t_start, 1)]
            results[name] = res
            ok = "max_allocated" in res
            print(f"[{time.time() - t_start:6.1f} s] done {name} rc={rc} "
                  + (f"peak {res['max_allocated'] / GiB:.2f} GiB allocated, {res['max_reserved'] / GiB:.2f} "
                     f"reserved, predicted {res['predicted'] / GiB:.2f} ({res['seconds']} s)" if ok
                     else res.get("error", "")[-1500:]), flush=True)
            save()
        time.sleep(1)
    save()
    with tarfile.open(out / "logs.tgz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
    print(table(json.loads((out / "memory.json").read_text())), flush=True)


# --- report ------------------------------------------------------------------------------------

def rows(doc):
    out = []
    done = [r for r in doc["results"] if "max_allocated" in r]
    for r in done:
        c = parse_config(r["name"])
        pred = predicted(c)
        # device_used is device-wide: outside-allocator memory only means something for a run
        # that had the GPU to itself (an interval no other run overlapped).
        a, b = r.get("interval", (0, 0))
        alone = "interval" in r and not any(o is not r and o.get("interval", (0, 0))[0] < b
                                            and a < o.get("interval", (0, 0))[1] for o in done)
        out.append({"name": r["name"], "pred": pred, "alloc": r["max_allocated"], "res": r["max_reserved"],
                    "outside": r.get("outside_allocator") if alone else None, "phase": r.get("peak_phase"),
                    "resident": r.get("resident_after_steps", [None])[-1]})
    return out


def earlier_rows(results_dir):
    """Peaks of earlier launch.yml runs (bench/results/gpu/*/summary-*.json: 15 or 6 steps, fresh
    processes, peak_mem_allocated_gib rounded to 0.01 GiB); the file name gives the preset and
    micro-batch (default 8), the summary the world size."""
    out = []
    for f in sorted(Path(results_dir).glob("*/summary-*.json")):
        d = json.loads(f.read_text())
        if "peak_mem_allocated_gib" not in d:
            continue
        name = f.stem[len("summary-"):]
        named = re.match(r"zero\d(-offload)?", name)
        if not named:  # preset=auto's runs (summary-auto+...): the preset it chose is in no name
            continue
        preset = named.group(0)
        mb = int(re.search(r"mb(\d+)", name).group(1)) if "mb" in name else 8
        shape = memory.model_shape(*SIZES[MODEL["size"]], MODEL["vocab"], MODEL["seq_len"])
        pred = memory.predict(shape, preset, mb, d["world"], d["world"])
        out.append({"name": f"{f.parent.name}/{name} (world {d['world']}, mb {mb})", "pred": pred,
                    "alloc": d["peak_mem_allocated_gib"] * GiB})
    return out


def earlier_table(results_dir, markdown=False):
    rs = earlier_rows(results_dir)
    head = ["run", "predicted GiB", "max allocated GiB", "pred/alloc"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] if markdown else \
        ["  ".join(f"{h:>14}" for h in head)]
    for r in rs:
        vals = [r["name"], f"{r['pred']['total'] / GiB:.2f}", f"{r['alloc'] / GiB:.2f}",
                f"{r['pred']['total'] / r['alloc']:.4f}"]
        lines.append(("| " + " | ".join(vals) + " |") if markdown else "  ".join(f"{v:>14}" for v in vals))
    return "\n".join(lines)


def table(doc, markdown=False):
    rs = rows(doc)
    lines = []
    head = ["config", "predicted GiB", "max allocated GiB", "pred/alloc", "max reserved GiB", "pred/reserved",
            "outside allocator GiB", "predicted phase", "measured phase"]
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    else:
        lines.append("  ".join(f"{h:>14}" for h in head))
    for r in rs:
        vals = [r["name"], f"{r['pred']['total'] / GiB:.2f}", f"{r['alloc'] / GiB:.2f}",
                f"{r['pred']['total'] / max(1, r['alloc']):.4f}", f"{r['res'] / GiB:.2f}",
                f"{r['pred']['total'] / max(1, r['res']):.3f}",
                f"{r['outside'] / GiB:.2f}" if r["outside"] is not None else "- (shared GPU)", r["pred"]["phase"],
                r["phase"] or "-"]
        lines.append(("| " + " | ".join(vals) + " |") if markdown else "  ".join(f"{v:>14}" for v in vals))
    resid = [r["alloc"] - (r["pred"]["total"] - r["pred"]["parts"]["overhead"]) for r in rs]
    if resid:
        worst = max(rs, key=lambda r: abs(r["pred"]["total"] / max(1, r["alloc"]) - 1))
        lines.append("")
        lines.append(f"overhead the data fits (median of measured - prediction without overhead): "
                     f"{statistics.median(resid) / 2**20:.0f} MiB (range {min(resid) / 2**20:.0f} .. "
                     f"{max(resid) / 2**20:.0f}); in use: {memory.OVERHEAD_BYTES / 2**20:.0f} MiB; worst "
                     f"prediction {worst['name']}: {worst['pred']['total'] / max(1, worst['alloc']):.4f} of measured")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="results directory (memory.json, logs.tgz)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="preset:micro_batch[:ckpt][:SIZE], comma-separated (SIZE: train.config.SIZES, e.g. 8b)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=3, help="configurations side by side on the GPU")
    ap.add_argument("--deadline", type=float, default=450, help="start no configuration after this many s")
    ap.add_argument("--child-timeout", type=float, default=240)
    ap.add_argument("--work", default="/tmp/gpu_memory")
    ap.add_argument("--report", help="memory.json to compare with the current formula")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--earlier", help="with --report: also bench/results/gpu (launch.yml runs' peaks)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29700, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.child, a.port, a.result, a.work, a.steps)
    if a.report:
        print(table(json.loads(Path(a.report).read_text()), a.markdown))
        if a.earlier:
            print()
            print(earlier_table(a.earlier, a.markdown))
        return 0
    if not a.out:
        ap.error("--out or --report")
    measure(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
