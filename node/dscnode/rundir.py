"""The run directory's layout (RunDir): every file name the toolkit reads or writes, in one place;
the run's secrets, kept beside it; writes that a reader never sees half done, and reads that never
follow a link planted in a directory the training user writes. The entry shim imports this module
in every rank: the standard library's lightest modules only."""
import json
import os
import stat as stat_mod
from pathlib import Path


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
    STACKS = "stacks"             # each rank's Python stack on a node, at a stall or on demand (a folder)
    RANKS_STARTED = "ranks.started"  # a rank started on this node (the entry shim)
    LOCK = ".launch.lock"         # in the run root: one launch at a time
    MEMORY = "memory.json"        # the plan's predicted peak per GPU (and preset=auto's key)
    MEASURED = "memory.jsonl"     # each rank's max_memory_allocated after its first steps (entry)
    AUTO = "auto.json"            # preset=auto's step-down ladder and the step that runs
    STEP_DOWNS = "step_downs.jsonl"  # each out-of-memory step down: the attempt, its cause, the next
    RUN_ID = "run_id"             # the run's id; its mtime is when the run was written (status's started)
    DS_CONFIG = "ds_config.json"  # the DeepSpeed config the plan composed (a step down rewrites it)
    HOSTFILE = "hostfile"         # DeepSpeed's hostfile, nodes in rank order
    DS_ENV = ".deepspeed_env"     # the ranks' environment, which DeepSpeed's runner reads (DS_ENV_FILE)
    TRAIN_CONFIG = "train.json"   # train.run's settings (dsc_train_config)
    MONITOR = "monitor"           # DeepSpeed's csv monitor output (a folder)
    TENSORBOARD = "tensorboard"   # DeepSpeed's TensorBoard event files, with dsc_tensorboard (a folder)
    SUMMARY = "summary.json"      # train.run's totals, written when it ends
    COMPLETE = "COMPLETE"         # in checkpoints/step<N>/: train.run's mark that the checkpoint is whole
    ALLREDUCE = "allreduce.json"  # train.allreduce's result, which preflight.yml reports
    SLURM_BATCH = "slurm.sbatch"  # dsc_launch_mode slurm: the batch job launch.yml submits
    SLURM_TASK = "slurm_task.sh"  # and the task it runs on each node (this node's launcher)
    RESTARTING = "restarting"     # slurm mode: the batch job restarts every node (its next attempt)
    OP_BUILDS = "op_builds.jsonl"  # each rank's JIT op build, its start and its end (entry)

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


def entries(folder):
    """The folder's entries (os.DirEntry), or none when it cannot be read."""
    try:
        return list(os.scandir(folder))
    except OSError:
        return []


def prune_secrets(run_root):
    """Remove the secrets files whose run directory is gone (a secrets file goes with its run;
    run by the training user, at write-secrets and start): the ids removed."""
    folder = Path(run_root) / SECRETS_DIR
    if folder.is_symlink():
        return []
    gone = []
    for e in entries(folder):
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


def write_atomic(path, text):
    """Readers (status, the playbooks) never see a half-written file; writers at once (ranks of one
    node) each write their own temporary file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    tmp.rename(path)


def append_line(path, line):
    with open(path, "a") as f:
        f.write(line + "\n")


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
