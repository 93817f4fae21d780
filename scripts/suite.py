"""The test suite's runner: the set-up steps beside each other, the three tiers, where the time went.

    bash scripts/test.sh [pytest args for the container tier]     # how it is run
    DSC_TIERS="unit local" bash scripts/test.sh                     # only these tiers
    DSC_DRY_RUN=1 bash scripts/test.sh [args]                       # print the steps, run nothing

The suite is a small graph of steps (steps() below). A step is a few commands and the steps it
waits for; it starts, in a thread of its own, as soon as those have passed, its output in
.cache/logs/<step>.log. The runner prints the steps' logs in the order they are declared,
following live the one it waits on. A set-up step's or the unit tier's failure ends the suite; a
failure of the local tier, the container tier or the systemd layer fails it at the end. On exit
every step still running is killed with its process tree. Each run appends one line to
.cache/suite-times.jsonl (scripts/timings.py). Standard library only: it runs on the machine's
python3 (3.11 or newer) before any venv exists.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import timings

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
LOGS = CACHE / "logs"
# Each container test file's seconds in a whole run (scripts/timings.py --durations writes it), for
# a clone that has run none: the order in which the workers take the files.
DURATIONS = ROOT / "molecule" / "tests" / "durations.json"
FIGURES = CACHE / "test-figures.jsonl"  # what the container tests measured (molecule/tests/conftest.py)
TIERS = ("unit", "local", "container")
PYTEST = ".venv/bin/pytest"
VENV_PY = ".venv/bin/python"
# The local tier's cgroup (low_priority_group), under cgroup v1's cpu hierarchy or v2's root.
LOW_GROUPS = (Path(f"/sys/fs/cgroup/cpu/dsc-tests-{os.getpid()}"), Path(f"/sys/fs/cgroup/dsc-tests-{os.getpid()}"))


@dataclass
class Step:
    name: str
    commands: list[list[str]]  # run one after the other; the first to fail ends the step
    after: tuple[str, ...] = ()  # the steps it waits for
    fatal: bool = True  # its failure ends the suite; else it fails the suite at the end
    low: bool = False  # at low priority (low_priority_group)
    # What the runner fills in.
    done: threading.Event = field(default_factory=threading.Event)
    outcome: str = "not run"
    start: float = 0.0  # seconds from the suite's start
    seconds: float = 0.0
    proc: subprocess.Popen | None = None
    shown: int = 0  # how much of its log the runner has printed
    ended_shown: bool = False

    @property
    def log(self):
        return LOGS / (self.name.split(" (")[0].replace(" ", "-") + ".log")


def suite_python():
    """The interpreter of the suite's two venvs (the control venv: Ansible, pytest; the local
    tier's train venv: torch, DeepSpeed): the distribution's where it is 3.11 or newer with venv and
    its headers, as Debian's is built with PGO and LTO and a python3 built from source by default
    (pyenv's) is not, and the suite is CPU-bound. PYTHON overrides it."""
    check = ("import ensurepip, os, sys, sysconfig, venv\n"
             "sys.exit(sys.version_info < (3, 11) or not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))")
    for python in ("/usr/bin/python3", "python3"):
        with contextlib.suppress(OSError):
            if subprocess.run([python, "-c", check], capture_output=True).returncode == 0:
                return python
    return "python3"


def steps(tiers, args):
    """What this run does, in the order the runner prints it. A step that this run leaves out (its
    tier not asked for, or its result already there) is no wait for the steps after it."""
    python = os.environ.get("PYTHON") or suite_python()
    unit, local, container = (t in tiers for t in TIERS)
    out = [Step("control venv", [["env", f"PYTHON={python}", "bash", "scripts/setup-control.sh"]])]
    if unit:
        out.append(Step("unit tier", [[PYTEST, "tests/unit", "-q", "-rs"]], after=("control venv",)))
    if local or container:
        # The offline wheelhouse: the nodes' torch and DeepSpeed, the vendored scripts' requirements.
        out.append(Step("wheelhouse", [["env", "REQUIREMENTS_FILE=tests/fixtures/scripts/requirements.txt",
                                        "bash", "scripts/wheelhouse.sh"]]))
    if container:
        missing = [t for t in ("podman", "runc", "mmdebstrap", "ssh-keygen", "rsync") if not shutil.which(t)]
        if missing:
            out.append(Step("node tools (apt)", [["bash", "-c", (
                "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                "podman runc mmdebstrap openssh-client rsync >/dev/null")]]))
        out.append(Step("node image", [["bash", "molecule/build-image.sh", "base"]], after=("node tools (apt)",)))
        # test_firewalld's nodes; off the path to the container tier's start.
        out.append(Step("systemd node image", [["bash", "molecule/build-image.sh", "systemd"]], after=("node image",)))
        if not (CACHE / "test-packages").is_dir():
            out.append(Step("test packages", fetch_test_packages(), after=("control venv",)))
        # provision.yml on one node of the bare image, committed: the clusters' nodes start from it.
        # The longest step before the container tier, so it starts as soon as its inputs are there.
        out.append(Step("provisioned image", [
            *[["env", f"DSC_TEST_CLUSTER={c}", VENV_PY, "molecule/cluster.py", "down"] for c in (0, 1)],
            [VENV_PY, "molecule/cluster.py", "image"]], after=("node image", "wheelhouse", "control venv")))
        out.append(Step("container tier", [container_tier(args)], fatal=False, after=(
            "provisioned image", "systemd node image", "test packages", "unit tier")))
        # test_slurm's nodes: the systemd layer on the provisioned image, beside the tier's start
        # (test_slurm's fixture waits for it under a lock).
        out.append(Step("systemd layer", [[VENV_PY, "molecule/cluster.py", "systemd-layer"]], fatal=False,
                        after=("provisioned image",)))
    if local:
        # The local tier, train venv and tests, at low priority from start to end, in the CPU the
        # image's build and the container tier leave idle; neither of them waits for it.
        if not (ROOT / ".cache/train-venv/bin/deepspeed").exists():
            out.append(Step("train venv", [[python, "-m", "venv", ".cache/train-venv"],
                                           [".cache/train-venv/bin/pip", "install", "-q", "--no-index",
                                            "--find-links", ".cache/wheelhouse", "torch", "deepspeed"]],
                            after=("wheelhouse",), low=True))
        out.append(Step("local tier", [[PYTEST, "tests/local", "-v", "-rs", "--durations=5"]], fatal=False, low=True,
                        after=("control venv", "train venv", "unit tier")))
    names = {s.name for s in out}
    for s in out:
        s.after = tuple(a for a in s.after if a in names)
    return out


def fetch_test_packages():
    """What the tests install beside the wheelhouse, fetched here so that the tests reach only their
    own containers: DeepSpeed's source archive as PyPI has it and wheel (the index test; a source
    build without a pyproject.toml needs wheel beside setuptools), and another version of packaging
    than the wheelhouse's (the version-skew preflight test)."""
    pins = dict(line.split("=", 1) for line in (ROOT / "requirements/pins.env").read_text().splitlines()
                if line.strip() and not line.startswith("#"))
    fetch = [VENV_PY, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
             "-d", ".cache/test-packages.part"]
    return [[*fetch, "--no-binary", ":all:", f"deepspeed=={pins['DEEPSPEED_VERSION']}"],
            [*fetch, "--only-binary", ":all:", "wheel", "packaging==26.3"],
            ["mv", ".cache/test-packages.part", ".cache/test-packages"]]


def container_tier(args):
    """pytest over molecule/tests on two clusters at once: pytest-xdist's two workers, a cluster
    each (molecule/cluster.py's cluster_index), each file whole on one worker (a file's module
    fixtures share its nodes), the next file to whichever worker is nearly done. Files go longest
    first by the last whole run recorded here (new files before them), so that both workers end
    together; with no run recorded (a fresh clone, CI), by molecule/tests/durations.json, a whole
    run's seconds per file kept with the tests. With
    args naming files or tests (molecule/tests/...), those alone; with other args (a -k), the whole
    tier's files. Whatever the durations or args, test_molecule.py goes first, to the first worker:
    molecule/tests/conftest.py puts its test ahead of the collection, and --no-loadscope-reorder
    keeps the workers to the collection's order (xdist's own puts files with more tests first),
    so that its idempotence run follows its cluster's provision with nothing between."""
    where = ["molecule/tests"]
    seconds = timings.last_file_seconds() or json.loads(DURATIONS.read_text())
    if any(a.startswith("molecule/tests/") for a in args):
        where = []
    elif seconds:
        names = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "molecule/tests").glob("test_*.py"))
        where = sorted(names, key=lambda f: -seconds.get(f, float("inf")))
    return [PYTEST, "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", *where, "-v", "-rs", "--durations=15",
            "-p", "no:cacheprovider", "--basetemp=.cache/pytest-tmp", *args]


def low_priority_group():
    """The local tier takes the CPU that the rest leaves idle, and a twentieth of the machine when
    none is idle (so that none of its tests waits without end). The kernel shares the CPU between
    groups before processes: with autogroup, the suite's session on the host weighs as one group and
    the containers' cgroup as another, and nice orders processes only inside their own group, so
    nice alone does not yield to the nodes. A cgroup of its own weighted 100 against the 1,024 of
    each other does (cgroup v1's cpu.shares; v2's cpu.weight 10 against 100). None where none can
    be made: its steps then run at nice 19."""
    for group in LOW_GROUPS:
        if not (group.parent / "cgroup.procs").exists():
            continue
        try:
            group.mkdir(exist_ok=True)
            try:
                (group / "cpu.shares").write_text("100\n")
            except OSError:
                (group / "cpu.weight").write_text("10\n")
            return group
        except OSError:
            with contextlib.suppress(OSError):
                group.rmdir()
    return None


def at_low_priority(argv, group):
    """argv run in the low-priority cgroup (the shell joins it, then becomes the command), else at nice 19."""
    if group is None:
        return ["nice", "-n", "19", *argv]
    join = '{ echo $$ >"$0/cgroup.procs"; } 2>/dev/null || renice -n 19 -p $$ >/dev/null; exec "$@"'
    return ["sh", "-c", join, str(group), *argv]


def kill_tree(pid, sig=signal.SIGTERM):
    """Signal a process, everything it started (as /proc's parent links have it) and its group."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for p in tree:
        with contextlib.suppress(OSError):
            os.kill(p, sig)
    with contextlib.suppress(OSError):
        os.killpg(pid, sig)


class Suite:
    def __init__(self, plan, env):
        self.steps = {s.name: s for s in plan}
        self.env = env
        self.t0 = time.monotonic()
        self.failed = None  # the fatal step that failed, which ends the suite
        self.stop = threading.Event()
        self.lock = threading.Lock()  # process starts against the kill at exit; lines to the timings file
        self.closing = False
        self.group = low_priority_group() if any(s.low for s in plan) else None

    def start(self):
        for step in self.steps.values():
            threading.Thread(target=self._run, args=(step,), daemon=True).start()

    def _run(self, step):
        for name in step.after:
            self.steps[name].done.wait()
            if self.steps[name].outcome != "passed":
                step.outcome = f"not run ({name} did not pass)"
                step.done.set()
                return
        if self.closing:
            step.done.set()
            return
        step.start = time.monotonic() - self.t0
        rc = 0
        with step.log.open("w") as log:
            if step.low:
                where = f"cgroup {self.group}" if self.group else "nice 19 (no cgroup of its own could be made)"
                log.write(f"== at low priority: {where}\n")
            for argv in step.commands:
                argv = at_low_priority(argv, self.group) if step.low else argv
                log.write(f"$ {shlex.join(argv)}\n")
                log.flush()
                with self.lock:
                    if self.closing:
                        rc = -1
                        break
                    # A process group of its own (killed whole at exit), not a session: a session
                    # is an autogroup of its own, which would weigh as much as all the containers.
                    step.proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                                 stdout=log, stderr=subprocess.STDOUT, process_group=0)
                rc = step.proc.wait()
                if rc:
                    break
        step.seconds = round(time.monotonic() - self.t0 - step.start, 1)
        step.outcome = "passed" if rc == 0 else "stopped" if self.closing else f"failed (exit {rc})"
        if rc == 5 and step.name.endswith(" tier"):
            step.outcome += ": pytest collected no tests, and that is a failure"
        self.row({"kind": "phase", "name": step.name, "start": round(step.start, 1), "seconds": step.seconds,
                  "outcome": step.outcome})
        if rc and step.fatal and not self.closing:
            with self.lock:
                self.failed = self.failed or step
            self.stop.set()
        step.done.set()

    def row(self, row):
        with self.lock, open(self.env["DSC_TIMINGS"], "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def follow(self, step):
        """Print the step's log as it grows, until it ends or a fatal failure ends the suite."""
        if not step.shown:
            print(f"== {step.name} ({step.log.relative_to(ROOT)})", flush=True)
        while True:
            ended = step.done.wait(0.5)
            if step.log.exists():
                with step.log.open("rb") as f:
                    f.seek(step.shown)
                    chunk = f.read()
                step.shown += len(chunk)
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            if ended or self.stop.is_set():
                break
        if ended and not step.ended_shown:
            step.ended_shown = True
            took = f", {step.seconds:.1f} s" if step.start else ""
            print(f"== {step.name}: {step.outcome}{took}", flush=True)

    def close(self, interrupted=False):
        """Kill every step still running, with all it started, and remove the cgroup. After a
        Ctrl-C the steps get it first, as a terminal would send it (pytest then tears its
        clusters down), and a minute to end."""
        with self.lock:
            self.closing = True
        running = [s.proc for s in self.steps.values() if s.proc and s.proc.poll() is None]
        if interrupted:
            for proc in running:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGINT)
            deadline = time.monotonic() + 60
            for proc in running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        # A step that has ended may leave a process behind in its group.
        for proc in running:
            kill_tree(proc.pid)
        for proc in running:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid, signal.SIGKILL)
        for _ in range(20):
            if self.group is None or not self.group.exists():
                break
            with contextlib.suppress(OSError):
                self.group.rmdir()
            time.sleep(0.25)


def print_plan(plan):
    for step in plan:
        flags = [f"after: {', '.join(step.after)}" if step.after else "at once",
                 *(["at low priority"] if step.low else []), *([] if step.fatal else ["fails the suite at the end"])]
        print(f"== {step.name} ({'; '.join(flags)})")
        for argv in step.commands:
            print(f"   {shlex.join(argv)}")


def git(*args):
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def main(args):
    tiers = (os.environ.get("DSC_TIERS") or " ".join(TIERS)).split()
    if set(tiers) - set(TIERS):
        sys.exit(f"DSC_TIERS={os.environ['DSC_TIERS']!r}: name some of {', '.join(TIERS)}")
    plan = steps(tiers, args)
    if os.environ.get("DSC_DRY_RUN"):
        print_plan(plan)
        return 0
    sys.stdout.reconfigure(line_buffering=True)  # its own lines between the logs' bytes, in order
    shutil.rmtree(LOGS, ignore_errors=True)
    LOGS.mkdir(parents=True)
    env = dict(os.environ, CONTAINERS_CONF=str(ROOT / "molecule/containers.conf"),
               DSC_TIMINGS=str(timings.RAW))
    # The container tier's workers pick their clusters themselves (cluster_index); one name for all
    # would put both workers on one cluster.
    env.pop("DSC_TEST_CLUSTER", None)
    timings.RAW.unlink(missing_ok=True)
    if "container" in tiers:
        FIGURES.unlink(missing_ok=True)
    # A TERM (CI's timeout, a kill) ends the suite as an interrupt does: through close().
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    suite = Suite(plan, env)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    interrupted = False
    try:
        suite.start()
        for step in plan:
            suite.follow(step)
            if suite.stop.is_set():
                suite.failed.done.wait()
                suite.follow(suite.failed)
                print(f"== {suite.failed.name} failed: the suite stops here")
                break
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        suite.close(interrupted)
        suite.row({"kind": "wall", "seconds": round(time.monotonic() - suite.t0, 1)})
        status = "passed" if all(s.outcome == "passed" for s in plan) else "failed"
        if FIGURES.exists():
            print("== figures the tests measured")
            print(FIGURES.read_text(), end="")
        rows = timings.load(timings.RAW)
        print(f"== where the time went ({timings.RAW.relative_to(ROOT)}; every run: "
              f"{timings.HISTORY.relative_to(ROOT)})")
        print(timings.summary(rows))
        run = timings.record(rows, time=started, commit=git("rev-parse", "--short", "HEAD"),
                             changed=bool(git("status", "--porcelain", "--untracked-files=no")),
                             asked=tiers, args=args, cpus=os.cpu_count(), status=status)
        with timings.HISTORY.open("a", encoding="utf-8") as f:
            f.write(json.dumps(run) + "\n")
    print(f"== suite: {status}")
    return 0 if status == "passed" else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
