"""The supervisor start detaches for a run (node/dscnode supervisor): failure lines from DeepSpeed
and pdsh, the {latest:...} checkpoint placeholder, stall detection, the exit code on a full disk,
and preset=auto's step down after an out-of-memory error in the first steps. Real processes, no
container.

    .venv/bin/pytest tests/unit/test_node_supervisor.py -q
"""
import json

import pytest

from dscnode import records, rundir, supervisor
from tests.unit.node_helpers import helper, wait_for, launcher_script


@pytest.mark.parametrize("line,expect", [
    ("node2: [2026] [INFO] [launch.py:335] Process 7 exits with return code = -9", ("node2", "signal", "a rank on node2 was killed by SIGKILL")),
    ("node1: [INFO] exits with return code = 3", ("node1", "exit", "ranks on node1 exited with code 3")),
    ("pdsh@node1: node2: ssh exited with exit code 255", ("node2", "lost", "the connection to node2 was lost (node down or sshd gone)")),
    ("node1: [INFO] exits with return code = 0", None),
    ("some other line", None),
])
def test_failure_lines_from_deepspeed_and_pdsh(line, expect):
    ev = supervisor.failure_event(line)
    if expect is None:
        assert ev is None
    else:
        assert (ev["node"], ev["kind"], supervisor.describe(ev)) == expect


def test_latest_checkpoint_placeholder_takes_the_highest_step_or_drops_the_option(tmp_path):
    for name in ("checkpoint-9", "checkpoint-40", "checkpoint-100x", "other"):
        (tmp_path / "out" / name).mkdir(parents=True)
    argv = ["deepspeed", "run.py", "--resume_from_checkpoint", "{latest:out/checkpoint-*}"]
    assert supervisor.resolve_latest(argv, tmp_path)[-1] == "out/checkpoint-100x"
    (tmp_path / "out" / "checkpoint-100x").rmdir()
    assert supervisor.resolve_latest(argv, tmp_path)[-2:] == ["--resume_from_checkpoint", "out/checkpoint-40"]
    assert supervisor.resolve_latest(argv, tmp_path / "nothing") == ["deepspeed", "run.py"]


def test_latest_checkpoint_stays_inside_the_working_directory(tmp_path):
    """A glob that climbs out ('..', an absolute one) is left as it is, and a match that is a link
    out of the working directory is not taken (the training user's planted link)."""
    (tmp_path / "elsewhere" / "checkpoint-999").mkdir(parents=True)
    work = tmp_path / "work"
    (work / "out" / "checkpoint-5").mkdir(parents=True)
    (work / "out" / "checkpoint-900").symlink_to(tmp_path / "elsewhere" / "checkpoint-999")
    argv = ["run.py", "--resume_from_checkpoint", "{latest:out/checkpoint-*}"]
    assert supervisor.resolve_latest(argv, work)[-1] == "out/checkpoint-5"
    for outside in ("{latest:../elsewhere/*}", "{latest:/etc/*}"):
        assert supervisor.resolve_latest(["--from", outside], work) == ["--from", outside]


def test_latest_checkpoint_never_takes_a_name_with_a_line_end(tmp_path):
    """A checkpoint name the training user made with a newline (pdsh's runner passes arguments
    unquoted: a second command) is never chosen; a placeholder with one is not a placeholder."""
    (tmp_path / "out" / "checkpoint-9").mkdir(parents=True)
    for name in ("checkpoint-99\n", "checkpoint-98\r", "checkpoint-97\ntouch"):
        (tmp_path / "out" / name).mkdir()
    argv = ["run.py", "--resume_from_checkpoint", "{latest:out/checkpoint-*}"]
    assert supervisor.resolve_latest(argv, tmp_path)[-1] == "out/checkpoint-9"
    assert supervisor.resolve_latest(["{latest:out/checkpoint-*}\n"], tmp_path) == ["{latest:out/checkpoint-*}\n"]


def test_a_run_without_a_new_step_for_the_limit_is_stalled_until_the_next_step(tmp_path):
    run = rundir.RunDir(tmp_path)
    progress = tmp_path / "progress.jsonl"

    def step(n):
        with progress.open("a") as f:
            f.write(json.dumps({"step": n, "loss": 1.0}) + "\n")
    watch = supervisor.Stall(run, timeout_s=0, min_s=5)
    assert watch.check(100.0) is None  # no step yet (start-up, op builds): nothing judged
    step(1)
    assert watch.check(101.0) is None
    step(3)
    assert watch.check(103.0) is None and watch.limit() == 10  # 10 x the median 1 s/step, over min_s
    assert watch.check(112.0) is None
    stalled = watch.check(113.5)
    # first: the supervisor reads every rank's stack at the mark, once (dscnode.stacks.at_stall)
    assert stalled == {"step": 3, "since": 103.0, "limit_s": 10.0, "first": True}
    assert json.loads((tmp_path / "stalled.json").read_text()) == {"step": 3, "since": 103.0, "limit_s": 10.0}
    assert watch.check(115.0) == {"step": 3, "since": 103.0, "limit_s": 10.0}
    step(4)
    assert watch.check(114.0) is None and not (tmp_path / "stalled.json").exists()
    assert supervisor.Stall(run, timeout_s=30).limit() == 30
    restarted = supervisor.Stall(run, timeout_s=0, min_s=5)  # a restart: step 4 is the last attempt's
    assert restarted.check(200.0) is None and restarted.check(300.0) is None
    step(2)
    assert restarted.check(301.0) is None and restarted.check(306.5)["step"] == 2
    assert supervisor.describe({"kind": "stall", "limit_s": 10.0, "step": 3}) == \
        "the run stalled: no step for 10 s after step 3"


