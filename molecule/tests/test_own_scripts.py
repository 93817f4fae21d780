"""Users' own training scripts through launch.yml on the container cluster (2 nodes x 1 CPU rank):
three public scripts this project did not write (tests/fixtures/scripts/SOURCES.md) across both
nodes to completion: cifar at the ZeRO stage its own flag sets, run_clm (HF's Trainer) and
accelerate's example with zero3, run_clm stopped and resumed, accelerate's restarted by
max_restarts; their requirements on every node; a dataset synced; secrets that reach the ranks and
nothing else; and the bad inputs refused before any node changes."""
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from cluster import FACTS, TEST_PACKAGES, WHEELHOUSE, lock_pins, wait

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "scripts"
RUNS = "/opt/dscluster/runs"
ENV = "/opt/dscluster/env"
# The dataset (text, tokenizer, tiny GPT-2 config) as a user keeps it on the control node;
# dsc_data_dir syncs it to the same path on every node.
DATA = "/tmp/dscluster-test-data"
SECRET = "hf_dsctest_7f3a91c2e5b8d4"
# Launch's preflight costs seconds of CPU per launch; the tests that only train a script skip it
# (test_preflight.py covers it; the secrets test keeps it: nothing a launch does may see the secret).
NO_PREFLIGHT = ["-e", "preflight=false"]


def e(**values):
    return ["-e", json.dumps(values)]


def launch(cluster, run_id, *extra, ok=True):
    for n in cluster.names:
        cluster.exec(n, f"rm -rf {RUNS}/{run_id}", check=False)
    r = cluster.playbook("launch.yml", *e(run_id=run_id, dsc_data_dir=DATA), *extra)
    if ok:
        assert r.returncode == 0, r.output[-6000:]
    return r






def shown_status(cluster, run_id):
    r = cluster.playbook("status.yml", "-e", f"run_id={run_id}")
    assert r.returncode == 0, r.output[-3000:]
    return r.output


def assert_finished_with_progress(cluster, run_id, steps):
    st = cluster.run_status(run_id)
    assert st["state"] == "finished", (st, cluster.exec(cluster.master, f"tail -40 {RUNS}/{run_id}/launcher.log").stdout)
    assert st["last"]["step"] == steps and st["last"]["loss"] > 0, st
    log = cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/launcher.log").stdout
    assert "dist_world_size=2" in log  # both nodes' ranks
    return st


# status.yml's rendering of the same record: once for cifar's run (no total known) and once for
# the run restarted by max_restarts; the other runs' records are checked as JSON alone.
def assert_shown_finished(cluster, run_id, steps, state="finished"):
    out = shown_status(cluster, run_id)
    assert f"run {run_id}: {state}" in out and f"step {steps}, loss " in out, out[-2000:]


@pytest.fixture(scope="module")
def data(provisioned):
    shutil.rmtree(DATA, ignore_errors=True)
    shutil.copytree(FIXTURES / "data", DATA)
    return DATA


CIFAR = ["-e", f"dsc_code_dir={FIXTURES / 'cifar'}", "-e", "dsc_entry_script=cifar10_deepspeed.py",
         "-e", "dsc_ds_config_mode=none", *e(dsc_resume_args=[])]


HF_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
LM_DATA = ["--model_type", "gpt2", "--config_name", f"{DATA}/gpt2-tiny", "--tokenizer_name", f"{DATA}/tokenizer",
           "--train_file", f"{DATA}/train.txt", "--block_size", "64", "--per_device_train_batch_size", "4"]


def clm_entry_args(steps, save_steps):
    # --save_on_each_node: run directories are per node, so each node keeps the Trainer's state
    return LM_DATA + ["--do_train", "--max_steps", str(steps), "--logging_steps", "2",
                      "--save_steps", str(save_steps), "--save_on_each_node", "--output_dir", "out",
                      "--report_to", "none"]


