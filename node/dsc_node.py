#!/usr/bin/env python3
"""The node helper: everything the playbooks ask of a node, in one standard-library program.

Installed by provision.yml on every node at /usr/local/lib/dscluster/dsc_node.py (root-owned) and
run under the node's system python3; `probe` also runs before provisioning (Ansible's script
module pushes it). Every command prints one JSON object.

    dsc_node.py probe [--run-root DIR]        # GPUs, interfaces, InfiniBand, CPUs, runs (the plan's input)
    dsc_node.py check                         # preflight: env, versions, names, disk, ports, firewall
                                              #   (arguments as JSON in $DSC_PREFLIGHT, as for the three below)
    dsc_node.py mesh                          # from the master, as the training user: ssh to every node, clocks
    dsc_node.py listen | connect              # hold / reach the master port (preflight's TCP check)
    dsc_node.py write-run RUN_DIR [--resume]  # stdin {files: {name: text}, code: base64 tar.gz}: the run's files
    dsc_node.py start RUN_DIR RUN_ID --run-root DIR (--ports FIRST LAST | --port P) [--replace]
                      [--hosts H1,H2] [--max-restarts N] [--backoff S] [--resume-args JSON_LIST]
                      [--stall-s S] [--stall-fail] -- CMD...
                                              # under a lock: refuse (or replace) an active run, take the
                                              # first free master port (--port: the one the master took,
                                              # no_ssh mode's other nodes), detach a supervisor that runs CMD,
                                              # tears the run down everywhere when a node fails and
                                              # restarts it from its checkpoint (opt-in)
    dsc_node.py procs RUN_ID                  # processes that carry DSC_RUN_ID=RUN_ID
    dsc_node.py stop RUN_ID [--grace S] [--run-dir DIR [--by WHO]] [--ext-dir DIR]
                                              # mark the run stopped (by WHO), TERM, then KILL after
                                              # S seconds
    dsc_node.py status RUN_DIR RUN_ID [--hosts H1,H2]
                                              # state, ranks alive, last metrics, first error
                                              # (with --hosts: every node's state and ranks, via pdsh)
    dsc_node.py write-exit RUN_DIR CODE       # the run's exit code, recorded on a worker
    dsc_node.py step-down RUN_DIR INDEX       # preset=auto's ladder step INDEX becomes the run's config
    dsc_node.py files RUN_DIR                 # the run's files but code and checkpoints (logs.yml)
    dsc_node.py log RUN_DIR RUN_ID [--lines N] [--hosts H1,H2]
                                              # the log's last N lines per node, its raw tail, the state
    dsc_node.py history RUN_DIR               # every logged step (metrics or progress), for plots
    dsc_node.py runs RUN_ROOT                 # every run, newest first, with its state (runs.yml)
    dsc_node.py free-port FIRST LAST          # the first port nobody listens on (exit 3 if none)
    dsc_node.py active RUN_ROOT               # the run whose supervisor is alive, if any
    dsc_node.py write-secrets RUN_DIR         # stdin {NAME: value}: the run's secrets, 0600, outside the run dir
    dsc_node.py entry --script FILE | --module NAME [ARGS...]
                                              # each rank: the run's secrets into the environment,
                                              # DeepSpeed's engine watched for progress, then the
                                              # user's script or module in this process
"""
import atexit
import base64
import fcntl
import glob
import hashlib
import importlib.util
import io
import json
import os
import pwd
import re
import runpy
import shlex
import shutil
import signal
import socket
import stat as stat_mod
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path


# Where provision.yml installs this helper on every node (root-owned; the plan reads it from here).
INSTALLED_PATH = "/usr/local/lib/dscluster/dsc_node.py"


def sha256(path):
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


class RunDir:
    """The run directory's layout: every file name the toolkit reads or writes, in one place."""
    PID = "launcher.pid"          # the supervisor's pid while the run is alive (restarts included)
    LOG = "launcher.log"          # DeepSpeed's launcher output (all nodes, through pdsh)
    CHILD = "launcher.child"      # the current attempt's launcher pid
    EXIT = "exit_code"            # written once, when the supervisor ends
    EXIT_RESERVE = ".exit_code.reserve"  # its room, taken at the start (a full disk at the end)
    FAILURE = "failure.json"      # which node failed first, and how
    RESTARTS = "restarts"         # restarts so far
    RESTARTS_LOG = "restarts.log"
    STOPPED = "stopped"           # a stop on purpose, naming who stopped it: no restart
    METRICS = "metrics.jsonl"     # one JSON object per logged step (train.run)
    PROGRESS = "progress.jsonl"   # any script's steps, as DeepSpeed's engine saw them (entry)
    ENGINE = "engine.json"        # what global rank 0's engine reported once initialised (entry)
    PORT = "master_port"
    LAUNCH = "launch.json"        # what the run was launched with (resume and restarts reuse it)
    CODE = "code"
    CHECKPOINTS = "checkpoints"   # train.run's; left out of logs.yml's copies with the code
    ATTEMPT = "attempt.json"      # the current attempt and where its output starts in the log
    STALLED = "stalled.json"      # no step for the stall time (removed when steps come again)
    RANKS_STARTED = "ranks.started"  # a rank started on this node (the entry shim)
    LOCK = ".launch.lock"         # in the run root: one launch at a time
    MEMORY = "memory.json"        # the plan's predicted peak per GPU (and preset=auto's key)
    MEASURED = "memory.jsonl"     # each rank's max_memory_allocated after its first steps (entry)
    AUTO = "auto.json"            # preset=auto's step-down ladder and the step that runs
    STEP_DOWNS = "step_downs.jsonl"  # each out-of-memory step down: the attempt, its cause, the next

    def __init__(self, path):
        self.path = Path(path)

    def __truediv__(self, name):
        return self.path / name


def secrets_file(run_dir):
    """Where a run's secrets live: beside the run directory, never in it (logs.yml copies the
    run directory), readable by the training user only."""
    run_dir = Path(run_dir)
    return run_dir.parent / SECRETS_DIR / f"{run_dir.name}.json"


SECRETS_DIR = ".secrets"  # in the run root: never a run (runs() leaves out every dot name)


def has_secrets(run_dir):
    """Whether the run's secrets file is there (lstat: never followed, root may ask)."""
    try:
        return stat_mod.S_ISREG(os.lstat(secrets_file(run_dir)).st_mode)
    except OSError:
        return False


def prune_secrets(run_root):
    """Remove the secrets files whose run directory is gone (a secrets file goes with its run;
    run by the training user, at write-secrets and start): the ids removed."""
    folder = Path(run_root) / SECRETS_DIR
    if folder.is_symlink():
        return []
    gone = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return gone
    for e in entries:
        run_id = e.name[:-len(".json")] if e.name.endswith(".json") else ""
        if run_id and not os.path.lexists(Path(run_root) / run_id):
            try:
                os.unlink(e.path)
                gone.append(run_id)
            except OSError:
                pass
    return sorted(gone)


