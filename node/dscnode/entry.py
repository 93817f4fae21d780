"""The entry shim: every rank of a run starts as

    <env python> -u dsc_node.pyz [--local_rank=N] entry --script FILE | --module NAME [ARGS...]

and runs here, under the training env's python: the run's secrets and this node's own network
settings into its environment, on GPUs NCCL's INIT and NET lines kept (keep_nccl_lines),
DeepSpeed's engine watched for progress (EngineWatch), its JIT op builds recorded (OpBuildWatch)
and py-cpuinfo's answer kept for the node (CpuInfoOnce), all through an import hook, then the
user's script or module in this process.
It imports rundir.py, ranktimes.py, nccllog.py, complete.py and the standard library, nothing
else of the package: its import cost is every rank's."""
import atexit
import importlib.util
import json
import os
import re
import runpy
import socket
import sys
import threading
import time
from pathlib import Path

from dscnode import complete, nccllog
from dscnode.ranktimes import RankTimes
from dscnode.rundir import RunDir, append_line, secrets_file, write_atomic


# The ranks' settings that differ between nodes (the plan's network_env: each node's own
# interface, RDMA ports, RoCE GID index): DSC_NODE_<VAR>=<node 0's>/<node 1's>/... in the
# hostfile's order; each rank takes its node's (node_env).
NODE_ENV_PREFIX = "DSC_NODE_"


def node_env(environ):
    """Each DSC_NODE_<VAR> of `environ` becomes <VAR> with this node's value: the one at
    CROSS_RANK, the node's place in the hostfile, which DeepSpeed's launch.py gives every rank
    (--node_rank). A node with no value ('') is left to NCCL's own choice."""
    node = int(environ.get("CROSS_RANK") or 0)
    for key in [k for k in environ if k.startswith(NODE_ENV_PREFIX)]:
        values = environ.pop(key).split("/")
        if node < len(values) and values[node]:
            environ[key[len(NODE_ENV_PREFIX):]] = values[node]


