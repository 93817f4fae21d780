#!/usr/bin/env python3
"""Node-side helper for runs: start a detached launcher, find, stop and report a run's processes.

Installed on every node as <dsc_install_root>/bin/dsc-runctl and run by the launch, status and
stop playbooks; standard library only (it runs under the node's system python3).

    dsc-runctl start RUN_DIR RUN_ID [--hosts H1,H2] [--max-restarts N] [--backoff S] -- CMD...
                                                # detach (setsid) a supervisor that runs CMD,
                                                # logs to RUN_DIR/launcher.log, tears the run
                                                # down everywhere when a node fails, and
                                                # restarts it from its checkpoint (opt-in)
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
import subprocess
import sys
import time
from pathlib import Path

# What the launchers print when a node's ranks end badly: launch.py on the node (pdsh prefixes its
# lines with the node name), and pdsh itself when a node's ssh session ends non-zero (255: the
# connection was lost, e.g. the node died).
RANK_EXIT = re.compile(r"^(\S+): .*exits with return code = (-?\d+)")
SSH_EXIT = re.compile(r"^pdsh@\S+: (\S+): ssh exited with exit code (\d+)")
CAUSE_ORDER = {"signal": 0, "lost": 1, "exit": 2}
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
    failure = None
    if (run / "failure.json").exists():
        try:
            failure = json.loads((run / "failure.json").read_text())
        except ValueError:
            pass
    error = None
    if state in ("failed", "lost"):
        error = first_error(run / "launcher.log")
        if failure:
            error = f"{failure['message']}; first error: {error}" if error else failure["message"]
    return {"host": socket.gethostname(), "run_id": run_id, "state": state, "exit_code": code,
            "launcher_pid": launcher, "ranks_alive": sum(1 for p in ps if is_rank(p)),
            "processes": len(ps), "last": last, "restarts": int(restarts),
            "failed_node": failure["node"] if failure and state in ("failed", "lost") else None,
            "first_error": error}


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
    if cause["kind"] == "lost":
        return f"the connection to {cause['node']} was lost (node down or sshd gone)"
    return f"ranks on {cause['node']} exited with code {cause['code']}"


def write_atomic(path, text):
    """Readers (status, the playbooks) never see a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def teardown(run_id, hosts):
    """Stop every process of the run here and, through pdsh, on the other nodes (by the
    DSC_RUN_ID marker each process carries, so orphans go too)."""
    others = hosts[1:]
    if others:
        subprocess.run(["pdsh", "-R", "ssh", "-t", "5", "-u", "60", "-w", ",".join(others),
                        os.path.abspath(__file__), "stop", run_id, "--grace", "5"],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=dict(os.environ, PDSH_RCMD_TYPE="ssh"), check=False)
    return stop(run_id, 5.0)


def watch(child, run, run_id, hosts, grace=3.0):
    """Wait for the launcher; when a node fails and the run has not ended grace seconds later
    (ranks elsewhere blocked in a collective with a dead peer), tear it down everywhere."""
    log = run / "launcher.log"
    pos = log.stat().st_size if log.exists() else 0
    events, deadline, torn = [], None, None
    while True:
        code = child.poll()
        with open(log, errors="replace") as f:
            f.seek(pos)
            chunk = f.read()
        done = chunk.rfind("\n") + 1
        pos += len(chunk[:done].encode(errors="replace"))
        for line in chunk[:done].splitlines():
            ev = failure_event(line)
            if ev:
                ev["time"] = time.time()
                events.append(ev)
        if code is not None:
            break
        if events and deadline is None:
            deadline = time.time() + grace
        if deadline and torn is None and time.time() >= deadline:
            torn = {"started": time.time()}
            child.terminate()  # DeepSpeed's runner relays it to pdsh and pkills its launchers
            torn.update(teardown(run_id, hosts))
            torn["done"] = time.time()
        time.sleep(0.5)
    cause = min(events, key=lambda e: (CAUSE_ORDER[e["kind"]], e["time"])) if events else None
    return code, cause, torn


def start(run_dir, run_id, cmd, hosts=(), max_restarts=0, backoff=10.0):
    """Double-fork into a new session so the supervisor outlives the Ansible connection; the
    supervisor's pid is the run's launcher.pid until the run ends, restarts included."""
    run = Path(run_dir)
    (run / "exit_code").unlink(missing_ok=True)
    (run / "failure.json").unlink(missing_ok=True)
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
    (run / "launcher.pid").write_text(str(os.getpid()))
    env = dict(os.environ, DSC_RUN_ID=run_id, DSC_RUN_DIR=str(run))
    restarts_file = run / "restarts"
    restarts = int(restarts_file.read_text()) if restarts_file.exists() else 0
    attempt = list(cmd)
    while True:
        child = subprocess.Popen(attempt, env=env, stdin=subprocess.DEVNULL)
        (run / "launcher.child").write_text(str(child.pid))
        code, cause, torn = watch(child, run, run_id, list(hosts))
        if cause:
            write_atomic(run / "failure.json", json.dumps(dict(cause, message=describe(cause), exit_code=code,
                                                               teardown=torn, restarts=restarts)) + "\n")
        if code == 0 or (run / "stopped").exists() or restarts >= max_restarts:
            break
        restarts += 1
        wait = min(backoff * 2 ** (restarts - 1), 600.0)
        restarts_file.write_text(f"{restarts}\n")
        with open(run / "restarts.log", "a") as f:
            f.write(json.dumps({"restart": restarts, "time": time.time(), "after_exit_code": code,
                                "cause": describe(cause) if cause else None, "backoff_s": wait}) + "\n")
        print(f"[dsc-runctl] restart {restarts}/{max_restarts} in {wait:.0f} s from the latest "
              f"complete checkpoint ({describe(cause) if cause else f'exit code {code}'})", flush=True)
        teardown(run_id, list(hosts))  # nothing of the failed attempt may linger anywhere
        time.sleep(wait)
        if (run / "stopped").exists():
            break
        attempt = list(cmd) + ([] if "--resume" in cmd else ["--resume"])
    write_atomic(run / "exit_code", f"{code}\n")
    (run / "launcher.pid").unlink(missing_ok=True)
    os._exit(0)


def main(argv):
    if not argv:
        print(__doc__)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "start":
        sep = args.index("--")
        opts = dict(zip(args[2:sep:2], args[3:sep:2]))
        return start(args[0], args[1], args[sep + 1:],
                     hosts=[h for h in opts.get("--hosts", "").split(",") if h],
                     max_restarts=int(opts.get("--max-restarts", 0)),
                     backoff=float(opts.get("--backoff", 10)))
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
