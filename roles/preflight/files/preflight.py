#!/usr/bin/env python3
"""Node-side probes for preflight.yml (and the fast checks launch.yml runs first).

Installed on every node as <dsc_install_root>/bin/dsc-preflight; standard library only (it runs
under the node's system python3, also where the training env is missing). Arguments come as one
JSON object in $DSC_PREFLIGHT; every command prints one JSON object.

    dsc-preflight probe      # this node: env, versions, names, disk, ports, interfaces, firewall
    dsc-preflight mesh       # from the master, as the training user: ssh to every node, clock offset
    dsc-preflight listen     # hold the master port open until every node has connected
    dsc-preflight connect    # connect to the master port (retrying while it is not yet open)
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

VERSIONS = r"""
import json, platform, torch, deepspeed
cuda = torch.cuda.is_available()
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__,
                  "cuda": torch.version.cuda or "cpu", "deepspeed": deepspeed.__version__,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-",
                  "torch_gpus": torch.cuda.device_count() if cuda else 0}))
"""


def run(cmd, timeout=60, env=None):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return r.returncode, r.stdout, r.stderr
    except FileNotFoundError as e:
        return 127, "", str(e)
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout} s"


def versions(python, env):
    if not os.access(python, os.X_OK):
        return {"error": f"{python} does not exist"}
    rc, out, err = run([python, "-c", VERSIONS], timeout=180, env=dict(os.environ, **env))
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


def first_free(first, last):
    return next((p for p in range(first, last + 1) if port_free(p)), None)


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


def firewall(first, last):
    if shutil.which("ufw"):
        rc, out, err = run(["ufw", "status"])
        state = "active" if "Status: active" in out else "inactive" if rc == 0 else "unknown"
        return {"tool": "ufw", "state": state, "master_rule": f"{first}:{last}/tcp" in out,
                "detail": (out or err).strip().splitlines()[0:1]}
    if shutil.which("firewall-cmd"):
        rc, out, _ = run(["firewall-cmd", "--state"])
        return {"tool": "firewalld", "state": "active" if out.strip() == "running" else "inactive",
                "master_rule": None}
    return {"tool": None, "state": "none", "master_rule": None}


def active_run(run_root):
    try:
        runs = sorted(os.listdir(run_root))
    except OSError:
        return None
    for run_id in runs:
        try:
            pid = int(open(os.path.join(run_root, run_id, "launcher.pid")).read().strip())
            os.kill(pid, 0)
            return run_id
        except (OSError, ValueError):
            continue
    return None


def probe(a):
    path, gib = free_gib(a["run_root"])
    out = {
        "hostname": socket.gethostname(),
        "time": time.time(),
        "cpus": os.cpu_count(),
        "env_prefix_exists": os.path.isdir(a["env_prefix"]),
        "versions": versions(a["python"], a.get("env", {})),
        "resolve": resolve(a["names"]),
        "disk": {"path": path, "free_gib": gib},
        "interfaces": interfaces(),
        "firewall": firewall(a["port_first"], a["port_last"]),
        "iperf3": bool(shutil.which("iperf3")),
        "code_dir_exists": os.path.isdir(a["code_dir"]) if a.get("code_dir") else None,
    }
    if a.get("master"):
        out["port"] = {"wanted": a["port_first"], "wanted_free": port_free(a["port_first"]),
                       "first_free": first_free(a["port_first"], a["port_last"])}
        out["active_run"] = active_run(a["run_root"])
    return out


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
        except socket.timeout:
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
        except socket.timeout:
            last = f"timed out after {a.get('timeout', 5)} s (a firewall dropping packets?)"
        except OSError as e:
            last = e.strerror or str(e)
            time.sleep(0.2)
    return {"ok": False, "msg": last}


COMMANDS = {"probe": probe, "mesh": mesh, "listen": listen, "connect": connect}


def main(argv):
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        return 2
    args = json.loads(os.environ.get("DSC_PREFLIGHT", "{}"))
    print(json.dumps(COMMANDS[argv[0]](args)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