def clm_args(preset, steps, save_steps=10):
    """transformers' run_clm.py: HF Trainer, the toolkit's preset with HF's "auto" values."""
    return ["-e", f"preset={preset}", "-e", f"dsc_code_dir={FIXTURES / 'clm'}", "-e", "dsc_entry_script=run_clm.py",
            "-e", "dsc_ds_config_mode=hf",
            *e(dsc_resume_args=["--resume_from_checkpoint", "{latest:out/checkpoint-*}"], dsc_rank_env=HF_OFFLINE,
               dsc_entry_args=clm_entry_args(steps, save_steps))]


def accelerate_args(preset, steps, checkpoint_every=6, resume_args=("--resume_from_checkpoint", "{latest:out/step_*}")):
    """accelerate's example: DeepSpeed through accelerate's own variables, no --local_rank."""
    return ["-e", f"preset={preset}", "-e", f"dsc_code_dir={FIXTURES / 'clm'}",
            "-e", "dsc_entry_script=deepspeed_with_config_support.py", "-e", "dsc_ds_config_mode=hf",
            "-e", "dsc_ds_config_arg=env",
            *e(dsc_resume_args=list(resume_args), dsc_launcher_args=["--no_local_rank"],
               dsc_rank_env=HF_OFFLINE,
               dsc_entry_args=LM_DATA + ["--max_train_steps", str(steps), "--checkpointing_steps",
                                         str(checkpoint_every), "--output_dir", "out"])]


