"""Benchmark (not a test): transformers' run_clm.py (tests/fixtures/scripts/clm, HF Trainer) on a GPU
machine, through launch.yml (hf mode, the toolkit's preset with HF's "auto" values) and by hand
with `deepspeed --num_gpus 1` and the very same ds_config.json and arguments, in one call.

    bench/gpu_launch.sh WHEELS clm OUT_DIR [gpu_clm.py options]   (on the device)

The model is GPT-2 124M (12 x 768, 12 heads, 50257-token vocabulary, random init), sequence 1024,
bf16, micro-batch 8, on the fixture's tokenizer and text (repeated). The figure compared is HF's
own `train_samples_per_second` over `--max_steps` steps, from each run's log (its clock starts after
the DeepSpeed engine is set up, so a long run leaves only the first steps' warm-up in it). Reps alternate
which side goes first (--first: the first rep's). Writes OUT_DIR/clm.json and each run's log.
`gpu_clm.py --pool A/clm.json B/clm.json ...` pools the pairs of several calls (here, no GPU).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "scripts"
DATA = Path("/tmp/clm-bench-data")
RUNS = "/opt/dscluster/runs"
GPT2_124M = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024,
             "vocab_size": 50257, "bos_token_id": 0, "eos_token_id": 0}


def entry_args(steps):
    return ["--model_type", "gpt2", "--config_name", f"{DATA}/gpt2-124m", "--tokenizer_name", f"{DATA}/tokenizer",
            "--train_file", f"{DATA}/train.txt", "--block_size", "1024", "--per_device_train_batch_size", "8",
            "--do_train", "--max_steps", str(steps), "--logging_steps", "50", "--save_strategy", "no",
            "--bf16", "--output_dir", "out", "--report_to", "none"]


def make_data():
    if (DATA / "train.txt").exists():
        return
    DATA.mkdir(parents=True)
    shutil.copytree(FIXTURES / "data" / "tokenizer", DATA / "tokenizer")
    # the fixture's tokenizer says 128 tokens; run_clm.py caps --block_size at it
    tok = json.loads((DATA / "tokenizer" / "tokenizer_config.json").read_text())
    (DATA / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(dict(tok, model_max_length=1024)))
    (DATA / "gpt2-124m").mkdir()
    (DATA / "gpt2-124m" / "config.json").write_text(json.dumps(GPT2_124M, indent=1))
    text = (FIXTURES / "data" / "train.txt").read_text()
    (DATA / "train.txt").write_text(text * 40)  # about 4 MB: enough 1024-token blocks


def playbook(*args):
    command = os.environ.get("DSC_ANSIBLE_PLAYBOOK", "ansible-playbook").split()
    r = subprocess.run([*command, "-i", "bench/inventory/gpu-local", *args], cwd=ROOT, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       env=dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg")))
    return r


def samples_per_s(log):
    m = re.findall(r"train_samples_per_second\s*=\s*([\d.]+)", log)
    return float(m[-1]) if m else None


def via_playbook(preset, run_id, steps, out):
    shutil.rmtree(f"{RUNS}/{run_id}", ignore_errors=True)
    t0 = time.time()
    r = playbook("launch.yml", "-e", f"preset={preset}", "-e", f"run_id={run_id}", "-e", "follow=true",
                 "-e", "dsc_ds_config_mode=hf", "-e", f"dsc_code_dir={FIXTURES / 'clm'}",
                 "-e", "dsc_entry_script=run_clm.py", "-e", "dsc_slots=1",  # one GPU, as by hand
                 "-e", json.dumps({"dsc_entry_args": entry_args(steps), "dsc_resume_args": []}))
    wall = time.time() - t0
    log = Path(f"{RUNS}/{run_id}/launcher.log").read_text() if Path(f"{RUNS}/{run_id}/launcher.log").exists() else ""
    (out / f"{run_id}.log").write_text(r.stdout[-20000:] + "\n==== launcher.log ====\n" + log)
    if r.returncode != 0:
        sys.exit(f"launch.yml {run_id} failed:\n{r.stdout[-4000:]}")
    return {"samples_per_s": samples_per_s(log), "wall_s": round(wall, 1)}


def by_hand(template, run_id, steps, out):
    """What a user types: the same script, arguments and ds_config.json, `deepspeed --num_gpus 1`."""
    src = Path(f"{RUNS}/{template}")
    work = Path(f"/tmp/{run_id}")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(src / "code", work)
    shutil.rmtree(work / "out", ignore_errors=True)
    cfg = json.loads((src / "ds_config.json").read_text())
    cfg.pop("csv_monitor", None)  # the toolkit's monitor writes into its run dir; nothing of the kind by hand
    (work / "ds_config.json").write_text(json.dumps(cfg))
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    t0 = time.time()
    r = subprocess.run(["/opt/torch/.venv/bin/deepspeed", "--num_gpus", "1", "--master_port", "29611",
                        "run_clm.py", "--deepspeed", str(work / "ds_config.json"), *entry_args(steps)],
                       cwd=work, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    (out / f"{run_id}.log").write_text(r.stdout)
    if r.returncode != 0:
        sys.exit(f"by hand {run_id} failed:\n{r.stdout[-4000:]}")
    return {"samples_per_s": samples_per_s(r.stdout), "wall_s": round(wall, 1)}


def pool(paths):
    """Every pair from several calls' clm.json: per preset the medians of each side, their ratio,
    and each pair's ratio (pairs are the runs of one rep, in the order they were made)."""
    pooled = {}
    for path in paths:
        for preset, rows in json.loads(Path(path).read_text()).items():
            into = pooled.setdefault(preset, {"launch": [], "hand": [], "pairs": []})
            for launch, hand in zip(rows["launch"], rows["hand"], strict=True):
                into["launch"].append(launch["samples_per_s"])
                into["hand"].append(hand["samples_per_s"])
                into["pairs"].append(round(launch["samples_per_s"] / hand["samples_per_s"], 3))
    for preset, rows in pooled.items():
        rows["ratio"] = round(statistics.median(rows["launch"]) / statistics.median(rows["hand"]), 3)
        print(f"{preset}: {len(rows['pairs'])} pairs, launch.yml median {statistics.median(rows['launch']):.1f} "
              f"samples/s, by hand {statistics.median(rows['hand']):.1f}, ratio {rows['ratio']}; "
              f"pair ratios {rows['pairs']}", file=sys.stderr)  # stdout: the JSON alone
    return pooled


