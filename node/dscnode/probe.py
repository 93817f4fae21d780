"""What the plan needs from a node, fast (no Python env, no torch) and read-only: GPUs,
interfaces, InfiniBand, CPUs and the CPU's identity, the runs, the firewall, the SSH host keys, the
installed helper's sha256, the node lock's and the wheelhouse copy's digests, the JIT cache's
built ops, and every path root creates or writes into, each read with lstat. Ansible's script module pushes the built file
and runs it before anything is installed (roles/plan)."""
import glob
import hashlib
import os
import platform
import pwd
import re
import socket
import stat as stat_mod
from pathlib import Path

from dscnode import INSTALLED_PATH
from dscnode.procs import run
from dscnode.records import runs
from dscnode.ufw import rule_files


def sha256(path):
    """A regular file's sha256, opened without following a link (the probe runs as root, also in
    directories the training user writes); None for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat_mod.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return hashlib.sha256(f.read()).hexdigest()


def tree_digest(folder):
    """What rsync compares (every regular file's path, size and whole-second mtime), as one
    sha256; None where the folder is missing or a link. Links inside are neither followed nor
    counted. The control node computes it for dsc_wheelhouse, the probe for the node's copy:
    equal, the push has nothing to send."""
    if not os.path.isdir(folder) or os.path.islink(folder):
        return None
    h = hashlib.sha256()
    for top, _dirs, files in sorted(os.walk(folder)):
        for name in sorted(files):
            st = os.lstat(os.path.join(top, name))
            if stat_mod.S_ISREG(st.st_mode):
                rel = os.path.relpath(os.path.join(top, name), folder)
                h.update(f"{rel}\0{st.st_size}\0{int(st.st_mtime)}\n".encode())
    return h.hexdigest()


# What provision puts into the install root, as the probe finds it: the node lock's two files
# (roles/pytorch) and the wheelhouse's copy. The plan compares them with what it would put there.
LOCK_FILES = {"wheels": "lock-wheels.txt", "sdists": "lock-sdists.txt"}
WHEELHOUSE_DIR = "wheelhouse"
EXT_DIR = "cache/torch_extensions"  # the JIT op cache, TORCH_EXTENSIONS_DIR


def built_ops(ext_dir):
    """The JIT cache's ops with a built library (<op>/<op>.so, a regular file; links neither
    followed nor counted): what the plan weighs when it picks the node that builds for its kind."""
    try:
        names = sorted(os.listdir(ext_dir)) if not os.path.islink(ext_dir) else []
    except OSError:
        return []
    return [n for n in names if stat_mod.S_ISDIR(_lstat_mode(os.path.join(ext_dir, n)))
            and stat_mod.S_ISREG(_lstat_mode(os.path.join(ext_dir, n, f"{n}.so")))]


def _lstat_mode(path):
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


def installed(install_root):
    return {"lock": {kind: sha256(os.path.join(install_root, name)) for kind, name in LOCK_FILES.items()},
            "wheelhouse": tree_digest(os.path.join(install_root, WHEELHOUSE_DIR)),
            "ops": built_ops(os.path.join(install_root, EXT_DIR))}


def ssh_host_keys(folder="/etc/ssh"):
    """This node's SSH host public keys ("type base64", ed25519 first), for the master's
    known_hosts; a file that is missing or not of that form is left out."""
    keys = []
    for kind in ("ed25519", "ecdsa", "rsa"):
        try:
            fields = open(os.path.join(folder, f"ssh_host_{kind}_key.pub")).read().split()[:2]
        except OSError:
            continue
        if len(fields) == 2 and re.fullmatch(r"[a-z0-9@.-]+", fields[0]) and re.fullmatch(r"[A-Za-z0-9+/]+={0,3}", fields[1]):
            keys.append(" ".join(fields))
    return keys


def cpu_identity(cpuinfo="/proc/cpuinfo"):
    """What code compiled on this node for its CPU depends on (DeepSpeed's CPU ops take
    -march=native): the machine, and the first processor's model and flags, as one short digest."""
    try:
        first = open(cpuinfo).read().split("\n\n")[0]
    except OSError:
        first = ""
    keep = [line.split(":", 1)[1].strip() for line in first.splitlines()
            if line.split(":", 1)[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return hashlib.sha256("\0".join([platform.machine(), *keep]).encode()).hexdigest()[:16]


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


# An IPv4-mapped GID (::ffff:a.b.c.d): the RoCE v2 GID that routes over the node's IPv4 network.
IPV4_GID = "0000:0000:0000:0000:0000:ffff:"


def rdma(root="/sys/class/infiniband"):
    """Each RDMA port (InfiniBand, or RoCE over Ethernet): device, port, state (ACTIVE, DOWN,
    ...), link layer and, for RoCE, the GID index NCCL needs (NCCL_IB_GID_INDEX: the first RoCE v2
    GID holding an IPv4 address; None where there is none)."""
    out = []
    base = Path(root)
    for dev in sorted(base.iterdir()) if base.is_dir() else []:
        ports = dev / "ports"
        for port in sorted(ports.iterdir() if ports.is_dir() else [], key=lambda p: int(p.name) if p.name.isdigit() else 0):
            def read(name, port=port):
                try:
                    return (port / name).read_text().strip()
                except OSError:
                    return ""
            entry = {"device": dev.name, "port": int(port.name) if port.name.isdigit() else 0,
                     "state": read("state").split(":")[-1].strip(), "link_layer": read("link_layer")}
            if entry["link_layer"] == "Ethernet":
                types = port / "gid_attrs" / "types"
                indexes = sorted((int(f.name) for f in types.iterdir() if f.name.isdigit()) if types.is_dir() else [])
                entry["gid_index"] = next((i for i in indexes if read(f"gid_attrs/types/{i}") == "RoCE v2"
                                           and read(f"gids/{i}").startswith(IPV4_GID)), None)
            out.append(entry)
    return out


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
        cache, f"{install_root}/{EXT_DIR}", f"{cache}/miniconda-installer.sh",
        f"{install_root}/{WHEELHOUSE_DIR}", *(f"{install_root}/{name}" for name in LOCK_FILES.values()),
        f"{install_root}/ds_report.txt")]
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


