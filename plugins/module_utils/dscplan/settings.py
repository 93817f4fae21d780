"""The settings: reading each one (a node's value or its default), their types, and the checks of
their values: paths, control characters, undeclared and retired names, secrets, the extra vars."""
from __future__ import annotations

import difflib
import functools
import ipaddress
import json
import os
import posixpath
import re
from pathlib import Path

from dscnode.safe import SHELL_SAFE

from .problems import is_int, shown

CLUSTER_GROUP = "cluster"
# CUDA variants and the package index each maps to (pytorch.org wheel indexes); "pypi" is the
# node's own pip configuration (PyPI or a site mirror).
TORCH_INDEXES = {
    "cpu": "https://download.pytorch.org/whl/cpu",
    "cu118": "https://download.pytorch.org/whl/cu118",
    "cu121": "https://download.pytorch.org/whl/cu121",
    "cu124": "https://download.pytorch.org/whl/cu124",
    "cu126": "https://download.pytorch.org/whl/cu126",
    "cu128": "https://download.pytorch.org/whl/cu128",
    "cu129": "https://download.pytorch.org/whl/cu129",
    "cu130": "https://download.pytorch.org/whl/cu130",
    "pypi": "",
}
# Settings that must be the same on every node (the launcher runs the master's paths everywhere).
CLUSTER_SETTINGS = (
    "dsc_cluster_name", "dsc_env_manager", "dsc_install_root", "dsc_run_root",
    "dsc_python_version", "dsc_torch_version", "dsc_torch_variant", "dsc_deepspeed_version",
    "dsc_py_spy_version", "dsc_train_user", "dsc_wheelhouse", "dsc_node_lock", "dsc_pip_index_url", "dsc_master_port",
    "dsc_master_port_last",
    "dsc_conda_env_name", "dsc_conda_installer_file", "dsc_conda_installer_sha256",
    "dsc_conda_accept_tos", "dsc_existing_python", "dsc_existing_install", "dsc_manage_packages", "dsc_launch_mode",
    "dsc_rank_env", "dsc_nccl_debug", "dsc_pg_timeout_min",
    "dsc_requirements", "dsc_requirements_file", "dsc_data_dir", "dsc_data_shared",
    "cluster_network_firewall", "cluster_network_firewall_backend", "cluster_network_ssh_sources",
    "dsc_slurm_install", "dsc_slurm_partition", "dsc_slurm_account", "dsc_slurm_cgroup",
    "dsc_slurm_slurmd_timeout_s",
)
# Checked like a cluster setting, but its values never enter the plan or a message (names only).
SECRET_SETTINGS = ("dsc_secrets",)
# Settings of one node.
NODE_SETTINGS = ("dsc_addr", "dsc_slots", "dsc_ssh_port", "dsc_gpus")
# What a node's probe is asked about, read before any plan exists (dscplan.probe_arguments).
PROBE_SETTINGS = ("dsc_install_root", "dsc_run_root", "dsc_train_user", "dsc_launch_mode", "dsc_data_dir",
                  "dsc_env_manager", "dsc_existing_python")
# Options of one run (launch, resume, status, stop, logs): -e values or the playbook's vars.
RUN_OPTIONS = (
    "preset", "run_id", "resume", "force", "replace", "dry_run", "follow", "max_restarts",
    "restart_backoff_s", "dsc_micro_batch", "dsc_grad_accum", "dsc_train_batch",
    "dsc_ds_config_overrides", "dsc_code_dir", "dsc_code_shared", "dsc_entry_module",
    "dsc_entry_script", "dsc_entry_args", "dsc_train_config", "preflight",
    "dsc_ds_config_mode", "dsc_ds_config_file", "dsc_ds_config_arg", "dsc_resume_args",
    "dsc_launcher_args", "dsc_stall_timeout_s", "dsc_stall_fail", "plot_runs",
    "dsc_tensorboard", "dsc_model_shape", "dsc_auto_memory_gib",
)
# What the playbooks tell the plan role (declared in its spec beside the settings, handed to the
# dsc_plan action as its arguments): never a setting, and with no default the plan reads.
PLAYBOOK_INPUTS = ("plan_run", "plan_allow_unreachable", "plan_firewall")
# The prefixes of the toolkit's settings: a variable with one that no role's meta/argument_specs.yml
# declares is refused (a mistyped name, or an earlier version's, would be ignored without a word).
SETTING_PREFIXES = ("dsc_", "cluster_network_")
# Settings renamed since an earlier version: the old name -> the one read now.
RETIRED_SETTINGS = {
    "cluster_network_nccl_debug": "dsc_nccl_debug",
    "cluster_network_pg_timeout_min": "dsc_pg_timeout_min",
    "cluster_network_env": "dsc_rank_env",
}
# What the toolkit itself sets with those prefixes (the plan, facts the roles record): a node
# has them when several playbooks run in one ansible-playbook command; never a setting.
TOOLKIT_VARIABLES = ("dsc_plan", "dsc_versions", "dsc_run_status", "dsc_python_version_installed",
                     "dsc_torch_probe", "dsc_preflight_rows")