def write_secrets(run_dir, values):
    """The run's secrets, written by the training user: directory 0700, file 0600, created with
    those modes (never world-readable, not even for a moment). Kept beside the run: resume and
    the supervisor's restarts start its ranks with them, without the operator passing them
    again; those of runs whose directory is gone are removed."""
    path = secrets_file(run_dir)
    prune_secrets(path.parent.parent)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({str(k): str(v) for k, v in values.items()}, f)
    tmp.rename(path)
    return {"ok": True, "names": sorted(values)}


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
    Applied when deepspeed.runtime.engine is imported (AfterImport), whoever imports it (the
    script, HF's Trainer, accelerate)."""

    MEASURE_STEPS = 3  # each rank's peak is recorded after each of its first optimizer steps

    def __init__(self, path, every=2.0, measured=None):
        self.path, self.every = Path(path), every
        self.measured = Path(measured) if measured else None
        try:
            self.config = json.loads((self.path.parent / RunDir.MEMORY).read_text())
        except (OSError, ValueError):
            self.config = {}
        self.loss, self.micro = None, 0
        self.step = self.written_step = 0
        self.time, self.samples = time.time(), 0
        self.engine = None
        self.total_steps = None  # where the script's trainer says it (watch_trainer)

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
        init, backward, step, save, hook = (engine_class.__init__, engine_class.backward, engine_class.step,
                                            engine_class.save_checkpoint, self)

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
            if save_latest and engine.use_node_local_storage() and engine.local_rank == 0 \
                    and engine.global_rank != 0:
                write_atomic(Path(save_dir) / "latest", str(tag))
            return out
        engine_class.__init__ = reporting_init
        engine_class.backward, engine_class.step = watched_backward, watched_step
        engine_class.save_checkpoint = node_local_save
        atexit.register(lambda: self.step != self.written_step and self.write())

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
        if self.total_steps:
            line["total_steps"] = self.total_steps
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        self.loss, self.micro, self.written_step = None, 0, self.step
        self.time, self.samples = now, samples


def peak_allocated(engine):
    """torch.cuda.max_memory_allocated() of the engine's device, None off CUDA."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available():
            return None
        return int(torch.cuda.max_memory_allocated(getattr(engine, "device", None)))
    except Exception:  # noqa: BLE001 - a record, never a rank's failure
        return None


def memory_summary(run_dir):
    """The run's predicted peak per GPU (memory.json) against its ranks' measured ones on this node
    (memory.jsonl, those of the configuration memory.json names now): predicted, measured (the
    largest rank's), ratio, over (by more than the tolerance, 5 %) and a line that says so; None
    where neither is there."""
    run = RunDir(run_dir)
    predicted = read_json(run / RunDir.MEMORY) or {}
    peaks = {}
    try:
        for text in (run / RunDir.MEASURED).read_text().splitlines():
            try:
                m = json.loads(text)
            except ValueError:
                continue
            if predicted and (m.get("preset"), m.get("micro_batch")) != (predicted.get("preset"), predicted.get("micro_batch")):
                continue  # an earlier step of the ladder's
            peaks[m.get("rank")] = max(peaks.get(m.get("rank"), 0), int(m.get("max_allocated") or 0))
    except OSError:
        pass
    if not predicted and not peaks:
        return None
    out = {k: predicted.get(k) for k in ("key", "preset", "micro_batch", "world", "predicted")}
    measured = max(peaks.values()) if peaks else None
    out.update(measured=measured, ranks=len(peaks), ratio=None, over=False, note=None)
    if measured and predicted.get("predicted"):
        ratio = measured / predicted["predicted"]
        out["ratio"] = round(ratio, 3)
        out["over"] = ratio > float(predicted.get("tolerance", 1.05))
        out["note"] = (f"measured {measured / 2**30:.2f} GiB per GPU against the predicted "
                       f"{predicted['predicted'] / 2**30:.2f} GiB (x{ratio:.2f})"
                       + (f": over the prediction by {100 * (ratio - 1):.0f} %; a later preset=auto of the "
                          f"same code and model uses the measured figure" if out["over"] else ""))
    return out


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


def entry(args, local_rank=()):
    """A rank: the run's secrets into this process's environment (they never pass a command
    line), the progress hook, then the user's script or module run here as `python FILE` or
    `python -m NAME` would (sys.argv, sys.path[0], __main__). DeepSpeed's launcher puts
    --local_rank=N right after the program (this helper): it goes back right after the user's."""
    if len(args) < 2 or args[0] not in ("--script", "--module"):
        print("usage: dsc_node.py entry --script FILE | --module NAME [ARGS...]", file=sys.stderr)
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
    patches = {"accelerate.state": accelerate_on_cpu}
    if run_dir:
        watch = EngineWatch(RunDir(run_dir) / RunDir.PROGRESS, measured=RunDir(run_dir) / RunDir.MEASURED)
        patches["deepspeed.runtime.engine"] = watch
        patches["transformers.trainer_callback"] = watch.watch_trainer
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


def become(user):
    """A preexec function that drops root to `user` (None when no change is needed)."""
    if not user or os.geteuid() != 0:
        return None
    pw = pwd.getpwnam(user)

    def drop():
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
    return drop


def run(cmd, timeout=60, env=None, user=None):
    """cmd's (exit code, stdout, stderr); as `user` when given and this helper is root."""
    drop = become(user)
    if drop:
        home = pwd.getpwnam(user).pw_dir
        env = dict(env or os.environ, HOME=home, USER=user, LOGNAME=user)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           preexec_fn=drop)
        return r.returncode, r.stdout, r.stderr
    except FileNotFoundError as e:
        return 127, "", str(e)
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout} s"


def read_text(path, limit=1 << 20):
    """A run file's text, never through a symbolic link: root reads run directories the training
    user writes, and a link planted there must not make it read another file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat_mod.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        return f.read(limit).decode(errors="replace")


def read_json(path):
    try:
        return json.loads(read_text(path))
    except (OSError, ValueError):
        return None


def port_free(port):
    # SO_REUSEADDR as torch's TCPStore binds: a port in TIME_WAIT is free to it.
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_port(first, last):
    return next((p for p in range(first, last + 1) if port_free(p)), None)


def start_time(pid):
    """A process's start time in clock ticks since boot (/proc/PID/stat field 22), or None:
    with the pid it names one process, never a later one that reused the number."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def write_pid(pid_file, pid):
    write_atomic(pid_file, f"{pid} {start_time(pid) or ''}".strip() + "\n")


def pid_alive(pid_file):
    """The pid in the file if that very process exists: the start time written beside it must
    match (a stale file whose pid was reused by another process reads as dead); EPERM on another
    user's process reads as alive."""
    try:
        pid, *started = read_text(pid_file).split()
        pid = int(pid)
        os.kill(pid, 0)
    except PermissionError:
        pass
    except (OSError, ValueError):
        return None
    if started and start_time(pid) not in (None, int(started[0])):
        return None
    return pid


def active(run_root):
    for pid_file in sorted(Path(run_root).glob(f"*/{RunDir.PID}")):
        if pid_alive(pid_file):
            return {"run_id": pid_file.parent.name, "run_dir": str(pid_file.parent)}
    return {}


def runs(run_root):
    """The runs under the run root, newest first: id, started (a launcher log exists), active,
    finished (exit code 0)."""
    out = []
    try:
        entries = list(os.scandir(run_root))
    except OSError:
        return out
    for e in entries:
        if not e.is_dir(follow_symlinks=False) or e.name.startswith("."):  # .secrets: no run
            continue
        d = RunDir(e.path)
        try:
            finished = read_text(d / RunDir.EXIT).strip() == "0"
        except OSError:
            finished = False
        out.append({"id": e.name, "mtime": e.stat(follow_symlinks=False).st_mtime,
                    "started": (d / RunDir.LOG).exists(), "active": bool(pid_alive(d / RunDir.PID)),
                    "finished": finished, "launch": read_json(d / RunDir.LAUNCH),
                    "memory": memory_summary(e.path),
                    "secrets": has_secrets(e.path)})
    return sorted(out, key=lambda r: r["mtime"], reverse=True)


def interfaces():
    """{name: [ipv4 addresses]} from iproute2, else names only (addresses unknown: None)."""
    rc, out, _ = run(["ip", "-o", "-4", "addr", "show"])
    if rc == 0:
        found = {name: [] for _, name in socket.if_nameindex()}
        for line in out.splitlines():
            m = re.match(r"^\d+:\s+(\S+)\s+inet\s+([\d.]+)/", line)
            if m:
                found.setdefault(m.group(1), []).append(m.group(2))
        return found
    return {name: None for _, name in socket.if_nameindex()}


def gpus():
    rc, out, _ = run(["nvidia-smi", "--query-gpu=index,compute_cap,driver_version,memory.total",
                      "--format=csv,noheader,nounits"], timeout=30)
    if rc != 0:
        return []
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    return [{"index": r[0], "compute_cap": r[1], "driver": r[2],
             "memory_mib": int(r[3]) if len(r) > 3 and r[3].isdigit() else None}
            for r in rows if len(r) >= 3]


def root_paths(install_root, run_root, data_dir, home):
    """Every path that root creates, changes or writes into on a node (provision, launch; stop
    and status only read), the one list the plan checks: [{var, path, role}]. role "root": root's
    alone (owner root, every directory above root's); "made": created by root for the training
    user (the install root: owner root or the training user, every directory above root's);
    "user": the training user's (written as that user; owner the training user or root)."""
    install_root = install_root.rstrip("/") or "/"
    cache = f"{install_root}/cache"
    out = [{"var": "node helper", "path": os.path.dirname(INSTALLED_PATH), "role": "root"},
           {"var": "node helper", "path": INSTALLED_PATH, "role": "root"},
           {"var": "dsc_install_root", "path": install_root, "role": "made"}]
    out += [{"var": "dsc_install_root", "path": p, "role": "user"} for p in (
        cache, f"{cache}/torch_extensions", f"{cache}/miniconda-installer.sh",
        f"{install_root}/wheelhouse", f"{install_root}/lock-wheels.txt",
        f"{install_root}/lock-sdists.txt", f"{install_root}/ds_report.txt")]
    if run_root:
        out.append({"var": "dsc_run_root", "path": run_root.rstrip("/") or "/", "role": "user"})
    if data_dir:
        out.append({"var": "dsc_data_dir", "path": data_dir.rstrip("/") or "/", "role": "user"})
    if home:
        out += [{"var": "dsc_train_user", "path": p, "role": "user"} for p in (
            f"{home}/.ssh", f"{home}/.ssh/authorized_keys", f"{home}/.ssh/id_ed25519",
            f"{home}/.ssh/known_hosts", f"{home}/.ssh/config")]
    return out


def path_chain(path):
    """lstat of a path and of every directory above it, "/" first (a link is reported with its
    target, never followed): [{path, kind, uid, user, mode, target}]; a missing one has kind
    "missing", and the chain stops there."""
    parts = [p for p in path.split("/") if p]
    out = []
    for i in range(len(parts) + 1):
        p = "/" + "/".join(parts[:i])
        try:
            st = os.lstat(p)
        except OSError:
            out.append({"path": p, "kind": "missing"})
            break
        kind = ("link" if stat_mod.S_ISLNK(st.st_mode) else "dir" if stat_mod.S_ISDIR(st.st_mode)
                else "file" if stat_mod.S_ISREG(st.st_mode) else "other")
        try:
            user = pwd.getpwuid(st.st_uid).pw_name
        except KeyError:
            user = str(st.st_uid)
        entry = {"path": p, "kind": kind, "uid": st.st_uid, "user": user, "mode": oct(st.st_mode & 0o7777)}
        if kind == "link":
            try:
                entry["target"] = os.readlink(p)
            except OSError:
                entry["target"] = "?"
        out.append(entry)
        if kind != "dir":
            break
    return out


