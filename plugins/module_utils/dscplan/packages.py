"""What the nodes install: the node helper's file, the requirements, the hashed lock, the wheelhouse
and the pip sources, and who owns an existing interpreter."""
from __future__ import annotations

import hashlib
import os
import posixpath
import re
import urllib.parse
from pathlib import Path

from dscnode import INSTALLED_PATH
from dscnode.build import build
from dscnode.probe import LOCK_FILES

# Packages installed with torch, from the same CUDA-variant index (dsc_requirements).
TORCH_FAMILY = ("torchvision", "torchaudio")


def node_helper(repo):
    """The node helper the nodes run, built from node/dscnode into the repository's .cache/
    (dscnode.build; the same sources give the same bytes): its path here and its sha256, which
    the probe's of the installed copy must match."""
    path = Path(repo) / ".cache" / posixpath.basename(INSTALLED_PATH)
    return str(path), build(path)


def existing_owner(node, py, report):
    """(the user that runs an existing interpreter, a problem or None), from what the probe saw
    of it (dscnode.probe.path_owners): root when it, the directories above it (as written and as
    resolved) and its lib directories are all root's and none is writable by group or others
    (a sticky directory such as /tmp excepted); else the one other user who owns some of them
    (it runs only as that user: root never runs what another user can change); refused when
    one is writable by group or others, or several users own parts of it."""
    where = f"dsc_existing_python on host {node} is {py!r}"
    if not report or report.get("error"):
        why = (report or {}).get("error") or "the probe did not look at it"
        return None, (f"{where}, which is not there ({why}). Fix: the path of the interpreter "
                      f"installed on every node, e.g. /opt/torch/.venv/bin/python.")
    entries = [e for e in report.get("entries") or [] if "uid" in e and e.get("kind") != "link"]
    for e in entries:
        mode = int(str(e["mode"]), 8)
        if mode & 0o022 and not (e.get("kind") == "dir" and mode & 0o1000):
            who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if mode & bit)
            return None, (f"{where}: {e['path']} is writable by {who} (mode {oct(mode)[2:]}, owner "
                          f"{e['user']}), so they could change what runs as root or as the env's "
                          f"owner. Fix: chmod go-w {e['path']} (an existing env must be root's, "
                          f"not writable by group or others, or one user's).")
    users = sorted({e["user"] for e in entries if int(e["uid"]) != 0})
    if len(users) > 1:
        return None, (f"{where}: parts of it belong to {', '.join(users)} (not only root), so no "
                      f"one user owns it to run it as, and root would run what they can change. "
                      f"Fix: make the env and the directories above it root's (not writable by "
                      f"group or others), or one user's: it then runs only as that user.")
    owner = users[0] if users else "root"
    inside = report.get("inside")
    if inside and "uid" not in inside:  # not walked whole (unreadable, too large): nobody's to name
        return None, (f"{where}: {inside['path']} is {inside['why']}, inside what the env imports: "
                      f"root's pip and every rank import it, and what was not checked may belong to "
                      f"another user. Fix: make it readable by root and the env no larger than that "
                      f"(an env of the toolkit's holds some 30,000 entries), or use an env of the "
                      f"training user's (dsc_env_manager venv); nothing was changed.")
    if inside:
        who = f" ({inside['user']})" if inside.get("user") else ""
        return None, (f"{where}: {inside['path']} is {inside['why']}{who}, inside what the env "
                      f"imports: root's pip and every rank import it, and whoever can write it would "
                      f"run code as them. Fix: make everything the env imports {owner}'s and not "
                      f"writable by group or others (chown -R {owner}: and chmod -R go-w that path), "
                      f"or use an env of the training user's (dsc_env_manager venv); nothing was changed.")
    return owner, None