# A credential inside a value (scheme://user:password@host).
URL_CREDENTIAL = re.compile(r"://[^/@\s]+:[^/@\s]*@")
# Every check below matches the whole string (fullmatch): `$` would accept a trailing newline,
# which DeepSpeed's runner and a free-form command split into another command or argument.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SECRET_NAME = re.compile(r"(?i)(pass|secret|token|key|credential)")
EXACT_VERSION = re.compile(r"[0-9]+(\.[0-9]+)+([a-z0-9.+-]*)")
USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
SAFE_PATH = re.compile(r"/[A-Za-z0-9._/+@-]*")
# Control characters (C0, DEL, C1, the Unicode line separators): refused in every setting and run
# option, whatever its own check (see control_characters).
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Values that only ever reach a JSON file (train.json, ds_config.json), never a path, command
# line or template: control characters are data there. Secret values are never shown either.
JSON_ONLY = ("dsc_train_config", "dsc_ds_config_overrides")


def read_pins(path):
    """requirements/pins.env: NAME=VALUE lines (also sourced by shell scripts)."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = line.split("=", 1)
            pins[key.strip()] = value.strip()
    return pins


def load_defaults(spec_path, pins_path):
    """Every setting's default: roles/plan/meta/argument_specs.yml, the versions from the pins."""
    import yaml  # the control node has it (Ansible needs it)
    with open(spec_path) as f:
        options = yaml.safe_load(f)["argument_specs"]["main"]["options"]
    defaults = {name: opt.get("default") for name, opt in options.items() if name not in PLAYBOOK_INPUTS}
    pins = read_pins(pins_path)
    defaults["dsc_torch_version"] = pins["TORCH_VERSION"]
    defaults["dsc_deepspeed_version"] = pins["DEEPSPEED_VERSION"]
    defaults["dsc_py_spy_version"] = pins["PY_SPY_VERSION"]
    return defaults


def ip_network(text):
    """An address or CIDR of either family, as the firewall rules use it: host bits cleared, a
    zone (%eth0) dropped, an IPv4-mapped IPv6 address as IPv4. ValueError when it is neither, or
    has anything around it (a space, a trailing newline)."""
    text = str(text)
    if text != text.strip() or CONTROL.search(text):
        raise ValueError(f"{text!r} has a space or control character")
    net = ipaddress.ip_network(text.split("%")[0], strict=False)
    if net.version == 6 and net.prefixlen == 128 and net.network_address.ipv4_mapped:
        net = ipaddress.ip_network(net.network_address.ipv4_mapped)
    return net


def _ssh_source(text):
    """An entry of cluster_network_ssh_sources: 'any', or an address or network of either family
    (nothing around it: no space or control character)."""
    if not isinstance(text, str) or text.lower() == "any":
        return isinstance(text, str)
    try:
        ip_network(text)
        return True
    except ValueError:
        return False