def root_path_report(install_root, run_root, data_dir, train_user):
    """root_paths with each one's chain (path_chain), for the plan to refuse before any change."""
    try:
        home = pwd.getpwnam(train_user).pw_dir if train_user else ""
    except KeyError:
        home = ""  # not created yet: provision makes the home, as root, in root's /home
    return [dict(e, chain=path_chain(e["path"])) for e in root_paths(install_root, run_root, data_dir, home)]


def probe(argv):
    """What the plan needs from a node; fast (no Python env, no torch) and read-only."""
    def arg(name):
        return argv[argv.index(name) + 1] if name in argv else ""
    run_root = arg("--run-root")
    existing = arg("--existing-python")
    install_root = arg("--install-root")
    ib = Path("/sys/class/infiniband")
    return {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "gpus": gpus(),
            "interfaces": interfaces(), "infiniband": ib.is_dir() and any(ib.iterdir()),
            "runs": runs(run_root) if run_root else [],
            "run_root_links": links(run_root) if run_root else [],
            "helper_sha256": sha256(INSTALLED_PATH), "firewalls": firewalls(),
            **({"existing_python": path_owners(existing)} if existing else {}),
            **({"root_paths": root_path_report(install_root, run_root, arg("--data-dir"),
                                               arg("--train-user"))} if install_root else {})}


def path_owners(path):
    """Who owns an interpreter that root may run, and who may write it: owner and mode of the
    path and of every directory above it, as written and as resolved (a venv's bin/python is a
    link to its base interpreter), and of the env's lib/python3* and site-packages directories
    (what it imports). Each read with lstat (a link is reported, never followed by the read
    itself); the resolved path is read component by component as os.path.realpath gives it.
    {"path", "entries": [{path, uid, user, mode, kind}]} or {"path", "error"}."""
    if not os.path.isabs(path) or "\0" in path:
        return {"path": path, "error": "not an absolute path"}
    real = os.path.realpath(path)
    if not os.path.isfile(real):
        return {"path": path, "error": f"{real} is not a file"}
    names = {}

    def user(uid):
        if uid not in names:
            try:
                names[uid] = pwd.getpwuid(uid).pw_name
            except KeyError:
                names[uid] = str(uid)
        return names[uid]

    chains = []
    for p in (os.path.normpath(path), real):
        parts = p.split("/")[1:]
        chains += ["/"] + ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]
    prefix = os.path.dirname(os.path.dirname(real))
    lexical_prefix = os.path.dirname(os.path.dirname(os.path.normpath(path)))
    for base in dict.fromkeys((lexical_prefix, prefix)):
        for lib in sorted(glob.glob(os.path.join(glob.escape(base), "lib", "python3*")))[:8]:
            chains += [os.path.join(base, "lib"), lib]
            chains += sorted(glob.glob(os.path.join(glob.escape(lib), "site-packages")))
    entries = []
    for p in dict.fromkeys(chains):
        try:
            st = os.lstat(p)
        except OSError as e:
            entries.append({"path": p, "error": e.strerror})
            continue
        kind = ("link" if stat_mod.S_ISLNK(st.st_mode) else "dir" if stat_mod.S_ISDIR(st.st_mode)
                else "file")
        entries.append({"path": p, "uid": st.st_uid, "user": user(st.st_uid),
                        "mode": oct(st.st_mode & 0o7777), "kind": kind})
    return {"path": path, "entries": entries}


def firewalls(root="/"):
    """Which host firewall runs, read from files (no firewall-cmd or ufw call: every playbook
    probes): ufw enabled in /etc/ufw/ufw.conf, a firewalld process; and the OS's ids from
    /etc/os-release (ID, then ID_LIKE), from which the plan takes cluster_network_firewall_backend
    auto. `root`: where those paths are (/ on a node)."""
    root = Path(root)

    def read(path):
        try:
            return (root / path).read_text(errors="replace")
        except OSError:
            return ""
    release = dict(line.split("=", 1) for line in read("etc/os-release").splitlines() if "=" in line)
    ids = " ".join(release.get(k, "").strip().strip('"\'') for k in ("ID", "ID_LIKE")).split()
    ufw = re.search(r"^\s*ENABLED\s*=\s*yes\s*$", read("etc/ufw/ufw.conf"), re.M | re.I) is not None
    try:
        pids = [p for p in os.listdir(root / "proc") if p.isdigit()]
    except OSError:
        pids = []
    firewalld = any(read(f"proc/{pid}/comm").strip() == "firewalld" for pid in pids)
    return {"os": ids, "ufw": ufw, "firewalld": firewalld}


def links(run_root):
    """The names of symbolic links in the run root (never run directories)."""
    try:
        return sorted(e.name for e in os.scandir(run_root) if e.is_symlink())[:1000]
    except OSError:
        return []


# Every installed distribution's version (preflight compares them between nodes), by name.
DISTRIBUTIONS = r"""
import importlib.metadata as md, re
dists = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version
         for d in md.distributions() if d.metadata["Name"]}
"""

VERSIONS = DISTRIBUTIONS + r"""
import json, platform, torch, deepspeed
cuda = torch.cuda.is_available()
print(json.dumps({"distributions": dists, "python": platform.python_version(), "torch": torch.__version__,
                  "cuda": torch.version.cuda or "cpu", "deepspeed": deepspeed.__version__,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-",
                  "torch_gpus": torch.cuda.device_count() if cuda else 0}))
"""


# The fast checks (launch.yml) read the same from the installed packages' metadata without
# importing them (importing torch and DeepSpeed takes seconds on a GPU node); torch's own
# version.py holds its CUDA build. The GPU count torch sees needs the import: full mode only.
VERSIONS_FAST = DISTRIBUTIONS + r"""
import json, os, platform, importlib.metadata as md, importlib.util
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
missing = [n for n in ("torch", "deepspeed") if version(n) is None]
if missing:
    raise SystemExit("ModuleNotFoundError: No module named " + repr(missing[0]))
spec = importlib.util.find_spec("torch")
info = {}
exec(open(os.path.join(os.path.dirname(spec.origin), "version.py")).read(), info)
nccl = [version(n) for n in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11") if version(n)]
print(json.dumps({"distributions": dists, "python": platform.python_version(), "torch": version("torch"),
                  "cuda": info.get("cuda") or "cpu", "deepspeed": version("deepspeed"),
                  "nccl": nccl[0] if nccl and info.get("cuda") else "-"}))
"""


def versions(python, env, fast=False, user=None):
    """The env's versions, read by its own python run as `user` (the env's owner): root never
    runs code from a place the training user can write (a planted .pth would run as root)."""
    if not os.access(python, os.X_OK):
        return {"error": f"{python} does not exist"}
    rc, out, err = run([python, "-c", VERSIONS_FAST if fast else VERSIONS], timeout=180,
                       env=dict(os.environ, **env), user=user)
    if rc != 0:
        last = [line for line in err.strip().splitlines() if line.strip()][-1:] or [f"exit {rc}"]
        return {"error": f"{python} cannot import torch and deepspeed: {last[0][:300]}"}
    return json.loads(out.strip().splitlines()[-1])


def resolve(names):
    out = {}
    for name in names:
        try:
            out[name] = sorted({a[4][0] for a in socket.getaddrinfo(name, None, socket.AF_INET)})
        except OSError as e:
            out[name] = [f"unresolved: {e.strerror or e}"]
    return out


def free_gib(path):
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path or "/")
    return path, round(st.f_bavail * st.f_frsize / 2**30, 1)


def firewall(first, last):
    """The node's firewall: firewalld when it is running (a node may have ufw installed beside
    it, inactive; the probe's firewalls() reads that), else ufw when installed, with whether the
    toolkit's master-port rule is there."""
    if shutil.which("firewall-cmd"):
        running = firewalls()["firewalld"]
        if running or not shutil.which("ufw"):
            return {"tool": "firewalld", "state": "active" if running else "inactive", "master_rule": None}
    if shutil.which("ufw"):
        rc, out, err = run(["ufw", "status"])
        state = "active" if "Status: active" in out else "inactive" if rc == 0 else "unknown"
        # As ufw shows the toolkit's deny: one port alone, never "29500:29500" (ufw refuses that).
        ports = f"{first}:{last}" if str(first) != str(last) else f"{first}"
        return {"tool": "ufw", "state": state, "master_rule": f"{ports}/tcp" in out,
                "detail": (out or err).strip().splitlines()[0:1]}
    return {"tool": None, "state": "none", "master_rule": None}


def check(a):
    """Preflight's view of a node (the control node judges it: plugins/filter/preflight.py)."""
    path, gib = free_gib(a["run_root"])
    out = {
        "hostname": socket.gethostname(),
        "time": time.time(),
        "cpus": os.cpu_count(),
        "env_prefix_exists": os.path.isdir(a["env_prefix"]),
        "versions": versions(a["python"], a.get("env", {}), fast=a.get("fast", False),
                             user=a.get("env_owner")),
        "resolve": resolve(a["names"]),
        "disk": {"path": path, "free_gib": gib},
        "interfaces": interfaces(),
        "firewall": firewall(a["port_first"], a["port_last"]),
        "iperf3": bool(shutil.which("iperf3")),
        "code_dir_exists": os.path.isdir(a["code_dir"]) if a.get("code_dir") else None,
        # A shared dataset must be readable by the training user (the ranks run as that user).
        "data_readable": (run(["test", "-r", a["data_dir"], "-a", "-x", a["data_dir"]],
                              user=a.get("train_user"))[0] == 0) if a.get("data_dir") else None,
        "jit_locks": jit_locks_as(a.get("ext_dir"), a.get("train_user")),
        "helper_owners": owners([INSTALLED_PATH, os.path.dirname(INSTALLED_PATH)]),
        # Every path root creates or writes into (the plan refuses a link or a foreign owner).
        "root_paths": root_path_report(a.get("install_root", ""), a["run_root"], a.get("data_dir", ""),
                                       a.get("train_user", "")) if a.get("install_root") else None,
    }
    if a.get("master"):
        out["port"] = {"wanted": a["port_first"], "wanted_free": port_free(a["port_first"]),
                       "first_free": free_port(a["port_first"], a["port_last"])}
        out["active_run"] = active(a["run_root"]).get("run_id")
    return out


