"""train/ on CPU: 2 gloo ranks on this machine, started by DeepSpeed's own launcher; and the
entry shim's per-rank times on a user's own loop (tests/fixtures/straggler.py).

These need torch and DeepSpeed on the control node: the test command builds .cache/train-venv
from the offline wheelhouse (scripts/test.sh, before the local tier). They need no container.
"""
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from dscnode import shrink, stragglers

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("DSC_TRAIN_VENV", ROOT / ".cache" / "train-venv"))
pytestmark = pytest.mark.skipif(not (VENV / "bin" / "deepspeed").exists(),
                                reason=f"no train venv at {VENV} (scripts/test.sh builds it)")
# train/ takes the run directory's names from dscnode.rundir: a launch's ranks import it from the
# node helper, whose entry shim runs train.run; these start train.run directly, with node/ on the
# import path as the control venv's dscluster.pth lists it.
NODE_PATH = {"PYTHONPATH": str(ROOT / "node")}
# What every rank here runs with, as a node's ranks have their env's (the plan's node_env): the
# venv's bin first on PATH (its ninja builds the ops, the one test_warm reads them with; ninja 1.13
# drops the log an older system ninja wrote, "build log version is too old; starting over", and
# builds again), one JIT cache (an op is built once for the whole tier), one thread a rank.
JIT_CACHE = ROOT / ".cache" / "torch_extensions"
RANK_ENV = dict(NODE_PATH, DS_ACCELERATOR="cpu", PATH=f"{VENV / 'bin'}:{os.environ['PATH']}",
                TORCH_EXTENSIONS_DIR=str(JIT_CACHE), OMP_NUM_THREADS="1")


def free_port():
    """A port no process listens on now (the kernel's pick): a fixed one collides with whatever
    else this machine runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def forget_shm(port):
    """DeepSpeed's CPU comm op leaves each rank's shared-memory buffer (66 MiB) in /dev/shm when
    the rank exits, named by the master's address and port: removed once the run ended (a suite
    run would otherwise leave gigabytes of this machine's memory behind)."""
    for f in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        f.unlink(missing_ok=True)


LAUNCH_TIMEOUT_S = 1800  # cpu_adam's build took over 600 s there on a slow 2-core machine