def as_bool(value):
    """A YAML/-e boolean (true, "yes", "1", ...) as bool."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def setting(hostvars, defaults, node, name):
    value = (hostvars.get(node) or {}).get(name)
    return defaults.get(name) if value is None else value


def _cluster_settings(hostvars, defaults, names, problems):
    """{name: value} of the cluster-wide settings; a value that differs between nodes is an error."""
    values = {}
    for var in CLUSTER_SETTINGS:
        by_value = {}
        for node in names:
            value = setting(hostvars, defaults, node, var)
            by_value.setdefault(json.dumps(value, sort_keys=True, default=str), []).append(node)
        if len(by_value) > 1:
            detail = "; ".join(f"{v} on {', '.join(h)}" for v, h in by_value.items())
            problems.add(f"{var} differs between nodes ({detail}). Fix: set it once for the group "
                         f"'{CLUSTER_GROUP}' (group_vars), not per host: the launcher runs the "
                         f"master's paths and settings on every node.")
        values[var] = setting(hostvars, defaults, names[0], var)
    return values


# System and shared directories, never a root of the toolkit's (it gives its roots to the
# training user, and launch syncs the dataset into dsc_data_dir deleting what the control node
# lacks): these trees whole (the directory and everything under it) ...
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/boot", "/dev", "/proc", "/sys", "/run", "/root",
                "/var/run", "/var/lock")
# ... /lib, /lib64, /lib32, /libx32 ... (and their trees)
SYSTEM_LIB = re.compile(r"/lib(x?[0-9]+)?")
# ... and these directories themselves (a directory of your own under them is fine).
SHARED_ROOTS = ("/", "/var", "/home", "/tmp", "/opt", "/srv", "/mnt", "/media", "/var/tmp",
                "/var/lib", "/var/log", "/var/cache", "/var/spool", "/var/mail")


def system_dir(path, trees=SYSTEM_TREES):
    """The system directory `path` is or is in (an absolute path, '..'-free as _abs_path has
    it), or None: '/', SHARED_ROOTS themselves, `trees` and /lib* whole."""
    path = re.sub("/+", "/", str(path)).rstrip("/") or "/"
    if path in SHARED_ROOTS:
        return path
    top = "/" + path.split("/")[1]
    if SYSTEM_LIB.fullmatch(top):
        return top
    return next((t for t in trees if path == t or path.startswith(t + "/")), None)


def _abs_path(problems, var, value, example, where, root=""):
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
    return f"in the system tree {found}"


def _control_paths(value, where):
    """The paths of the strings in value (keys included) that hold a control character."""
    if isinstance(value, str):
        return [(where, CONTROL.search(value).group())] if CONTROL.search(value) else []
    if isinstance(value, dict):
        return [(f"{where} (a key)", CONTROL.search(k).group()) for k in value
                if isinstance(k, str) and CONTROL.search(k)] + \
               [p for k, v in value.items() for p in _control_paths(v, f"{where}.{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _control_paths(v, f"{where}[{i}]")]
    return []


def control_characters(hostvars, names, options, problems):
    """Every setting and run option, whole (list items and mapping keys too): a control character
    (a trailing newline, a carriage return, a NUL) is refused, whatever the setting's own check.
    DeepSpeed's runner quotes only arguments with a space, so a newline there starts a second
    command on every node; a free-form command splits on it. Cluster-wide settings are read on
    the first node (another value elsewhere is reported as differing); dsc_secrets by name."""
    fix = ("Fix: the value without it (YAML's | and > blocks and a copied line end add a "
           "trailing newline): control characters split commands and arguments on the nodes.")
    for i, node in enumerate(names):
        hv = hostvars.get(node) or {}
        wanted = NODE_SETTINGS + (CLUSTER_SETTINGS if i == 0 else ())
        found = [p for var in wanted if var in hv for p in _control_paths(hv[var], var)]
        secrets = hv.get("dsc_secrets") if i == 0 else None
        if isinstance(secrets, dict):
            found += [("dsc_secrets (a name)", CONTROL.search(k).group()) for k in secrets
                      if isinstance(k, str) and CONTROL.search(k)]
        for path, char in found:
            problems.add(f"{path} on host {node} holds a control character ({char!r}). {fix}")
    for var in RUN_OPTIONS:
        if var in (options or {}) and var not in JSON_ONLY:
            for path, char in _control_paths(options[var], var):
                problems.add(f"{path} holds a control character ({char!r}). {fix}")


@functools.cache
def declared_settings(repo):
    """Every option a role's meta/argument_specs.yml declares (each entry point's): the settings."""
    import yaml  # the control node has it (Ansible needs it)
    names = set()
    for spec in Path(repo, "roles").glob("*/meta/argument_specs.yml"):
        for entry in yaml.safe_load(spec.read_text())["argument_specs"].values():
            names.update(entry.get("options") or {})
    return frozenset(names)


def undeclared_settings(variables, extra_vars, declared, problems):
    """A variable with a setting's prefix (SETTING_PREFIXES) that no role declares, set for a node
    (`variables`: {node: the names it has}) or given with -e (`extra_vars`), is refused once,
    naming its hosts: a retired one names the setting that replaced it."""
    hosts = {}
    for node, names in variables.items():
        for name in names:
            if name not in extra_vars:
                hosts.setdefault(str(name), []).append(node)
    where = {name: f"on host{'s' if len(at) > 1 else ''} {', '.join(at)}" for name, at in hosts.items()}
    where.update({str(name): "(given with -e)" for name in sorted(extra_vars)})
    for name, at in where.items():
        if not name.startswith(SETTING_PREFIXES) or name in declared or name in TOOLKIT_VARIABLES:
            continue
        current = RETIRED_SETTINGS.get(name)
        if current:
            problems.add(f"{name} {at} is the name of an earlier version: the setting is {current} now, "
                         f"and {name} would be ignored. Fix: rename it to {current}.")
            continue
        close = difflib.get_close_matches(name, sorted(declared), n=1, cutoff=0.8)
        problems.add(f"{name} {at} is not a setting: no role declares it (roles/*/meta/argument_specs.yml), "
                     f"so it would be ignored. Fix: "
                     + (f"{close[0]}, if that is what you meant, or remove it." if close else
                        "remove it, or correct its name (roles/plan/meta/argument_specs.yml lists the settings)."))


def _existing_python(problems, py, where):
    """dsc_existing_python: its env (two levels up) is the env's prefix, whose bin/ leads PATH
    on every node: not '/', a shared root itself, or a system tree (the system's own interpreter,
    /usr/bin/python3 or /usr/local/bin/python3, excepted: root's, used as it is)."""
    example = "/opt/torch/.venv/bin/python"
    if not _abs_path(problems, "dsc_existing_python", py, example, where):
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


def _check_settings(s, first, problems, check_dir):
    """What the argument spec can't say about the cluster-wide settings (its types and choices are
    checked before the plan, by the plan role's argument validation). `first` names the host whose
    value is shown (they agree, or a 'differs' message came already)."""
    where = f"on host {first}"
    _abs_path(problems, "dsc_install_root", s["dsc_install_root"], "/opt/dscluster", where,
              "provision makes it the training user's (with the env, the cache and the wheelhouse "
              "target under it)")
    if s["dsc_run_root"]:
        _abs_path(problems, "dsc_run_root", s["dsc_run_root"], "/opt/dscluster/runs", where,
                  "provision makes it the training user's")
    for var, example in (("dsc_torch_version", "2.13.0"), ("dsc_deepspeed_version", "0.19.8"),
                         ("dsc_py_spy_version", "0.4.2")):
        if var == "dsc_py_spy_version" and s[var] in ("", None):
            continue  # no stack reader installed
        if not EXACT_VERSION.fullmatch(str(s[var])):
            problems.add(f"{var} {where} is {str(s[var])!r}, not an exact version. Fix: pin one "
                         f"release, e.g. {example!r}: the same on every node, no range.")
    if not re.fullmatch(r"3\.\d+(\.\d+)?", str(s["dsc_python_version"])):
        problems.add(f"dsc_python_version {where} is {str(s['dsc_python_version'])!r}. Fix: a "
                     f"Python 3 version such as '3.11' (quoted in YAML).")
    user = str(s["dsc_train_user"])
    if user == "root" or not USER_NAME.fullmatch(user):
        problems.add(f"dsc_train_user {where} is {user!r}. Fix: a non-root user name (lower "
                     f"case, e.g. dstrain): ranks must not run as root.")
    cname = str(s["dsc_cluster_name"])
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", cname) or cname in (".", ".."):
        problems.add(f"dsc_cluster_name {where} is {cname!r}. Fix: letters, digits, '.', '_' and "
                     f"'-' only (it names key and report files).")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(s["dsc_conda_env_name"])):
        problems.add(f"dsc_conda_env_name {where} is {s['dsc_conda_env_name']!r}. Fix: letters, "
                     f"digits, '.', '_' and '-' only.")
    if s["dsc_torch_variant"] not in TORCH_INDEXES:
        problems.add(f"dsc_torch_variant {where} is {s['dsc_torch_variant']!r}. Fix: one of "
                     f"{', '.join(TORCH_INDEXES)}.")
    sha = str(s["dsc_conda_installer_sha256"] or "")
    if s["dsc_env_manager"] == "conda" and not re.fullmatch(r"[0-9a-fA-F]{64}", sha):
        # Downloaded or pushed from the control node: an installer runs only when it is the one
        # whose checksum the operator wrote down.
        problems.add(f"dsc_conda_installer_sha256 {where} is {'empty' if not sha else repr(sha)}. "
                     f"Fix: the installer's sha256 (64 hex digits, published beside it on "
                     f"repo.anaconda.com), for a downloaded installer and for "
                     f"dsc_conda_installer_file alike.")
    if s["dsc_env_manager"] == "existing":
        py = str(s["dsc_existing_python"] or "")
        if not posixpath.isabs(py):
            problems.add(f"dsc_existing_python {where} is {py!r}. Fix: the absolute path of the "
                         f"interpreter already on the node, e.g. /opt/torch/.venv/bin/python.")
        else:
            _existing_python(problems, py, where)
    _check_package_sources(s, where, problems, check_dir)
    _check_launch_settings(s, where, problems)