# What runs in an op's build directory while torch holds its lock: ninja and the compilers.
BUILDERS = {"ninja", "c++", "g++", "gcc", "cc", "cc1plus", "cc1", "as", "ld", "collect2", "nvcc",
            "cicc", "ptxas", "fatbinary", "nvlink", "hipcc", "clang", "clang++"}


def jit_locks(ext_dir, min_age_s=60.0, now=None):
    """Torch's op-build locks (`<TORCH_EXTENSIONS_DIR>/<op>/lock`, a file torch creates before
    building and removes after; every later build of that op on the node waits while it
    exists): each with its age and whether it is stale, i.e. older than `min_age_s` with no
    builder working in its directory. A rank killed mid-build leaves one behind and every later
    run on the node hangs in "Waiting for lock". Read as the lock's owner: a process whose
    directory cannot be read counts as a builder when its name is a compiler's."""
    now = time.time() if now is None else now
    try:
        os.listdir(ext_dir)  # glob says nothing of a directory it cannot read
    except FileNotFoundError:
        return []
    except OSError as e:
        return [{"path": str(ext_dir), "error": f"{ext_dir}: {e.strerror}"}]
    locks = list(Path(ext_dir).glob("*/lock")) + list(Path(ext_dir).glob("*/*/lock"))
    if not locks:
        return []
    cwds, unknown = [], False
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cwds.append(os.readlink(f"/proc/{entry.name}/cwd"))
        except PermissionError:
            try:
                unknown |= Path(f"/proc/{entry.name}/comm").read_text().strip() in BUILDERS
            except OSError:
                pass
        except OSError:
            pass
    out = []
    for lock in sorted(locks):
        try:
            age = now - lock.stat().st_mtime
        except OSError:
            continue
        where = str(lock.parent)
        busy = unknown or any(c == where or c.startswith(where + "/") for c in cwds)
        out.append({"path": str(lock), "age_s": round(age, 1), "stale": age >= min_age_s and not busy})
    return out


def owners(paths):
    """Each path's owner uid and mode: what root runs must be root's alone (not group- or
    world-writable), else whoever can write it runs code as root."""
    out = {}
    for path in paths:
        try:
            st = os.lstat(path)
            out[path] = {"uid": st.st_uid, "mode": oct(st.st_mode & 0o7777),
                         "safe": st.st_uid == 0 and not st.st_mode & 0o022 and not os.path.islink(path)}
        except OSError as e:
            out[path] = {"error": e.strerror, "safe": False}
    return out


def jit_locks_as(ext_dir, user):
    """jit_locks read as `user` (the builders' owner: root may be denied their /proc entries),
    in a forked child that drops to that user: no interpreter is executed, so that one the user
    cannot run (root's own under /root) does not matter."""
    if not ext_dir:
        return []
    drop = become(user)
    if not drop:
        return jit_locks(ext_dir)
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(readable)
        try:
            drop()
            found = jit_locks(ext_dir)
        except Exception as e:  # noqa: BLE001 - reported, not raised, by a child that must _exit
            found = [{"path": ext_dir, "error": f"{type(e).__name__}: {e}"[:200]}]
        with os.fdopen(writable, "w") as out:
            out.write(json.dumps(found))
        os._exit(0)
    os.close(writable)
    with os.fdopen(readable) as got:
        text = got.read()
    os.waitpid(pid, 0)
    try:
        return json.loads(text)
    except ValueError:
        return [{"path": ext_dir, "error": "the check ended without an answer"}]


def remove_stale_locks(ext_dir):
    """Remove the stale op-build locks (jit_locks); the paths removed."""
    removed = []
    for lock in jit_locks(ext_dir):
        if lock["stale"]:
            try:
                os.unlink(lock["path"])
                removed.append(lock["path"])
            except OSError:
                pass
    return removed


def mesh(a):
    """ssh to every node as DeepSpeed's runner and pdsh do (the training user's ssh config, no
    prompt), and read each clock's offset against this one over the open session: the node
    prints its time when a byte arrives, so the error is half a round trip on an established
    connection (milliseconds), not the connection set-up."""
    out = {}
    for node in a["nodes"]:
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "PasswordAuthentication=no",
               node, "hostname; read x; date +%s.%N"]
        try:
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, bufsize=1)
        except OSError as e:
            out[node] = {"ok": False, "error": str(e)}
            continue
        try:
            hostname = p.stdout.readline().strip()
            if not hostname:  # ssh failed before the command ran: report ssh's own error
                p.wait(timeout=20)
                err = p.stderr.read().strip().splitlines() or [f"exit {p.returncode}"]
                out[node] = {"ok": False, "error": err[-1][:300]}
                continue
            t0 = time.time()
            p.stdin.write("\n")
            p.stdin.flush()
            stamp = p.stdout.readline().strip()
            t1 = time.time()
            p.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired) as e:
            p.kill()
            out[node] = {"ok": False, "error": f"ssh did not finish: {e}"}
            continue
        if p.returncode != 0 or not hostname or not stamp:
            err = p.stderr.read().strip().splitlines() or [f"exit {p.returncode}"]
            out[node] = {"ok": False, "error": err[-1][:300]}
            continue
        out[node] = {"ok": True, "hostname": hostname, "rtt_s": round(t1 - t0, 4),
                     "offset_s": round(float(stamp) - (t0 + t1) / 2, 4)}
    return out


def listen(a):
    """Hold the port the launch would take until every node connected to it (or time out)."""
    port = a["port"]
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    s.settimeout(1.0)
    seen, deadline = [], time.time() + a.get("seconds", 60)
    while len(seen) < a["expect"] and time.time() < deadline:
        try:
            conn, peer = s.accept()
        except TimeoutError:
            continue
        seen.append(peer[0])
        conn.settimeout(2.0)
        try:  # let the client close first, so TIME_WAIT stays on its side
            conn.recv(1)
        except OSError:
            pass
        conn.close()
    s.close()
    return {"port": port, "seen": seen}


def connect(a):
    deadline, last = time.time() + a.get("timeout", 5), "no attempt"
    while time.time() < deadline:
        try:
            with socket.create_connection((a["host"], a["port"]), timeout=max(0.5, deadline - time.time())):
                return {"ok": True, "msg": "connected"}
        except TimeoutError:
            last = f"timed out after {a.get('timeout', 5)} s (a firewall dropping packets?)"
        except OSError as e:
            last = e.strerror or str(e)
            time.sleep(0.2)
    return {"ok": False, "msg": last}


# What the launchers print when a node's ranks end badly: launch.py on the node (pdsh prefixes its
# lines with the node name), and pdsh itself when a node's ssh session ends non-zero (255: the
# connection was lost, e.g. the node died).
RANK_EXIT = re.compile(r"^(\S+): .*exits with return code = (-?\d+)")
SSH_EXIT = re.compile(r"^pdsh@\S+: (\S+): ssh exited with exit code (\d+)")
# A stall is the supervisor's own verdict, taken only while no other failure was seen: what its
# teardown then causes (lost sessions, killed ranks) is not the cause.
CAUSE_ORDER = {"stall": -1, "signal": 0, "lost": 1, "exit": 2}
# An out-of-memory error as a rank prints it (torch.OutOfMemoryError, "CUDA out of memory").
OUT_OF_MEMORY = re.compile(r"(OutOfMemoryError|CUDA out of memory)")
# preset=auto steps down only while the run has made no more optimizer steps than this.
FIRST_STEPS = EngineWatch.MEASURE_STEPS
ERROR_LINE = re.compile(r"(Traceback|Error|error:|Killed|exits with return code = [1-9]|"
                        r"was not reachable|Address already in use)")


class Blind(RuntimeError):
    """Processes this helper cannot inspect: a lookup that cannot see must never say "none"."""


def procs(run_id):
    """Every process whose environment carries DSC_RUN_ID=run_id (supervisor, launcher, pdsh,
    ranks). Run as the training user, who owns them all: reading another user's
    /proc/PID/environ needs CAP_SYS_PTRACE, which containers and hardened kernels deny even
    root. An environment of our own user's that cannot be read raises Blind; as root, any
    non-root one."""
    marker = f"DSC_RUN_ID={run_id}".encode()
    me, out, blind = os.geteuid(), [], []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            if marker not in env:
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except PermissionError:
            try:
                owner = (d / "environ").stat().st_uid
            except OSError:
                continue
            # A run never runs as root (the plan refuses a root training user), and the kernel
            # gives root the /proc files of non-dumpable processes (sshd's session processes):
            # those are not looked at. As root, any other user's unreadable one is blindness.
            if owner != 0 and (me == 0 or owner == me):
                blind.append(int(d.name))
            continue
        except OSError:  # gone meanwhile
            continue
        out.append({"pid": int(d.name), "cmd": cmd[:300], "ppid": parent(d)})
    if blind:
        raise Blind(f"cannot read the environment of {len(blind)} processes (e.g. pid {blind[0]}: "
                    f"permission denied); run the helper as the user who owns the run")
    return out