def main():
    if sys.argv[1:2] == ["--pool"]:  # gpu_clm.py --pool A/clm.json B/clm.json ...
        print(json.dumps(pool(sys.argv[2:]), indent=1))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--presets", nargs="+", default=["zero2", "zero3"])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--provision", action="store_true")
    p.add_argument("--first", choices=["launch", "hand"], default="launch",
                   help="the side that goes first in the first rep (later reps alternate)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    make_data()
    if a.provision:
        r = playbook("provision.yml", "-e", json.dumps({"dsc_requirements": ["datasets==5.0.1"]}))
        (out / "provision.log").write_text(r.stdout[-30000:])
        if r.returncode != 0:
            sys.exit(f"provision.yml failed:\n{r.stdout[-4000:]}")
    results = json.loads((out / "clm.json").read_text()) if (out / "clm.json").exists() else {}
    for preset in a.presets:
        rows = results.setdefault(preset, {"launch": [], "hand": []})
        for rep in range(a.reps):
            stamp = f"{preset}-{int(time.time())}"
            sides = ["launch", "hand"] if (rep + (a.first == "hand")) % 2 == 0 else ["hand", "launch"]
            template = None
            if sides[0] == "hand":  # the hand side needs a run directory to copy: launch first once
                template = f"clm-{stamp}-t"
                via_playbook(preset, template, 10, out)
            for side in sides:
                if side == "launch":
                    run_id = f"clm-{stamp}"
                    rows["launch"].append(via_playbook(preset, run_id, a.steps, out))
                    template = template or run_id
                else:
                    rows["hand"].append(by_hand(template, f"hand-{stamp}", a.steps, out))
                rows[side][-1]["first"] = sides[0]
                print(preset, side, rows[side][-1], flush=True)
                (out / "clm.json").write_text(json.dumps(results, indent=1))
        launch = statistics.median(r["samples_per_s"] for r in rows["launch"])
        hand = statistics.median(r["samples_per_s"] for r in rows["hand"])
        rows["ratio"] = round(launch / hand, 3)
        print(f"{preset}: launch.yml {launch:.1f} samples/s, by hand {hand:.1f}, ratio {rows['ratio']}", flush=True)
        (out / "clm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
