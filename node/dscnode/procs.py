"""A run's processes on this node: found by the DSC_RUN_ID each one carries, signalled and stopped
(here, and through pdsh on the run's other nodes); the supervisor's pid file; commands run as
another user; torch's op-build locks that a rank killed mid-build leaves behind."""
import json
import os
import pwd
import re
import select
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

from dscnode import program
from dscnode.rundir import RunDir, read_text, write_atomic


def user_name(uid):
    """The user name of a uid, or the uid itself where no user has it."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


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


def run_bounded(cmd, limit, timeout=30, keep=None):
    """cmd's (exit code, stdout as text) where root runs a system tool whose output it parses
    (nvidia-smi, the kernel log), never waiting past `timeout` seconds: a tool stuck in the driver
    (a GPU off the bus) may ignore SIGKILL, so the output is read through select() against a
    deadline, and a tool still running then is killed and left to a thread that reaps it (124).
    At most `limit` bytes are kept: the first ones (the tool is killed once it writes more: None),
    or with `keep` (a test on each line) the last `limit` bytes of the lines it keeps, the tool
    read to its end. stderr is discarded; 127 where there is no such tool."""
    try:  # a session of its own: its children (a shell's) die with it and close the pipe
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    except OSError:
        return 127, ""
    deadline, kept, size, rest, rc = time.monotonic() + timeout, [], 0, b"", 0
    fd = p.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
        if not ready:
            rc = 124
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        if keep is None:
            kept.append(chunk)
            size += len(chunk)
            if size > limit:
                rc = None
                break
            continue
        *lines, rest = (rest + chunk).split(b"\n")
        rest = rest[-limit:]
        for line in lines:
            if keep(line):
                kept.append(line + b"\n")
                size += len(line) + 1
        while size > limit and kept:
            size -= len(kept.pop(0))
    if rc in (124, None):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        threading.Thread(target=p.wait, daemon=True).start()  # reaped when it can be, never waited on here
    else:
        rc = p.wait()
    p.stdout.close()
    return rc, b"".join(kept)[:limit].decode(errors="replace")


def start_time(pid):
    """A process's start time in clock ticks since boot (/proc/PID/stat field 22), or None:
    with the pid it names one process, never a later one that reused the number."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def started_at(pid):
    """A process's start as a Unix time (its start_time and the boot time), or None."""
    ticks = start_time(pid)
    try:
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return None if ticks is None else boot + ticks / os.sysconf("SC_CLK_TCK")


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
    # "dsc_node.py": the built dsc_node.pyz, and a supervisor that an earlier release's
    # dsc_node.py started and that still runs.
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
    op-build locks under `ext_dir` go too (a rank killed mid-build leaves one; every rank takes
    the lock of each JIT op it loads, built or not): those made while the run's processes lived
    at once, the others once old (jit_locks)."""
    if run_dir and os.path.isdir(run_dir):
        write_atomic(RunDir(run_dir) / RunDir.STOPPED, f"{by or 'stopped'}\n")
    found = procs(run_id)
    since = min(filter(None, (started_at(p["pid"]) for p in found)), default=None)
    # The attempt's launcher first, by the pid its supervisor recorded, whatever its name (a
    # wrapper may exec deepspeed.real): DeepSpeed's runner exits 0 when its pdsh dies of a signal
    # (it passes on only a positive exit code), and the stopped run would read as finished.
    child = pid_alive(RunDir(run_dir) / RunDir.CHILD) if run_dir else None
    signal_all([p["pid"] for p in found if p["pid"] == child], signal.SIGKILL)
    signal_all([p["pid"] for p in found if RUNNER.search(p["cmd"]) and not is_supervisor(p)], signal.SIGKILL)
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
    removed = remove_stale_locks(ext_dir, since) if ext_dir and not left else []
    return {"found": len(found), "left": len(left), "left_pids": [p["pid"] for p in left],
            "removed_locks": removed}


def teardown(run_id, hosts, run_dir=None, by=None):
    """Stop every process of the run here and, through pdsh, on the other nodes (by the
    DSC_RUN_ID marker each process carries, so orphans go too); with run_dir, marked stopped by
    `by` on every node. The op-build locks its ranks left in the node-local JIT cache (the same
    path on every node: TORCH_EXTENSIONS_DIR, the run's environment) go too, so that a restart
    does not wait on them."""
    ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR")
    marked = (["--run-dir", run_dir] + (["--by", by] if by else [])) if run_dir else []
    on_others(hosts, "stop", run_id, "--grace", "5", *marked, *(["--ext-dir", ext_dir] if ext_dir else []))
    return stop(run_id, 5.0, run_dir, ext_dir=ext_dir, by=by)


def on_others(hosts, *args):
    """This helper with args on every other node of the run, through pdsh (best effort: a node
    that cannot be reached keeps no record, and its status says so): what each node printed,
    by the name pdsh prefixed its lines with."""
    others = list(hosts)[1:]
    printed = {}
    if others:
        # pdsh hands the remote shell one line: each argument quoted (a stop's --by has spaces).
        r = subprocess.run(["pdsh", "-R", "ssh", "-t", "5", "-u", "60", "-w", ",".join(others),
                            shlex.join([program(), *map(str, args)])],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                           env=dict(os.environ, PDSH_RCMD_TYPE="ssh"), check=False)
        for line in r.stdout.splitlines():
            host, sep, text = line.partition(": ")
            if sep and host in others:
                printed[host] = printed.get(host, "") + text + "\n"
    return printed


# What runs in an op's build directory while torch holds its lock: ninja and the compilers.
BUILDERS = {"ninja", "c++", "g++", "gcc", "cc", "cc1plus", "cc1", "as", "ld", "collect2", "nvcc",
            "cicc", "ptxas", "fatbinary", "nvlink", "hipcc", "clang", "clang++"}


def jit_locks(ext_dir, min_age_s=60.0, now=None, since=None):
    """Torch's op-build locks (`<TORCH_EXTENSIONS_DIR>/<op>/lock`, a file torch creates before
    building or loading and removes after; every later load of that op on the node waits while
    it exists): each with its age and whether it is stale, i.e. with no builder working in its
    directory and older than `min_age_s`, or made at `since` or after (a Unix time: while the
    processes just stopped lived, which made it). A rank killed mid-build leaves one behind and
    every later run on the node hangs in "Waiting for lock". Read as the lock's owner: a process
    whose directory cannot be read counts as a builder when its name is a compiler's."""
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
        made_since = since is not None and now - age >= since
        out.append({"path": str(lock), "age_s": round(age, 1),
                    "stale": (age >= min_age_s or made_since) and not busy})
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


def remove_stale_locks(ext_dir, since=None):
    """Remove the stale op-build locks (jit_locks); the paths removed."""
    removed = []
    for lock in jit_locks(ext_dir, since=since):
        if lock["stale"]:
            try:
                os.unlink(lock["path"])
                removed.append(lock["path"])
            except OSError:
                pass
    return removed