# DeepSpeed's runner answers SIGTERM by pkill-ing every launcher that matches its command line on
# every node (other runs' too): it and pdsh get SIGKILL, never TERM. The supervisor is left to
# record the exit code once its launcher is gone.
RUNNER = re.compile(r"(/deepspeed |deepspeed\.launcher\.runner|^pdsh |/pdsh )")
SUPERVISOR = " start "


def is_supervisor(p):
    return "dsc_node.py" in p["cmd"] and SUPERVISOR in p["cmd"]


def parent(proc_dir):
    try:  # /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def ranks_of(ps):
    """The ranks among a run's processes: children of a node's launch.py (DeepSpeed's per-node
    launcher), not their DataLoader workers."""
    launchers = {p["pid"] for p in ps if "deepspeed.launcher.launch" in p["cmd"]}
    return [p for p in ps if p.get("ppid") in launchers]


def started_by(ps, pid):
    """The processes among ps that descend from pid (through the ppids that ps records)."""
    children = {}
    for p in ps:
        children.setdefault(p.get("ppid"), []).append(p)
    out, todo = [], [pid]
    while todo:
        for p in children.pop(todo.pop(), []):
            out.append(p)
            todo.append(p["pid"])
    return out


def signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_gone(run_id, seconds, keep=lambda p: True):
    deadline = time.time() + seconds
    while True:
        left = [p for p in procs(run_id) if keep(p)]
        if not left or time.time() >= deadline:
            return left
        time.sleep(0.2)


def stop(run_id, grace, run_dir=None, ext_dir=None, by=None):
    """Mark the run stopped, naming `by` where given (a supervisor then restarts nothing; status
    and follow say who stopped it), SIGKILL DeepSpeed's runner and
    pdsh, TERM the rest (each node's launch.py ends its ranks), KILL what is left after `grace`
    seconds, then let the supervisor record the exit code; report what was found and what
    survived. Only processes that carry this run's id are touched. With nothing left, stale
    op-build locks under `ext_dir` go too (a rank killed mid-build leaves one)."""
    if run_dir and os.path.isdir(run_dir):
        write_atomic(RunDir(run_dir) / RunDir.STOPPED, f"{by or 'stopped'}\n")
    found = procs(run_id)
    signal_all([p["pid"] for p in found if RUNNER.search(p["cmd"]) and not is_supervisor(p)],
               signal.SIGKILL)
    workers = lambda p: not is_supervisor(p)  # noqa: E731
    signal_all([p["pid"] for p in procs(run_id) if workers(p)], signal.SIGTERM)
    left = wait_gone(run_id, grace, workers)
    if left:
        signal_all([p["pid"] for p in left], signal.SIGKILL)
        wait_gone(run_id, 5, workers)
    left = wait_gone(run_id, 10)  # the supervisor writes exit_code and ends
    supervisor = pid_alive(RunDir(run_dir) / RunDir.PID) if run_dir else None
    deadline = time.time() + 10
    while supervisor and pid_alive(RunDir(run_dir) / RunDir.PID) and time.time() < deadline:
        time.sleep(0.2)
    if supervisor and pid_alive(RunDir(run_dir) / RunDir.PID):
        signal_all([supervisor], signal.SIGKILL)
    if left:
        signal_all([p["pid"] for p in left], signal.SIGKILL)
        left = wait_gone(run_id, 5)
    removed = remove_stale_locks(ext_dir) if ext_dir and not left else []
    return {"found": len(found), "left": len(left), "left_pids": [p["pid"] for p in left],
            "removed_locks": removed}


# A Python exception's last line as pdsh passes it on ("node2: ValueError: ..."), with the
# "[rankN]:" prefix torch's elastic logging adds.
EXCEPTION = re.compile(r"^(?:(\S+): )?(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt)\b.*)$")


