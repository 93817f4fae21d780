"""Preflight on a node: check (the env and its versions, names, disk, the master port, the
firewall, op-build locks, who owns the helper and the paths root writes, the GPUs' health), mesh (ssh from the
master to every node, each clock's offset) and listen / connect (the master port held and
reached); their arguments come as JSON in $DSC_PREFLIGHT, and the control node judges the answers
(plugins/filter/preflight.py). Also the free master port that start takes."""
import json
import os
import shutil
import socket
import subprocess
import time

from dscnode import INSTALLED_PATH, gpuhealth
from dscnode.probe import firewalls, interfaces, root_path_report
from dscnode.procs import active, jit_locks_as, run, user_name


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
    """The env's versions, read by its own python run as `user` (the training user, who runs the
    ranks): root runs an env's python for pip alone, and never what another user can write (a
    planted .pth, a package of another user's in site-packages)."""
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
                             user=a.get("train_user")),
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
        # The GPU gate: launch's and resume's fast checks read it too (no DCGM there: seconds).
        "gpu_health": gpuhealth.report(a.get("used_gpus"), a.get("train_user", ""), full=not a.get("fast")),
    }
    if a.get("master"):
        out["port"] = {"wanted": a["port_first"], "wanted_free": port_free(a["port_first"]),
                       "first_free": free_port(a["port_first"], a["port_last"])}
        out["active_run"] = active(a["run_root"]).get("run_id")
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


RELEASE = b"R"  # what the last connection sends: every node has tried, the listener may go


def listen(a):
    """Hold the port the launch would take until every node connected to it, a release came
    (connect with release: every node's attempt has ended, a blocked one too), or time out."""
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
        conn.settimeout(2.0)
        try:  # let the client close first, so TIME_WAIT stays on its side
            data = conn.recv(1)
        except OSError:
            data = b""
        conn.close()
        if data == RELEASE:
            break
        seen.append(peer[0])
    s.close()
    return {"port": port, "seen": seen}


def connect(a):
    deadline, last = time.time() + a.get("timeout", 5), "no attempt"
    while time.time() < deadline:
        try:
            with socket.create_connection((a["host"], a["port"]), timeout=max(0.5, deadline - time.time())) as c:
                if a.get("release"):
                    c.sendall(RELEASE)
                return {"ok": True, "msg": "connected"}
        except TimeoutError:
            last = f"timed out after {a.get('timeout', 5)} s (a firewall dropping packets?)"
        except OSError as e:
            last = e.strerror or str(e)
            time.sleep(0.2)
    return {"ok": False, "msg": last}


def listeners(port, net="/proc/net"):
    """The TCP sockets listening on `port` (IPv4 and IPv6, any address): [{uid, inode}], from the
    kernel's tables, which any user may read."""
    out = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{net}/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                out.append({"uid": int(cols[7]), "inode": int(cols[9])})
    return out


def _sockets_of_session(sid):
    """The socket inodes the processes of session `sid` hold open (this user's own)."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[3]) != sid:
                    continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    held.add(int(target[8:-1]))
        except (OSError, ValueError, IndexError):
            continue
    return held


def iperf_server(a):
    """A one-shot iperf3 server on this node's training address for preflight's and doctor.yml's
    pairs, run as the calling user (the training user) and detached, answered once it listens:
    {"listening": true, "pid"}. Where another process holds the port, nothing of ours listens and
    the answer names its owner ({"listening": false, "error"}): the pair's client then measures
    nothing, never a stranger's server."""
    port, seconds = int(a["port"]), int(a.get("seconds", 60))

    def taken(why):
        held = listeners(port)
        owners = ", ".join(sorted({user_name(h["uid"]) for h in held})) or "nobody now"
        return {"listening": False, "error": f"port {port} on {socket.gethostname()}: {why}; it is held "
                                             f"by a process of {owners}. Fix: end that process, or set "
                                             f"preflight_iperf_port to a free port"}
    deadline = time.time() + float(a.get("wait_s", 5))  # our own server of the last round may still be ending
    while any(h["uid"] == os.getuid() for h in listeners(port)) and time.time() < deadline:
        time.sleep(0.1)
    if listeners(port):
        return taken("another process listens on it already")
    server = subprocess.Popen(["timeout", str(seconds), "iperf3", "-s", "-1", "-p", str(port), "-B", a["addr"]],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    deadline = time.time() + 10
    while time.time() < deadline and server.poll() is None:
        ours = _sockets_of_session(server.pid)
        if any(h["inode"] in ours for h in listeners(port)):
            return {"listening": True, "pid": server.pid}
        time.sleep(0.05)
    if server.poll() is None:
        server.kill()
    return taken("our iperf3 server did not listen")
