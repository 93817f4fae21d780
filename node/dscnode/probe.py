"""What the plan needs from a node, fast (no Python env, no torch) and read-only: GPUs,
interfaces and their stated speeds, InfiniBand, CPUs and the CPU's identity, the runs, the firewall, the SSH host keys, the
installed helper's sha256, the node lock's and the wheelhouse copy's digests, the JIT cache's
built ops, and every path root creates or writes into, each read with lstat. Ansible's script module pushes the built file
and runs it before anything is installed (roles/plan)."""
import glob
import hashlib
import os
import platform
import pwd
import re
import shutil
import socket
import stat as stat_mod
from pathlib import Path

from dscnode import INSTALLED_PATH, ROOT_PACKAGES, ROOT_STATE, WARM_RECORDS, warm_record
from dscnode.procs import run
from dscnode.records import runs
from dscnode.rundir import LOCK_LIMIT, REFUSED, open_regular, read_json, refused
from dscnode.ufw import rule_files


def sha256(path, limit=LOCK_LIMIT):
    """A regular file's sha256, read as open_regular allows (never through a link, never a FIFO,
    at most `limit` bytes, also where the file grows while read: the probe runs as root, also in
    directories the training user writes); None for anything else (a refusal is in rundir.REFUSED)."""
    try:
        with open_regular(path, limit) as f:
            h, left = hashlib.sha256(), limit
            while chunk := f.read(min(1 << 20, left + 1)):
                left -= len(chunk)
                if left < 0:
                    refused(path, f"grew past {limit:,} bytes while read, more than a file of its kind may hold")
                    return None
                h.update(chunk)
            return h.hexdigest()
    except OSError:
        return None


def unlinked(path):
    """True where no part of an absolute path is a symbolic link another user could have made
    (each part lstat'ed from the root; a link of root's in a directory of root's is the system's
    layout, /opt -> /var/opt, as the plan's path checks take it): what root reads below the path
    is what it names."""
    at, parent_uid = "/", 0
    for part in str(path).strip("/").split("/"):
        at = os.path.join(at, part)
        try:
            st = os.lstat(at)
        except OSError:
            return False
        if stat_mod.S_ISLNK(st.st_mode) and (st.st_uid != 0 or parent_uid != 0):
            return False
        try:
            parent_uid = os.stat(at).st_uid if stat_mod.S_ISLNK(st.st_mode) else st.st_uid
        except OSError:  # a link to nothing
            return False
    return True


# The most entries (files and folders) tree_digest compares (a wheelhouse holds some hundreds).
WHEELHOUSE_FILES = 100_000


def tree_digest(folder):
    """What rsync compares (every regular file's path, size and whole-second mtime), as one
    sha256; None where the folder is missing or a link, or holds more than WHEELHOUSE_FILES
    entries (walked no further: provision sends it again). Links inside are neither followed nor
    counted; a file gone while walked is passed over. The control node computes it for
    dsc_wheelhouse, the probe for the node's copy: equal, the push has nothing to send."""
    if not os.path.isdir(folder) or os.path.islink(folder):
        return None
    h, seen = hashlib.sha256(), 0
    for top, dirs, files in os.walk(folder):  # top-down, in place: the walk goes no further than read
        dirs.sort()
        seen += len(dirs) + len(files)
        if seen > WHEELHOUSE_FILES:
            refused(folder, f"more than {WHEELHOUSE_FILES:,} entries, not all compared")
            return None
        for name in sorted(files):
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            if stat_mod.S_ISREG(st.st_mode):
                rel = os.path.relpath(os.path.join(top, name), folder)
                h.update(f"{rel}\0{st.st_size}\0{int(st.st_mtime)}\n".encode())
    return h.hexdigest()


# What provision puts into the install root, as the probe finds it: the node lock's two files
# (roles/pytorch) and the wheelhouse's copy. The plan compares them with what it would put there.
LOCK_FILES = {"wheels": "lock-wheels.txt", "sdists": "lock-sdists.txt"}
WHEELHOUSE_DIR = "wheelhouse"
EXT_DIR = "cache/torch_extensions"  # the JIT op cache, TORCH_EXTENSIONS_DIR


# An op library the probe hashes (a CUDA op's fat binary for several architectures included).
OP_LIMIT = 512 << 20


def recorded_ops(ext_dir, record=None):
    """The ops the toolkit's last warm-up on this node built or loaded, as root recorded them
    (its warm record: each op library's sha256), whose library in the JIT cache is still that one:
    what the plan weighs when it picks the node that builds for its kind. A folder the training
    user made there, or a library changed since, does not count."""
    libs = (read_json(record or warm_record(ext_dir)) or {}).get("libs")
    if not isinstance(libs, dict):
        return []
    return sorted(name for name, lib in libs.items()
                  if isinstance(name, str) and "/" not in name and name not in (".", "..")
                  and isinstance(lib, dict) and lib.get("sha256") and unlinked(os.path.join(ext_dir, name))
                  and sha256(os.path.join(ext_dir, name, f"{name}.so"), OP_LIMIT) == lib["sha256"])