class EngineWatch:
    """What every rank's DeepSpeed engine does for the toolkit, whatever script drives it:
    - progress: each optimizer step, as global rank 0 sees it, appended to the run's
      progress.jsonl at most every `every` seconds: step, loss (the mean over the micro-batches
      since the last line), lr, samples, samples/s, the mean step time since the last line and,
      where the script's trainer says it, the total steps. The loss is read (.item(), a device
      sync) only when a line is written.
    - the run's total: DeepSpeed's engine has none, and scripts' own arguments mean what each
      script makes them mean, so the total is read only where it is unambiguous: HF's Trainer
      (run_clm.py, run_mlm.py, ...) sets state.max_steps, in optimizer steps as the engine counts
      them (from --max_steps, or the epochs times the batches per epoch), before it calls its
      callbacks' on_train_begin (watch_trainer). Any other script logs no total.
    - the engine's configuration: global rank 0 writes engine.json (its ZeRO stage) once the
      engine is initialised, whatever chose it (a preset, the user's file, HF's Trainer, the
      script's own config).
    - node-local checkpoints: with checkpoint.use_node_local_storage (run directories are per
      node) DeepSpeed has each node's local rank 0 save the shared state, but writes the
      `latest` tag on global rank 0 only, so load_checkpoint(tag=None) - HF's Trainer and
      accelerate resume that way - fails on every other node. Their local rank 0 writes it too.
    - checkpoints complete across the cluster: each save's tag is marked complete once DeepSpeed's
      save returns, and a load without a tag takes the newest tag complete on every node
      (dscnode.complete), not a node's own `latest`.
    - node-local saves recorded: each node's local rank 0 appends each to its saves.jsonl; the
      master's supervisor keeps each node's part on another node too (dscnode.copies), and a
      master that takes over a run (dscnode.shrink) finds its checkpoints there.
    Applied when deepspeed.runtime.engine is imported (AfterImport), whoever imports it (the
    script, HF's Trainer, accelerate)."""

    MEASURE_STEPS = 3  # each rank's peak is recorded after each of its first optimizer steps

    def __init__(self, path, every=2.0, measured=None, argv=(), times=None):
        self.path, self.every = Path(path), every
        self.measured = Path(measured) if measured else None
        self.times = times  # RankTimes: each rank's time in collectives, gathered every window
        self.config = self.configuration(self.path.parent, argv)
        self.loss, self.micro = None, 0
        self.step = self.written_step = 0
        self.time, self.samples = time.time(), 0
        self.engine = None
        self.total_steps = None  # where the script's trainer says it (watch_trainer)

    @staticmethod
    def configuration(run_dir, argv):
        """The preset and micro-batch this rank's peaks are recorded for: memory.json's (the
        plan's prediction), or, where the rank was started with a later step's ds_config of
        preset=auto's ladder (the supervisor's attempt after a step down), that step's (auto.json)."""
        try:
            config = json.loads((run_dir / RunDir.MEMORY).read_text())
        except (OSError, ValueError):
            return {}
        steps = [int(m.group(1)) for arg in argv
                 if (m := re.fullmatch(re.escape(str(run_dir)) + r"/ds_config\.step(\d+)\.json", str(arg)))]
        if steps:
            try:
                step = json.loads((run_dir / RunDir.AUTO).read_text())["ladder"][steps[0]]
                config = dict(config, preset=step["preset"], micro_batch=step["micro_batch"])
            except (OSError, ValueError, KeyError, IndexError, TypeError):
                pass
        return config

    TOTAL_ENV = "DSC_TOTAL_STEPS"  # a script's own total (train.run sets it before its first step)

    def __call__(self, module):
        self.patch(module.DeepSpeedEngine)

    def watch_trainer(self, module):
        """transformers.trainer_callback: the total steps HF's Trainer has set when it starts
        training (a resumed run's too: the Trainer sets it again after loading its state)."""
        handler, hook = module.CallbackHandler, self
        begin = handler.on_train_begin

        def on_train_begin(callbacks, args, state, control):
            max_steps = getattr(state, "max_steps", None)
            if isinstance(max_steps, int) and max_steps > 0:
                hook.total_steps = max_steps
            return begin(callbacks, args, state, control)
        handler.on_train_begin = on_train_begin

    def patch(self, engine_class):
        init, backward, step, save, load, hook = (engine_class.__init__, engine_class.backward, engine_class.step,
                                                  engine_class.save_checkpoint, engine_class.load_checkpoint, self)

        def reporting_init(engine, *args, **kwargs):
            init(engine, *args, **kwargs)
            if getattr(engine, "global_rank", None) == 0:
                hook.record_engine(engine)

        def watched_backward(engine, loss, *args, **kwargs):
            if engine.global_rank == 0 and hasattr(loss, "detach"):
                value = loss.detach().float()
                hook.loss = value if hook.loss is None else hook.loss + value
                hook.micro += 1
            return backward(engine, loss, *args, **kwargs)

        def watched_step(engine, *args, **kwargs):
            out = step(engine, *args, **kwargs)
            if hook.times:
                hook.times.stepped(engine)
            if hook.measured and 0 < engine.global_steps <= hook.MEASURE_STEPS:
                hook.record_peak(engine)
            if engine.global_rank == 0 and engine.global_steps != hook.step:
                hook.step, hook.engine = engine.global_steps, engine
                if time.time() - hook.time >= hook.every or hook.written_step == 0:
                    hook.write()
            return out
        def node_local_save(engine, save_dir, tag=None, client_state={}, save_latest=True, **kwargs):  # noqa: B006
            tag = tag if tag is not None else f"global_step{engine.global_steps}"
            out = save(engine, save_dir, tag, client_state, save_latest, **kwargs)
            # DeepSpeed's save ends at a barrier: every rank's part is written, on every node
            if engine.local_rank == 0 and (engine.use_node_local_storage() or engine.global_rank == 0):
                if save_latest and engine.global_rank != 0:
                    write_atomic(Path(save_dir) / "latest", str(tag))
                complete.mark(save_dir, tag)
            if engine.local_rank == 0:  # on every node: a later master reads it (a shared save too)
                hook.record_save(save_dir, tag, engine.global_steps, engine.use_node_local_storage())
            return out

        def agreed_load(engine, load_dir, tag=None, *args, **kwargs):
            if tag is None and not engine.load_universal_checkpoint():
                import torch.distributed as dist  # noqa: PLC0415 - loaded with the engine already
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, complete.tags(load_dir))
                tag = complete.agreed(everyone)
                if tag == "":
                    if engine.global_rank == 0:
                        print(f"dsc_node: no checkpoint in {load_dir} is complete on every node "
                              f"({complete.MARKS}); starting without one", file=sys.stderr, flush=True)
                    return None, None  # as DeepSpeed answers where there is no checkpoint
            # A universal checkpoint (a run gone on on fewer nodes, dscnode.shrink) loads with
            # DeepSpeed's load_universal at this world size; what the run saves next is its own.
            universal = tag is not None and os.path.isfile(os.path.join(load_dir, str(tag), complete.UNIVERSAL))
            was = engine._config.load_universal_checkpoint
            engine._config.load_universal_checkpoint = was or universal
            try:
                return load(engine, load_dir, tag, *args, **kwargs)
            finally:
                engine._config.load_universal_checkpoint = was
        engine_class.__init__ = reporting_init
        engine_class.backward, engine_class.step = watched_backward, watched_step
        engine_class.save_checkpoint, engine_class.load_checkpoint = node_local_save, agreed_load
        atexit.register(lambda: self.step != self.written_step and self.write())

    def record_save(self, save_dir, tag, step, node_local):
        """A save: a node-local one for the supervisor to keep each node's part of it on another
        node too (dscnode.copies), once the run has logged a later step or ended; either kind for
        a run that goes on on fewer nodes (dscnode.shrink) to find its newest checkpoint."""
        try:
            append_line(self.path.parent / RunDir.SAVES, json.dumps(
                {"save_dir": os.path.abspath(save_dir), "tag": str(tag), "step": step,
                 "node_local": bool(node_local), "time": round(time.time(), 1)}))
        except OSError:
            pass

    def record_engine(self, engine):
        """engine.json: the ZeRO stage the engine runs with (status and runs.yml show it where
        the toolkit's preset is not the run's config); nothing where the engine cannot say."""
        try:
            record = {"zero_stage": int(engine.zero_optimization_stage()), "time": round(time.time(), 3)}
            write_atomic(self.path.parent / RunDir.ENGINE, json.dumps(record) + "\n")
        except Exception:  # noqa: BLE001 - a record, never a rank's failure
            pass

    def record_peak(self, engine):
        """This rank's torch.cuda.max_memory_allocated() so far, a line of memory.jsonl with the
        configuration it ran (memory.json's preset and micro-batch); nothing off the GPU."""
        peak = peak_allocated(engine)
        if peak is None:
            return
        line = {"rank": int(getattr(engine, "global_rank", 0)), "host": socket.gethostname(),
                "step": int(engine.global_steps), "max_allocated": int(peak),
                "preset": self.config.get("preset"), "micro_batch": self.config.get("micro_batch"),
                "time": round(time.time(), 3)}
        try:
            with open(self.measured, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:
            pass

    def write(self):
        engine, now = self.engine, time.time()
        try:
            lr = float(engine.get_lr()[0])
        except Exception:  # noqa: BLE001 - no scheduler or optimizer yet: no lr
            lr = None
        loss = float(self.loss.item()) / self.micro if self.micro else None
        samples = int(getattr(engine, "global_samples", 0) or 0)
        # Rates over the steps since the last line (the first line's interval holds start-up).
        since = bool(self.written_step) and now > self.time and self.step > self.written_step
        rate = (samples - self.samples) / (now - self.time) if since else None
        step_time = (now - self.time) / (self.step - self.written_step) if since else None
        line = {"step": self.step, "loss": None if loss is None else round(loss, 6), "lr": lr,
                "samples": samples, "samples_per_s": None if rate is None else round(rate, 2),
                "step_time_s": None if step_time is None else round(step_time, 4),
                "time": round(now, 3)}
        total = self.total_steps or os.environ.get(self.TOTAL_ENV, "")
        if str(total).isdigit() and int(total) > 0:
            line["total_steps"] = int(total)
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        self.loss, self.micro, self.written_step = None, 0, self.step
        self.time, self.samples = now, samples


class OpBuildWatch:
    """DeepSpeed's JIT op builds, which a rank waits on before its first step: OpBuilder.jit_load
    compiles an op (torch's cpp_extension.load: ninja, g++, nvcc) the first time a node uses it,
    a minute or more (70 s for cpu_adam, DeepSpeedCPUAdam's op, on a CPU node), and says nothing
    meanwhile. Each build's start and end go to the run's op_builds.jsonl, a line each, where
    status reads what is being built. An op whose .so is already in the node's JIT cache
    (TORCH_EXTENSIONS_DIR/<op>/, where provision builds deepspeed_warm_ops) only loads: no line."""

    def __init__(self, path):
        self.path = Path(path)

    def __call__(self, module):
        self.patch(module.OpBuilder)

    def patch(self, builder_class):
        jit_load, hook = builder_class.jit_load, self

        def recorded_jit_load(builder, *args, **kwargs):
            op = str(getattr(builder, "name", "?"))
            if hook.cached(op):
                return jit_load(builder, *args, **kwargs)
            start, ok = time.time(), False
            hook.record(op=op, builder=type(builder).__name__, event="start")
            try:
                out = jit_load(builder, *args, **kwargs)
                ok = True
                return out
            finally:
                hook.record(op=op, builder=type(builder).__name__, event="end", ok=ok,
                            seconds=round(time.time() - start, 1))
        builder_class.jit_load = recorded_jit_load

    @staticmethod
    def cached(op):
        """Whether the op's .so is in the node's JIT cache, as provision's warm-up checks it;
        without TORCH_EXTENSIONS_DIR, torch's own default cache."""
        root = os.environ.get("TORCH_EXTENSIONS_DIR")
        try:
            folder = Path(root, op) if root else \
                Path(importlib.import_module("torch.utils.cpp_extension")._get_build_directory(op, False))
            return any(name.endswith(".so") for name in os.listdir(folder))
        except Exception:  # noqa: BLE001 - not found where looked: recorded as a build
            return False

    def record(self, **line):
        line.update(rank=os.environ.get("RANK"), pid=os.getpid(), time=round(time.time(), 3))
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:  # a record, never a rank's failure
            pass


class CpuInfoOnce:
    """py-cpuinfo's get_cpu_info, which DeepSpeed calls twice for every CPU op it loads, cached or
    not (OpBuilder.cpu_arch and simd_width, for the build flags), and once more in
    DeepSpeedCPUAdam: each call starts a fresh Python that probes the CPU, about a second of CPU
    time, so each rank of a gloo run spent two seconds on it before its first step. A node's CPU
    does not change while it runs: the first answer is kept beside the JIT cache
    (TORCH_EXTENSIONS_DIR/cpuinfo.json, written by the training user for this boot and this
    py-cpuinfo) and every later call on the node reads it; without TORCH_EXTENSIONS_DIR, once
    per process."""

    def __init__(self, root=None, boot_id=None):
        self.path = Path(root, "cpuinfo.json") if root else None
        self.key = boot_id or read_boot_id()
        self.info = None

    def __call__(self, module):
        get_cpu_info, version = module.get_cpu_info, getattr(module, "CPUINFO_VERSION_STRING", "?")

        def once():
            if self.info is None:
                self.info = self.kept(version)
            if self.info is None:
                self.info = get_cpu_info()
                self.keep(version)
            return dict(self.info)
        module.get_cpu_info = once

    def kept(self, version):
        if not self.path:
            return None
        try:
            kept = json.loads(self.path.read_text())
            if kept["boot_id"] == self.key and kept["cpuinfo"] == version and kept["info"].get("arch"):
                return kept["info"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or not ours
            pass
        return None

    def keep(self, version):
        if self.path and self.key:
            try:
                write_atomic(self.path, json.dumps({"boot_id": self.key, "cpuinfo": version, "info": self.info}))
            except OSError:  # a cache, never a rank's failure
                pass


def read_boot_id():
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def peak_allocated(engine):
    """torch.cuda.max_memory_allocated() of the engine's device, None off CUDA."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available():
            return None
        return int(torch.cuda.max_memory_allocated(getattr(engine, "device", None)))
    except Exception:  # noqa: BLE001 - a record, never a rank's failure
        return None


class AfterImport:
    """A meta path finder that calls fn(module) right after a module's first import, whoever
    imports it: {module name: fn}."""

    def __init__(self, patches):
        self.patches = dict(patches)

    def find_spec(self, name, path=None, target=None):
        fn = self.patches.pop(name, None)
        if fn is None:
            return None
        spec = importlib.util.find_spec(name)  # the other finders' (this one no longer has it)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            fn(module)
        spec.loader.exec_module = patched
        return spec


def accelerate_on_cpu(module):
    """accelerate (1.15) chooses a process-group backend for GPU-like devices only: under
    DeepSpeed's launcher on CPU nodes (DS_ACCELERATOR=cpu, gloo) it gets none and counts one
    process while DeepSpeed has the whole world, so HF's "auto" batch and every gather are wrong
    ("invalid output tensor list ... expected length 2, got 1"). It gets accelerate's own CPU
    path (multi-CPU over gloo) instead; on GPU nodes nothing changes."""
    state = module.PartialState
    prepare = state._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, kind = prepare(self, cpu, sagemaker_dp, backend)
        if chosen is None and kind in (None, module.DistributedType.NO) and not cpu \
                and os.environ.get("DS_ACCELERATOR") == "cpu" \
                and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", module.DistributedType.MULTI_CPU
        return chosen, kind
    state._prepare_backend = prepare_backend


def keep_nccl_lines(environ, folder):
    """On GPU ranks (the plan's DS_ACCELERATOR, or none given) whose NCCL_DEBUG is the plan's
    default (WARN) and who name no debug file of their own: NCCL's INIT and NET lines, which say
    the transport it chose, kept per process in the run directory for status.yml
    (dscnode.nccllog). A level set on purpose (dsc_nccl_debug, dsc_rank_env) is left as it is,
    printed where the user asked."""
    if environ.get("DS_ACCELERATOR", "cuda") != "cuda" or environ.get("NCCL_DEBUG", "WARN").upper() != "WARN" \
            or environ.get("NCCL_DEBUG_FILE"):
        return
    try:
        folder.mkdir(exist_ok=True)
    except OSError:
        return
    environ.update(nccllog.debug_env(folder))


def entry(args, local_rank=()):
    """A rank: the run's secrets and this node's network settings (node_env) into this process's
    environment (secrets never pass a command line), the progress hook, then the user's script or module run here as `python FILE` or
    `python -m NAME` would (sys.argv, sys.path[0], __main__). DeepSpeed's launcher puts
    --local_rank=N right after the program (this helper): it goes back right after the user's."""
    if len(args) < 2 or args[0] not in ("--script", "--module"):
        print("usage: dsc_node.pyz entry --script FILE | --module NAME [ARGS...]", file=sys.stderr)
        return 2
    kind, target, rest = args[0], args[1], args[2:]
    run_dir = os.environ.get("DSC_RUN_DIR")
    if run_dir and os.environ.pop("DSC_SECRETS", "") == "1":
        try:
            os.environ.update(json.loads(secrets_file(run_dir).read_text()))
        except (OSError, ValueError) as e:
            raise SystemExit(f"dsc_node entry: the run's secrets ({secrets_file(run_dir)}) cannot "
                             f"be read: {e}. Fix: resume with dsc_secrets given again (resume.yml "
                             f"writes them anew on every node).") from None
    node_env(os.environ)
    patches = {"accelerate.state": accelerate_on_cpu,
               "cpuinfo": CpuInfoOnce(os.environ.get("TORCH_EXTENSIONS_DIR"))}
    if run_dir:
        window = RankTimes.window_from(os.environ.get("DSC_RANK_WINDOW"))
        times = RankTimes(RunDir(run_dir) / RunDir.RANKS, window) if window > 0 else None
        watch = EngineWatch(RunDir(run_dir) / RunDir.PROGRESS, measured=RunDir(run_dir) / RunDir.MEASURED,
                            argv=rest, times=times)
        patches["deepspeed.runtime.engine"] = watch
        if times:
            patches["deepspeed.comm.torch"] = times
        patches["transformers.trainer_callback"] = watch.watch_trainer
        patches["deepspeed.ops.op_builder.builder"] = OpBuildWatch(RunDir(run_dir) / RunDir.OP_BUILDS)
        keep_nccl_lines(os.environ, RunDir(run_dir) / RunDir.NCCL)
        (RunDir(run_dir) / RunDir.RANKS_STARTED).touch()
    sys.meta_path.insert(0, AfterImport(patches))
    sys.argv = [target] + list(local_rank) + rest
    try:
        if kind == "--module":
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    leave_finished()


def leave_finished():
    """The script has finished: what Python's own exit does before finalization (wait for the
    non-daemon threads, run the atexit handlers, flush), then exit 0 without the finalization.
    gloo's worker threads can abort it after a finished run ("terminate called without an active
    exception", pytorch/pytorch#179291): the launcher would then fail a run that is done."""
    threading._shutdown()  # what Py_Finalize calls first; joins the non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)
