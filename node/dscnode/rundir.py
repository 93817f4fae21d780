"""The run directory's layout (RunDir): every file name the toolkit reads or writes, in one place;
the run's secrets, kept beside it; writes that a reader never sees half done, and reads that never
follow a link planted in a directory the training user writes. The entry shim imports this module
in every rank: the standard library's lightest modules only."""
import errno
import itertools
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
    AUTO = "auto.json"            # preset=auto's step-down ladder (the steps taken: STEP_DOWNS)
    STEP_DOWNS = "step_downs.jsonl"  # each out-of-memory step down (the master's supervisor alone writes it): what the run trains with
    RUN_ID = "run_id"             # the run's id; its mtime is when the run was written (status's started)
    DS_CONFIG = "ds_config.json"  # the DeepSpeed config the plan composed (preset=auto's first step)
    HOSTFILE = "hostfile"         # DeepSpeed's hostfile, nodes in rank order
    DS_ENV = ".deepspeed_env"     # the ranks' environment, which DeepSpeed's runner reads (DS_ENV_FILE)
    TRAIN_CONFIG = "train.json"   # train.run's settings (dsc_train_config)
    MONITOR = "monitor"           # DeepSpeed's csv monitor output (a folder)
    TENSORBOARD = "tensorboard"   # DeepSpeed's TensorBoard event files, with dsc_tensorboard (a folder)
    SUMMARY = "summary.json"      # train.run's totals, written when it ends
    COMPLETE = "COMPLETE"         # in checkpoints/step<N>/: train.run's mark that the checkpoint is whole
    ALLREDUCE = "allreduce.json"  # train.allreduce's result, which preflight.yml reports
    SLURM_BATCH = "slurm.sbatch"  # the slurm launch mode: the batch job launch.yml submits
    SLURM_TASK = "slurm_task.sh"  # and the task it runs on each node (this node's launcher)
    RESTARTING = "restarting"     # slurm mode: the batch job restarts every node (its next attempt)
    OP_BUILDS = "op_builds.jsonl"  # each rank's JIT op build, its start and its end (entry)
    RANKS = "ranks.jsonl"         # every window of steps, each rank's step and collective times (entry, rank 0)
    SLOW = "slow.json"            # the rank the others wait for, while it is so (the supervisor)
    SAVES = "saves.jsonl"         # each node-local checkpoint saved, once training moved on from it (entry, rank 0)
    COPIES = "copies.jsonl"       # where each save's parts were also kept (the supervisor, dscnode.copies)
    SHRINK = "shrink.json"        # dsc_min_nodes: each world size the run may go on at, its batch (the plan)
    SHRINKS = "shrinks.jsonl"     # each continuation on fewer nodes (the supervisor, dscnode.shrink)
    SHRUNK_ENV = ".deepspeed_env.shrunk"  # the ranks' environment for the survivors (the supervisor)
    NCCL = "nccl_debug"           # each GPU rank's NCCL INIT and NET lines, <host>-<pid>.log (entry, dscnode.nccllog)

    @staticmethod
    def step_config(index):
        """The ds_config of preset=auto's ladder step `index` (the plan writes every step's at
        launch; the supervisor's attempts take the one of the step the run is at)."""
        return RunDir.DS_CONFIG if int(index) == 0 else f"ds_config.step{int(index)}.json"

    @staticmethod
    def world_config(world):
        """The ds_config for `world` ranks, where the run goes on on fewer nodes (the plan writes
        one for each world size dsc_min_nodes allows)."""
        return f"ds_config.world{int(world)}.json"

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


# The most a file of each kind may hold before a reader refuses it (read_bytes): a record of the
# toolkit's (launch.json, attempt.json, a pid file), a log of JSON lines read whole (memory.jsonl,
# step_downs.jsonl, op_builds.jsonl), the steps a plot draws (metrics.jsonl), a lock of the
# node's packages. A log read from its end (launcher.log, the last step) has no limit: only its
# tail is read.
RECORD_LIMIT = 1 << 20
LINES_LIMIT = 16 << 20
HISTORY_LIMIT = 256 << 20
LOCK_LIMIT = 16 << 20


class Unreadable(OSError):
    """A file a reader refused: a link, not a regular file (a FIFO, a device, a directory), or
    larger than its kind may be. Its message names the path and what is wrong."""


# What this process refused to read, in order (at most 50): [{"path", "why"}]. The probe reports
# them, and the plan shows each with the node (the playbook goes on where it can).
REFUSED = []


def refused(path, why):
    """Note a file left unread (REFUSED), and the error that says so."""
    if len(REFUSED) < 50 and not any(r["path"] == str(path) for r in REFUSED):
        REFUSED.append({"path": str(path), "why": why})
    return Unreadable(f"{path}: {why}")


def open_regular(path, limit=None):
    """A regular file opened for reading (binary), never through a symbolic link, never blocking
    (a FIFO or a device is refused, not waited on), at most `limit` bytes long (None: any size,
    for a reader of its end). Root reads files the training user writes: a link planted there
    must not make it read another file, a FIFO must not hang it, a sparse file of a terabyte must
    not exhaust its memory. Unreadable (an OSError) when it is not so; OSError as os.open raises
    it for a missing one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise refused(path, "a symbolic link (never followed)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat_mod.S_ISFIFO(st.st_mode) else "a directory" if stat_mod.S_ISDIR(st.st_mode)
                    else "a device" if stat_mod.S_ISCHR(st.st_mode) or stat_mod.S_ISBLK(st.st_mode)
                    else "a socket" if stat_mod.S_ISSOCK(st.st_mode) else "not a regular file")
            raise refused(path, f"{kind}, not a regular file (never read)")
        if limit is not None and st.st_size > limit:
            raise refused(path, f"{st.st_size:,} bytes, more than a file of its kind may hold ({limit:,})")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path, limit=RECORD_LIMIT):
    """A regular file's bytes, read as open_regular allows (at most `limit`: a file that grows
    past it while read is cut there)."""
    with open_regular(path, limit) as f:
        return f.read(limit)


def read_text(path, limit=RECORD_LIMIT):
    """A run file's text, read as open_regular allows."""
    return read_bytes(path, limit).decode(errors="replace")


def read_json(path, limit=RECORD_LIMIT):
    try:
        return json.loads(read_text(path, limit))
    except (OSError, ValueError):
        return None


def read_tail(path, size, start=0):
    """The last `size` bytes of a file (from byte `start` at the earliest) and the offset they
    start at, read as open_regular allows (any length: only the tail is read)."""
    with open_regular(path) as f:
        end = f.seek(0, os.SEEK_END)
        offset = max(start, end - size)
        f.seek(offset)
        return f.read(end - offset), offset


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


def json_objects(lines):
    """The JSON objects among jsonl lines, in their order: a line that is not one (half-written,
    a stray value) is passed over."""
    for line in lines:
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            yield value


def last_lines(path, count, size=65536, start=0):
    """The last `count` JSON objects of a jsonl file, oldest first, from its last `size` bytes
    (and, with `start`, written past that byte offset): whole lines only, the part after the last
    newline being still written. [] when the file cannot be read."""
    try:
        data, _ = read_tail(path, size, start)
    except OSError:
        return []
    newest = json_objects(reversed(data.decode(errors="replace").split("\n")[:-1]))
    return list(itertools.islice(newest, count))[::-1]


def last_line(path, start=0):
    """The last JSON line of a jsonl file (train.run's metrics, any script's progress), or None;
    with `start`, only a line written past that byte offset counts."""
    return next(iter(last_lines(path, 1, start=start)), None)