def test_the_exit_code_is_recorded_on_a_disk_too_full_for_a_new_file(tmp_path, monkeypatch):
    run = rundir.RunDir(tmp_path)
    supervisor.reserve_exit(run)

    def full(path, text):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(supervisor, "write_atomic", full)
    supervisor.record_exit(run, -9)
    assert (tmp_path / "exit_code").read_text() == "-9\n" and not (tmp_path / ".exit_code.reserve").exists()
    assert records.status(tmp_path, "r-full")["exit_code"] == "-9"


def ladder(run, micro_batches=(16, 8, 4)):
    """preset=auto's files as the plan writes them at launch: the ladder, every step's ds_config."""
    steps = [{"preset": f"zero{i + 1}", "micro_batch": mb, "grad_accum": 64 // mb, "train_batch": 64,
              "predicted": mb * 2 ** 30} for i, mb in enumerate(micro_batches)]
    (run / "auto.json").write_text(json.dumps({"ladder": steps}))
    for i, mb in enumerate(micro_batches):
        (run / rundir.RunDir.step_config(i)).write_text(json.dumps({"train_micro_batch_size_per_gpu": mb}))
    (run / "memory.json").write_text(json.dumps({"key": "k", "preset": "zero1", "micro_batch": 16, "predicted": 1}))
    (run / "launch.json").write_text(json.dumps({"preset": "zero1", "dsc_micro_batch": 16, "dsc_train_batch": 64}))


def test_an_out_of_memory_error_in_the_first_steps_steps_down_preset_autos_ladder(tmp_path):
    """The supervisor (max_restarts 0): a rank's torch.OutOfMemoryError at micro-batch 16 and 8
    does not fail the run: each attempt steps down the ladder, recorded with its cause in
    step_downs.jsonl (its one writer), the next attempt started with that step's ds_config (which
    the plan wrote at launch), and shown by status; micro-batch 4 trains and the run finishes.
    No file the plan wrote is rewritten: launch.json says what was launched, trained_with what
    trained."""
    root = tmp_path / "runs"
    run = root / "auto1"
    run.mkdir(parents=True)
    ladder(run)
    written = {f.name: f.read_text() for f in run.iterdir()}
    script = launcher_script(tmp_path, 'for a in "$@"; do case "$a" in *.json) cfg=$a;; esac; done\n'
                                       'if grep -q \'"train_micro_batch_size_per_gpu": 4\' "$cfg"; '
                                       'then echo trained; exit 0; fi\n'
                                       'echo "node1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"\n'
                                       'echo "node1: [launch] exits with return code = 1"; exit 1')
    started = helper("start", run, "auto1", "--run-root", root, "--ports", 29820, 29830, "--", script,
                     "--deepspeed_config", run / "ds_config.json")
    assert started.returncode == 0, started.stderr
    assert wait_for(run / "exit_code", 30)
    assert (run / "exit_code").read_text().strip() == "0", (run / "launcher.log").read_text()
    downs = [json.loads(x) for x in (run / "step_downs.jsonl").read_text().splitlines()]
    assert [(d["preset"], d["micro_batch"], d["next"]["micro_batch"]) for d in downs] == [("zero1", 16, 8), ("zero2", 8, 4)]
    assert all("torch.OutOfMemoryError" in d["cause"] for d in downs)
    assert {name: (run / name).read_text() for name in written} == written  # nothing rewritten
    assert records.trained_with(run) == {"step": 2, "preset": "zero3", "micro_batch": 4, "predicted": 4 * 2 ** 30,
                                         "ds_config": "ds_config.step2.json"}
    st = records.status(run, "auto1")
    assert st["state"] == "finished" and st["restarts"] == 0 and len(st["step_downs"]) == 2
    assert st["config"] == "preset zero3" and st["memory"]["preset"] == "zero3" and st["memory"]["micro_batch"] == 4
    assert "stepping down to zero2 micro-batch 8" in (run / "launcher.log").read_text()


def test_no_step_down_for_another_error_a_run_past_its_first_steps_or_a_spent_ladder(tmp_path):
    run = rundir.RunDir(tmp_path)
    ladder(tmp_path)
    assert supervisor.step_down(run, None, 1) is None  # not out of memory
    (tmp_path / "progress.jsonl").write_text(json.dumps({"step": 4}) + "\n")
    assert supervisor.step_down(run, "torch.OutOfMemoryError: CUDA out of memory", 1) is None  # trained already
    (tmp_path / "progress.jsonl").write_text(json.dumps({"step": 2}) + "\n")
    assert supervisor.step_down(run, "node1: torch.OutOfMemoryError: CUDA out of memory", 1) == 1
    assert supervisor.step_down(run, "node1: torch.OutOfMemoryError: CUDA out of memory", 1) == 2
    assert supervisor.step_down(run, "node1: torch.OutOfMemoryError: CUDA out of memory", 1) is None  # spent
    assert len(records.step_downs(tmp_path)) == 2
    # every node runs the master's command, with the step's ds_config (written on every node)
    cmd = ["deepspeed", "run.py", "--deepspeed_config", str(tmp_path / "ds_config.json")]
    assert supervisor.at_step(cmd, run, 1)[-1] == str(tmp_path / "ds_config.step1.json")
    assert supervisor.at_step(cmd, run, 0) == cmd
