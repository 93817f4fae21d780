"""What launch.yml runs on a node: write-run (the run's files and code, written by the training
user) and start (under the run root's lock: refuse or replace an active run, take a master port,
detach the supervisor)."""
import base64
import fcntl
import io
import json
import os
import tarfile
import time
from pathlib import Path

from dscnode.checks import free_port
from dscnode.procs import active, pid_alive, teardown
from dscnode.records import config_label
from dscnode.rundir import RunDir, prune_secrets, write_atomic
from dscnode.supervisor import best_effort, describe, gate_cause, gpu_gate, record_failure, supervise, with_resume


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
    # A resume is a new attempt on every node: the last one's ranks and end (stopped, its exit
    # code, its failure) are no longer this node's state. The master's supervisor clears its own
    # at its start; a worker has none, and its ranks would train under a "failed" from before.
    for name in (RunDir.STOPPED, RunDir.EXIT, RunDir.FAILURE, RunDir.RANKS_STARTED):
        (run / name).unlink(missing_ok=True)
    return {"ok": True, "run_dir": run_dir}


def start(run_dir, run_id, cmd, run_root, ports, replace=False, hosts=(), max_restarts=0,
          backoff=10.0, resume_args=("--resume",), stall=None, port=None, foreground=False, attempt=0,
          used_gpus=None, copies=True, agreed=None):
    """Under the run root's lock: refuse (or replace) an active run, take the first free master
    port (or `port`, the one the master took: only the master's rank 0 listens on it), then
    double-fork a supervisor into a new session so that it outlives the Ansible
    connection; its pid is the run's launcher.pid until the run ends, restarts included.
    `foreground` (Slurm's task on a node): the supervisor is this process, and the task ends
    with the run; `attempt` above 0 is the batch job's restart of every node, from the latest
    complete checkpoint (resume_args), which the GPU gate (`used_gpus`: {node: GPU indices}) may
    refuse as it refuses the supervisor's own restarts. `copies`: each node's part of a node-local
    checkpoint also kept on the next node (dscnode.copies), where the supervisor reaches others.
    `agreed`: what every node agreed each `{latest:GLOB}` is before this start
    (supervisor.agree_latest), where no supervisor reaches the others."""
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
    try:
        if attempt:
            refused = gpu_gate(list(hosts)[:1], used_gpus or {})
            if refused:  # the run's cause, as the supervisor's own restarts record it
                cause = gate_cause(refused)
                record_failure(run, cause, restarts=attempt)
                print(json.dumps({"started": False, "error": describe(cause)}))
                return 6
            write_atomic(run / RunDir.RESTARTS, f"{attempt}\n")
            cmd = with_resume(cmd, resume_args)
    finally:  # the batch job's restart has begun here, or the gate refused it
        (run / RunDir.RESTARTING).unlink(missing_ok=True)
    if foreground:
        lock.close()
        supervise(run, run_id, cmd, hosts, max_restarts, backoff, resume_args, stall, used_gpus, copies, agreed)
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
    supervise(run, run_id, cmd, hosts, max_restarts, backoff, resume_args, stall, used_gpus, copies, agreed)