def _check_package_sources(s, where, problems, check_dir):
    """Where the nodes install from: the wheelhouse, the node lock and the pip index."""
    wheelhouse = str(s["dsc_wheelhouse"] or "")
    if wheelhouse and check_dir is not None and not check_dir(wheelhouse):
        problems.add(f"dsc_wheelhouse {where} is {wheelhouse!r}, which does not exist on the "
                     f"control node. Fix: build it (scripts/wheelhouse.sh) or point it at a "
                     f"directory of wheels.")
    node_lock = str(s["dsc_node_lock"] or "")
    if node_lock and wheelhouse:
        problems.add(f"dsc_node_lock {where} is set beside dsc_wheelhouse. Fix: one of them: the "
                     f"wheelhouse's own requirements.lock is its lock.")
    elif node_lock and check_dir is not None and not os.path.isfile(node_lock):
        problems.add(f"dsc_node_lock {where} is {node_lock!r}, which is not a file on the control "
                     f"node. Fix: write it with scripts/nodelock.sh {node_lock}.")
    index = str(s["dsc_pip_index_url"] or "")
    if index and (not INDEX_URL.fullmatch(index) or wheelhouse):
        problems.add(f"dsc_pip_index_url {where} is {index!r}. Fix: an http(s) URL of letters, digits "
                     f"and . _ ~ : / @ % + - only, e.g. https://pypi.example.org/simple"
                     + (", and no dsc_wheelhouse (installs from it are offline)." if wheelhouse else "."))
    elif index.startswith("http:") and not node_lock:
        problems.add(f"dsc_pip_index_url {where} is {index!r}: plain HTTP, and no dsc_node_lock to "
                     f"check what comes over it. Fix: https, or a dsc_node_lock (scripts/nodelock.sh): "
                     f"every file is then checked against its sha256.")


