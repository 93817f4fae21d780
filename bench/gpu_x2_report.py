"""Tables for docs/benchmarks.md from the two-GPU machine's results (bench/results/gpu/x2{a,b,c}).

    python3 bench/gpu_x2_report.py      # prints Markdown, writes bench/results/gpu/summary-x2.json

x2d (a later lease): zero3 on one GPU, zero2 at micro-batch 16 on two.
x2a: provision, preflight (NCCL all-reduce across both GPUs), zero2 and zero3 on 2 GPUs, hand-run
ZeRO-2 on 2 GPUs. x2b and x2c: one GPU of the same kind of machine, the tuning variants (+compile,
+mbN) beside hand-run ZeRO-2 and plain PyTorch. Steady rate: mean step time over the steps after
the third, tokens per step from the run's own metrics.
"""
import json
import re
from pathlib import Path

RES = Path(__file__).resolve().parents[1] / "bench" / "results" / "gpu"
L, D, T, V, N = 24, 2048, 2048, 50304, 1_418_399_744
FPT_REF = 6 * N + 12 * L * D * T   # as gpt_reference.py counts (embedding included)
PEAK = 989e12
NVLINK_REF_GBPS = 370              # H100/H200 NVLink ring all-reduce busbw (REFERENCE_NUMBERS.md)


def launch_row(path):
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    steady = [r for r in rows if r["step"] > 3]
    tokens_per_step = rows[-1]["tokens_per_s"] * rows[-1]["step_time_s"]
    tps = tokens_per_step / (sum(r["step_time_s"] for r in steady) / len(steady))
    summ = json.loads(path.with_name(path.name.replace("metrics-", "summary-").replace(".jsonl", ".json")).read_text())
    variant = path.stem[len("metrics-"):]
    gpus = 1 if "gpus1" in variant else 2
    mb = int(m.group(1)) if (m := re.search(r"mb(\d+)", variant)) else 8
    return {"machine": path.parent.name, "run": f"launch.yml {variant.replace('_', ' +')}", "gpus": gpus, "micro_batch": mb,
            "compile": "compile" in variant, "tokens_per_s": round(tps), "tokens_per_s_per_gpu": round(tps / gpus),
            "mfu_ref_count": round(tps * FPT_REF / (PEAK * gpus), 3), "peak_gib": summ.get("peak_mem_allocated_gib"),
            "estimate_gpu_gib": round(summ["memory_estimate"]["gpu_bytes"] / 2**30, 2),
            "time_to_first_step_s": summ.get("time_to_first_step_s")}


def reference_rows(path):
    """Lines 'NAME RESULT {...}' (bench/gpu.sh); a two-rank run prints one RESULT per rank: keep one."""
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        name = line.split()[0] if not line.startswith("RESULT") else ""
        r = json.loads(re.findall(r"RESULT (\{.*?\})", line)[0])
        gpus = 2 if name.endswith("x2") else 1
        run = "plain PyTorch" if r["mode"] == "torch" else f"DeepSpeed by hand, ZeRO-{r['stage']}"
        out.append({"machine": path.parent.name, "run": run, "gpus": gpus, "micro_batch": 8, "compile": False,
                    "tokens_per_s": r["tokens_per_s"] * gpus, "tokens_per_s_per_gpu": r["tokens_per_s"],
                    "mfu_ref_count": r["mfu_vs_989"], "peak_gib": r["peak_mem_GiB"], "estimate_gpu_gib": None,
                    "time_to_first_step_s": None})
    return out


def main():
    rows = []
    for d in ("x2a", "x2b", "x2c", "x2d"):
        rows += [launch_row(p) for p in sorted((RES / d).glob("metrics-*.jsonl"))]
        rows += reference_rows(RES / d / "reference.txt")
    by = {(r["machine"], r["run"]): r for r in rows}
    one = by[("x2b", "launch.yml zero2 +gpus1")]["tokens_per_s"]
    pre = json.loads((RES / "x2a" / "preflight-gpu-local-latest.json").read_text())
    ar = pre["measured"]["allreduce"]
    ratios = {
        "2 GPUs: launch.yml zero2 / hand-run ZeRO-2 on 2 GPUs (same call)":
            by[("x2a", "launch.yml zero2")]["tokens_per_s"] / by[("x2a", "DeepSpeed by hand, ZeRO-2")]["tokens_per_s"],
        "scaling efficiency zero2, 2 GPUs vs 1 (micro-batch 8)": by[("x2a", "launch.yml zero2")]["tokens_per_s"] / (2 * one),
        "scaling efficiency zero3, 2 GPUs (x2a) vs 1 GPU (x2d, another lease)":
            by[("x2a", "launch.yml zero3")]["tokens_per_s"] / (2 * by[("x2d", "launch.yml zero3 +gpus1")]["tokens_per_s"]),
        "2 GPUs: micro-batch 16 / 8 (zero2; x2d vs x2a)":
            by[("x2d", "launch.yml zero2 +mb16")]["tokens_per_s"] / by[("x2a", "launch.yml zero2")]["tokens_per_s"],
        "1 GPU: launch.yml zero2 / hand-run ZeRO-2 (same call)":
            one / by[("x2b", "DeepSpeed by hand, ZeRO-2")]["tokens_per_s"],
        "1 GPU: launch.yml zero2 / plain PyTorch (same call)": one / by[("x2b", "plain PyTorch")]["tokens_per_s"],
        "1 GPU: +compile / zero2": by[("x2b", "launch.yml zero2 +gpus1 +compile")]["tokens_per_s"] / one,
        "1 GPU: micro-batch 12 / 8": by[("x2c", "launch.yml zero2 +gpus1 +mb12")]["tokens_per_s"] / one,
        "1 GPU: micro-batch 16 / 8": by[("x2c", "launch.yml zero2 +gpus1 +mb16")]["tokens_per_s"] / one,
        "1 GPU: micro-batch 16 / hand-run ZeRO-2 (same call)":
            by[("x2c", "launch.yml zero2 +gpus1 +mb16")]["tokens_per_s"] / by[("x2c", "DeepSpeed by hand, ZeRO-2")]["tokens_per_s"],
        "1 GPU: micro-batch 16 / plain PyTorch (x2b's call)":
            by[("x2c", "launch.yml zero2 +gpus1 +mb16")]["tokens_per_s"] / by[("x2b", "plain PyTorch")]["tokens_per_s"],
        "all-reduce busbw at 1 GiB / NVLink ring reference 370 GB/s": ar["busbw_gbps_max"] / NVLINK_REF_GBPS,
    }
    (RES / "summary-x2.json").write_text(json.dumps({"rows": rows, "allreduce": ar,
                                                     "ratios": {k: round(v, 3) for k, v in ratios.items()}}, indent=1) + "\n")
    print("| call | run | GPUs | micro-batch | tokens/s | per GPU | MFU (reference's count) | peak GiB | estimate GPU GiB | first step s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['machine']} | {r['run']} | {r['gpus']} | {r['micro_batch']} | {r['tokens_per_s']:,} | "
              f"{r['tokens_per_s_per_gpu']:,} | {r['mfu_ref_count']} | {r['peak_gib'] or '-'} | "
              f"{r['estimate_gpu_gib'] or '-'} | {r['time_to_first_step_s'] or '-'} |")
    print("\n| message | time | busbw |\n|---|---|---|")
    for x in ar["rows"]:
        print(f"| {x['bytes'] // 2**20} MiB | {x['time_us']} us | {x['busbw_gbps']} GB/s |")
    print()
    for k, v in ratios.items():
        print(f"- {k}: {v:.3f}")


if __name__ == "__main__":
    main()
