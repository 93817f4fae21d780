"""The entry shim every rank starts through (node/dscnode entry), from the built dsc_node.pyz: a
script or module run as python would with the run's secrets, its exit after its threads and
atexit handlers, the import patches, and the engine hook (the pace, HF Trainer's total, the ZeRO
stage, each rank's measured peak against the prediction).

    .venv/bin/pytest tests/unit/test_node_entry.py -q
"""
import json
import os
import subprocess
import sys
import types

import pytest

from dscnode import entry, records, rundir
from tests.unit.node_helpers import HELPER, helper


def test_the_entry_shim_runs_a_script_or_module_as_python_would_with_the_secrets(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    helper("write-secrets", run_dir, stdin=json.dumps({"HF_TOKEN": "hf_abc"}))
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    show = ("import json, os, sys\n"
            "print(json.dumps({'argv': sys.argv[1:], 'name': __name__, 'path0': sys.path[0],"
            " 'token': os.environ.get('HF_TOKEN'), 'flag': os.environ.get('DSC_SECRETS')}))\n")
    (code / "train.py").write_text(show)
    (code / "pkg" / "__init__.py").write_text("")
    (code / "pkg" / "run.py").write_text(show)
    env = dict(os.environ, DSC_RUN_DIR=str(run_dir), DSC_SECRETS="1")
    for target in (["--script", str(code / "train.py")], ["--module", "pkg.run"]):
        # as DeepSpeed's launcher starts it: --local_rank=N right after the program
        r = subprocess.run([sys.executable, str(HELPER), "--local_rank=0", "entry", *target, "--lr", "1"],
                           cwd=code, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out == {"argv": ["--local_rank=0", "--lr", "1"], "name": "__main__", "path0": str(code),
                       "token": "hf_abc", "flag": None}
    (tmp_path / "runs" / ".secrets" / "r1.json").unlink()
    r = subprocess.run([sys.executable, str(HELPER), "entry", "--script", str(code / "train.py")],
                       cwd=code, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "the run's secrets" in r.stderr and "Fix: resume with dsc_secrets given again" in r.stderr


@pytest.mark.parametrize("end,code", [("", 0), ("sys.exit(0)", 0), ("sys.exit(3)", 3),
                                      ("raise ValueError('boom')", 1)])
def test_a_finished_script_leaves_after_its_threads_and_atexit_handlers(tmp_path, end, code):
    """After the script returns (or exits 0) the shim joins its non-daemon threads, runs its
    atexit handlers and flushes, then leaves without interpreter finalization; a failure keeps
    its own exit code and traceback."""
    (tmp_path / "train.py").write_text(
        "import atexit, sys, threading, time\n"
        "def later():\n"
        "    time.sleep(0.5)\n"
        "    open('thread.txt', 'w').write('done')\n"
        "threading.Thread(target=later).start()\n"
        "atexit.register(lambda: open('atexit.txt', 'w').write(open('thread.txt').read()))\n"
        "class Finalized:\n"  # what interpreter finalization would run: module teardown
        "    def __del__(self):\n"
        "        sys.__stderr__.write('finalized')\n"
        "import json; json.kept = Finalized()\n"
        "print('unflushed', end='')\n"
        f"{end}\n")
    r = subprocess.run([sys.executable, str(HELPER), "entry", "--script", "train.py"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == code, r.stderr
    assert r.stdout == "unflushed" and (tmp_path / "atexit.txt").read_text() == "done"
    assert ("ValueError: boom" in r.stderr) is (code == 1)
    assert ("finalized" in r.stderr) is (code != 0)


def test_after_import_patches_a_module_once_on_its_first_import(tmp_path):
    (tmp_path / "pkg_after").mkdir()
    (tmp_path / "pkg_after" / "__init__.py").write_text("")
    (tmp_path / "pkg_after" / "engine.py").write_text("class Engine:\n    def step(self):\n        return 'original'\n")
    seen = []

    def patch(module):
        seen.append(module.__name__)
        module.Engine.step = lambda self: "patched"
    finder = entry.AfterImport({"pkg_after.engine": patch})
    sys.path.insert(0, str(tmp_path))
    sys.meta_path.insert(0, finder)
    try:
        from pkg_after.engine import Engine  # noqa: PLC0415 - the import is what is tested
        import pkg_after.engine  # noqa: F401, PLC0415 - a second import: no second patch
        assert Engine().step() == "patched" and seen == ["pkg_after.engine"]
    finally:
        sys.meta_path.remove(finder)
        sys.path.remove(str(tmp_path))


class FakeEngine:
    """What the entry shim reads of DeepSpeed's engine: rank, steps, samples, ZeRO stage."""

    def __init__(self, rank=0, stage=3):
        self.global_rank, self.global_steps, self.global_samples, self.stage = rank, 0, 0, stage
        self.device = None

    def zero_optimization_stage(self):
        return self.stage

    def get_lr(self):
        return [1e-3]

    def backward(self, loss):
        return loss

    def step(self):
        self.global_steps += 1
        self.global_samples += 8

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True):  # noqa: B006
        return None

    def load_checkpoint(self, load_dir, tag=None):
        return None, None


class FakeLoss:
    def __init__(self, value):
        self.value = value

    def detach(self):
        return self

    def float(self):
        return self

    def __add__(self, other):
        return FakeLoss(self.value + other.value)

    def item(self):
        return self.value


def trainer_callback_module():
    """transformers.trainer_callback as the entry shim sees it: a CallbackHandler whose
    on_train_begin HF's Trainer calls once state.max_steps is set."""
    class CallbackHandler:
        def on_train_begin(self, args, state, control):
            return control
    return type("module", (), {"CallbackHandler": CallbackHandler})


def test_the_entry_shim_logs_hf_trainers_total_and_the_pace_and_records_the_engines_zero_stage(tmp_path):
    class Engine(FakeEngine):
        pass
    watch = entry.EngineWatch(tmp_path / "progress.jsonl", every=0)
    watch.patch(Engine)
    module = trainer_callback_module()
    watch.watch_trainer(module)
    Engine(rank=1, stage=2)
    assert not (tmp_path / "engine.json").exists()  # global rank 0's alone
    engine = Engine(rank=0, stage=3)
    assert json.loads((tmp_path / "engine.json").read_text())["zero_stage"] == 3
    engine.backward(FakeLoss(2.0))
    engine.step()
    state = type("TrainerState", (), {"max_steps": 500})()
    assert module.CallbackHandler().on_train_begin(None, state, "control") == "control"
    for loss in (1.5, 1.0):
        engine.backward(FakeLoss(loss))
        engine.step()
    lines = [json.loads(x) for x in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [(x["step"], x.get("total_steps"), x["loss"]) for x in lines] == [(1, None, 2.0), (2, 500, 1.5), (3, 500, 1.0)]
    assert lines[0]["step_time_s"] is None and lines[1]["step_time_s"] >= 0  # the first holds start-up
    # a Trainer that trains by epochs of an unknown length (max_steps 0) gives no total
    watch.total_steps = None
    module.CallbackHandler().on_train_begin(None, type("TrainerState", (), {"max_steps": 0})(), None)
    assert watch.total_steps is None


def test_the_entry_shim_takes_a_scripts_own_total_from_the_environment(tmp_path, monkeypatch):
    """train.run sets DSC_TOTAL_STEPS: follow shows step N/total from the first progress line,
    before its metrics.jsonl has one."""
    class Engine(FakeEngine):
        pass
    watch = entry.EngineWatch(tmp_path / "progress.jsonl", every=0)
    watch.patch(Engine)
    engine = Engine(rank=0, stage=0)
    monkeypatch.setenv(entry.EngineWatch.TOTAL_ENV, "400")
    engine.backward(FakeLoss(2.0))
    engine.step()
    monkeypatch.setenv(entry.EngineWatch.TOTAL_ENV, "")
    engine.backward(FakeLoss(1.0))
    engine.step()
    lines = [json.loads(x) for x in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [x.get("total_steps") for x in lines] == [400, None]
    assert records.status(tmp_path, "own")["total_steps"] is None  # the newest line has none


def test_each_rank_records_its_peak_after_its_first_steps_and_status_sets_it_against_the_prediction(tmp_path, monkeypatch):
    """The entry shim's engine hook: every rank (not only rank 0) appends its
    max_memory_allocated after each of its first 3 optimizer steps with the configuration it ran;
    status and runs set the largest against memory.json's prediction and say when it is over by
    more than 5 %, with the ratio."""
    run = tmp_path / "r1"
    run.mkdir()
    gib = 2 ** 30
    (run / "memory.json").write_text(json.dumps({"key": "k1", "preset": "zero1", "micro_batch": 16, "world": 2,
                                                 "predicted": 50 * gib, "tolerance": 1.05}))

    class Engine:
        def __init__(self, rank):
            self.global_rank, self.global_steps, self.device = rank, 0, None

        def backward(self, loss):
            return loss

        def step(self):
            self.global_steps += 1

        def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True):  # noqa: B006
            return None

        def load_checkpoint(self, load_dir, tag=None):
            return None, None
    peaks = {0: 60 * gib, 1: 72 * gib}
    monkeypatch.setattr(entry, "peak_allocated", lambda engine: peaks[engine.global_rank])
    watch = entry.EngineWatch(run / "progress.jsonl", measured=run / "memory.jsonl")
    watch.patch(Engine)
    for rank in (0, 1):
        engine = Engine(rank)
        for _ in range(5):
            engine.step()
    lines = [json.loads(x) for x in (run / "memory.jsonl").read_text().splitlines()]
    assert [(m["rank"], m["step"]) for m in lines] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert all((m["preset"], m["micro_batch"]) == ("zero1", 16) for m in lines)
    mem = records.status(run, "r1")["memory"]
    assert (mem["predicted"], mem["measured"], mem["ratio"], mem["over"], mem["ranks"]) == (50 * gib, 72 * gib, 1.44, True, 2)
    assert mem["note"].startswith("measured 72.00 GiB per GPU against the predicted 50.00 GiB (x1.44): over the "
                                  "prediction by 44 %")
    assert next(r for r in records.runs(tmp_path) if r["id"] == "r1")["memory"]["key"] == "k1"
    # after a step down, the measured peaks of the earlier configuration are not this one's
    (run / "memory.json").write_text(json.dumps({"key": "k1", "preset": "zero2", "micro_batch": 8, "world": 2,
                                                 "predicted": 30 * gib}))
    mem = records.status(run, "r1")["memory"]
    assert mem["measured"] is None and mem["ratio"] is None and not mem["over"]
    # off the GPU nothing is recorded
    monkeypatch.undo()
    assert entry.peak_allocated(Engine(0)) is None or "torch" in sys.modules


FAKE_OP_BUILDER = '''import json, os


class OpBuilder:
    """DeepSpeed's OpBuilder as the entry shim sees it: jit_load compiles the op into the node's
    JIT cache (here: writes its .so), after reading what the run has recorded meanwhile."""

    def __init__(self, name):
        self.name, self.seen = name, None

    def jit_load(self, verbose=True):
        records = os.path.join(os.environ["DSC_RUN_DIR"], "op_builds.jsonl")
        self.seen = [json.loads(x) for x in open(records)] if os.path.exists(records) else []
        if self.name == "broken":
            raise RuntimeError("ninja: build stopped")
        folder = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], self.name)
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, self.name + ".so"), "w").close()
        return "module " + self.name
'''


def test_each_rank_records_the_jit_op_builds_it_waits_on_and_status_says_so(tmp_path, monkeypatch):
    """A first use on this node (no .so in TORCH_EXTENSIONS_DIR): the shim, through its import
    hook on DeepSpeed's builder module, records the build's start before it compiles and its end
    after, failed or not; an op already in the cache only loads, unrecorded. Status reports an op
    building while a live process of the run started it, once however many ranks wait on it."""
    code, run, ext = tmp_path / "code", tmp_path / "run", tmp_path / "ext"
    (code / "deepspeed" / "ops" / "op_builder").mkdir(parents=True)
    run.mkdir()
    for pkg in ("deepspeed", "deepspeed/ops", "deepspeed/ops/op_builder"):
        (code / pkg / "__init__.py").write_text("")
    (code / "deepspeed" / "ops" / "op_builder" / "builder.py").write_text(FAKE_OP_BUILDER)
    (code / "train.py").write_text(
        "import json\n"
        "from deepspeed.ops.op_builder.builder import OpBuilder\n"
        "class CPUAdamBuilder(OpBuilder):\n"
        "    pass\n"
        "first = CPUAdamBuilder('cpu_adam')\n"
        "assert first.jit_load() == 'module cpu_adam'\n"
        "again = CPUAdamBuilder('cpu_adam')\n"
        "again.jit_load()\n"
        "try:\n"
        "    CPUAdamBuilder('broken').jit_load()\n"
        "except RuntimeError:\n"
        "    pass\n"
        "print(json.dumps({'first': first.seen, 'again': again.seen}))\n")
    env = dict(os.environ, DSC_RUN_DIR=str(run), TORCH_EXTENSIONS_DIR=str(ext), RANK="1")
    r = subprocess.run([sys.executable, str(HELPER), "entry", "--script", str(code / "train.py")],
                       cwd=code, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    (start,) = seen["first"]  # while cpu_adam compiled: its start, recorded
    assert (start["op"], start["builder"], start["event"], start["rank"]) == ("cpu_adam", "CPUAdamBuilder", "start", "1")
    assert records.op_build(run, set()) is None  # its process is gone
    lines = [json.loads(x) for x in (run / rundir.RunDir.OP_BUILDS).read_text().splitlines()]
    assert len(seen["again"]) == 2  # loaded from the cache: nothing recorded
    assert [(x["op"], x["event"], x.get("ok")) for x in lines] == [
        ("cpu_adam", "start", None), ("cpu_adam", "end", True), ("broken", "start", None), ("broken", "end", False)]
    # Two ranks of a live run wait on one build: one op, since the first started; a dead
    # process's start without an end counts for nothing.
    (run / rundir.RunDir.OP_BUILDS).write_text("".join(json.dumps(x) + "\n" for x in [
        dict(start, pid=101, time=1000.0), dict(start, pid=102, time=1002.0), dict(start, pid=103, op="fused_adam"),
        {"op": "cpu_adam", "event": "end", "pid": 102}]))
    build = records.op_build(run, {101, 102, 104})
    assert build == {"ops": ["cpu_adam"], "since": 1000.0, "note": (
        "building DeepSpeed op cpu_adam (first use on this node: compiled once, can take minutes; "
        "deepspeed_warm_ops with CPUAdamBuilder builds it at provision)")}
    monkeypatch.setattr(records, "procs", lambda run_id: [{"pid": 101, "cmd": "python -u dsc_node.pyz entry", "ppid": 1}])
    assert records.status(run, "r1")["op_build"] == build
    (run / rundir.RunDir.OP_BUILDS).unlink()
    assert records.status(run, "r1")["op_build"] is None


def test_py_cpuinfo_runs_once_per_node_and_boot_and_every_later_call_reads_its_answer(tmp_path):
    """DeepSpeed asks py-cpuinfo twice per CPU op it loads; each answer costs a fresh Python. The
    first rank's answer is kept in the JIT cache for this boot; ranks after it read it; another
    boot, another py-cpuinfo or a damaged file asks again."""
    calls = []

    def cpuinfo_module():
        module = types.ModuleType("cpuinfo")
        module.CPUINFO_VERSION_STRING = "9.0.0"
        module.get_cpu_info = lambda: calls.append(1) or {"arch": "X86_64", "flags": ["avx2"]}
        return module

    def rank(boot_id="boot-1"):
        module = cpuinfo_module()
        entry.CpuInfoOnce(tmp_path, boot_id)(module)
        return module
    first = rank()
    assert first.get_cpu_info() == {"arch": "X86_64", "flags": ["avx2"]} and first.get_cpu_info()["arch"] == "X86_64"
    assert len(calls) == 1 and json.loads((tmp_path / "cpuinfo.json").read_text())["boot_id"] == "boot-1"
    assert rank().get_cpu_info()["flags"] == ["avx2"] and len(calls) == 1  # another rank: read
    assert rank("boot-2").get_cpu_info() and len(calls) == 2  # rebooted: asked again, kept anew
    (tmp_path / "cpuinfo.json").write_text("{not json")
    assert rank("boot-2").get_cpu_info() and len(calls) == 3
    assert not list(tmp_path.glob("*.tmp"))
    module = cpuinfo_module()  # no TORCH_EXTENSIONS_DIR: once per process, nothing written
    entry.CpuInfoOnce(None, "boot-1")(module)
    assert module.get_cpu_info() and module.get_cpu_info() and len(calls) == 4


def test_each_node_takes_its_own_value_of_the_per_node_settings():
    """DeepSpeed's launch.py gives every rank CROSS_RANK (its node's place in the hostfile)."""
    env = {"CROSS_RANK": "1", "DSC_NODE_NCCL_SOCKET_IFNAME": "eth0/ens5/eth0",
           "DSC_NODE_NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1//mlx5_0:1", "NCCL_DEBUG": "WARN"}
    entry.node_env(env)
    assert env == {"CROSS_RANK": "1", "NCCL_SOCKET_IFNAME": "ens5", "NCCL_DEBUG": "WARN"}
    env = {"DSC_NODE_NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1//mlx5_0:1"}  # no CROSS_RANK: one node, node 0
    entry.node_env(env)
    assert env == {"NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1"}


def test_a_ranks_peaks_are_labelled_with_the_ladder_step_its_command_names(tmp_path):
    """After a step down the supervisor starts the ranks with that step's ds_config: each rank
    labels its measured peaks with that step's preset and micro-batch (auto.json), memory.json's
    otherwise; nothing is rewritten for it."""
    (tmp_path / "memory.json").write_text(json.dumps({"preset": "zero1", "micro_batch": 16, "predicted": 1}))
    (tmp_path / "auto.json").write_text(json.dumps({"ladder": [{"preset": "zero1", "micro_batch": 16},
                                                               {"preset": "zero2", "micro_batch": 8}]}))
    first = ["--deepspeed_config", str(tmp_path / "ds_config.json")]
    assert entry.EngineWatch.configuration(tmp_path, first)["micro_batch"] == 16
    stepped = entry.EngineWatch.configuration(tmp_path, ["--deepspeed_config", str(tmp_path / "ds_config.step1.json")])
    assert (stepped["preset"], stepped["micro_batch"], stepped["predicted"]) == ("zero2", 8, 1)


def test_each_nodes_local_rank_0_records_each_save_and_whether_it_is_node_local(tmp_path):
    """saves.jsonl, what the supervisor copies to other nodes (dscnode.copies, node-local saves
    alone) and converts for fewer nodes (dscnode.shrink): each save, recorded by the node's local
    rank 0 when DeepSpeed's save returns (each node's run directory its own), never by another
    rank; a save to shared storage (dsc_checkpoint_shared_dir) said not node-local."""
    run, ckpt = tmp_path / "r1", tmp_path / "ckpt"
    run.mkdir()
    ckpt.mkdir()

    class Engine(FakeEngine):
        def __init__(self, rank, node_local=True):
            super().__init__(rank)
            self.local_rank, self.node_local = rank, node_local

        def use_node_local_storage(self):
            return self.node_local
    watch = entry.EngineWatch(run / "progress.jsonl")
    watch.patch(Engine)
    master, second, shared = Engine(0), Engine(1), Engine(0, node_local=False)
    master.step()
    master.save_checkpoint(str(ckpt), tag="step1")
    second.save_checkpoint(str(ckpt), tag="step1")  # the master's second rank
    shared.save_checkpoint(str(ckpt), tag="step2")
    saves = [json.loads(x) for x in (run / rundir.RunDir.SAVES).read_text().splitlines()]
    assert [(s["save_dir"], s["tag"], s["step"], s["node_local"]) for s in saves] == [
        (str(ckpt), "step1", 1, True), (str(ckpt), "step2", 0, False)]