def _check_launch_settings(s, where, problems):
    """What every launch uses: the master port range, the SSH sources, the process group's
    timeout and the ranks' environment."""
    first_port, last_port = s["dsc_master_port"], s["dsc_master_port_last"]
    if not is_int(first_port) or not 1024 <= int(first_port) < 65536:
        problems.add(f"dsc_master_port {where} is {shown(first_port)}. Fix: a TCP port 1024-65535.")
    elif not is_int(last_port) or not int(first_port) <= int(last_port) < 65536:
        problems.add(f"dsc_master_port_last {where} is {shown(last_port)}. Fix: a port from "
                     f"dsc_master_port ({first_port}) to 65535; the range is tried in order.")
    sources = s["cluster_network_ssh_sources"]
    if not isinstance(sources, list) or not all(_ssh_source(x) for x in sources):
        problems.add(f"cluster_network_ssh_sources {where} is {shown(sources)}. Fix: a list of "
                     f"addresses or networks (IPv4 or IPv6), e.g. [192.0.2.10, 2001:db8::/64], or "
                     f"[any] to allow SSH from everywhere.")
    if not is_int(s["dsc_pg_timeout_min"]) or int(s["dsc_pg_timeout_min"]) <= 0:
        problems.add(f"dsc_pg_timeout_min {where} is {s['dsc_pg_timeout_min']!r}. Fix: minutes, "
                     f"a positive whole number.")
    env = s["dsc_rank_env"]
    if not isinstance(env, dict):
        problems.add(f"dsc_rank_env {where} is {env!r}. Fix: a mapping of variable names to "
                     f"values, e.g. {{NCCL_IB_HCA: mlx5}}.")
    else:
        for key, value in env.items():
            check_env_var(problems, key, value, f"dsc_rank_env {where}")
INDEX_URL = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._~:/@%+-]*)?")


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


