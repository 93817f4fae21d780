"""preset=auto's step down on the container cluster: an out-of-memory error in the first steps
does not fail the run; the supervisor relaunches every node at the next configuration of auto's
ladder and the run's records keep the one that trained."""
import json

from cluster import HELPER

RUNS = "/opt/dscluster/runs"
# What auto is told of the model (its candidates come from this; the script's real model is tiny):
# on CPU nodes with 16 GiB per rank, auto chooses micro-batch 8 and steps down to 4, then 2.
# A complete shape (nothing assumed): a fused GELU, as train/model.py's.
SHAPE = {"layers": 2, "hidden": 64, "heads": 2, "vocab": 512, "seq_len": 8192, "attention": "eager",
         "dropout": 0, "tied": True, "activation": "gelu"}
# A DeepSpeed-style script that runs out of memory above micro-batch 4, as a GPU would.
SCRIPT = """import argparse
import deepspeed
import torch

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
deepspeed.add_config_arguments(p)
args = p.parse_args()
model = torch.nn.Linear(8, 8)
engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
mb = engine.train_micro_batch_size_per_gpu()
for _ in range(2 * engine.gradient_accumulation_steps()):
    if mb > 4:
        raise getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)(
            f"CUDA out of memory. Tried to allocate 2.00 GiB (the test's own, micro-batch {mb})")
    engine.backward(engine(torch.randn(mb, 8)).pow(2).mean())
    engine.step()
"""


def test_an_out_of_memory_error_in_the_first_steps_steps_down_and_trains(provisioned, cluster, tmp_path):
    (tmp_path / "oom.py").write_text(SCRIPT)
    r = cluster.playbook("launch.yml", "-e", "run_id=auto-oom", "-e", "follow=true", "-e", "preflight=false",
                         "-e", f"dsc_code_dir={tmp_path}", "-e", "dsc_entry_script=oom.py", "-e", "preset=auto",
                         "-e", "dsc_auto_memory_gib=16", "-e", "dsc_train_batch=32",
                         "-e", json.dumps({"dsc_model_shape": SHAPE}))
    assert r.returncode == 0, r.output[-4000:]
    assert "preset=auto chose zero3 at micro-batch 8" in r.output, r.output[-4000:]
    assert "steps down to: zero3 micro-batch 4, then zero3 micro-batch 2" in r.output
    assert "step down 1: zero3 micro-batch 8 ran out of memory" in r.output and "OutOfMemoryError" in r.output
    launch = json.loads(cluster.exec(cluster.master, f"cat {RUNS}/auto-oom/launch.json").stdout)
    assert (launch["preset"], launch["dsc_micro_batch"]) == ("zero3", 8)  # what was launched, never rewritten
    log = cluster.exec(cluster.master, f"cat {RUNS}/auto-oom/launcher.log").stdout
    for n in cluster.names:  # every node ran the stepped-down configuration, written there at launch
        cfg = json.loads(cluster.exec(n, f"cat {RUNS}/auto-oom/ds_config.step1.json").stdout)
        assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (4, 4), n
        assert any(line.startswith(f"{n}: ") and "ds_config.step1.json" in line for line in log.splitlines()), n
    status = cluster.playbook("status.yml", "-e", "run_id=auto-oom")
    assert "run auto-oom: finished" in status.output and "(restarts" not in status.output, status.output[-3000:]
    trained = json.loads(cluster.exec(cluster.master, f"{HELPER} status {RUNS}/auto-oom auto-oom", user="dstrain").stdout)
    assert trained["config"] == "preset zero3" and trained["step_downs"][-1]["next"]["micro_batch"] == 4  # what trained
    assert "step down 1: zero3 micro-batch 8 ran out of memory" in status.output