def installed(folder):
    """What provision put into a folder it installs from (the install root's, or root's own
    ROOT_PACKAGES for an env of root's): the node lock's two files' sha256 and the wheelhouse's
    digest, for the plan to compare with what it would put there."""
    return {"lock": {kind: sha256(os.path.join(folder, name)) for kind, name in LOCK_FILES.items()},
            "wheelhouse": tree_digest(os.path.join(folder, WHEELHOUSE_DIR))}


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


def link_speeds(root="/sys/class/net"):
    """{interface: its stated speed in Mbit/s} where the kernel knows one (a physical NIC that is up,
    a veth; -1 or an error for the others: absent)."""
    out = {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            mbps = int(Path(root, name, "speed").read_text().strip())
        except (OSError, ValueError):
            continue
        if mbps > 0:
            out[name] = mbps
    return out


# An IPv4-mapped GID (::ffff:a.b.c.d): the RoCE v2 GID that routes over the node's IPv4 network.
IPV4_GID = "0000:0000:0000:0000:0000:ffff:"


def rdma(root="/sys/class/infiniband"):
    """Each RDMA port (InfiniBand, or RoCE over Ethernet): device, port, state (ACTIVE, DOWN,
    ...), link layer, its rate in Gbit/s and, for RoCE, the GID index NCCL needs (NCCL_IB_GID_INDEX: the first RoCE v2
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
            rate = re.match(r"([\d.]+) Gb/sec", read("rate"))  # "200 Gb/sec (4X HDR)"
            entry = {"device": dev.name, "port": int(port.name) if port.name.isdigit() else 0,
                     "state": read("state").split(":")[-1].strip(), "link_layer": read("link_layer"),
                     "rate_gbps": float(rate.group(1)) if rate else None}
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
    alone (owner root, every directory above root's; "node helper" and "root state" are the
    toolkit's fixed paths, no setting); "made": created by root for the training user (the
    install root: where it exists, the training user's, every directory above root's); "theirs":
    the training user's own (the run root, the dataset: where it exists, the training user's);
    "user": inside the training user's (written as that user; owner the training user or root)."""
    install_root = install_root.rstrip("/") or "/"
    cache = f"{install_root}/cache"
    out = [{"var": "node helper", "path": os.path.dirname(INSTALLED_PATH), "role": "root"},
           {"var": "node helper", "path": INSTALLED_PATH, "role": "root"}]
    out += [{"var": "root state", "path": p, "role": "root"} for p in (
        ROOT_STATE, WARM_RECORDS, warm_record(f"{install_root}/{EXT_DIR}"), ROOT_PACKAGES, f"{ROOT_PACKAGES}/{WHEELHOUSE_DIR}",
        *(f"{ROOT_PACKAGES}/{name}" for name in LOCK_FILES.values()))]
    out.append({"var": "dsc_install_root", "path": install_root, "role": "made"})
    out += [{"var": "dsc_install_root", "path": p, "role": "user"} for p in (
        cache, f"{install_root}/{EXT_DIR}", f"{cache}/miniconda-installer.sh",
        f"{install_root}/{WHEELHOUSE_DIR}", *(f"{install_root}/{name}" for name in LOCK_FILES.values()),
        f"{install_root}/ds_report.txt")]
    if run_root:
        out.append({"var": "dsc_run_root", "path": run_root.rstrip("/") or "/", "role": "theirs"})
    if data_dir:
        out.append({"var": "dsc_data_dir", "path": data_dir.rstrip("/") or "/", "role": "theirs"})
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


def slurm_partitions(train_user):
    """The slurm launch mode: {"partitions": {partition: [node names]}, "jobs": {job name: [id,
    state]}} as the Slurm controller this node's client reaches lists them (sinfo, squeue), or
    {"error": why} (either's): the plan checks the inventory's nodes against the master's, and a
    run's job already queued, before a job is submitted. The jobs are the training user's own
    (none before that user exists): another user's job of the same name is no run of ours."""
    rc, out, err = run(["sinfo", "--noheader", "--Node", "--format", "%N|%P"], timeout=20)
    queue = ""
    if rc == 0 and _user_exists(train_user):  # pending, running, ending
        rc, queue, err = run(["squeue", "--noheader", "--user", train_user, "--format", "%j|%i|%T"], timeout=20)
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


def _user_exists(name):
    try:
        return bool(name) and pwd.getpwnam(name) is not None
    except KeyError:
        return False


def probe(run_root="", existing="", install_root="", data_dir="", train_user="", slurm=False):
    """What the plan needs from a node; fast (no Python env, no torch) and read-only. Every file
    it reads where another user can write is read as rundir.open_regular allows; what it refused
    is listed in `refused_reads` ({path, why}), which the plan shows naming the node."""
    ib = Path("/sys/class/infiniband")
    out = {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "memory_mib": memory_mib(), "cpu": cpu_identity(), "gpus": gpus(),
           "interfaces": interfaces(), "link_speeds": link_speeds(), "infiniband": ib.is_dir() and any(ib.iterdir()), "rdma": rdma(),
           "systemd": os.path.isdir("/run/systemd/system"),  # systemd is the init (sd_booted's test)
           "rsync": shutil.which("rsync") is not None,  # the wheelhouse's push and the dataset's sync use it
           "runs": runs(run_root) if run_root and unlinked(run_root) else [],  # a linked one: refused by the plan
           "run_root_links": links(run_root) if run_root else [],
           "helper_sha256": sha256(INSTALLED_PATH), "firewalls": firewalls(), "ssh_host_keys": ssh_host_keys(),
           **({"existing_python": path_owners(existing)} if existing else {}),
           **({"slurm": slurm_partitions(train_user)} if slurm else {}),
           **({"root_paths": root_path_report(install_root, run_root, data_dir, train_user),
               "installed": dict(installed(install_root), ops=recorded_ops(os.path.join(install_root, EXT_DIR))),
               "installed_root": installed(ROOT_PACKAGES)} if install_root else {})}
    out["refused_reads"] = list(REFUSED)
    return out


def path_owners(path):
    """Who owns an interpreter that root may run, and who may write it: owner and mode of the
    path and of every directory above it, as written and as resolved (a venv's bin/python is a
    link to its base interpreter), and of the env's lib/python3* and site-packages directories
    (what it imports). Each read with lstat (a link is reported, never followed by the read
    itself); the resolved path is read component by component as os.path.realpath gives it.
    Then everything the env imports, walked whole (foreign_inside): "inside" names the first
    entry there that its owner does not own alone.
    {"path", "entries": [{path, uid, user, mode, kind}], "inside"} or {"path", "error"}."""
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
    # What the env imports from, whole: its own prefix, and the base interpreter's where that is
    # not the system's (a venv of /usr/bin/python3 imports the system's standard library).
    inside = None
    try:
        owner = os.lstat(lexical_prefix).st_uid
    except OSError:
        owner = None
    for base in dict.fromkeys((lexical_prefix, prefix)):
        if owner is not None and not inside and (base == lexical_prefix or not _system_prefix(base)):
            inside = foreign_inside(base, owner)
    if inside and "uid" in inside:
        inside["user"] = user(inside["uid"])
    return {"path": path, "entries": entries, "inside": inside}


def _system_prefix(path):
    return path in ("/", "/usr", "/usr/local") or path.startswith(("/usr/lib", "/usr/share"))


# The most entries foreign_inside walks in an env (a CUDA torch env holds some 30,000): a larger
# tree is reported unchecked rather than walked without end.
ENV_ENTRIES = 400_000


def foreign_inside(prefix, owner, limit=ENV_ENTRIES):
    """The first entry under an env's prefix (every file, directory and link, walked with lstat,
    none followed) that whoever runs the env does not own alone: owned by a user other than the
    env's owner (`owner`, a uid) and root, or writable by group or others (a sticky directory
    excepted); a link whose target outside the prefix is so. Such a file is imported by every
    process of the env, root's pip and the training user's ranks alike, and whoever can write it
    runs code as them. {path, uid, why} or {path, why}; None when there is none."""
    root = os.path.realpath(prefix)
    stack, seen = [prefix], 0
    while stack:
        folder = stack.pop()
        try:
            listing = list(os.scandir(folder))
        except OSError as e:
            return {"path": folder, "why": f"unreadable ({e.strerror})"}
        for e in listing:
            seen += 1
            if seen > limit:
                return {"path": prefix, "why": f"a tree of more than {limit:,} entries, not all checked"}
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            found = _foreign(e.path, st, owner)
            if found:
                return found
            if stat_mod.S_ISLNK(st.st_mode):
                target = os.path.realpath(e.path)
                if target != root and not target.startswith(root + "/"):
                    try:
                        found = _foreign(target, os.stat(target), owner, f"the target of {e.path}: ")
                    except OSError:
                        found = None
                    if found:
                        return found
            elif stat_mod.S_ISDIR(st.st_mode):
                stack.append(e.path)
    return None


def _foreign(path, st, owner, said=""):
    if st.st_uid not in (0, owner):
        return {"path": path, "uid": st.st_uid, "why": f"{said}owned by another user"}
    mode = st.st_mode
    if not stat_mod.S_ISLNK(mode) and mode & 0o022 and not (stat_mod.S_ISDIR(mode) and mode & 0o1000):
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if mode & bit)
        return {"path": path, "uid": st.st_uid, "why": f"{said}writable by {who} (mode {oct(mode & 0o7777)[2:]})"}
    return None


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
    # A process named firewalld counts only where root runs it: any user can name a process so.
    firewalld = any(read(f"proc/{pid}/comm").strip() == "firewalld" and _uid(root / "proc" / pid) == 0 for pid in pids)
    return {"os": ids, "ufw": ufw, "firewalld": firewalld, "ipv6": (root / "proc/sys/net/ipv6").is_dir(),
            "ufw_rules": rule_files(str(root / "etc" / "ufw"))}


def _uid(path):
    try:
        return os.stat(path).st_uid
    except OSError:
        return None


def links(run_root):
    """The names of symbolic links in the run root (never run directories)."""
    try:
        return sorted(e.name for e in os.scandir(run_root) if e.is_symlink())[:1000]
    except OSError:
        return []