def test_requirements_are_installed_at_the_same_version_on_every_node(provisioned, cluster):
    want = [line.split("==") for line in (FIXTURES / "requirements.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    for n in cluster.names:
        got = cluster.versions(n, f"{ENV}/bin/python", [p for p, _ in want])
        assert got == dict(want), (n, got)
    # Installed from the wheelhouse's hashed lock: every locked package at its locked version.
    # The image's provision from the bare image installed it; the cluster's compared every node's
    # env with the lock and, nothing differing, installed nothing.
    def task(out, name):
        return out.split(f"TASK [pytorch : {name}")[1].split("TASK [")[0]
    for out, nodes in ((provisioned["bare"], cluster.names[:1]), (provisioned["cluster"], cluster.names)):
        compared = task(out, "Compare the env with the lock")
        assert all(f"ok: [{n}]" in compared for n in nodes), compared
    assert f"changed: [{cluster.master}]" in task(provisioned["bare"], "Install the lock's wheels")
    installed = task(provisioned["cluster"], "Install the lock's wheels")
    assert all(f"skipping: [{n}]" in installed for n in cluster.names), installed
    lock = lock_pins((WHEELHOUSE / "requirements.lock").read_text())
    for n in cluster.names:
        got = cluster.versions(n, f"{ENV}/bin/python", lock)
        assert got == lock, (n, {k: (v, lock[k]) for k, v in got.items() if v != lock[k]})


def test_a_package_changed_on_one_node_is_a_preflight_fail(provisioned, cluster):
    worker = cluster.names[1]
    wheel = next(TEST_PACKAGES.glob("packaging-*.whl"))  # scripts/test.sh fetches it
    other = wheel.name.split("-")[1]
    was = cluster.exec(worker, f"{ENV}/bin/python -c 'import importlib.metadata as m; print(m.version(\"packaging\"))'").stdout.strip()
    assert was != other
    cluster.copy_to(worker, wheel, f"/tmp/{wheel.name}")
    try:
        cluster.exec(worker, f"{ENV}/bin/pip install -q --no-deps --no-index /tmp/{wheel.name}", user="dstrain")
        r = cluster.playbook("preflight.yml")
        assert r.returncode != 0
        assert f"packaging {other} here, {was} on {cluster.master}" in r.output, r.output[-4000:]
        assert "FAIL" in r.output and worker in r.output
    finally:
        cluster.exec(worker, f"{ENV}/bin/pip install -q --no-deps --no-index --find-links /opt/dscluster/wheelhouse "
                             f"packaging=={was}", user="dstrain")
    # Healthy again for the tests after this one: the master's version back on the worker.
    assert cluster.versions(worker, f"{ENV}/bin/python", ["packaging"]) == {"packaging": was}


# One run: zero3 by the script's own flag under preset=zero2, which mode none leaves unused (a
# second run at the other stage would repeat every check).
def test_deepspeed_examples_cifar_trains_across_both_nodes_at_its_own_stage(data, cluster):
    """The script passes its own config to deepspeed.initialize (mode none, its --stage flag)."""
    run_id = "own-cifar"
    launch(cluster, run_id, *CIFAR, "-e", "preset=zero2", "-e", "follow=true", *NO_PREFLIGHT,
           *e(dsc_entry_args=["--deepspeed", "--stage", "3", "--epochs", "1", "--log-interval", "8",
                              "--dtype", "fp32"]))
    # 512 synthetic samples, the script's global batch of 16: 32 steps
    assert_finished_with_progress(cluster, run_id, 32)
    assert_shown_finished(cluster, run_id, 32)
    log = cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/launcher.log").stdout
    # the script chose its ZeRO stage from its own flag, passed through the entry shim, and its
    # engine's stage is what status and runs.yml name (not the preset's 2)
    assert "entry --script cifar10_deepspeed.py --deepspeed --stage 3 " in log
    st = cluster.run_status(run_id)
    assert st["config"] == "ZeRO stage 3" and st["total_steps"] is None, st
    assert "Finished Training" in log and "Accuracy of the network" in log


def assert_hf_trainer_finished(cluster, run_id, preset, steps):
    """run_clm.py's run ended at `steps` under the preset's ZeRO stage, with HF's "auto" values
    filled in for the real world of two ranks and DeepSpeed's csv monitor in the run directory."""
    st = assert_finished_with_progress(cluster, run_id, steps)
    assert st["total_steps"] == steps and st["config"] == f"ZeRO stage {preset[-1]}", st  # HF's Trainer's
    cfg = json.loads(cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/ds_config.json").stdout)
    assert cfg["zero_optimization"]["stage"] == int(preset[-1]) and cfg["train_batch_size"] == "auto"
    log = cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/launcher.log").stdout
    assert "Total train batch size (w. parallel, distributed & accumulation) = 8" in log
    assert "***** Running training *****" in log and "train_loss" in log
    cluster.exec(cluster.master, f"test -s {RUNS}/{run_id}/monitor/ds/Train_Samples_lr.csv")
    return log


def assert_accelerate_finished(cluster, run_id, steps):
    """accelerate's script ended at `steps`, its ranks told the config through accelerate's own
    variable."""
    assert_finished_with_progress(cluster, run_id, steps)
    env = cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/.deepspeed_env").stdout
    assert f"ACCELERATE_DEEPSPEED_CONFIG_FILE={RUNS}/{run_id}/ds_config.json" in env


def files_on_every_node(cluster, run_id, path):
    return all(cluster.exec(n, f"test -f {RUNS}/{run_id}/code/{path}", check=False).returncode == 0
               for n in cluster.names)


def complete_checkpoints(cluster, node, run_id):
    """The steps of run_clm's checkpoints on a node that hold trainer_state.json (the Trainer writes it last)."""
    found = cluster.exec(node, f"ls -d {RUNS}/{run_id}/code/out/checkpoint-*/trainer_state.json", check=False).stdout
    return {int(p.split("/checkpoint-")[1].split("/")[0]) for p in found.split()}


def test_run_clm_stopped_mid_run_resumes_from_its_checkpoint(data, cluster):
    run_id, ended = "own-clm-resume", False
    launch(cluster, run_id, *clm_args("zero3", 2000, save_steps=10), *NO_PREFLIGHT)
    try:
        # the Trainer writes trainer_state.json last: checkpoint-10 and -20 complete on both nodes
        wait(lambda: files_on_every_node(cluster, run_id, "out/checkpoint-20/trainer_state.json"), 900,
             "run_clm's checkpoint-20 on every node")
        stop = cluster.playbook("stop.yml", "-e", f"run_id={run_id}")
        assert stop.returncode == 0 and "none left" in stop.output, stop.output[-3000:]
        assert cluster.run_status(run_id)["state"] == "stopped"
        # The HF Trainer drives DeepSpeed's engine: the entry shim timed both ranks' collectives,
        # gathered every 10 steps (the slow rank's figures, docs/runs.md).
        windows = [json.loads(x) for x in
                   cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/ranks.jsonl").stdout.splitlines()]
        assert windows and windows[0]["step"] == 10, windows
        assert all(sorted(r["rank"] for r in w["ranks"]) == [0, 1] and all(r["calls"] > 0 for r in w["ranks"])
                   for w in windows), windows
        # {latest:...} takes the newest checkpoint complete on every node: where the stop came
        # while one was written, a node may hold it without trainer_state.json (or without the
        # shim's mark of DeepSpeed's part), and the resume takes the one before, on both nodes.
        # The newest checkpoint whole on both is cut short on the worker, as a node lost mid-save leaves it.
        cut = max(set.intersection(*(complete_checkpoints(cluster, n, run_id) for n in cluster.names)))
        worker = cluster.names[1]
        cluster.exec(worker, f"rm {RUNS}/{run_id}/code/out/checkpoint-{cut}/trainer_state.json")
        done = max(set.intersection(*(complete_checkpoints(cluster, n, run_id) for n in cluster.names)))
        assert done < cut <= max(complete_checkpoints(cluster, cluster.master, run_id))
        # resume.yml starts the same entry point from launch.json; -e gives it a nearer end
        r = cluster.playbook("resume.yml", "-e", f"run_id={run_id}", "-e", "follow=true", *NO_PREFLIGHT,
                             *e(dsc_entry_args=clm_entry_args(done + 10, 50)))
        assert r.returncode == 0, r.output[-6000:]
        ended = True  # followed to its end: nothing of the run is left for stop.yml
        log = assert_hf_trainer_finished(cluster, run_id, "zero3", done + 10)
        assert f"--resume_from_checkpoint out/checkpoint-{done}" in log
        said = next(x for x in log.splitlines() if x.startswith("[dsc_node] {latest:out/checkpoint-*}"))
        assert f"out/checkpoint-{done}, the newest complete on {cluster.master}, {worker}" in said, said
        assert f"out/checkpoint-{cut} ({worker}: no trainer_state.json)" in said, said
        assert f"Continuing training from global step {done}" in log, log[-3000:]
    finally:
        if not ended:
            cluster.playbook("stop.yml", "-e", f"run_id={run_id}")


def test_accelerate_script_restarted_by_max_restarts_finishes(data, cluster):
    """accelerate's save_state writes the scheduler, sampler and model files on the main process
    only (unless the script sets ProjectConfiguration(save_on_each_node=True), which this one
    does not), so with node-local run directories the other node cannot load them: this script's
    restart starts over (dsc_resume_args []); run_clm.py above resumes from its checkpoint."""
    run_id, worker, ended = "own-acc-restart", cluster.names[1], False
    launch(cluster, run_id, *accelerate_args("zero3", 80, checkpoint_every=1000, resume_args=()),
           "-e", "max_restarts=1", "-e", "restart_backoff_s=2", *NO_PREFLIGHT)
    try:
        # killed at its first logged step: 80 steps of this tiny model can pass in seconds, and a
        # kill that comes after the run's end restarts nothing
        wait(lambda: (cluster.run_status(run_id).get("last") or {}).get("step", 0) >= 1, 600, "a first step", every=0.5)
        victim = wait(lambda: cluster.rank_pids(worker, run_id, "--script deepspeed_with_config_support.py"), 60,
                      "a rank on the worker")[0]
        cluster.exec(worker, f"kill -9 {victim}")
        st = wait(lambda: (s := cluster.run_status(run_id))["state"] in ("finished", "failed") and s, 900,
                  "the restarted run to end", every=2)
        assert st["state"] == "finished" and st["restarts"] == 1, st
        ended = True  # its supervisor recorded the end: nothing of the run is left for stop.yml
        log = cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/launcher.log").stdout
        assert "[dsc_node] restart 1/1" in log and f"a rank on {worker} was killed by SIGKILL" in log
        restarts = [json.loads(x) for x in cluster.exec(cluster.master, f"cat {RUNS}/{run_id}/restarts.log").stdout.splitlines()]
        assert len(restarts) == 1 and f"a rank on {worker} was killed by SIGKILL" in restarts[0]["cause"], restarts
        assert_shown_finished(cluster, run_id, 80, state="finished (restarts: 1)")
        # the same entry point, launcher options and arguments both times
        spawned = [x for x in log.splitlines() if "spawned with command" in x]
        assert len(spawned) == 4 and all("'entry', '--script', 'deepspeed_with_config_support.py', '--model_type'" in x
                                         for x in spawned), spawned
        assert_accelerate_finished(cluster, run_id, 80)
    finally:
        if not ended:
            cluster.playbook("stop.yml", "-e", f"run_id={run_id}")


SECRET_SCRIPT = """import hashlib, os, pathlib, time
# Each rank: proves it has the secret (its hash), then lives long enough to be looked at.
pathlib.Path(os.environ["DSC_RUN_DIR"], f"token-{os.environ['RANK']}.sha256").write_text(
    hashlib.sha256(os.environ["HF_TOKEN"].encode()).hexdigest())
time.sleep(float(os.environ.get("HOLD_S", "8")))
"""


def test_secrets_reach_the_ranks_and_nowhere_else(data, cluster, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "show_secret.py").write_text(SECRET_SCRIPT)
    vars_file = tmp_path / "secrets.yml"  # what a user keeps in an ansible-vault file
    vars_file.write_text(f"dsc_secrets:\n  HF_TOKEN: {SECRET}\n")
    run_id, ended = "own-secret", False
    launch(cluster, run_id, "-e", f"@{vars_file}", "-e", f"dsc_code_dir={code}", "-e", "dsc_entry_script=show_secret.py",
           "-e", "dsc_ds_config_mode=none", "-v")
    try:
        want = hashlib.sha256(SECRET.encode()).hexdigest()
        for rank, node in enumerate(cluster.names):
            got = wait(lambda: cluster.exec(node, f"cat {RUNS}/{run_id}/token-{rank}.sha256", check=False).stdout.strip(),  # noqa: B023 - called in this iteration
                       120, f"rank {rank}'s token hash on {node}")
            assert got == want
        for node in cluster.names:  # while the ranks live: no command line holds it
            cmdlines = cluster.exec(node, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '", check=False).stdout
            assert "show_secret.py" in cmdlines and SECRET not in cmdlines
        wait(lambda: cluster.run_status(run_id)["state"] == "finished", 120, "the run to finish")
        ended = True  # its supervisor recorded the end: nothing of the run is left for stop.yml
        logs = tmp_path / "logs"
        fetched = cluster.playbook("logs.yml", "-e", f"run_id={run_id}", "-e", f"logs_dest={logs}")
        assert fetched.returncode == 0, fetched.output[-3000:]
        assert any(logs.rglob("launcher.log"))
        for node in cluster.names:
            found = cluster.exec(node, f"grep -rl {SECRET} {RUNS}/{run_id} || true").stdout.strip()
            assert found == "", (node, found)
            mode = cluster.exec(node, f"stat -c %a {RUNS}/.secrets/{run_id}.json").stdout.strip()
            assert mode == "600"
        for where in (logs, FACTS):
            hits = [str(p) for p in Path(where).rglob("*") if p.is_file() and SECRET in p.read_text(errors="replace")]
            assert hits == [], hits
        assert SECRET not in fetched.output
    finally:
        if not ended:
            cluster.playbook("stop.yml", "-e", f"run_id={run_id}")


@pytest.mark.parametrize("extra,needle", [
    (["-e", "dsc_entry_script=../cifar/cifar10_deepspeed.py"], "dsc_entry_script is '../cifar/cifar10_deepspeed.py'"),
    (["-e", "dsc_entry_script=missing.py"], "dsc_entry_script is 'missing.py', which is not in dsc_code_dir"),
    # the settings' own spec (roles/plan/meta/argument_specs.yml) refuses it first, naming the choices
    (["-e", "dsc_ds_config_mode=auto"], "dsc_ds_config_mode must be one of: preset, file, hf, none, got: auto"),
    (["-e", "dsc_ds_config_mode=file", "-e", "dsc_ds_config_file=NOTJSON"], "is not JSON"),
    (["-e", "dsc_requirements_file=", *e(dsc_requirements=["transformers==9.9.9"])],
     "'transformers==9.9.9' is not in dsc_wheelhouse"),
    (["-e", "dsc_data_dir=/nonexistent/dataset"], "dsc_data_dir on host"),
])
def test_bad_input_for_own_scripts_is_refused_before_any_node_changes(provisioned, cluster, tmp_path, extra, needle):
    not_json = tmp_path / "ds_config.json"
    not_json.write_text("{'zero_optimization': {'stage': 2}}")  # Python, not JSON
    extra = [x.replace("NOTJSON", str(not_json)) for x in extra]
    before = [cluster.exec(n, f"ls -A {RUNS}; ls -A {DATA} 2>/dev/null | wc -l", check=False).stdout for n in cluster.names]
    r = cluster.playbook("launch.yml", "-e", "run_id=own-bad", "-e", f"dsc_code_dir={FIXTURES / 'clm'}",
                         "-e", "dsc_entry_script=run_clm.py", *extra)
    assert r.returncode != 0 and needle in r.output, r.output[-3000:]
    assert ("Fix:" in r.output and "nothing was changed" in r.output) or "must be one of" in needle
    after = [cluster.exec(n, f"ls -A {RUNS}; ls -A {DATA} 2>/dev/null | wc -l", check=False).stdout for n in cluster.names]
    assert after == before


def test_a_ds_config_deepspeed_rejects_is_refused_before_any_node_changes(provisioned, cluster, tmp_path):
    bad = tmp_path / "ds_config.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2, "no_such_key": 1}}))
    before = [cluster.exec(n, f"ls -A {RUNS}", check=False).stdout for n in cluster.names]
    r = cluster.playbook("launch.yml", "-e", "run_id=own-bad-config", "-e", "dsc_ds_config_mode=file",
                         "-e", f"dsc_ds_config_file={bad}")
    assert r.returncode != 0 and "DeepSpeed rejects the run's ds_config" in r.output, r.output[-3000:]
    assert "no_such_key" in r.output and "nothing was changed" in r.output
    assert [cluster.exec(n, f"ls -A {RUNS}", check=False).stdout for n in cluster.names] == before


def test_a_shared_data_path_must_be_readable_on_every_node(data, cluster):
    """dsc_data_shared: nothing is synced; preflight checks the training user can read the path
    on every node (a FAIL names the node that lacks it)."""
    shared = "/tmp/dscluster-shared-data"
    worker = cluster.names[1]
    for n in cluster.names:
        cluster.exec(n, f"rm -rf {shared} && mkdir -p {shared} && echo x > {shared}/part-0 && chmod -R a+rX {shared}")
    cluster.exec(worker, f"chmod 0700 {shared}")  # root's only there: its ranks could not read it
    # The fast checks (the readable rows are theirs; the network measurements read no data): the
    # master's row passes, the worker's fails.
    r = cluster.playbook("preflight.yml", "-e", f"dsc_data_dir={shared}", "-e", "dsc_data_shared=true",
                         "-e", "preflight_full=false")
    rows = [line for line in r.output.splitlines() if line.strip().lstrip('"').startswith("data path ")]
    assert r.returncode != 0 and len(rows) == 2, r.output[-3000:]
    assert cluster.master in rows[0] and "PASS" in rows[0] and f"{shared} readable by dstrain" in rows[0], rows
    assert worker in rows[1] and "FAIL" in rows[1] and f"{shared} missing or not readable by dstrain" in rows[1], rows
    for n in cluster.names:
        cluster.exec(n, f"rm -rf {shared}")