def first_error(log, offset=0):
    """(the first error of the attempt whose output starts at offset, that node's traceback):
    the first exception line (type and message, with the node that printed it), else the first
    line that looks like an error; the traceback is up to 20 lines of that node's output before
    it, from its "Traceback" line."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None, []
    for i, line in enumerate(lines):
        m = EXCEPTION.match(line.strip())
        if m and "Warning" not in line:
            node = m.group(1)
            own = [x for x in lines[:i] if node is None or x.startswith(node + ": ")]
            start = max((j for j, x in enumerate(own) if "Traceback" in x), default=len(own))
            return line.strip()[:400], (own[start:] + [line])[-20:]
    for line in lines:
        if ERROR_LINE.search(line) and "UserWarning" not in line:
            return line.strip()[:400], []
    return None, []


def status(run_dir, run_id):
    run = RunDir(run_dir)
    ps = procs(run_id)
    launcher = pid_alive(run / RunDir.PID)
    # Where this node's supervisor started ranks itself (one node, or no_ssh mode), its own
    # ranks, not those of another node on the same host; pdsh's come through sshd.
    own = ranks_of(started_by(ps, launcher)) if launcher else []
    ranks = len(own or ranks_of(ps))
    code = (run / RunDir.EXIT).read_text().strip() if (run / RunDir.EXIT).exists() else None
    # A worker has no launcher of its own (pdsh starts its ranks): its ranks say it runs, and
    # the supervisor writes the exit code into every node's run directory when the run ends.
    if launcher or (ranks and code is None):
        state = "stalled" if launcher and (run / RunDir.STALLED).exists() else "running"
    elif code == "0":
        state = "finished"
    elif (run / RunDir.STOPPED).exists():
        state = "stopped"
    elif code is not None:
        state = "failed"
    elif not (run / RunDir.LOG).exists():  # a worker (no launcher here), or a run not yet started
        state = "ended" if (run / RunDir.RANKS_STARTED).exists() else "not started"
    else:
        state = "lost"  # launcher gone without an exit code (killed with the node)
    last = last_line(run / RunDir.METRICS) or last_line(run / RunDir.PROGRESS)
    restarts = (run / RunDir.RESTARTS).read_text().strip() if (run / RunDir.RESTARTS).exists() else "0"
    failure = read_json(run / RunDir.FAILURE)
    error, trace = None, []
    if state in ("failed", "lost"):
        offset = (read_json(run / RunDir.ATTEMPT) or {}).get("offset", 0)
        error, trace = first_error(run / RunDir.LOG, offset)
        if failure:
            error = f"{failure['message']}; first error: {error}" if error else failure["message"]
    try:
        started = (run / "run_id").stat().st_mtime
    except OSError:
        started = None
    return {"host": socket.gethostname(), "run_id": run_id, "state": state, "exit_code": code,
            "started": started, "total_steps": total_steps(last),
            "launcher_pid": launcher, "ranks_alive": ranks,
            "processes": len(ps), "last": last, "restarts": int(restarts),
            "failed_node": failure["node"] if failure and state in ("failed", "lost") else None,
            "first_error": error, "traceback": trace, "memory": memory_summary(run_dir),
            "step_downs": step_downs(run_dir), "config": config_label(run),
            "stopped_by": stopped_by(run) if state == "stopped" else None}


def total_steps(last):
    """The run's total steps where its writer knew it: train.run's metrics carry its config's
    steps, the entry shim's progress HF's Trainer's max_steps; None for any other script, and
    None where the step is past it (a total that is not the run's)."""
    last = last or {}
    total, step = last.get("total_steps"), last.get("step")
    if not isinstance(total, int) or total <= 0 or (isinstance(step, int) and step > total):
        return None
    return total


def config_label(run):
    """What decides the run's DeepSpeed configuration, as the launch message and runs.yml say it:
    "preset zero2" where the toolkit's preset is the config (dsc_ds_config_mode preset);
    otherwise (the user's file, HF's Trainer, the script itself) the ZeRO stage its engine
    reported ("ZeRO stage 3"), and "its own ZeRO stage" before it has. None without a launch
    record."""
    launch = read_json(run / RunDir.LAUNCH)
    if not isinstance(launch, dict):
        return None
    if launch.get("dsc_ds_config_mode", "preset") == "preset":
        return f"preset {launch.get('preset')}"
    stage = (read_json(run / RunDir.ENGINE) or {}).get("zero_stage")
    return f"ZeRO stage {stage}" if isinstance(stage, int) else "its own ZeRO stage"


def stopped_by(run):
    """Who stopped the run on purpose, as the stop marker names it (stop.yml, a replacing
    launch); None for a marker that names no one."""
    try:
        said = read_text(run / RunDir.STOPPED).strip()
    except OSError:
        return None
    return said if said and said != "stopped" else None


def step_downs(run_dir):
    """preset=auto's out-of-memory steps down so far: each failed attempt's configuration and
    cause, and the configuration it stepped down to."""
    try:
        return [json.loads(x) for x in (RunDir(run_dir) / RunDir.STEP_DOWNS).read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def size_of(path):
    """A file's size, 0 when it does not exist."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def last_line(path, start=0):
    """The last JSON line of a jsonl file (train.run's metrics, any script's progress), or None;
    with `start`, only a line written past that byte offset counts."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - 65536))
            lines = f.read().decode(errors="replace").strip().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def log_tail(run_dir, run_id, lines=20, hosts=()):
    """The end of the run's launcher log (every node's output comes through pdsh, each line
    prefixed by its node's name): its path, the last `lines` lines of each node ("launcher" for
    the lines of no node's ranks: DeepSpeed's runner, pdsh, the supervisor), and the raw tail
    with the byte offset it starts at, from which follow streams; with the run's state."""
    log = RunDir(run_dir) / RunDir.LOG
    try:
        size = log.stat().st_size
    except OSError:
        size = 0
    start = max(0, size - max(65536, lines * 400 * max(1, len(hosts))))
    data = b""
    if size:
        with open(log, "rb") as f:
            f.seek(start)
            data = f.read(size - start)
    cut = data.find(b"\n") + 1 if start else 0  # from the first whole line
    data, start = data[cut:], start + cut
    end = data.rfind(b"\n") + 1  # up to the last whole line
    text = data[:end].decode(errors="replace")
    nodes = {}
    for line in text.splitlines():
        name, _, rest = line.partition(": ")
        node = name if name in hosts and rest else "launcher"
        nodes.setdefault(node, []).append(rest if node != "launcher" else line)
    return {"run_id": run_id, "state": status(run_dir, run_id)["state"], "log": str(log), "offset": start,
            "text": text, "nodes": {k: v[-lines:] for k, v in nodes.items()} if lines else {}}


def history(run_dir):
    """Every logged step of the run (train.run's metrics.jsonl, else the entry shim's
    progress.jsonl): what plots draw."""
    run = RunDir(run_dir)
    for name in (RunDir.METRICS, RunDir.PROGRESS):
        try:
            return [json.loads(x) for x in (run / name).read_text().splitlines() if x.strip()]
        except (OSError, ValueError):
            continue
    return []


def runs_table(run_root):
    """Every run under the run root, newest first: id, config (config_label), state, last step,
    loss, throughput (tokens/s from train.run's metrics, samples/s from any other script's
    progress), started, duration and restarts (runs.yml's table)."""
    rows, now = [], time.time()
    for r in runs(run_root):
        run = RunDir(Path(run_root) / r["id"])
        st = status(run.path, r["id"])
        try:
            started = (run / "run_id").stat().st_mtime
        except OSError:
            started = r["mtime"]
        try:
            ended = (run / RunDir.EXIT).stat().st_mtime
        except OSError:
            ended = None if st["state"] == "running" else r["mtime"]
        last = st["last"] or {}
        rows.append({"id": r["id"], "config": st["config"], "state": st["state"],
                     "step": last.get("step"), "loss": last.get("loss"),
                     "tokens_per_s": last.get("tokens_per_s"), "samples_per_s": last.get("samples_per_s"),
                     "started": started, "duration_s": round((ended or now) - started, 1),
                     "restarts": st["restarts"]})
    return sorted(rows, key=lambda row: row["started"], reverse=True)


def failure_event(line):
    """A node's failure as the launcher log shows it, or None."""
    m = RANK_EXIT.match(line)
    if m and m.group(2) != "0":
        code = int(m.group(2))
        return {"node": m.group(1), "code": code, "kind": "signal" if code < 0 else "exit",
                "line": line.strip()[:400]}
    m = SSH_EXIT.match(line)
    if m:
        code = int(m.group(2))
        return {"node": m.group(1), "code": code, "kind": "lost" if code == 255 else "exit",
                "line": line.strip()[:400]}
    return None


def describe(cause):
    if cause["kind"] == "signal":
        name = signal.Signals(-cause["code"]).name if -cause["code"] in signal.Signals._value2member_map_ else cause["code"]
        return f"a rank on {cause['node']} was killed by {name}"
    if cause["kind"] == "stall":
        return f"the run stalled: no step for {cause['limit_s']:.0f} s after step {cause['step']}"
    if cause["kind"] == "lost":
        return f"the connection to {cause['node']} was lost (node down or sshd gone)"
    return f"ranks on {cause['node']} exited with code {cause['code']}"


def write_atomic(path, text):
    """Readers (status, the playbooks) never see a half-written file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    tmp.rename(path)


def teardown(run_id, hosts, run_dir=None, by=None):
    """Stop every process of the run here and, through pdsh, on the other nodes (by the
    DSC_RUN_ID marker each process carries, so orphans go too); with run_dir, marked stopped by
    `by` on every node."""
    marked = (["--run-dir", run_dir] + (["--by", by] if by else [])) if run_dir else []
    on_others(hosts, "stop", run_id, "--grace", "5", *marked)
    return stop(run_id, 5.0, run_dir, by=by)


class Stall:
    """A run whose ranks are alive but complete no step: a collective that never returns (a
    peer stopped, an NCCL hang) looks exactly like that. The steps are global rank 0's
    (train.run's metrics.jsonl, any script's progress.jsonl, both on the master); before the
    first one of this attempt nothing is judged (start-up, op builds, a restart loading its
    checkpoint: the lines an earlier attempt wrote do not count). Stalled after `timeout_s`
    without a new step; 0 means 10x the median step time, at least `min_s`."""

    def __init__(self, run, timeout_s=0.0, min_s=300.0):
        self.run, self.timeout_s, self.min_s = run, float(timeout_s), float(min_s)
        self.step, self.since, self.per_step = None, time.time(), []
        self.start = {name: size_of(run / name) for name in (RunDir.METRICS, RunDir.PROGRESS)}
        (run / RunDir.STALLED).unlink(missing_ok=True)

    def limit(self):
        if self.timeout_s > 0:
            return self.timeout_s
        times = sorted(self.per_step)
        return max(self.min_s, 10 * times[len(times) // 2]) if times else self.min_s

    def check(self, now):
        """None while steps come; else the stall record, written to stalled.json."""
        last = next(filter(None, (last_line(self.run / name, start) for name, start in self.start.items())), {})
        step = last.get("step")
        if step is not None and step != self.step:
            if self.step is not None and step > self.step:
                self.per_step.append((now - self.since) / (step - self.step))
            self.step, self.since = step, now
            (self.run / RunDir.STALLED).unlink(missing_ok=True)
            return None
        if self.step is None or now - self.since < self.limit():
            return None
        record = {"step": self.step, "since": round(self.since, 3), "limit_s": round(self.limit(), 1)}
        if not (self.run / RunDir.STALLED).exists():
            write_atomic(self.run / RunDir.STALLED, json.dumps(record) + "\n")
            print(f"[dsc_node] stalled: no step for {record['limit_s']:.0f} s after step {self.step}",
                  flush=True)
        return record


def watch(child, run, run_id, hosts, pos, grace=3.0, stall=None, seen=None):
    """Wait for the launcher; when a node fails and the run has not ended grace seconds later
    (ranks elsewhere blocked in a collective with a dead peer), tear it down everywhere. A
    stall (`stall`: {timeout_s, fail}) is marked in the run directory, and with fail it ends the
    attempt as a failure (teardown, then a restart when max_restarts allows). `seen` (a dict) gets
    the attempt's first out-of-memory line ("oom")."""
    seen = {} if seen is None else seen
    log = run / RunDir.LOG
    events, deadline, torn = [], None, None
    stall = stall or {}
    stalls, checked = Stall(run, stall.get("timeout_s", 0), stall.get("min_s", 300)), 0.0
    while True:
        code = child.poll()
        with open(log, errors="replace") as f:
            f.seek(pos)
            chunk = f.read()
        done = chunk.rfind("\n") + 1
        pos += len(chunk[:done].encode(errors="replace"))
        for line in chunk[:done].splitlines():
            if "oom" not in seen and OUT_OF_MEMORY.search(line):
                seen["oom"] = line.strip()[:400]
            ev = failure_event(line)
            if ev:
                ev["time"] = time.time()
                events.append(ev)
        if code is not None:
            break
        if time.time() - checked >= 2:
            checked = time.time()
            stalled = stalls.check(checked)
            if stalled and stall.get("fail") and deadline is None:
                events.append({"node": hosts[0] if hosts else socket.gethostname(), "kind": "stall",
                               "code": -1, "time": time.time(), "step": stalled["step"],
                               "limit_s": stalled["limit_s"], "line": ""})
                deadline = time.time()
        if events and deadline is None:
            deadline = time.time() + grace
        if deadline and torn is None and time.time() >= deadline:
            torn = {"started": time.time()}
            child.kill()  # not TERM: the runner would pkill other runs' launchers by pattern
            torn.update(teardown(run_id, hosts))
            torn["done"] = time.time()
        time.sleep(0.5)
    cause = min(events, key=lambda e: (CAUSE_ORDER[e["kind"]], e["time"])) if events else None
    return code, cause, torn


def run_files(run_dir):
    """Every file of the run directory but its code and checkpoints (what logs.yml fetches):
    logs, metrics, monitor output, summaries, the rendered config."""
    run, out = Path(run_dir), []
    for dirpath, dirnames, filenames in os.walk(run):
        if Path(dirpath) == run:
            dirnames[:] = [d for d in dirnames if d not in (RunDir.CODE, RunDir.CHECKPOINTS)]
        out += [str(Path(dirpath, f).relative_to(run)) for f in filenames if not f.endswith(".tmp")]
    return sorted(out)


def write_run(run_dir, spec, resume=False):
    """The run's files and code, written by the training user on every node. A new run never
    lands in a directory that a run already used (metrics and checkpoints would mix)."""
    run = RunDir(run_dir)
    planted = [str(p) for p in (Path(run_dir), run / RunDir.CODE) if p.is_symlink()]
    if planted:  # the plan refuses this too; a link made since is caught here
        return {"ok": False, "error": f"refused: {planted[0]} is a symbolic link, not a directory"}
    if not resume and (run / RunDir.LOG).exists():
        return {"ok": False, "error": f"{run_dir} already holds a run"}
    (run / RunDir.CODE).mkdir(parents=True, exist_ok=True)
    for name, text in spec.get("files", {}).items():
        if "/" in name or name.startswith(".."):
            return {"ok": False, "error": f"refused file name {name!r}"}
        write_atomic(run / name, text)
    if spec.get("code"):
        dest = Path(spec["code_dest"])
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(base64.b64decode(spec["code"])), mode="r:gz") as tar:
            members = tar.getmembers()
            # tarfile's "data" filter is missing from older 3.11 releases (Debian 12): the same
            # rule by hand, nothing outside dest and no links.
            bad = [m.name for m in members if m.name.startswith("/") or ".." in m.name.split("/")
                   or not (m.isfile() or m.isdir())]
            if bad:
                return {"ok": False, "error": f"refused code archive entries {bad[:3]}"}
            tar.extractall(dest, members=members)
    (run / RunDir.STOPPED).unlink(missing_ok=True)
    return {"ok": True, "run_dir": run_dir}


def start(run_dir, run_id, cmd, run_root, ports, replace=False, hosts=(), max_restarts=0,
          backoff=10.0, resume_args=("--resume",), stall=None, port=None):
    """Under the run root's lock: refuse (or replace) an active run, take the first free master
    port (or `port`, the one the master took: only the master's rank 0 listens on it), then
    double-fork a supervisor into a new session so that it outlives the Ansible
    connection; its pid is the run's launcher.pid until the run ends, restarts included."""
    run = RunDir(run_dir)
    lock = open(Path(run_root) / RunDir.LOCK, "a")
    fcntl.flock(lock, fcntl.LOCK_EX)  # held until the new supervisor's pid is recorded
    best_effort(prune_secrets, run_root)
    other = active(run_root)
    if other and other["run_id"] == run_id:  # two launches of one run id raced past the plan
        print(json.dumps({"started": False, "active": other, "error": f"run {run_id} is already running"}))
        return 4
    if other:
        if not replace:
            print(json.dumps({"started": False, "active": other,
                              "error": f"run {other['run_id']} is active"}))
            return 4
        teardown(other["run_id"], list(hosts), other["run_dir"],
                 by=f"a launch with replace=true (run {run_id})")
    port = port or free_port(*ports)
    if port is None:
        print(json.dumps({"started": False, "error": f"every master port from {ports[0]} to "
                                                     f"{ports[1]} is in use"}))
        return 3
    write_atomic(run / RunDir.PORT, f"{port}\n")
    cmd = [cmd[0], "--master_port", str(port)] + list(cmd[1:])
    (run / RunDir.EXIT).unlink(missing_ok=True)
    (run / RunDir.FAILURE).unlink(missing_ok=True)
    if os.fork():
        pid = None
        for _ in range(100):  # until the supervisor recorded its pid (or already ended)
            pid = pid_alive(run / RunDir.PID)
            if pid or (run / RunDir.EXIT).exists():
                break
            time.sleep(0.1)
        print(json.dumps({"started": True, "pid": pid, "port": port, "config": config_label(run),
                          "replaced": other.get("run_id") if other else None}))
        return 0
    lock.close()
    os.setsid()
    if os.fork():
        os._exit(0)
    supervise(run, run_id, cmd, hosts, max_restarts, backoff, resume_args, stall)


# Matched against the whole string (fullmatch; `$` would take a trailing newline, which DeepSpeed's
# pdsh runner passes unquoted: a second command on every node).
LATEST = re.compile(r"\{latest:(.+)\}")
SAFE_ARG = re.compile(r"[\w@%+=:,./-]*")


def newest(pattern, cwd="."):
    """The newest path matching the glob, by the last number in its name (checkpoint-40 after
    checkpoint-9), then by mtime; None if nothing matches."""
    def key(p):
        nums = re.findall(r"\d+", os.path.basename(p.rstrip("/")))
        return (int(nums[-1]) if nums else -1, os.path.getmtime(os.path.join(cwd, p)))
    found = [p for p in glob.glob(pattern, root_dir=cwd) if SAFE_ARG.fullmatch(p)]
    return max(found, key=key) if found else None


def resolve_latest(argv, cwd="."):
    """A script's resume arguments, as the plan allows them: `{latest:GLOB}` becomes the newest
    match (e.g. HF's --resume_from_checkpoint out/checkpoint-40); with no match yet (stopped
    before the first save) it is dropped with the option right before it, and the run starts
    over."""
    out = []
    for arg in argv:
        m = LATEST.fullmatch(arg)
        if not m:
            out.append(arg)
            continue
        path = newest(m.group(1), cwd)
        if path:
            out.append(path)
        elif out and out[-1].startswith("-"):
            out.pop()
    return out


def supervise(run, run_id, cmd, hosts, max_restarts, backoff, resume_args=(), stall=None):
    log = os.open(run / RunDir.LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = sys.stderr = Unfailing(sys.stdout)  # the log on a full disk ends no supervisor
    write_pid(run / RunDir.PID, os.getpid())
    reserve_exit(run)
    env = dict(os.environ, DSC_RUN_ID=run_id, DSC_RUN_DIR=str(run.path))
    restarts_file = run / RunDir.RESTARTS
    restarts = int(restarts_file.read_text()) if restarts_file.exists() else 0
    attempt = list(cmd)
    while True:
        # Where this attempt's output starts, taken before the spawn: its first failure line is
        # never missed, and status reads the latest attempt's error, not an earlier one's.
        offset = (run / RunDir.LOG).stat().st_size
        (run / RunDir.FAILURE).unlink(missing_ok=True)  # the cause shown is this attempt's
        best_effort(write_atomic, run / RunDir.ATTEMPT,
                    json.dumps({"attempt": restarts + 1, "offset": offset}) + "\n")
        child = subprocess.Popen(resolve_latest(attempt), env=env, stdin=subprocess.DEVNULL)
        best_effort(write_atomic, run / RunDir.CHILD, str(child.pid))
        seen = {}
        code, cause, torn = watch(child, run, run_id, list(hosts), offset, stall=stall, seen=seen)
        if cause:
            best_effort(write_atomic, run / RunDir.FAILURE, json.dumps(dict(
                cause, message=describe(cause), exit_code=code, teardown=torn, restarts=restarts)) + "\n")
        if code == 0 or (run / RunDir.STOPPED).exists():
            break
        down = step_down(run, hosts, seen.get("oom"), code)
        if down:  # preset=auto: the next configuration of its ladder, from the start
            teardown(run_id, list(hosts))
            if (run / RunDir.STOPPED).exists():
                break
            attempt = list(cmd)
            continue
        if restarts >= max_restarts:
            break
        restarts += 1
        wait = min(backoff * 2 ** (restarts - 1), 600.0)
        best_effort(write_atomic, restarts_file, f"{restarts}\n")
        best_effort(append_line, run / RunDir.RESTARTS_LOG, json.dumps(
            {"restart": restarts, "time": time.time(), "after_exit_code": code,
             "cause": describe(cause) if cause else None, "backoff_s": wait}))
        print(f"[dsc_node] restart {restarts}/{max_restarts} in {wait:.0f} s from the latest "
              f"complete checkpoint ({describe(cause) if cause else f'exit code {code}'})", flush=True)
        teardown(run_id, list(hosts))  # nothing of the failed attempt may linger anywhere
        time.sleep(wait)
        if (run / RunDir.STOPPED).exists():
            break
        resumes = list(resume_args) and list(cmd[-len(resume_args):]) == list(resume_args)
        attempt = list(cmd) + ([] if resumes else list(resume_args))
    record_exit(run, code)
    on_others(hosts, "write-exit", str(run.path), str(code))
    (run / RunDir.PID).unlink(missing_ok=True)
    os._exit(0)


def run_steps(run):
    """The latest optimizer step the run has logged (train.run's metrics, any script's progress),
    or None."""
    steps = [(last_line(run / name) or {}).get("step") for name in (RunDir.METRICS, RunDir.PROGRESS)]
    steps = [x for x in steps if isinstance(x, int)]
    return max(steps) if steps else None


def step_down(run, hosts, oom, code):
    """preset=auto's answer to an out-of-memory error in the first steps (none past FIRST_STEPS):
    the next step of auto.json's ladder on every node (step-down), recorded in step_downs.jsonl
    and said in the log; False where it does not apply (no ladder, the ladder spent, another
    error, a run that already trained)."""
    ladder = read_json(run / RunDir.AUTO) or {}
    steps, index = ladder.get("ladder") or [], int(ladder.get("index", 0))
    at = run_steps(run)
    if not oom or index + 1 >= len(steps) or (at is not None and at > FIRST_STEPS):
        return False
    was, nxt = steps[index], steps[index + 1]
    record = {"attempt": index + 1, "time": round(time.time(), 3), "exit_code": code, "at_step": at,
              "preset": was["preset"], "micro_batch": was["micro_batch"], "cause": oom,
              "next": {k: nxt[k] for k in ("preset", "micro_batch", "grad_accum")}}
    best_effort(append_line, run / RunDir.STEP_DOWNS, json.dumps(record))
    print(f"[dsc_node] out of memory in the first steps at {was['preset']} micro-batch "
          f"{was['micro_batch']}: stepping down to {nxt['preset']} micro-batch {nxt['micro_batch']} "
          f"(step {index + 1} of {len(steps) - 1} of preset=auto's ladder)", flush=True)
    apply_step(run.path, index + 1)
    on_others(hosts, "step-down", str(run.path), str(index + 1))
    return True


def apply_step(run_dir, index):
    """The ladder's step `index` becomes the run's configuration on this node: ds_config.json,
    memory.json's prediction and launch.json's preset and micro-batch (what resume starts)."""
    run = RunDir(run_dir)
    ladder = read_json(run / RunDir.AUTO) or {}
    step = (ladder.get("ladder") or [])[int(index)]
    write_atomic(run / "ds_config.json", json.dumps(step["ds_config"], indent=2, sort_keys=True) + "\n")
    memory = read_json(run / RunDir.MEMORY)
    if memory:
        memory.update(preset=step["preset"], micro_batch=step["micro_batch"], predicted=step["predicted"])
        write_atomic(run / RunDir.MEMORY, json.dumps(memory, indent=2, sort_keys=True) + "\n")
    launch = read_json(run / RunDir.LAUNCH)
    if launch:
        launch.update(preset=step["preset"], dsc_micro_batch=step["micro_batch"])
        write_atomic(run / RunDir.LAUNCH, json.dumps(launch, indent=2, sort_keys=True) + "\n")
    write_atomic(run / RunDir.AUTO, json.dumps(dict(ladder, index=int(index)), sort_keys=True) + "\n")
    return {"ok": True, "preset": step["preset"], "micro_batch": step["micro_batch"]}


class Unfailing:
    """A stream whose writes never raise (the supervisor's log on a full disk)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError:
            return 0

    def flush(self):
        try:
            self.stream.flush()
        except OSError:
            pass


def best_effort(fn, *args, **kwargs):
    """A supervisor's record that may fail on a full disk: the supervisor goes on (it still has
    to tear down, restart and record the exit code)."""
    try:
        fn(*args, **kwargs)
    except OSError:
        pass


def append_line(path, line):
    with open(path, "a") as f:
        f.write(line + "\n")


def reserve_exit(run):
    """Room for the exit code, taken while the disk has it: record_exit overwrites this file in
    place when a full disk refuses a new one."""
    best_effort(write_atomic, run / RunDir.EXIT_RESERVE, " " * 32 + "\n")


def record_exit(run, code):
    """The run's exit code, always: a new file, else (disk full) the reserved one rewritten in
    place and renamed (neither needs a free block)."""
    try:
        write_atomic(run / RunDir.EXIT, f"{code}\n")
        (run / RunDir.EXIT_RESERVE).unlink(missing_ok=True)
        return
    except OSError:
        pass
    with open(run / RunDir.EXIT_RESERVE, "r+") as f:
        f.write(f"{code}\n")
        f.truncate()
    os.replace(run / RunDir.EXIT_RESERVE, run / RunDir.EXIT)


def node_states(run_dir, run_id, hosts, own):
    """{node: {state, ranks_alive}} for follow's line: this node's own (`own`, its status), the
    others' through pdsh (the same way the launcher reaches them); a node that does not answer is
    "unreachable", with no rank counted."""
    def of(st):
        return {"state": st["state"], "ranks_alive": int(st.get("ranks_alive") or 0)}
    states = {hosts[0]: of(own)} if hosts else {}
    others = list(hosts)[1:]
    if not others:
        return states
    r = subprocess.run(["pdsh", "-R", "ssh", "-t", "5", "-u", "20", "-w", ",".join(others),
                        os.path.abspath(__file__), "status", str(run_dir), run_id],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       env=dict(os.environ, PDSH_RCMD_TYPE="ssh"), check=False)
    for line in r.stdout.splitlines():
        name, _, text = line.partition(": ")
        try:
            states[name] = of(json.loads(text))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return {h: states.get(h, {"state": "unreachable", "ranks_alive": 0}) for h in hosts}


def on_others(hosts, *args):
    """This helper with args on every other node of the run, through pdsh (best effort: a node
    that cannot be reached keeps no record, and its status says so)."""
    others = list(hosts)[1:]
    if others:
        # pdsh hands the remote shell one line: each argument quoted (a stop's --by has spaces).
        subprocess.run(["pdsh", "-R", "ssh", "-t", "5", "-u", "60", "-w", ",".join(others),
                        shlex.join([os.path.abspath(__file__), *map(str, args)])],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=dict(os.environ, PDSH_RCMD_TYPE="ssh"), check=False)


def options(args, flags=(), valued=()):
    """(positional, {option: value}) for the few options each command has."""
    pos, opts, i = [], {}, 0
    while i < len(args):
        if args[i] in flags:
            opts[args[i]] = True
        elif args[i] in valued:
            i += 1
            opts[args[i - 1]] = args[i]
        elif args[i] == "--ports":
            opts["--ports"] = (int(args[i + 1]), int(args[i + 2]))
            i += 2
        else:
            pos.append(args[i])
        i += 1
    return pos, opts


JSON_COMMANDS = {"check": check, "mesh": mesh, "listen": listen, "connect": connect}


def main(argv):
    # What the toolkit writes on a node (run files, logs, checkpoints: every rank starts through
    # this helper's entry shim) is the training user's and root's alone on a shared machine.
    os.umask(0o027)
    try:
        return command(argv)
    except Blind as e:
        print(json.dumps({"error": str(e)}))
        return 5


def command(argv):
    if not argv:
        print(__doc__)
        return 2
    # DeepSpeed's launcher: `python -u dsc_node.py --local_rank=N entry ...` (unless --no_local_rank)
    local_rank = argv[:1] if argv[0].startswith("--local_rank=") else []
    argv = argv[len(local_rank):] or [""]
    cmd, args = argv[0], argv[1:]
    if cmd in JSON_COMMANDS:
        print(json.dumps(JSON_COMMANDS[cmd](json.loads(os.environ.get("DSC_PREFLIGHT", "{}")))))
    elif cmd == "probe":
        print(json.dumps(probe(args)))
    elif cmd == "write-run":
        pos, opts = options(args, flags=("--resume",))
        result = write_run(pos[0], json.load(sys.stdin), resume="--resume" in opts)
        print(json.dumps(result))
        return 0 if result["ok"] else 4
    elif cmd == "start":
        sep = args.index("--")
        pos, opts = options(args[:sep], flags=("--replace", "--stall-fail"),
                            valued=("--run-root", "--hosts", "--max-restarts", "--backoff",
                                    "--resume-args", "--stall-s", "--port"))
        return start(pos[0], pos[1], args[sep + 1:], opts["--run-root"], opts.get("--ports"),
                     replace="--replace" in opts,
                     hosts=[h for h in opts.get("--hosts", "").split(",") if h],
                     max_restarts=int(opts.get("--max-restarts", 0)),
                     backoff=float(opts.get("--backoff", 10)),
                     resume_args=json.loads(opts.get("--resume-args", '["--resume"]')),
                     stall={"timeout_s": float(opts.get("--stall-s", 0)), "fail": "--stall-fail" in opts},
                     port=int(opts["--port"]) if "--port" in opts else None)
    elif cmd == "procs":
        print(json.dumps(procs(args[0])))
    elif cmd == "stop":
        pos, opts = options(args, valued=("--grace", "--run-dir", "--ext-dir", "--by"))
        print(json.dumps(stop(pos[0], float(opts.get("--grace", 15)), opts.get("--run-dir"),
                              opts.get("--ext-dir"), opts.get("--by"))))
    elif cmd == "runs":
        print(json.dumps(runs_table(args[0])))
    elif cmd == "log":
        pos, opts = options(args, valued=("--lines", "--hosts"))
        print(json.dumps(log_tail(pos[0], pos[1], int(opts.get("--lines", 20)),
                                  [h for h in opts.get("--hosts", "").split(",") if h])))
    elif cmd == "history":
        print(json.dumps(history(args[0])))
    elif cmd == "files":
        print(json.dumps(run_files(args[0])))
    elif cmd == "write-secrets":
        print(json.dumps(write_secrets(args[0], json.load(sys.stdin))))
    elif cmd == "entry":
        return entry(args, local_rank)
    elif cmd == "step-down":  # preset=auto's next configuration, on a worker (the supervisor's)
        if os.path.isdir(args[0]):
            print(json.dumps(apply_step(args[0], int(args[1]))))
    elif cmd == "write-exit":  # the supervisor's record of how the run ended, on a worker
        if os.path.isdir(args[0]):
            write_atomic(RunDir(args[0]) / RunDir.EXIT, f"{int(args[1])}\n")
    elif cmd == "status":
        pos, opts = options(args, valued=("--hosts",))
        st = status(pos[0], pos[1])
        if opts.get("--hosts"):
            st["nodes"] = node_states(pos[0], pos[1], opts["--hosts"].split(","), st)
        print(json.dumps(st))
    elif cmd == "free-port":
        port = free_port(int(args[0]), int(args[1]))
        if port is None:
            print(f"every master port from {args[0]} to {args[1]} is in use", file=sys.stderr)
            return 3
        print(port)
    elif cmd == "active":
        print(json.dumps(active(args[0])))
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