def memory_mib():
    """The node's memory (MemTotal, MiB; None where /proc/meminfo does not say): Slurm's RealMemory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def slurm_partitions():
    """dsc_launch_mode slurm: {"partitions": {partition: [node names]}, "jobs": {job name: [id,
    state]}} as the Slurm controller this node's client reaches lists them (sinfo, squeue), or
    {"error": why} (either's): the plan checks the inventory's nodes against the master's, and a run's job
    already queued, before a job is submitted."""
    rc, out, err = run(["sinfo", "--noheader", "--Node", "--format", "%N|%P"], timeout=20)
    if rc == 0:
        rc, queue, err = run(["squeue", "--noheader", "--format", "%j|%i|%T"], timeout=20)  # pending, running, ending
    if rc != 0:
        return {"error": " ".join((err or out).split())[-300:] or f"sinfo or squeue exited with {rc}"}
    partitions = {}
    for line in out.splitlines():
        node, _, partition = line.strip().partition("|")
        if node and partition:  # the default partition is listed with a '*'
            partitions.setdefault(partition.rstrip("*"), []).append(node)
    jobs = {}
    for line in queue.splitlines():
        name, _, rest = line.strip().partition("|")
        if rest:
            jobs[name] = rest.split("|")
    return {"partitions": partitions, "jobs": jobs}


def probe(run_root="", existing="", install_root="", data_dir="", train_user="", slurm=False):
    """What the plan needs from a node; fast (no Python env, no torch) and read-only."""
    ib = Path("/sys/class/infiniband")
    return {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "memory_mib": memory_mib(), "cpu": cpu_identity(), "gpus": gpus(),
            "interfaces": interfaces(), "infiniband": ib.is_dir() and any(ib.iterdir()), "rdma": rdma(),
            "runs": runs(run_root) if run_root else [],
            "run_root_links": links(run_root) if run_root else [],
            "helper_sha256": sha256(INSTALLED_PATH), "firewalls": firewalls(), "ssh_host_keys": ssh_host_keys(),
            **({"existing_python": path_owners(existing)} if existing else {}),
            **({"slurm": slurm_partitions()} if slurm else {}),
            **({"root_paths": root_path_report(install_root, run_root, data_dir, train_user),
                "installed": installed(install_root)} if install_root else {})}


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
    auto. Also what cluster_network's ufw.yml reads before it changes anything: whether the kernel
    has IPv6 (ufw's own test) and ufw's rule files (user.rules, user6.rules; "" where missing).
    `root`: where those paths are (/ on a node)."""
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
    return {"os": ids, "ufw": ufw, "firewalld": firewalld, "ipv6": (root / "proc/sys/net/ipv6").is_dir(),
            "ufw_rules": rule_files(str(root / "etc" / "ufw"))}


def links(run_root):
    """The names of symbolic links in the run root (never run directories)."""
    try:
        return sorted(e.name for e in os.scandir(run_root) if e.is_symlink())[:1000]
    except OSError:
        return []
