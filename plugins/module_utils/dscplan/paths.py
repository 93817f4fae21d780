"""The paths root makes, writes and runs on the nodes, checked before any node changes: an absolute
path of safe characters, never a system directory, the probe's lstat chains of every path root
writes (no planted link, no foreign owner, no directory it did not make given away), an existing
interpreter's place, the dataset directory."""
from __future__ import annotations

import posixpath
import re

from dscnode import ROOT_STATE

from .problems import as_bool


SAFE_PATH = re.compile(r"/[A-Za-z0-9._/+@-]*")

# System and shared directories, never a root of the toolkit's (it gives its roots to the
# training user, and launch syncs the dataset into dsc_data_dir deleting what the control node
# lacks): these trees whole (the directory and everything under it), the toolkit's own root
# state among them (the warm-up's records and the packages root installs from: given to the
# training user, root would consume what that user writes) ...
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/boot", "/dev", "/proc", "/sys", "/run", "/root",
                "/var/run", "/var/lock", ROOT_STATE)

# ... /lib, /lib64, /lib32, /libx32 ... (and their trees)
SYSTEM_LIB = re.compile(r"/lib(x?[0-9]+)?")

# ... and these directories themselves (a directory of your own under them is fine).
SHARED_ROOTS = ("/", "/var", "/home", "/tmp", "/opt", "/srv", "/mnt", "/media", "/var/tmp",
                "/var/lib", "/var/log", "/var/cache", "/var/spool", "/var/mail")


def system_dir(path, trees=SYSTEM_TREES):
    """The system directory `path` is or is in (an absolute path, '..'-free as abs_path has
    it), or None: '/', SHARED_ROOTS themselves, `trees` and /lib* whole."""
    path = re.sub("/+", "/", str(path)).rstrip("/") or "/"
    if path in SHARED_ROOTS:
        return path
    top = "/" + path.split("/")[1]
    if SYSTEM_LIB.fullmatch(top):
        return top
    return next((t for t in trees if path == t or path.startswith(t + "/")), None)


def abs_path(problems, var, value, example, where, root=""):
    """An absolute path of the safe characters, without '..'; with `root` (what the toolkit does
    to it) not a system directory either (system_dir). True when it passes."""
    value = str(value)
    if not posixpath.isabs(value):
        problems.add(f"{var} {where} is {value!r}, not an absolute path. Fix: an absolute path "
                     f"such as {example}, the same on every node.")
    elif not SAFE_PATH.fullmatch(value) or "/../" in value + "/" or "/./" in value + "/":
        problems.add(f"{var} {where} is {value!r}. Fix: an absolute path of letters, digits and "
                     f"'._-+@/' only, without '..' (it reaches commands run as root).")
    elif root and system_dir(value):
        problems.add(f"{var} {where} is {value!r}, {_system_words(system_dir(value))}, and {root}. "
                     f"Fix: a directory of the toolkit's own, such as {example}.")
    else:
        return True
    return False


def _system_words(found):
    if found == "/":
        return "the root directory"
    if found in SHARED_ROOTS:
        return f"the system directory {found} itself"
    if found == ROOT_STATE:
        return f"in {found}, where root keeps what only root may write"
    return f"in the system tree {found}"


def check_existing_python(problems, py, where):
    """dsc_existing_python: its env (two levels up) is the env's prefix, whose bin/ leads PATH
    on every node: not '/', a shared root itself, or a system tree (the system's own interpreter,
    /usr/bin/python3 or /usr/local/bin/python3, excepted: root's, used as it is)."""
    example = "/opt/torch/.venv/bin/python"
    if not abs_path(problems, "dsc_existing_python", py, example, where):
        return
    prefix = posixpath.dirname(posixpath.dirname(re.sub("/+", "/", py).rstrip("/")))
    found = system_dir(prefix, tuple(t for t in SYSTEM_TREES if t != "/usr"))
    if found or posixpath.basename(posixpath.dirname(py)) != "bin":
        what = ("not in an env's bin directory" if posixpath.basename(posixpath.dirname(py)) != "bin"
                else f"whose env {prefix!r} is {_system_words(found)}")
        problems.add(f"dsc_existing_python {where} is {py!r}, {what}: its bin directory leads "
                     f"every rank's PATH and its prefix is taken as the env's. Fix: the "
                     f"interpreter of an env of its own, e.g. {example} (or the system's "
                     f"/usr/bin/python3).")