def _data(s, where, problems, check_dir):
    """The dataset directory: synced from the control node to the same path on every node, or
    (dsc_data_shared) already there on a shared filesystem, checked by preflight."""
    given = str(s["dsc_data_dir"] or "")
    if not given:
        return {"dir": "", "shared": False}
    path = given.rstrip("/") or "/"
    _abs_path(problems, "dsc_data_dir", path, "/data/my-dataset", where,
              "launch makes it the training user's and syncs the dataset into it, deleting what "
              "the control node lacks" if not as_bool(s["dsc_data_shared"]) else
              "every rank reads it as the dataset (dsc_data_shared)")
    shared = as_bool(s["dsc_data_shared"])
    if not shared and check_dir is not None and not check_dir(path):
        problems.add(f"dsc_data_dir {where} is {path!r}, which is not a directory on the control "
                     f"node. Fix: the dataset directory to sync to every node, or set "
                     f"dsc_data_shared: true for a path every node already has.")
    return {"dir": path, "shared": shared}


def secret_names(hostvars, names, problems):
    """The names in dsc_secrets ({NAME: value}, one mapping for the cluster, usually an
    ansible-vault file): checked here, values never shown or copied into the plan."""
    seen = {}
    for node in names:
        value = (hostvars.get(node) or {}).get("dsc_secrets") or {}
        if not isinstance(value, dict):
            problems.add(f"dsc_secrets on host {node} is not a mapping. Fix: NAME: value pairs "
                         f"(e.g. HF_TOKEN: !vault ...) in group_vars/cluster.")
            return []
        for key, v in value.items():
            if not ENV_NAME.fullmatch(str(key)):
                problems.add(f"dsc_secrets on host {node}: {key!r} is not a plain variable name. "
                             f"Fix: letters, digits and '_', not starting with a digit.")
            elif not isinstance(v, (str, int, float)) or "\0" in str(v):
                problems.add(f"dsc_secrets on host {node}: the value of {key} is not a string. "
                             f"Fix: a string (quoted in YAML).")
        seen.setdefault(json.dumps(value, sort_keys=True, default=str), []).append(node)
    if len(seen) > 1:
        problems.add(f"dsc_secrets differs between nodes ({'; '.join(', '.join(h) for h in seen.values())}). "
                     f"Fix: set it once for the group '{CLUSTER_GROUP}' (values not shown).")
    first = (hostvars.get(names[0]) or {}).get("dsc_secrets") or {} if names else {}
    return sorted(map(str, first)) if isinstance(first, dict) else []


def check_env_var(problems, key, value, where):
    if not ENV_NAME.fullmatch(str(key)):
        problems.add(f"{where}: {key!r} is not a plain variable name. Fix: letters, digits and "
                     f"'_', not starting with a digit.")
    elif SECRET_NAME.search(str(key)):
        problems.add(f"{where}: {key} looks like a secret. Fix: move it to dsc_secrets (an "
                     f"ansible-vault value; this file's values land on every node's command line).")
    elif URL_CREDENTIAL.search(str(value)):
        problems.add(f"{where}: the value of {key} holds a password in a URL. Fix: move it to "
                     f"dsc_secrets (an ansible-vault value), or drop the credentials from the URL.")
    if not SHELL_SAFE.fullmatch(str(value)):
        problems.add(f"{where}: the value of {key} is {str(value)!r}. Fix: letters, digits and "
                     f"'@%+=:,./-_' only (DeepSpeed's runner puts it on a shell command line).")


# What makes a string a template to Ansible: a start string of Jinja's default delimiters, or a
# '#jinja2:' header (ansible-core 2.19 templates a string that begins with one, with whatever
# delimiters the header sets). Refused anywhere in the string: a superset of both.
JINJA = re.compile(r"{{|{%|{#|#jinja2:")


def templates_in(value, where, is_template=None):
    """The paths of the strings in value (an -e value: str, list, dict; keys too) that Ansible
    would evaluate as templates (lookups run commands on the control node), so the plan refuses
    them: JINJA, and `is_template` (the running Ansible's own detection, when given) besides."""
    def hit(text):
        return isinstance(text, str) and bool(JINJA.search(text) or (is_template and is_template(text)))
    if isinstance(value, str):
        return [where] if hit(value) else []
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in templates_in(v, f"{where}.{k}", is_template)] + \
               [f"{where} (a key)" for k in value if hit(k)]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in templates_in(v, f"{where}[{i}]", is_template)]
    return []


def literal_extra_vars(extra, is_template=None):
    """Every -e value is taken literally: a problem per variable that holds a Jinja template."""
    return [f"{path} holds a Jinja template ('{{{{', '{{%', '{{#' or a '#jinja2:' header): -e values "
            f"are taken literally and never evaluated (a lookup there would run on the control "
            f"node). Fix: pass the plain value."
            for name, value in extra.items()
            for path in (templates_in(value, str(name), is_template)
                         + ([f"{name} (the name)"] if templates_in(str(name), "", is_template) else []))]
