#!/usr/bin/env python3
"""Node-side helper for runs: start a detached launcher, find, stop and report a run's processes.

Installed on every node as <dsc_install_root>/bin/dsc-runctl and run by the launch, status and
stop playbooks; standard library only (it runs under the node's system python3).

    dsc-runctl start RUN_DIR RUN_ID -- CMD...   # detach (setsid), log to RUN_DIR/launcher.log
    dsc-runctl procs RUN_ID                     # JSON: processes that carry DSC_RUN_ID=RUN_ID
    dsc-runctl stop RUN_ID [--grace S]          # TERM, then KILL after S seconds; JSON result
    dsc-runctl status RUN_DIR RUN_ID            # JSON: state, ranks alive, last metrics, first error
    dsc-runctl free-port FIRST LAST             # first port nobody listens on, exit 3 if none
    dsc-runctl active RUN_ROOT                  # JSON: the run whose launcher is alive, if any
"""
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

ERROR_LINE = re.compile(r"(Traceback|Error|error:|Killed|exits with return code = [1-9]|"
                        r"was not reachable|Address already in use)")


def procs(run_id):
    """Every process whose environment carries DSC_RUN_ID=run_id (launcher, pdsh, ranks)."""
    marker = f"DSC_RUN_ID={run_id}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            if marker not in env:
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out.append({"pid": int(d.name), "cmd": cmd[:300]})
    return out


def is_rank(p):
    return " -m deepspeed.launcher" not in p["cmd"] and "deepspeed.launcher.runner" not in p["cmd"] \
        and "pdsh" not in p["cmd"] and "/bin/deepspeed" not in p["cmd"] and "dsc-runctl" not in p["cmd"] \
        and ("python" in p["cmd"])


def stop(run_id, grace):
    found = procs(run_id)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs(run_id):
            try:
                os.kill(p["pid"], sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + (grace if sig == signal.SIGTERM else 5)
        while time.time() < deadline and procs(run_id):
            time.sleep(0.2)
        if not procs(run_id):
            break
    left = procs(run_id)
    return {"found": len(found), "left": len(left), "left_pids": [p["pid"] for p in left]}


def pid_alive(pid_file):
    try:
        pid = int(Path(pid_file).read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def first_error(log):
    try:
        with open(log, errors="replace") as f:
            for line in f:
                if ERROR_LINE.search(line) and "UserWarning" not in line:
                    return line.strip()[:400]
    except OSError:
        pass
    return None


def status(run_dir, run_id):
    run = Path(run_dir)
    ps = procs(run_id)
    launcher = pid_alive(run / "launcher.pid")
    code = (run / "exit_code").read_text().strip() if (run / "exit_code").exists() else None
    if launcher:
        state = "running"
    elif code == "0":
        state = "finished"
    elif (run / "stopped").exists():
        state = "stopped"
    elif code is not None:
        state = "failed"
    elif not (run / "launcher.log").exists():
        state = "not started"
    else:
        state = "lost"  # launcher gone without an exit code (killed with the node)
    last = None
    metrics = run / "metrics.jsonl"
    if metrics.exists():
        lines = metrics.read_text().strip().splitlines()
        last = json.loads(lines[-1]) if lines else None
    restarts = (run / "restarts").read_text().strip() if (run / "restarts").exists() else "0"
    return {"host": socket.gethostname(), "run_id": run_id, "state": state, "exit_code": code,
            "launcher_pid": launcher, "ranks_alive": sum(1 for p in ps if is_rank(p)),
            "processes": len(ps), "last": last, "restarts": int(restarts),
            "first_error": first_error(run / "launcher.log") if state in ("failed", "lost") else None}


def free_port(first, last):
    for port in range(first, last + 1):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore binds
        try:
            s.bind(("0.0.0.0", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    return None


def active(run_root):
    for run in sorted(Path(run_root).glob("*/launcher.pid")):
        if pid_alive(run):
            return {"run_id": run.parent.name, "run_dir": str(run.parent)}
    return {}


def start(run_dir, run_id, cmd):
    """Double-fork into a new session so the launcher outlives the Ansible connection."""
    run = Path(run_dir)
    (run / "exit_code").unlink(missing_ok=True)
    if os.fork():
        for _ in range(50):  # wait until the pid file exists
            if (run / "launcher.pid").exists():
                break
            time.sleep(0.1)
        print(json.dumps({"started": True, "pid": int((run / "launcher.pid").read_text())}))
        return 0
    os.setsid()
    if os.fork():
        os._exit(0)
    log = os.open(run / "launcher.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    env = dict(os.environ, DSC_RUN_ID=run_id, DSC_RUN_DIR=str(run))
    child = os.fork()
    if child == 0:
        os.execvpe(cmd[0], cmd, env)
    (run / "launcher.pid").write_text(str(child))
    _, st = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(st)
    tmp = run / "exit_code.tmp"
    tmp.write_text(f"{code}\n")
    tmp.rename(run / "exit_code")
    (run / "launcher.pid").unlink(missing_ok=True)
    os._exit(0)


def main(argv):
    if not argv:
        print(__doc__)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "start":
        sep = args.index("--")
        return start(args[0], args[1], args[sep + 1:])
    if cmd == "procs":
        print(json.dumps(procs(args[0])))
    elif cmd == "stop":
        grace = float(args[args.index("--grace") + 1]) if "--grace" in args else 15.0
        print(json.dumps(stop(args[0], grace)))
    elif cmd == "status":
        print(json.dumps(status(args[0], args[1])))
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
