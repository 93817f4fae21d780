"""Tables and chart for docs/benchmarks.md from the GPU results kept in bench/results/gpu/.

    python3 bench/gpu_report.py            # prints the Markdown tables, writes bench/results/gpu/summary.json
    python3 bench/gpu_report.py --png docs/benchmarks.png    # also the chart (needs matplotlib)

Steady throughput is the mean step time over the steps after the first three (the reference script
times 12 steps after 3 warm-ups). Model FLOPs are counted both ways: PaLM's 6N + 12LdT with N
without the input embedding (train.run's "tflops"/"mfu") and with N including it (the reference
script's count), so the ratios against the reference compare like with like.
"""
import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "bench" / "results" / "gpu"
L, D, T, V, N = 24, 2048, 2048, 50304, 1_418_399_744
TOKENS_PER_STEP = 8 * T
FPT_PALM = 6 * (N - V * D) + 12 * L * D * T       # without the input embedding
FPT_REF = 6 * N + 12 * L * D * T                  # as gpt_reference.py counts
PEAK = 989e12


def steady(path):
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    times = [r["step_time_s"] for r in rows if r["step"] > 3]
    tps = TOKENS_PER_STEP / (sum(times) / len(times))
    return tps, rows


def refs(path):
    return [json.loads(m) for m in re.findall(r"RESULT (\{.*\})", path.read_text())]


def ttfs(session, preset):
    run = session / f"run-{preset}.json"
    if not run.exists():
        return None
    start = json.loads(run.read_text())["playbook_start"]
    first = json.loads((session / f"metrics-{preset}.jsonl").read_text().splitlines()[0])["time"]
    return round(first - start, 1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--png", default="")
    a = p.parse_args()
    s1, s2 = RES / "s1", RES / "s2"
    rows = []
    for session, label in ((s2, "B"), (s1, "A")):
        for m in sorted(session.glob("metrics-*.jsonl")):
            preset = m.stem[len("metrics-"):]
            tps, raw = steady(m)
            summ = session / f"summary-{preset}.json"
            summ = json.loads(summ.read_text()) if summ.exists() else {}
            est = summ.get("memory_estimate", {})
            rows.append({"session": label, "run": f"launch.yml -e preset={preset}", "preset": preset,
                         "tokens_per_s": round(tps), "tflops_palm": round(tps * FPT_PALM / 1e12, 1),
                         "mfu_palm": round(tps * FPT_PALM / PEAK, 3), "mfu_ref_count": round(tps * FPT_REF / PEAK, 3),
                         "peak_gib": summ.get("peak_mem_allocated_gib"),
                         "estimate_gpu_gib": round(est["gpu_bytes"] / 2**30, 2) if "gpu_bytes" in est else None,
                         "estimate_cpu_gib": round(est["cpu_bytes"] / 2**30, 2) if "cpu_bytes" in est else None,
                         "time_to_first_step_s": ttfs(session, preset), "steps_timed": len([r for r in raw if r["step"] > 3])})
        for f in sorted(session.glob("reference*.txt")):
            for r in refs(f):
                name = "plain PyTorch" if r["mode"] == "torch" else f"DeepSpeed by hand, ZeRO-{r['stage']}"
                tps = r["tokens_per_s"]
                rows.append({"session": label, "run": name, "preset": r["mode"] + str(r["stage"] or ""),
                             "tokens_per_s": tps, "tflops_palm": round(tps * FPT_PALM / 1e12, 1),
                             "mfu_palm": round(tps * FPT_PALM / PEAK, 3), "mfu_ref_count": r["mfu_vs_989"],
                             "peak_gib": r["peak_mem_GiB"], "estimate_gpu_gib": None, "estimate_cpu_gib": None,
                             "time_to_first_step_s": None, "steps_timed": 12})
    by = {(r["session"], r["preset"]): r for r in rows}
    ratios = {
        "B: launch.yml zero2 / hand-run ZeRO-2 (same machine, same call)":
            by[("B", "zero2")]["tokens_per_s"] / by[("B", "ds2")]["tokens_per_s"],
        "A: launch.yml zero2 / hand-run ZeRO-2": by[("A", "zero2")]["tokens_per_s"] / by[("A", "ds2")]["tokens_per_s"],
        "A: launch.yml zero3 / hand-run ZeRO-3": by[("A", "zero3")]["tokens_per_s"] / by[("A", "ds3")]["tokens_per_s"],
        "A: launch.yml zero2 / plain PyTorch": by[("A", "zero2")]["tokens_per_s"] / by[("A", "torch")]["tokens_per_s"],
    }
    (RES / "summary.json").write_text(json.dumps({"rows": rows, "ratios": {k: round(v, 3) for k, v in ratios.items()}}, indent=1) + "\n")
    print("| session | run | tokens/s | TFLOP/s (PaLM, no embedding) | MFU (PaLM) | MFU (reference's count) | peak GiB | estimate GPU GiB | estimate CPU GiB | time to first step s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['session']} | {r['run']} | {r['tokens_per_s']:,} | {r['tflops_palm']} | {r['mfu_palm']} | {r['mfu_ref_count']} | "
              f"{r['peak_gib'] or '-'} | {r['estimate_gpu_gib'] or '-'} | {r['estimate_cpu_gib'] or '-'} | {r['time_to_first_step_s'] or '-'} |")
    print()
    for k, v in ratios.items():
        print(f"- {k}: {v:.3f}")
    if a.png:
        import matplotlib  # noqa: PLC0415 - only where a picture is drawn
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - after use("Agg")
        shown = [r for r in rows if r["session"] == "A"] + [r for r in rows if r["session"] == "B"]
        fig, ax = plt.subplots(figsize=(10, 4.8))
        labels = [f"{r['session']}: {r['run'].replace('launch.yml -e preset=', 'launch.yml ')}" for r in shown]
        colors = ["tab:blue" if r["run"].startswith("launch") else "tab:gray" for r in shown]
        ax.barh(labels, [r["tokens_per_s"] for r in shown], color=colors)
        for i, r in enumerate(shown):
            ax.text(r["tokens_per_s"], i, f" {r['tokens_per_s']:,}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s, 1.42 B GPT, seq 2048, micro-batch 8, bf16, one H200")
        ax.set_title("launch.yml presets (blue) beside hand-run DeepSpeed and plain PyTorch (gray)")
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)
        print(f"\nchart: {a.png}")


if __name__ == "__main__":
    main()