# The toolkit's fixed paths on a node (dscnode.probe.root_paths): no setting moves them.
FIXED_PATHS = ("node helper", "root state")


def root_path_problems(node, report, train_user, data=True):
    """Refusals for the paths root creates or writes into on a node (the probe's root_paths:
    each with the lstat of every directory above it), before any node changes: a link planted
    where root would follow it, an owner other than the expected one (an install root or run
    root that exists must be the training user's already: the toolkit makes its own so, and
    never gives away a directory it did not make), a directory above a path of root's that
    another user owns. `data`: check dsc_data_dir (launch, when it is synced)."""
    out = []
    seen = set()
    for entry in report or []:
        var, path, role = entry.get("var", "?"), entry.get("path", "?"), entry.get("role", "user")
        if var == "dsc_data_dir" and not data:
            continue
        fixed = var in FIXED_PATHS
        chain = entry.get("chain") or []
        where = f"{var} on host {node}" + ("" if fixed else f": root writes {path}")
        for i, c in enumerate(chain):
            p, kind = c.get("path", "?"), c.get("kind")
            parent = chain[i - 1] if i else None
            if kind == "missing":
                break
            last = i == len(chain) - 1 and p == path
            owner = c.get("user", "?")
            if kind == "link":
                # A link of root's in a directory of root's is the system's layout (/opt -> /var/opt).
                if c.get("uid") == 0 and (parent is None or parent.get("uid") == 0):
                    continue
                msg = (f"{where}, and {p} is a link to {c.get('target', '?')} owned by {owner}: "
                       f"root would follow it. Fix: remove the link (rm {p}; provision then "
                       f"creates a real directory)" + ("" if fixed else f", or set {var} to a path without links")
                       + "; nothing was changed.")
            elif last and role == "root" and c.get("uid") != 0:
                msg = (f"{where}: {p} is owned by {owner}, not root: whoever owns it can "
                       f"change what root runs. Fix: chown root:root {p} (or remove it: provision "
                       f"makes it); nothing was changed.")
            elif last and role in ("made", "theirs") and owner != train_user:
                made = ("the toolkit makes its install root the training user's" if role == "made"
                        else "the training user writes it")
                mine = (f"it exists and is owned by {owner}, not {train_user}: {made}, and never takes "
                        f"a directory it did not make" + (" (a system directory given to the training "
                                                          "user would let them change what root runs)"
                                                          if c.get("uid") == 0 else ""))
                msg = (f"{where}, and {mine}. Fix: point {var} at a path that does not exist yet "
                       f"(e.g. under /opt), or chown -R {train_user}: {p} if it is meant to be "
                       f"theirs; nothing was changed.")
            elif last and role == "user" and owner != train_user and c.get("uid") != 0:
                msg = (f"{where}, and {p} is owned by {owner}, not {train_user} or root. "
                       f"Fix: point {var} at a path of {train_user}'s, or chown -R {train_user}: {p} "
                       f"if it is theirs; nothing was changed.")
            elif not last and role in ("root", "made") and c.get("uid") != 0:
                msg = (f"{where}, and the directory above it, {p}, is owned by {owner}: "
                       f"whoever owns it can swap {path} for a link between the check and the write. "
                       f"Fix: " + (f"chown root {p}" if fixed else f"set {var} under a directory of "
                                   f"root's (e.g. /opt), or chown root {p}") + "; nothing was changed.")
            else:
                continue
            if p not in seen:
                seen.add(p)
                out.append(msg)
            break
    return out


def data_dir(s, where, problems, check_dir):
    """The dataset directory: synced from the control node to the same path on every node, or
    (dsc_data_shared) already there on a shared filesystem, checked by preflight."""
    given = str(s["dsc_data_dir"] or "")
    if not given:
        return {"dir": "", "shared": False}
    path = given.rstrip("/") or "/"
    abs_path(problems, "dsc_data_dir", path, "/data/my-dataset", where,
              "launch makes it the training user's and syncs the dataset into it, deleting what "
              "the control node lacks" if not as_bool(s["dsc_data_shared"]) else
              "every rank reads it as the dataset (dsc_data_shared)")
    shared = as_bool(s["dsc_data_shared"])
    if not shared and check_dir is not None and not check_dir(path):
        problems.add(f"dsc_data_dir {where} is {path!r}, which is not a directory on the control "
                     f"node. Fix: the dataset directory to sync to every node, or set "
                     f"dsc_data_shared: true for a path every node already has.")
    return {"dir": path, "shared": shared}