def read_requirements(s, where, problems):
    """dsc_requirements plus the lines of dsc_requirements_file, each a plain PEP 508 requirement
    (name, extras, version specifiers, markers), then the toolkit's own py-spy at
    dsc_py_spy_version: [(text, name)]. No URLs, options or editable installs: what a node
    installs is named here, and the wheelhouse can be checked for it."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    given = s["dsc_requirements"] or []
    if not isinstance(given, list):
        problems.add(f"dsc_requirements {where} is {given!r}. Fix: a list of requirements, e.g. "
                     f"['transformers==4.57.6', 'datasets==5.0.1'].")
        given = []
    lines = [(str(r), "dsc_requirements") for r in given]
    path = str(s["dsc_requirements_file"] or "")
    if path:
        try:
            text = Path(path).read_text()
        except (OSError, ValueError) as e:  # ValueError: a NUL in the path
            problems.add(f"dsc_requirements_file {where} is {path!r}: {getattr(e, 'strerror', None) or e}. Fix: the path "
                         f"of a requirements file on the control node.")
            text = ""
        lines += [(line.split(" #")[0].strip(), f"dsc_requirements_file {path}")
                  for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    out = []
    for text, var in lines:
        try:
            req = Requirement(text)
        except InvalidRequirement as e:
            problems.add(f"{var} {where}: {text!r} is not a requirement ({e}). Fix: a name and "
                         f"version such as 'transformers==4.57.6' (no pip options or URLs).")
            continue
        name = canonicalize_name(req.name)
        if req.url:
            problems.add(f"{var} {where}: {text!r} installs from a URL. Fix: a name and version; "
                         f"put the wheel into dsc_wheelhouse (scripts/wheelhouse.sh).")
        elif name in ("torch", "deepspeed", "py-spy"):
            problems.add(f"{var} {where}: {text!r}. Fix: drop it; torch, DeepSpeed and py-spy are "
                         f"dsc_torch_version, dsc_deepspeed_version and dsc_py_spy_version.")
        else:
            out.append((str(req), name))
    if s.get("dsc_py_spy_version"):
        out.append((f"py-spy=={s['dsc_py_spy_version']}", "py-spy"))
    return out


def wheelhouse_gaps(requirements, wheelhouse):
    """Requirements that no wheel or sdist in the wheelhouse satisfies: [(text, versions there)]."""
    from packaging.requirements import Requirement
    from packaging.utils import (
        InvalidSdistFilename,
        InvalidWheelFilename,
        canonicalize_name,
        parse_sdist_filename,
        parse_wheel_filename,
    )
    have = {}
    for f in os.listdir(wheelhouse):
        try:
            name, version = (parse_wheel_filename(f)[:2] if f.endswith(".whl")
                             else parse_sdist_filename(f))
        except (InvalidWheelFilename, InvalidSdistFilename):
            continue
        have.setdefault(canonicalize_name(name), []).append(version)
    gaps = []
    for text, name in requirements:
        spec = Requirement(text).specifier
        versions = have.get(name, [])
        if not any(spec.contains(v, prereleases=True) for v in versions):
            gaps.append((text, sorted(str(v) for v in versions)))
    return gaps


def split_requirements(s, where, problems, check_dir):
    """(torch-family requirements, the others): the first are installed with torch from its
    index, the others with DeepSpeed; offline, each must be in the wheelhouse."""
    reqs = read_requirements(s, where, problems)
    wheelhouse = str(s["dsc_wheelhouse"] or "")
    if reqs and wheelhouse and check_dir is not None and check_dir(wheelhouse):
        for text, versions in wheelhouse_gaps(reqs, wheelhouse):
            problems.add(f"dsc_requirements {where}: {text!r} is not in dsc_wheelhouse {wheelhouse} "
                         f"({'it has ' + ', '.join(versions) if versions else 'none there'}); the "
                         f"nodes install offline from it. Fix: REQUIREMENTS='{text}' "
                         f"scripts/wheelhouse.sh {wheelhouse}, or another version.")
    return ([t for t, n in reqs if n in TORCH_FAMILY], [t for t, n in reqs if n not in TORCH_FAMILY])


LOCK_LINE = re.compile(r"([A-Za-z0-9_.-]+)==(\S+) --hash=sha256:[0-9a-f]{64}(  # sdist)?")


def pip_sources(wheelhouse, index, torch_index):
    """pip's source arguments on the nodes: `pip_source_args` for DeepSpeed, the requirements and
    a lock's source packages; `pip_lock_args` for a lock's wheels (torch's index beside the
    index); `pip_torch_args` for an unlocked torch (its own index only). Offline from the node's
    wheelhouse when there is one. A plain-HTTP index (allowed with a lock only) is named a
    trusted host too, or pip ignores it."""
    if wheelhouse:
        offline = f"--no-index --find-links {wheelhouse}"
        return {"pip_source_args": offline, "pip_lock_args": offline, "pip_torch_args": offline}
    source = ""
    if index:
        host = urllib.parse.urlsplit(index).netloc
        source = f"--index-url {index}" + (f" --trusted-host {host}" if index.startswith("http:") else "")
    return {"pip_source_args": source,
            "pip_lock_args": " ".join(filter(None, [source, torch_index and f"--extra-index-url {torch_index}"])),
            "pip_torch_args": f"--index-url {torch_index}" if torch_index else source}


def lock_texts(lock):
    """The lock's files as roles/pytorch writes them on a node (lock-wheels.txt, lock-sdists.txt:
    a line per package), {} without a lock."""
    return {kind: "\n".join(lock[kind]) + "\n" for kind in LOCK_FILES} if lock else {}


def already_there(probe, lock, wheelhouse_digest, root_packages=False):
    """(lock_current, wheelhouse_current): whether a node holds the lock's files and the
    wheelhouse's copy exactly as provision would put them there (the probe's `installed`, or
    `installed_root` for root's own folder, dscnode.probe), so that provision sends neither
    (roles/pytorch). `wheelhouse_digest`: dscnode.probe.tree_digest of dsc_wheelhouse on the
    control node, None without one."""
    have = (probe or {}).get("installed_root" if root_packages else "installed") or {}
    texts = lock_texts(lock)
    lock_current = bool(lock) and all(
        (have.get("lock") or {}).get(kind) == hashlib.sha256(texts[kind].encode()).hexdigest() for kind in LOCK_FILES)
    return lock_current, wheelhouse_digest is not None and have.get("wheelhouse") == wheelhouse_digest


def op_sources(nodes, probes, build):
    """Each node's ops_kind (what DeepSpeed's JIT-built ops depend on: the CPU, the GPUs' compute
    capabilities and `build`, the env and versions every node shares) and ops_source: the node of
    its kind that builds them and ships them to the others (roles/deepspeed), so that no node
    compiles what another has built. The master is always its own kind's source: it never loads
    a build another node's training user could have changed (the master's holds the cluster key).
    For another kind, the first node in rank order with the most ops the toolkit's own warm-up
    built there (the probe's `installed.ops`: those whose library root recorded, unchanged; a
    folder the training user planted does not count)."""
    kinds = {}
    for n in nodes:
        probe = probes.get(n.name) or {}
        identity = [probe.get("cpu") or n.name, ",".join(sorted(n.compute_caps)), *build]
        n.ops_kind = hashlib.sha256("\0".join(identity).encode()).hexdigest()[:12]
        built = len((probe.get("installed") or {}).get("ops") or [])
        kinds.setdefault(n.ops_kind, []).append((n.rank != 0, -built, n.rank, n.name))
    for n in nodes:
        n.ops_source = min(kinds[n.ops_kind])[-1]


def node_lock(s, texts, where, problems, check_dir):
    """The lock every node installs exactly, each file checked against its sha256: the
    wheelhouse's requirements.lock (scripts/wheelhouse.sh) or dsc_node_lock (scripts/nodelock.sh,
    from an index). It must pin the torch and DeepSpeed of the plan and satisfy every requirement.
    {from: wheelhouse | index, wheels: lines, sdists: lines built on the node}, or None."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
    wheelhouse, node_lock = str(s["dsc_wheelhouse"] or ""), str(s["dsc_node_lock"] or "")
    if wheelhouse:
        var, path, source, tool = "dsc_wheelhouse", os.path.join(wheelhouse, "requirements.lock"), \
            "wheelhouse", f"scripts/wheelhouse.sh {wheelhouse}"
        if check_dir is None or not check_dir(wheelhouse) or not os.path.isfile(path):
            return None
    elif node_lock:
        var, path, source, tool = "dsc_node_lock", node_lock, "index", f"scripts/nodelock.sh {node_lock}"
        if check_dir is None or not os.path.isfile(path):
            return None
    else:
        return None
    pins, lock = {}, {"from": source, "wheels": [], "sdists": []}
    for line in open(path).read().splitlines():
        m = LOCK_LINE.fullmatch(line)
        if m:
            pins[canonicalize_name(m.group(1))] = Version(m.group(2))
            lock["sdists" if m.group(3) else "wheels"].append(line)
        elif line.strip() and not line.startswith("#"):
            problems.add(f"{var} {where}: {path} has a line that is not a hashed pin "
                         f"({line[:80]!r}). Fix: rebuild it with {tool}.")
            return None
    if lock["sdists"] and "setuptools" not in pins:
        problems.add(f"{var} {where}: {path} has source packages and no setuptools to build "
                     f"them with. Fix: rebuild it with {tool}.")
    wanted = [f"torch=={s['dsc_torch_version']}", f"deepspeed=={s['dsc_deepspeed_version']}"] + list(texts)
    for text in wanted:
        req = Requirement(text)
        got = pins.get(canonicalize_name(req.name))
        if got is None or not req.specifier.contains(Version(got.public), prereleases=True):
            problems.add(f"{var} {where}: its lock has {req.name} {got or 'not at all'}, the plan "
                         f"wants {text}. Fix: rebuild the lock for these pins and requirements "
                         f"({tool} with the requirements).")
    return lock