def launch(run_dir: Path, ds: dict, *sets, resume=False, ranks=2, check=True, program=("train.run",), env=None):
    """DeepSpeed's launcher over `ranks` gloo ranks of `program` (python -m's arguments: train.run,
    or the node helper's entry shim and a script), with train.run's --set options."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "ds_config.json").write_text(json.dumps(ds))
    env = dict(os.environ, **RANK_ENV, DSC_RUN_DIR=str(run_dir), LOCAL_SIZE=str(ranks), **(env or {}))
    port = free_port()
    cmd = [str(VENV / "bin" / "deepspeed"), "--num_gpus", str(ranks), "--master_port", port, "--module", *program,
           "--deepspeed_config", str(run_dir / "ds_config.json")]
    for s in sets:
        cmd += ["--set", s]
    if resume:
        cmd.append("--resume")
    try:  # at low priority beside the container tier, an op's first build can wait long for CPU
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    finally:
        forget_shm(port)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def metrics(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def ds(stage, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    cfg.update(extra)
    return cfg


# Each stage with a model, ZeRO-3 (which partitions the tied embeddings) with both; ZeRO-2 trains
# the GPT in the tests below.
@pytest.mark.parametrize("stage,model", [(1, "gpt"), (2, "bert"), (3, "gpt"), (3, "bert")])
def test_tiny_models_train_with_zero(tmp_path, model, stage):
    run = tmp_path / "run"
    launch(run, ds(stage), f"model={model}", "steps=4", "vocab_size=512", "seq_len=64")
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["zero_stage"] == stage and summary["world"] == 2
    assert summary["memory_estimate"]["params"] > 0
    assert (run / "checkpoints" / "step4" / "COMPLETE").exists()
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["loss"] == r["loss"]  # not NaN


def test_loss_falls_on_text_files(tmp_path):
    run = tmp_path / "run"
    launch(run, ds(2), "data=text", f"data_path={ROOT / 'train'}", "steps=30", "lr=0.003",
           "seq_len=64", "size=tiny", "save_final=false")
    rows = metrics(run)
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 1.0, f"loss went from {first:.3f} to {last:.3f}"


def test_resume_follows_the_uninterrupted_trajectory(tmp_path):
    """Stop after step 6 (checkpoint at 4), resume to 10: steps 5-10 match the uninterrupted run."""
    common = ["steps=10", "save_every=4", "vocab_size=512", "seq_len=64", "lr=0.002"]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    launch(whole, ds(2), *common)
    launch(broken, ds(2), *common, "stop_at=6")
    assert not (broken / "checkpoints" / "step6").exists()
    r = launch(broken, ds(2), *common, resume=True)
    assert "loaded" in r.stdout and "step 4" in r.stdout
    a = {m["step"]: m["loss"] for m in metrics(whole)}
    b = [m for m in metrics(broken)]
    resumed = {m["step"]: m["loss"] for m in b[6:]}  # after the 6 steps of the first attempt
    assert sorted(resumed) == [5, 6, 7, 8, 9, 10]
    # Tolerance: fp32 on CPU with the same data order; allow reduction-order noise only.
    for step, loss in resumed.items():
        assert abs(loss - a[step]) <= 1e-4 * max(1.0, abs(a[step])), (step, loss, a[step])


def test_a_checkpoint_converted_to_universal_goes_on_at_half_the_ranks_on_the_same_trajectory(tmp_path):
    """What dsc_min_nodes does at the restart that drops a lost node, on this machine: a ZeRO-2
    run of 2 ranks through the entry shim saves at step 6 and trains on to 10; its step-6
    checkpoint, converted (dscnode.shrink.convert: DeepSpeed's ds_to_universal) and installed as
    the tag folder (marked universal), resumes on 1 rank at twice the gradient accumulation (the
    same global batch, and the same samples at each step: train/data.py). The shim loads it with
    DeepSpeed's load_universal, and steps 7-10 follow the 2-rank run's losses. (ZeRO-3 continues
    on fewer nodes in the container tier, molecule/tests/test_fewer_nodes.py.)"""
    common = ["steps=10", "save_every=6", "vocab_size=512", "seq_len=64", "lr=0.002"]
    shim = ("dscnode", "entry", "--module", "train.run")
    whole, fewer = tmp_path / "whole", tmp_path / "fewer"
    launch(whole, ds(2), *common, program=shim)
    save_dir = fewer / "checkpoints"
    converted = save_dir / shrink.STAGE / "step6"
    seconds = shrink.convert(str(VENV / "bin" / "python"), str(whole / "checkpoints" / "step6"), str(converted),
                             {"tag": "step6", "lost": ["rank 1"]})
    shrink.install(str(save_dir), "step6", str(converted))
    assert (save_dir / "step6" / "COMPLETE").exists() and seconds > 0
    r = launch(fewer, ds(2, gradient_accumulation_steps=2), *common, program=shim, ranks=1, resume=True)
    assert f"resume: loaded {save_dir}/step6 (step 6)" in r.stdout, r.stdout[-3000:]
    a = {m["step"]: m["loss"] for m in metrics(whole)}
    b = {m["step"]: m["loss"] for m in metrics(fewer)}
    assert sorted(b) == [7, 8, 9, 10], b
    # Tolerance: fp32 on CPU, the same samples; the sums over them taken in another order only.
    for step, loss in b.items():
        assert abs(loss - a[step]) <= 1e-4 * max(1.0, abs(a[step])), (step, loss, a[step])


def test_half_written_checkpoint_is_never_latest(tmp_path):
    ck = tmp_path / "checkpoints"
    (ck / "step4").mkdir(parents=True)
    (ck / "step4" / "COMPLETE").write_text("{}")
    (ck / "step8").mkdir()  # interrupted mid-write: no marker
    (ck / "latest").write_text("step8")  # DeepSpeed's own pointer may already name it
    r = subprocess.run([str(VENV / "bin" / "python"), "-c",
                        f"from train.run import latest_complete; print(latest_complete(__import__('pathlib').Path('{ck}')).name)"],
                       cwd=ROOT, env=dict(os.environ, **NODE_PATH), capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "step4", r.stderr


@pytest.mark.parametrize("sets,needle", [
    (["size=huge"], "config key 'size'"),
    (["steps=ten"], "config key 'steps' expects int"),
    (["no_such_key=1"], "unknown config key 'no_such_key'"),
    (["data=text"], "'data_path' is required"),
])
def test_bad_config_gives_a_clear_error(tmp_path, sets, needle):
    env = dict(os.environ, **NODE_PATH, DSC_RUN_DIR=str(tmp_path))
    cmd = [str(VENV / "bin" / "python"), "-m", "train.run"] + [a for s in sets for a in ("--set", s)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert needle in r.stderr, r.stderr


def test_cpu_offload_trains_on_a_pretokenized_array(tmp_path):
    """ZeRO-2 with the optimizer offloaded to CPU (DeepSpeedCPUAdam), data from a user's .npy."""
    r = subprocess.run([str(VENV / "bin" / "python"), "-c",
                        f"import numpy as np; np.save('{tmp_path}/tok.npy', (np.arange(20000) * 7 % 500).astype(np.int32))"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    offload = ds(2, optimizer={"type": "AdamW", "params": {"lr": 0.001}})
    offload["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    launch(run, offload, "data=array", f"data_path={tmp_path}/tok.npy", "vocab_size=512", "seq_len=64",
           "steps=6", "save_final=false")
    rows = metrics(run)
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.parametrize("preset", ["zero1", "zero3", "zero2-offload"])
def test_the_rank_the_others_wait_for_is_named_in_every_zero_stage(tmp_path, preset):
    """A user's own loop through the entry shim, as a launch starts it: rank 1 computes 1 s longer
    than rank 0 from step 16 of 32. Every window of 4 steps (DSC_RANK_WINDOW) global rank 0 writes
    both ranks' figures to ranks.jsonl: the four windows before the slowdown mark no rank, the
    windows after it (3 in a row at least) name rank 1 with rank 0 waiting for it, in ZeRO-1 (gradients all-reduced at
    the step), ZeRO-3 (parameters gathered asynchronously ahead of use, overlapping compute) and
    ZeRO-2 with the optimizer on the CPU alike (dscnode.stragglers says why the measure holds)."""
    run = tmp_path / "run"
    cfg = ds(int(preset[4]), optimizer={"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}})
    if preset.endswith("offload"):
        cfg["optimizer"]["params"].pop("torch_adam")  # DeepSpeed's CPU Adam, as the offload presets run it
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    launch(run, cfg, program=("dscnode", "entry", "--script", str(ROOT / "tests/fixtures/straggler.py"),
                              "--steps", "32", "--slow-rank", "1", "--slow-from", "16", "--slow-s", "1"),
           env={"DSC_RANK_WINDOW": "4"})
    windows = [json.loads(line) for line in (run / "ranks.jsonl").read_text().splitlines()]
    assert [w["step"] for w in windows] == [4, 8, 12, 16, 20, 24, 28, 32], windows
    assert all(sorted(r["rank"] for r in w["ranks"]) == [0, 1] for w in windows)
    healthy, slowed = windows[:4], windows[4:]
    # a window alone may name a rank descheduled a while on this busy machine; 3 in a row do not
    # (judged on the windows alone: the seconds they must span, MIN_SPAN_S, are the unit tests')
    assert [stragglers.verdict(healthy[i:i + 3], min_span_s=0) for i in (0, 1)] == [None, None], healthy
    # the same tolerance after it: one window in which rank 1 was itself descheduled (its own wait
    # then hides the others') leaves 3 in a row that name it. The second rank 1 sleeps outweighs
    # that: at 0.25 s, with this tier at low priority beside the containers, a CI run saw steps of
    # 1.5 s and two of four windows below the wait share the judgement needs
    judged = [stragglers.judge(w) for w in slowed]
    assert sum(bool(j) for j in judged) >= 3 and all(j["rank"] == 1 for j in judged if j), slowed
    marked = [stragglers.verdict(slowed[i:i + 3], min_span_s=0) for i in (0, 1)]
    assert any(m and m["rank"] == 1 and m["since_step"] in (20, 24) for m in marked), slowed
    for w in slowed:
        fast, slow = sorted(w["ranks"], key=lambda r: r["rank"])
        # rank 1 sleeps 1 s a step in its compute, and rank 0 waits in its collectives longer
        # than rank 1 does (by how much moves with this busy machine: a descheduled rank 1 waits
        # too; the judgement above is what counts)
        assert slow["compute_s"] >= 0.8 and fast["comm_s"] > slow["comm_s"], w
        assert fast["calls"] >= 1 and slow["calls"] == fast["calls"], w


def two_nodes(tmp_path, *args):
    """The checkpoint loop on two "nodes" of this machine, one rank each (torchrun's --nnodes 2),
    each in its own folder with node-local checkpoints, through the entry shim: what each loaded."""
    cfg = ds(1, optimizer={"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}},
             checkpoint={"use_node_local_storage": True})
    (tmp_path / "ds_config.json").write_text(json.dumps(cfg))
    port = free_port()
    env = dict(os.environ, **RANK_ENV)
    procs = []
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir(exist_ok=True)
        procs.append(subprocess.Popen(
            [str(VENV / "bin" / "python"), "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port,
             "-m", "dscnode", "entry", "--script", str(ROOT / "tests/fixtures/checkpoint_loop.py"),
             "--deepspeed_config", str(tmp_path / "ds_config.json"), *args],
            cwd=tmp_path / f"node{node}", env=dict(env, DSC_RUN_DIR=str(tmp_path / f"node{node}")), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        forget_shm(port)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    return [json.loads((tmp_path / f"node{n}" / "loaded.json").read_text()) for n in (0, 1)], outs


def test_a_resume_takes_the_newest_checkpoint_complete_on_every_node(tmp_path):
    """A DeepSpeed-style loop saves global_step4 and global_step8 on both nodes, each tag marked
    complete there once DeepSpeed's save returned. Node 1's global_step8 is then cut short as a node
    lost mid-save leaves it: a part gone, no mark, its `latest` still global_step4, while node 0's
    `latest` (written by global rank 0 before DeepSpeed's closing barrier) says global_step8. A load
    without a tag resumes both ranks from global_step4; DeepSpeed's own `latest` would have had
    node 0 at step 8 and node 1 at step 4."""
    first, _ = two_nodes(tmp_path, "--steps", "8", "--save-every", "4")
    assert [(r["loaded"], r["end"]) for r in first] == [(None, 8), (None, 8)]
    for n in (0, 1):
        ckpt = tmp_path / f"node{n}" / "ckpt"
        assert (ckpt / "complete_tags").read_text().split() == ["global_step4", "global_step8"]
    cut = tmp_path / "node1" / "ckpt"
    (cut / "complete_tags").write_text("global_step4\n")
    (cut / "latest").write_text("global_step4")
    for f in (cut / "global_step8").glob("*optim_states*"):
        f.unlink()
    assert (tmp_path / "node0" / "ckpt" / "latest").read_text() == "global_step8"
    again, _ = two_nodes(tmp_path, "--steps", "10", "--save-every", "4")
    assert [(r["loaded_step"], r["end"]) for r in again] == [(4, 10), (4, 10)], again
    assert all("/global_step4/" in r["loaded"] for r in again), again
    # no tag complete on every node: both start over, saying why
    (cut / "complete_tags").write_text("global_step8\n")
    (tmp_path / "node0" / "ckpt" / "complete_tags").write_text("global_step4\n")
    fresh, outs = two_nodes(tmp_path, "--steps", "2", "--save-every", "4")
    assert [(r["loaded"], r["loaded_step"]) for r in fresh] == [(None, 0), (None, 0)]
    assert "no checkpoint in ckpt is complete on every node" in outs[0]
