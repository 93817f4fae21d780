"""The settings' values: each one read (a node's value or its default, one value for the whole
cluster where it must be), and the checks of what they hold: versions, names, users, package
sources, ports, the ranks' environment, secrets. Their names are vocabulary.py's, the paths'
checks paths.py's, what any value refuses hygiene.py's."""
from __future__ import annotations

import json
import os
import posixpath
import re

from dscnode.safe import SHELL_SAFE

from .network import ssh_source
from .paths import abs_path, check_existing_python
from .problems import is_int, shown
from .vocabulary import CLUSTER_GROUP, CLUSTER_SETTINGS, TORCH_INDEXES


# A credential inside a value (scheme://user:password@host).
URL_CREDENTIAL = re.compile(r"://[^/@\s]+:[^/@\s]*@")

# Every check below matches the whole string (fullmatch): `$` would accept a trailing newline,
# which DeepSpeed's runner and a free-form command split into another command or argument.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

SECRET_NAME = re.compile(r"(?i)(pass|secret|token|key|credential)")

EXACT_VERSION = re.compile(r"[0-9]+(\.[0-9]+)+([a-z0-9.+-]*)")

USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


def setting(hostvars, defaults, node, name):
    value = (hostvars.get(node) or {}).get(name)
    return defaults.get(name) if value is None else value


def cluster_settings(hostvars, defaults, names, problems):
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


def check_settings(s, first, problems, check_dir):
    """What the argument spec can't say about the cluster-wide settings (its types and choices are
    checked before the plan, by the plan role's argument validation). `first` names the host whose
    value is shown (they agree, or a 'differs' message came already)."""
    where = f"on host {first}"
    abs_path(problems, "dsc_install_root", s["dsc_install_root"], "/opt/dscluster", where,
              "provision makes it the training user's (with the env, the cache and the wheelhouse "
              "target under it)")
    if s["dsc_run_root"]:
        abs_path(problems, "dsc_run_root", s["dsc_run_root"], "/opt/dscluster/runs", where,
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
            check_existing_python(problems, py, where)
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
    if not isinstance(sources, list) or not all(ssh_source(x) for x in sources):
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
        window = env.get("DSC_RANK_WINDOW")
        if window is not None and (not is_int(window) or int(window) < 0):
            problems.add(f"dsc_rank_env {where}: DSC_RANK_WINDOW is {str(window)!r}. Fix: the steps of "
                         f"each window of the slow-rank measurement, a whole number (10 by default; "
                         f"0 turns it off).")


INDEX_URL = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._~:/@%+-]*)?")


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
