"""The plan: the one place that validates the inventory and the run options and derives everything
the roles apply. Pure Python (no Ansible import), so that every check is unit-tested in seconds:

    python3 -m pytest tests/unit          # the checks, the batch arithmetic, the launcher command

plugins/action/dsc_plan.py feeds it (each node's inventory values, what each node's probe saw,
the run options) and hands the result to every later play as `dsc_plan`. Inputs:

    hostvars  {node: {variable: value}}   inventory values as Ansible resolved them for that node
                                          (unset ones absent: defaults come from `defaults`)
    groups    {"cluster": [...], "master": [...]}
    probes    {node: what `dsc_node.pyz probe` printed}: gpus, interfaces, infiniband, runs
    defaults  {variable: default}         roles/plan/meta/argument_specs.yml's defaults
    paths     {"repo": ..., "templates": ...} on the control node
    variables {node: [names]}             every variable name a node has (undeclared settings)
    extra_vars {names}                    the names given with -e (a resume refuses LAUNCH_ONLY)

make_plan's plan is asdict() of a Plan (launch, resume, preflight) or a CompanionPlan (the other
playbooks): those records declare every key the roles read.

Every problem comes back at once, each naming the variable, the host and the fix; a value that
must be the same on every node is reported once, not once per node.
"""
from __future__ import annotations

import base64
import copy
import difflib
import functools
import hashlib
import io
import ipaddress
import json
import os
import posixpath
import re
import sys
import tarfile
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path

# The node helper's package (node/dscnode): the plan reads the run directory's names and the
# helper's installed path from it, and builds from it the one file the nodes run.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "node"))
from dscnode import INSTALLED_PATH
from dscnode.build import build
from dscnode.rundir import SECRETS_DIR, RunDir

CLUSTER_GROUP = "cluster"
MASTER_GROUP = "master"
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
    "dsc_train_user", "dsc_wheelhouse", "dsc_node_lock", "dsc_pip_index_url", "dsc_master_port",
    "dsc_master_port_last",
    "dsc_conda_env_name", "dsc_conda_installer_file", "dsc_conda_installer_sha256",
    "dsc_conda_accept_tos", "dsc_existing_python", "dsc_existing_install", "dsc_manage_packages", "dsc_launch_mode",
    "dsc_rank_env", "dsc_nccl_debug", "dsc_pg_timeout_min",
    "dsc_requirements", "dsc_requirements_file", "dsc_data_dir", "dsc_data_shared",
    "cluster_network_firewall", "cluster_network_firewall_backend", "cluster_network_ssh_sources",
)
# Checked like a cluster setting, but its values never enter the plan or a message (names only).
SECRET_SETTINGS = ("dsc_secrets",)
# Settings of one node.
NODE_SETTINGS = ("dsc_addr", "dsc_slots", "dsc_ssh_port", "dsc_gpus")
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
CONFIG_MODES = ("preset", "file", "hf", "none")
# How the ds_config reaches the script, per mode: DeepSpeed-style scripts take
# --deepspeed_config (deepspeed.add_config_arguments), HF Trainer scripts --deepspeed; "env" hands
# it to accelerate (ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_CONFIG_FILE), as `accelerate
# launch` would.
CONFIG_ARGS = {"preset": "--deepspeed_config", "file": "--deepspeed_config", "hf": "--deepspeed", "none": ""}
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
# What HF's Trainer fills in itself from its TrainingArguments ("auto" in its ds_config).
HF_AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto",
           "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
# What a run was launched with, written to its launch.json: resume.yml and restarts start exactly
# the same command (the user's entry point and arguments, the preset, the batch) from it.
LAUNCH_SPEC = (
    "preset", "dsc_micro_batch", "dsc_grad_accum", "dsc_train_batch", "dsc_ds_config_overrides",
    "dsc_code_dir", "dsc_code_shared", "dsc_entry_module", "dsc_entry_script", "dsc_entry_args",
    "dsc_train_config", "dsc_ds_config_mode", "dsc_ds_config_file", "dsc_ds_config_arg",
    "dsc_resume_args", "dsc_launcher_args",
)
# Run options that only a launch applies: they shape the files and code written into the run
# directory then (ds_config.json, train.json, .deepspeed_env, memory.json, code/), which a resume
# keeps as they are; resume refuses them given with -e. dsc_code_dir too, unless the code is on a
# shared filesystem (run from there, not copied). What a resume does apply: the entry point and
# its arguments, resume and launcher arguments, restarts, stall handling, follow, preflight.
LAUNCH_ONLY = (
    "preset", "dsc_micro_batch", "dsc_grad_accum", "dsc_train_batch", "dsc_ds_config_overrides",
    "dsc_ds_config_mode", "dsc_ds_config_file", "dsc_ds_config_arg", "dsc_tensorboard",
    "dsc_train_config", "dsc_model_shape", "dsc_auto_memory_gib", "dsc_code_shared",
)
# DeepSpeed launcher options a run may add (dsc_launcher_args): flag -> takes a value. The rest
# (hostfile, include, ports, node rank, ssh) are the plan's.
LAUNCHER_OPTIONS = {"--bind_cores_to_rank": False, "--bind_core_list": True, "--no_local_rank": False,
                    "--enable_each_rank_log": True}
# A resume argument the node helper replaces with the newest path matching the glob, relative to
# the run's working directory (dropped, with the option before it, while there is none).
LATEST = re.compile(r"\{latest:[\w@%+=:,./*?-]+\}")
# DeepSpeed's monitor sections: a config with one keeps it (csv_monitor is added otherwise).
MONITORS = ("csv_monitor", "tensorboard", "wandb", "comet")
# Packages installed with torch, from the same CUDA-variant index (dsc_requirements).
TORCH_FAMILY = ("torchvision", "torchaudio")
# A credential inside a value (scheme://user:password@host).
URL_CREDENTIAL = re.compile(r"://[^/@\s]+:[^/@\s]*@")
HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")
# Every check below matches the whole string (fullmatch): `$` would accept a trailing newline,
# which DeepSpeed's runner and a free-form command split into another command or argument.
# Values DeepSpeed's runner puts on the remote command line unquoted; anything else it
# double-quotes, where $() and backticks still expand: refused.
DS_ENV_SAFE = re.compile(r"[\w@%+=:,./-]*")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SECRET_NAME = re.compile(r"(?i)(pass|secret|token|key|credential)")
EXACT_VERSION = re.compile(r"[0-9]+(\.[0-9]+)+([a-z0-9.+-]*)")
USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SAFE_PATH = re.compile(r"/[A-Za-z0-9._/+@-]*")
HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})")
# Control characters (C0, DEL, C1, the Unicode line separators): refused in every setting and run
# option, whatever its own check (see control_characters).
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Values that only ever reach a JSON file (train.json, ds_config.json), never a path, command
# line or template: control characters are data there. Secret values are never shown either.
JSON_ONLY = ("dsc_train_config", "dsc_ds_config_overrides")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# fp16 with dynamic loss scaling, for GPUs without bf16 (compute capability below 8.0).
FP16 = {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
        "hysteresis": 2, "min_loss_scale": 1}


def node_helper(repo):
    """The node helper the nodes run, built from node/dscnode into the repository's .cache/
    (dscnode.build; the same sources give the same bytes): its path here and its sha256, which
    the probe's of the installed copy must match."""
    path = Path(repo) / ".cache" / posixpath.basename(INSTALLED_PATH)
    return str(path), build(path)


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
    defaults = {name: opt.get("default") for name, opt in options.items()}
    pins = read_pins(pins_path)
    defaults["dsc_torch_version"] = pins["TORCH_VERSION"]
    defaults["dsc_deepspeed_version"] = pins["DEEPSPEED_VERSION"]
    return defaults


class Problems:
    """Error messages, in order, each once."""

    def __init__(self):
        self.messages = []

    def add(self, message):
        if message not in self.messages:
            self.messages.append(message)


def shown(value):
    """A value as a message shows it: numbers plain (-e gives them as strings), the rest quoted."""
    return str(int(value)) if _is_int(value) else repr(value)


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


def _is_int(value):
    """A whole number, or its decimal digits alone (-e gives numbers as strings): nothing around
    them, no other digits than 0-9."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value) is not None)


def as_bool(value):
    """A YAML/-e boolean (true, "yes", "1", ...) as bool."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def node_order(groups):
    """Inventory order, the `master` group's first node moved to the front: host order is
    DeepSpeed's node rank order."""
    nodes = list(dict.fromkeys(groups.get(CLUSTER_GROUP) or []))
    masters = [h for h in groups.get(MASTER_GROUP) or [] if h in nodes]
    if masters:
        nodes.remove(masters[0])
        nodes.insert(0, masters[0])
    return nodes


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
    return (users[0] if users else "root"), None


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
    for var, example in (("dsc_torch_version", "2.13.0"), ("dsc_deepspeed_version", "0.19.8")):
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
    first_port, last_port = s["dsc_master_port"], s["dsc_master_port_last"]
    if not _is_int(first_port) or not 1024 <= int(first_port) < 65536:
        problems.add(f"dsc_master_port {where} is {shown(first_port)}. Fix: a TCP port 1024-65535.")
    elif not _is_int(last_port) or not int(first_port) <= int(last_port) < 65536:
        problems.add(f"dsc_master_port_last {where} is {shown(last_port)}. Fix: a port from "
                     f"dsc_master_port ({first_port}) to 65535; the range is tried in order.")
    sources = s["cluster_network_ssh_sources"]
    if not isinstance(sources, list) or not all(_ssh_source(x) for x in sources):
        problems.add(f"cluster_network_ssh_sources {where} is {shown(sources)}. Fix: a list of "
                     f"addresses or networks (IPv4 or IPv6), e.g. [192.0.2.10, 2001:db8::/64], or "
                     f"[any] to allow SSH from everywhere.")
    if not _is_int(s["dsc_pg_timeout_min"]) or int(s["dsc_pg_timeout_min"]) <= 0:
        problems.add(f"dsc_pg_timeout_min {where} is {s['dsc_pg_timeout_min']!r}. Fix: minutes, "
                     f"a positive whole number.")
    env = s["dsc_rank_env"]
    if not isinstance(env, dict):
        problems.add(f"dsc_rank_env {where} is {env!r}. Fix: a mapping of variable names to "
                     f"values, e.g. {{NCCL_IB_HCA: mlx5}}.")
    else:
        for key, value in env.items():
            check_env_var(problems, key, value, f"dsc_rank_env {where}")


def read_requirements(s, where, problems):
    """dsc_requirements plus the lines of dsc_requirements_file, each a plain PEP 508 requirement
    (name, extras, version specifiers, markers): [(text, name)]. No URLs, options or editable
    installs: what a node installs is named here, and the wheelhouse can be checked for it."""
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
        elif name in ("torch", "deepspeed"):
            problems.add(f"{var} {where}: {text!r}. Fix: drop it; torch and DeepSpeed are "
                         f"dsc_torch_version and dsc_deepspeed_version.")
        else:
            out.append((str(req), name))
    return out


def wheelhouse_gaps(requirements, wheelhouse):
    """Requirements that no wheel or sdist in the wheelhouse satisfies: [(text, versions there)]."""
    from packaging.requirements import Requirement
    from packaging.utils import (InvalidSdistFilename, InvalidWheelFilename, canonicalize_name,
                                 parse_sdist_filename, parse_wheel_filename)
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


def _requirements(s, where, problems, check_dir):
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
INDEX_URL = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._~:/@%+-]*)?")


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


def _lock(s, texts, where, problems, check_dir):
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


def root_path_problems(node, report, train_user, data=True):
    """Refusals for the paths root creates or writes into on a node (the probe's root_paths:
    each with the lstat of every directory above it), before any node changes: a link planted
    where root would follow it, an owner other than the expected one, a directory above a path
    of root's that another user owns. `data`: check dsc_data_dir (launch, when it is synced)."""
    out = []
    seen = set()
    for entry in report or []:
        var, path, role = entry.get("var", "?"), entry.get("path", "?"), entry.get("role", "user")
        if var == "dsc_data_dir" and not data:
            continue
        chain = entry.get("chain") or []
        where = f"{var} on host {node}" + ("" if var == "node helper" else f": root writes {path}")
        for i, c in enumerate(chain):
            p, kind = c.get("path", "?"), c.get("kind")
            parent = chain[i - 1] if i else None
            if kind == "missing":
                break
            last = i == len(chain) - 1 and p == path
            if kind == "link":
                # A link of root's in a directory of root's is the system's layout (/opt -> /var/opt).
                if c.get("uid") == 0 and (parent is None or parent.get("uid") == 0):
                    continue
                msg = (f"{where}, and {p} is a link to {c.get('target', '?')} owned by {c.get('user', '?')}: "
                       f"root would follow it. Fix: remove the link (rm {p}; provision then "
                       f"creates a real directory), or set {var if var != 'node helper' else 'nothing'} "
                       f"to a path without links; nothing was changed.")
            elif last and role == "root" and c.get("uid") != 0:
                msg = (f"{where}: {p} is owned by {c.get('user', '?')}, not root: whoever owns it can "
                       f"change what root runs. Fix: chown root:root {p} (or remove it: provision "
                       f"installs it); nothing was changed.")
            elif last and role in ("made", "user") and c.get("user") != train_user and (
                    c.get("uid") != 0 or var == "dsc_data_dir"):  # synced as the user, never chowned
                owners = train_user if var == "dsc_data_dir" else f"{train_user} or root"
                msg = (f"{where}, and {p} is owned by {c.get('user', '?')}, not {owners}. "
                       f"Fix: point {var} at a path of {train_user}'s, or chown -R {train_user}: {p} "
                       f"if it is theirs; nothing was changed.")
            elif not last and role in ("root", "made") and c.get("uid") != 0:
                msg = (f"{where}, and the directory above it, {p}, is owned by {c.get('user', '?')}: "
                       f"whoever owns it can swap {path} for a link between the check and the write. "
                       f"Fix: set {var} under a directory of root's (e.g. /opt), or chown root {p}; "
                       f"nothing was changed.")
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
    if not DS_ENV_SAFE.fullmatch(str(value)):
        problems.add(f"{where}: the value of {key} is {str(value)!r}. Fix: letters, digits and "
                     f"'@%+=:,./-_' only (DeepSpeed's runner puts it on a shell command line).")


def training_address(name, hv):
    """(the node's training address, a problem or None): dsc_addr, else ansible_host, else the
    inventory name; an IPv4 address (not unspecified or multicast). A host name is refused (the
    firewall's rules, NCCL's interface and the rendezvous are made from the address, and one
    resolved differently on each node would split them), and so is IPv6, not supported yet
    (the probe reads IPv4 interfaces only): both before any node changes."""
    given = hv.get("dsc_addr")
    addr = str(given or hv.get("ansible_host") or name)
    if given:
        where = f"dsc_addr on host {name} is {addr!r}"
    elif hv.get("ansible_host"):
        where = f"dsc_addr on host {name} is unset and ansible_host, which stands for it, is {addr!r}"
    else:
        where = (f"dsc_addr on host {name} is unset, and so is ansible_host: the inventory name "
                 f"{addr!r} stands for it")
    fix = "Fix: set dsc_addr to the node's IPv4 address on the training network, e.g. 10.0.0.11"
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        if HOST_NAME.fullmatch(addr) and not re.fullmatch(r"[0-9.]+", addr):
            return addr, (f"{where}, a host name, not an IPv4 address: the firewall's rules, NCCL's "
                          f"interface and the rendezvous are made from the address. {fix}.")
        return addr, f"{where}, not an IPv4 address. {fix}."
    if ip.version == 6:
        return addr, (f"{where}, an IPv6 address: IPv6 training addresses are not supported yet "
                      f"(the probe, NCCL's interface and the rendezvous are IPv4 here; the "
                      f"firewall covers both families). {fix}"
                      + (f" ({ip.ipv4_mapped} here)." if ip.ipv4_mapped else "."))
    if ip.is_unspecified or ip.is_multicast or addr == "255.255.255.255":
        return addr, f"{where}, not the address of one node. {fix}."
    return str(ip), None


def _nodes(names, hostvars, defaults, probes, problems):
    nodes, seen_addr, seen_target = [], {}, {}
    for rank, name in enumerate(names):
        hv = hostvars.get(name) or {}
        probe = probes.get(name)
        reachable = probe is not None  # else only status.yml plans, showing the node as unreachable
        probe = probe or {}
        gpus = probe.get("gpus") or []
        if not HOST_NAME.fullmatch(name):
            problems.add(f"inventory: host name {name!r}. Fix: letters, digits, '.' and '-' only "
                         f"(it goes into the hostfile, /etc/hosts and ssh's config).")
        addr, problem = training_address(name, hv)
        if problem:
            problems.add(problem)
        if addr in seen_addr:
            problems.add(f"dsc_addr on host {name} is {addr}, the same as on host "
                         f"{seen_addr[addr]}. Fix: give each node its own training-network "
                         f"address.")
        seen_addr.setdefault(addr, name)
        target = (str(hv.get("ansible_host") or name), str(hv.get("ansible_port") or 22))
        if target in seen_target:
            problems.add(f"ansible_host on host {name} is {target[0]} (port {target[1]}), the same "
                         f"machine as host {seen_target[target]}. Fix: list each machine once in "
                         f"the group 'cluster' (one machine under two names would be provisioned "
                         f"twice at once and get two training addresses).")
        seen_target.setdefault(target, name)
        slots = wanted_slots = setting(hostvars, defaults, name, "dsc_slots")
        if str(slots) == "auto":
            if not gpus and reachable:
                problems.add(f"dsc_slots on host {name} is 'auto' but nvidia-smi found no GPU "
                             f"there. Fix: set dsc_slots to the rank count for a CPU-only node.")
            slots = len(gpus)
        elif not _is_int(slots) or int(slots) <= 0:
            problems.add(f"dsc_slots on host {name} is {shown(slots)}. Fix: a positive number of GPUs "
                         f"(or of ranks on a CPU-only node), or 'auto' to detect GPUs with "
                         f"nvidia-smi.")
            slots = 0
        gpu_ids, slots = _gpu_selection(name, hv.get("dsc_gpus") or [], gpus, wanted_slots, slots,
                                        reachable, problems)
        port = hv.get("dsc_ssh_port", hv.get("ansible_port", 22))
        if not _is_int(port) or not 0 < int(port) < 65536:
            problems.add(f"dsc_ssh_port on host {name} is {shown(port)}. Fix: a TCP port 1-65535.")
            port = 22
        nodes.append({
            "name": name, "rank": rank, "addr": addr, "slots": int(slots), "ssh_port": int(port),
            "gpus": len(gpus), "gpu_ids": gpu_ids,
            # DeepSpeed's hostfile counts a node's GPUs from 0; a selection is passed as --include.
            "hostfile_slots": len(gpus) if gpu_ids else int(slots),
            "compute_caps": sorted({str(g.get("compute_cap", "")) for g in gpus} - {""}),
            "driver": (gpus[0].get("driver") if gpus else "") or "",
            # The smallest of the GPUs used (MiB; None where nvidia-smi did not say): preset=auto.
            "gpu_memory_mib": min((g.get("memory_mib") or 0 for g in gpus
                                   if not gpu_ids or int(g.get("index", -1)) in gpu_ids), default=0) or None,
            "iface": interface_for(addr, probe.get("interfaces") or {}),
            "infiniband": bool(probe.get("infiniband")), "reachable": reachable,
            # The node helper installed there is this repository's (else launch installs it).
            "helper_sha256": probe.get("helper_sha256"),
            # Symbolic links in the run root: never a run directory (see _refused_starts).
            "run_root_links": list(probe.get("run_root_links") or []),
            # The runs whose secrets file is there (resume uses it: _resume_secrets).
            "runs_with_secrets": [r["id"] for r in probe.get("runs") or [] if r.get("secrets")],
            # Each run's measured peaks on this node against its prediction (preset=auto reads them).
            "memory_records": [dict(r["memory"], run_id=r["id"]) for r in probe.get("runs") or []
                               if isinstance(r.get("memory"), dict)],
        })
    return nodes


# cluster_network_firewall_backend auto: the firewall of the OS family (/etc/os-release's ID and
# ID_LIKE, as the probe reads them).
FIREWALL_AUTO = {"debian": "ufw", "ubuntu": "ufw", "rhel": "firewalld", "fedora": "firewalld",
                 "centos": "firewalld"}


def _firewall_backends(nodes, probes, s, check, problems):
    """Each node's firewall (node["firewall_backend"]: cluster_network_firewall_backend, auto taken
    from its OS). With `check` and the firewall managed: refused where auto knows no firewall for
    the OS, or where the other firewall runs (two fight over the same tables, and the one not
    managed here keeps the site's rules in force unseen)."""
    wanted = str(s["cluster_network_firewall_backend"])
    for node in nodes:
        seen = (probes.get(node["name"]) or {}).get("firewalls") or {}
        ids = seen.get("os") or []
        backend = wanted if wanted != "auto" else next((FIREWALL_AUTO[i] for i in ids if i in FIREWALL_AUTO), "")
        node["firewall_backend"] = backend
        if not check or not as_bool(s["cluster_network_firewall"]) or not node["reachable"]:
            continue
        where = f"cluster_network_firewall_backend on host {node['name']} is {wanted!r}"
        os_ids = " ".join(ids) or "no /etc/os-release"
        if not backend:
            problems.add(f"{where}, and auto knows no firewall for its OS ({os_ids}). Fix: ufw or "
                         f"firewalld, or cluster_network_firewall: false to leave the firewall to "
                         f"the site.")
            continue
        other = "firewalld" if backend == "ufw" else "ufw"
        if seen.get(other):
            chosen = f" ({backend} on {os_ids})" if wanted == "auto" else ""
            problems.add(f"{where}{chosen}, and {other} is running there. Fix: "
                         f"cluster_network_firewall_backend: {other} (the site's firewall), or stop "
                         f"{other}, or cluster_network_firewall: false to leave the firewall to the "
                         f"site.")


def _gpu_selection(name, wanted, gpus, wanted_slots, slots, reachable, problems):
    """(the GPU indices chosen on a node, its slots): dsc_gpus lists indices nvidia-smi reports
    there; the slots are then their count."""
    if not wanted:
        return [], slots
    if not isinstance(wanted, list) or not all(_is_int(i) for i in wanted) \
            or len(set(map(int, wanted))) != len(wanted):
        problems.add(f"dsc_gpus on host {name} is {wanted!r}. Fix: a list of distinct GPU "
                     f"indices as nvidia-smi numbers them, e.g. [0, 1].")
        return [], slots
    ids = [int(i) for i in wanted]
    present = {int(g["index"]) for g in gpus if _is_int(g.get("index"))}
    missing = [i for i in ids if i not in present]
    if reachable and missing:
        problems.add(f"dsc_gpus on host {name} names GPU {', '.join(map(str, missing))}, which "
                     f"nvidia-smi does not report there (it has {sorted(present) or 'none'}). Fix: "
                     f"indices of GPUs on that node.")
    if str(wanted_slots) not in ("auto", str(len(ids))):
        problems.add(f"dsc_slots on host {name} is {shown(wanted_slots)} but dsc_gpus chooses {len(ids)} "
                     f"GPUs. Fix: leave dsc_slots at auto with dsc_gpus.")
    return ids, len(ids)


def interface_for(addr, interfaces):
    """The interface holding the address (loopback for 127.x where none is reported: gVisor)."""
    holding = sorted(n for n, addrs in interfaces.items() if addr in (addrs or []))
    if holding:
        return holding[0]
    return "lo" if addr.startswith("127.") else ""


def _env_paths(s, install_root):
    manager = s["dsc_env_manager"]
    prefix = {"venv": f"{install_root}/env",
              "conda": f"{install_root}/miniconda/envs/{s['dsc_conda_env_name']}",
              "existing": posixpath.dirname(posixpath.dirname(str(s["dsc_existing_python"] or "")))
              }.get(manager, "")
    python = str(s["dsc_existing_python"]) if manager == "existing" else f"{prefix}/bin/python"
    return prefix, python


def batch(micro, accum, total, world):
    """train_batch = micro x accum x world: derive what is missing (0 = not given), check the rest."""
    try:
        if not all(_is_int(v) for v in (micro or 0, accum or 0, total or 0, world)):
            raise ValueError("not a whole number")
        micro, accum, total, world = int(micro or 0), int(accum or 0), int(total or 0), int(world)
    except (TypeError, ValueError):
        return {"error": f"batch settings must be whole numbers (dsc_micro_batch={micro!r}, "
                         f"dsc_grad_accum={accum!r}, dsc_train_batch={total!r}). Fix: numbers, "
                         f"0 for 'derive it'."}
    where = (f"(dsc_micro_batch={micro}, dsc_grad_accum={accum}, dsc_train_batch={total}, "
             f"world size {world}; 0 means not given)")
    if world <= 0:
        return {"error": f"world size is {world}: no slots in the cluster"}
    if micro < 0 or accum < 0 or total < 0:
        return {"error": f"batch settings cannot be negative {where}. Fix: positive numbers, or 0 "
                         f"to derive one."}
    if micro and accum and total:
        if micro * accum * world != total:
            return {"error": f"batch settings disagree: {micro} x {accum} x {world} = "
                             f"{micro * accum * world}, not {total} {where}. Fix: give any two."}
    elif micro and total:
        accum, rem = divmod(total, micro * world)
        if rem or not accum:
            return {"error": f"dsc_train_batch {total} is not a multiple of micro-batch x world "
                             f"size = {micro * world} {where}. Fix: a multiple of it."}
    elif accum and total:
        micro, rem = divmod(total, accum * world)
        if rem or not micro:
            return {"error": f"dsc_train_batch {total} is not a multiple of grad-accum x world "
                             f"size = {accum * world} {where}. Fix: a multiple of it."}
    elif micro:
        accum = accum or 1
    else:
        return {"error": f"no micro-batch {where}. Fix: set dsc_micro_batch to a positive number "
                         f"(and optionally one of dsc_grad_accum, dsc_train_batch)."}
    return {"micro_batch": micro, "grad_accum": accum, "train_batch": micro * accum * world}


def presets(templates_dir):
    """{name: ds_config fragment}: every templates/ds_config/<name>.json but the base."""
    folder = Path(templates_dir) / "ds_config"
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))
            if not p.stem.startswith("_")}


def merge(base, top):
    """Deep merge: mappings merge key by key, anything else in `top` replaces."""
    out = copy.deepcopy(base)
    for key, value in (top or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def precision(accelerator, compute_caps):
    """bf16 from compute capability 8.0 (Ampere) up, fp16 with loss scaling below, fp32 on CPU."""
    if accelerator == "cpu":
        return {"bf16": {"enabled": False}, "fp16": {"enabled": False}}
    if min((float(c) for c in compute_caps), default=0.0) >= 8.0:
        return {"bf16": {"enabled": True}, "fp16": {"enabled": False}}
    return {"bf16": {"enabled": False}, "fp16": dict(FP16)}


def ds_config(templates_dir, preset, accelerator, compute_caps, sizes, overrides):
    base = json.loads((Path(templates_dir) / "ds_config" / "_base.json").read_text())
    cfg = merge(merge(base, presets(templates_dir)[preset]), precision(accelerator, compute_caps))
    cfg = merge(cfg, {"train_micro_batch_size_per_gpu": sizes["micro_batch"],
                      "gradient_accumulation_steps": sizes["grad_accum"],
                      "train_batch_size": sizes["train_batch"]})
    return merge(cfg, overrides)


def _checked_batch(cfg, world, problems, where):
    """Batch arithmetic where the config gives numbers ("auto" values are left to HF)."""
    micro, accum, total = (cfg.get(k) for k in BATCH_KEYS)
    nums = [v for v in (micro, accum, total) if isinstance(v, int) and not isinstance(v, bool)]
    if len(nums) == 3 and micro * accum * world != total:
        problems.add(f"{where}: train_batch_size {total} is not train_micro_batch_size_per_gpu "
                     f"{micro} x gradient_accumulation_steps {accum} x world size {world} = "
                     f"{micro * accum * world}. Fix: give two of them (or 'auto' for HF scripts).")


def compose_config(mode, templates_dir, preset, explicit, accelerator, caps, sizes, overrides,
                   user_config, world, problems):
    """The run's ds_config for a config mode, or None (mode none):
    preset  the preset file + precision by hardware + the batch + overrides (the toolkit's own);
    file    the user's ds_config as the base; a preset given explicitly (-e preset=...), batch
            settings given explicitly and the overrides merged on top;
    hf      like file (or the preset when no file is given) with HF's "auto" values kept: the
            Trainer fills in batch, clipping, precision and its own optimizer;
    none    the script configures DeepSpeed itself."""
    if mode == "none":
        return None
    if mode == "preset":
        return ds_config(templates_dir, preset, accelerator, caps, sizes, overrides)
    if user_config is None:  # hf without a file of the user's
        base = json.loads((Path(templates_dir) / "ds_config" / "_base.json").read_text())
        base.pop("optimizer", None)
        cfg = merge(merge(base, presets(templates_dir)[preset]), HF_AUTO)
        if cfg.get("zero_optimization", {}).get("stage") == 3:  # HF's and accelerate's save_model
            cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    else:
        cfg = copy.deepcopy(user_config)
        if "preset" in explicit:
            cfg = merge(cfg, presets(templates_dir)[preset])
    given = ("dsc_micro_batch", "dsc_grad_accum", "dsc_train_batch")
    if any(k in explicit for k in given) and "error" not in sizes:
        cfg = merge(cfg, {"train_micro_batch_size_per_gpu": sizes["micro_batch"],
                          "gradient_accumulation_steps": sizes["grad_accum"],
                          "train_batch_size": sizes["train_batch"]})
    cfg = merge(cfg, overrides)
    _checked_batch(cfg, world, problems, "dsc_ds_config_file" if user_config is not None else "ds_config")
    return cfg


def read_user_config(path, problems):
    """The user's ds_config.json on the control node, or None with a problem."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as e:
        problems.add(f"dsc_ds_config_file is {path!r}: {e.strerror}. Fix: the path of your "
                     f"ds_config.json on the control node.")
        return None
    except ValueError as e:
        problems.add(f"dsc_ds_config_file {path!r} is not JSON ({e}). Fix: a DeepSpeed config "
                     f"as JSON (DeepSpeed's own format, not HJSON or YAML).")
        return None
    if not isinstance(cfg, dict):
        problems.add(f"dsc_ds_config_file {path!r} holds a {type(cfg).__name__}, not a JSON "
                     f"object. Fix: a DeepSpeed config such as {{\"zero_optimization\": ...}}.")
        return None
    return cfg


def parse_hostfile(text):
    """Parse a hostfile exactly as deepspeed.launcher.runner.fetch_hostfile does; raise on error."""
    hosts = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = HOSTFILE_LINE.match(line)
        if not m:
            raise ValueError(f"Hostfile contains a bad entry: {line}")
        host, slots = m.group(1), int(m.group(2))
        if host in (h for h, _ in hosts):
            raise ValueError(f"Hostfile contains multiple entries for {host}")
        hosts.append((host, slots))
    if not hosts:
        raise ValueError("Hostfile is empty or not formatted correctly")
    return hosts


def parse_ds_env(text):
    """Parse .deepspeed_env as DeepSpeed's runner does (split on the first '='); raise on lines
    it would crash on or mangle."""
    env = {}
    lines = text.split("\n")
    for n, line in enumerate(lines, 1):
        if line == "" and n == len(lines):
            continue  # the final newline
        if "=" not in line:
            raise ValueError(f".deepspeed_env line {n} has no '=' (blank or comment lines crash "
                             f"the launcher): {line!r}")
        key, val = line.split("=", 1)
        if not ENV_NAME.fullmatch(key):
            raise ValueError(f".deepspeed_env line {n}: {key!r} is not a plain variable name")
        env[key] = val
    return env


def render(templates_dir, name, **values):
    """Render templates/<name> (the files users may edit) with Jinja2, as Ansible would."""
    import jinja2  # the control node has it (Ansible needs it); nodes never import this module
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir)),
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             keep_trailing_newline=True)
    return env.get_template(name).render(**values)


def _run_sections(config, run_dir, tensorboard):
    """What the toolkit adds to a run's ds_config, whatever its mode: DeepSpeed's csv monitor
    (lr, samples) unless the config has a monitor of its own, TensorBoard when asked (event files
    in the run directory, fetched by logs.yml), and node-local checkpoint storage unless the config
    says otherwise (run directories are per node: each node's local rank 0 saves the shared
    state; a shared filesystem sets it false in its own config)."""
    if not any(k in config for k in MONITORS):
        config["csv_monitor"] = {"enabled": True, "output_path": f"{run_dir}/monitor/", "job_name": "ds"}
    if tensorboard:
        config["tensorboard"] = {"enabled": True, "output_path": f"{run_dir}/tensorboard/", "job_name": "ds"}
    if "use_node_local_storage" not in config.get("checkpoint", {}):
        config["checkpoint"] = dict(config.get("checkpoint", {}), use_node_local_storage=True)


def _run_options(options, defaults, runs_seen):
    """The run options: given ones, else the resumed run's launch spec, else the defaults."""
    opt = {k: options.get(k, defaults.get(k)) for k in RUN_OPTIONS}
    opt = {k: (defaults.get(k) if v is None else v) for k, v in opt.items()}
    if as_bool(opt["resume"]):  # the run's own launch spec: the same entry, arguments, preset and
        # batch, except what this command gives explicitly (-e), e.g. more steps; never what
        # only a launch applies (its files keep the run's own: _refused_on_resume)
        wanted = str(opt["run_id"] or "") or (runs_seen[0]["id"] if runs_seen else "")
        spec = next((r.get("launch") for r in runs_seen if r["id"] == wanted), None) or {}
        opt.update({k: v for k, v in spec.items()
                    if k in LAUNCH_SPEC and (k not in options or k in LAUNCH_ONLY)})
    return opt


def _refused_on_resume(extra_vars, opt, run_id, problems):
    """On resume: the -e options only a launch applies (LAUNCH_ONLY; dsc_code_dir where the run's
    code was copied into it) are refused, naming them: the resume would ignore them."""
    given = [k for k in LAUNCH_ONLY if k in extra_vars]
    if "dsc_code_dir" in extra_vars and not as_bool(opt["dsc_code_shared"]):
        given.append("dsc_code_dir")
    if given:
        one = len(given) == 1
        problems.add(f"{', '.join(given)} given with -e on resume: a resume keeps the files and code "
                     f"run {run_id!r} was launched with (ds_config.json, train.json, .deepspeed_env, "
                     f"memory.json, code/), so {'it' if one else 'they'} would be ignored. Fix: launch a "
                     f"new run with {'this option' if one else 'these options'} (launch.yml), or resume "
                     f"without {'it' if one else 'them'}.")


def _run_id(opt, preset, plan, runs_seen, now, problems):
    """The run id: given, else (resume) the newest run, else <preset>-<UTC time>; checked."""
    run_id = str(opt["run_id"] or "")
    if not run_id and as_bool(opt["resume"]):
        run_id = runs_seen[0]["id"] if runs_seen else ""
        if not run_id:
            problems.add(f"run_id: no run to resume under {plan['run_root']} on "
                         f"{plan['master']}. Fix: pass -e run_id=ID of an earlier run.")
    if not run_id:
        run_id = f"{preset}-{now}"
    if not RUN_ID.fullmatch(run_id) or run_id in (".", ".."):
        problems.add(f"run_id is {run_id!r}. Fix: 1-64 letters, digits, '.', '_' and '-', "
                     f"starting with a letter or digit (it names a directory on every node).")
    return run_id


def _arguments(value, var, example, problems, also=None):
    """A list of command-line arguments in the charset DeepSpeed's pdsh runner passes safely
    (`also`: a pattern of further arguments allowed, resolved by the node helper)."""
    if not isinstance(value, list):
        problems.add(f"{var} is {value!r}. Fix: a list of arguments, e.g. {example}.")
        return []
    for arg in value:
        if not DS_ENV_SAFE.fullmatch(str(arg)) and not (also and also.fullmatch(str(arg))):
            problems.add(f"{var} holds {str(arg)!r}. Fix: letters, digits and '@%+=:,./-_' only "
                         f"(the pdsh launcher passes arguments through a shell on every node).")
    return [str(a) for a in value]


def _launcher_args(value, problems):
    """dsc_launcher_args: the DeepSpeed launcher options a run may add (LAUNCHER_OPTIONS)."""
    args = _arguments(value, "dsc_launcher_args", "['--bind_cores_to_rank']", problems)
    i = 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name not in LAUNCHER_OPTIONS:
            problems.add(f"dsc_launcher_args holds {args[i]!r}. Fix: one of "
                         f"{', '.join(LAUNCHER_OPTIONS)}; the hostfile, GPUs, ports and nodes "
                         f"come from the inventory.")
        elif LAUNCHER_OPTIONS[name] and "=" not in args[i]:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                problems.add(f"dsc_launcher_args: {name} needs a value. Fix: {name} VALUE.")
            i += 1
        i += 1
    return args


def _entry(opt, paths, problems):
    """What the launcher starts: a module or a script inside the code directory, its arguments."""
    module, script = str(opt["dsc_entry_module"] or ""), str(opt["dsc_entry_script"] or "")
    if script and (posixpath.isabs(script) or ".." in script.split("/")
                   or not re.fullmatch(r"[A-Za-z0-9._/-]+", script)):
        problems.add(f"dsc_entry_script is {script!r}. Fix: a path relative to dsc_code_dir, "
                     f"e.g. train.py or scripts/train.py.")
    if not script and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", module):
        problems.add(f"dsc_entry_module is {module!r}. Fix: a Python module name such as "
                     f"train.run, or set dsc_entry_script.")
    shared = as_bool(opt["dsc_code_shared"])
    code_dir = str(opt["dsc_code_dir"] or "") or str(Path(paths["repo"]) / "train")
    if shared:
        _abs_path(problems, "dsc_code_dir", code_dir, "/shared/code", "(dsc_code_shared)",
                  "every rank runs the code in it, from it")
    elif not os.path.isdir(code_dir):
        problems.add(f"dsc_code_dir is {code_dir!r}, which is not a directory on the control "
                     f"node. Fix: the directory that holds your training code.")
    elif script and not os.path.isfile(os.path.join(code_dir, script)):
        problems.add(f"dsc_entry_script is {script!r}, which is not in dsc_code_dir "
                     f"({code_dir}). Fix: a path relative to that directory.")
    return {"module": module, "script": script, "code_dir": code_dir, "shared": shared,
            "launcher_args": _launcher_args(opt["dsc_launcher_args"], problems),
            "args": _arguments(opt["dsc_entry_args"], "dsc_entry_args", "['--set', 'steps=100']", problems),
            "resume_args": _arguments(opt["dsc_resume_args"], "dsc_resume_args",
                                      "['--resume'], ['--resume_from_checkpoint', "
                                      "'{latest:out/checkpoint-*}'], or [] for a script that resumes "
                                      "from its own output dir", problems, LATEST)}


def _config_choice(opt, problems):
    """(mode, how the file reaches the script, the user's ds_config or None)."""
    mode = str(opt["dsc_ds_config_mode"])
    if mode not in CONFIG_MODES:
        problems.add(f"dsc_ds_config_mode is {mode!r}. Fix: one of {', '.join(CONFIG_MODES)} "
                     f"(preset: the toolkit's; file: your ds_config.json; hf: HF Trainer or "
                     f"accelerate, 'auto' values kept; none: the script configures DeepSpeed).")
        mode = "preset"
    config_arg = str(opt["dsc_ds_config_arg"] or "") or CONFIG_ARGS[mode]
    if config_arg not in ("--deepspeed_config", "--deepspeed", "env", "none", ""):
        problems.add(f"dsc_ds_config_arg is {config_arg!r}. Fix: --deepspeed_config "
                     f"(DeepSpeed-style scripts), --deepspeed (HF Trainer), env (accelerate: "
                     f"ACCELERATE_DEEPSPEED_CONFIG_FILE) or none.")
    config_arg = "" if config_arg == "none" or mode == "none" else config_arg
    user_file, user_config = str(opt["dsc_ds_config_file"] or ""), None
    if mode == "file" and not user_file:
        problems.add("dsc_ds_config_file is empty but dsc_ds_config_mode is 'file'. Fix: the path "
                     "of your ds_config.json on the control node.")
    elif mode in ("file", "hf") and user_file:
        user_config = read_user_config(user_file, problems)
    return mode, config_arg, user_config


def _refused_starts(opt, run_id, plan, runs_seen, refuse_active, problems):
    """An active run (unless replace), a resume of an unknown run, a new run in a used directory."""
    seen = {r["id"]: r for r in runs_seen}
    active = [r["id"] for r in runs_seen if r.get("active")]
    for node in plan.get("nodes") or []:
        if run_id in node.get("run_root_links", ()):
            problems.add(f"run_id {run_id!r}: {plan['run_root']}/{run_id} on {node['name']} is a "
                         f"symbolic link, not a run directory (a run's files would be written "
                         f"wherever it points). Fix: remove the link (check who planted it), or "
                         f"launch with another run_id.")
    if refuse_active and active and active[0] != run_id and not as_bool(opt["replace"]) \
            and not as_bool(opt["dry_run"]):
        problems.add(f"run {active[0]} is active on {plan['master']}. Fix: stop it "
                     f"(ansible-playbook stop.yml -e run_id={active[0]}), or launch with "
                     f"-e replace=true to stop and replace it.")
    if as_bool(opt["resume"]) and run_id not in seen and run_id:
        problems.add(f"run_id {run_id!r}: no such run under {plan['run_root']} on "
                     f"{plan['master']} to resume. Fix: the id of an earlier run "
                     f"({', '.join(list(seen)[:5]) or 'none there'}).")
    elif as_bool(opt["resume"]) and seen.get(run_id, {}).get("active"):
        problems.add(f"run_id {run_id!r} is still running on {plan['master']}: resuming it would "
                     f"start a second copy. Fix: follow it (status.yml -e run_id={run_id} "
                     f"-e follow=true), or stop it first (stop.yml -e run_id={run_id}).")
    elif as_bool(opt["resume"]) and seen.get(run_id, {}).get("finished") and not as_bool(opt["force"]):
        problems.add(f"run_id {run_id!r} finished on {plan['master']}; resuming it would train "
                     f"past its end and rewrite its summary. Fix: add -e force=true, with more "
                     f"steps than it ran, or launch a new run.")
    elif not as_bool(opt["resume"]) and seen.get(run_id, {}).get("started"):
        problems.add(f"run_id {run_id!r}: {plan['run_root']}/{run_id} already holds a run (its "
                     f"metrics and checkpoints would mix with a new run's). Fix: resume it "
                     f"(ansible-playbook resume.yml -e run_id={run_id}) or launch with another "
                     f"run_id.")


def secrets_path(run_root, run_id):
    """Where the node helper keeps a run's secrets (dscnode.rundir.secrets_file): beside the run."""
    return f"{run_root}/{SECRETS_DIR}/{run_id}.json"


def _resume_secrets(run_id, plan, runs_seen, problems):
    """On resume: whether the ranks load the run's secrets (DSC_SECRETS). Given again
    (dsc_secrets), they are written anew and must name every secret the run was launched with;
    not given, the run's own file (0600, beside it) is used, on every node, or resume refuses,
    naming the secrets: ranks never start without them silently."""
    run = next((r for r in runs_seen if r["id"] == run_id), None)
    if run is None or "nodes" not in plan:
        return False
    recorded = sorted(map(str, (run.get("launch") or {}).get("secret_names") or []))
    given = plan.get("secret_names") or []
    if given:
        missing = [n for n in recorded if n not in given]
        if missing:
            problems.add(f"dsc_secrets: run {run_id!r} was launched with {', '.join(recorded)}; this "
                         f"resume gives {', '.join(given)} and leaves out {', '.join(missing)}, "
                         f"which its ranks would start without. Fix: give every one of them (the "
                         f"resume writes the run's secrets anew), or none: the run's own are used.")
        return True
    having = [n["name"] for n in plan["nodes"] if run_id in n.get("runs_with_secrets", ())]
    if not recorded and not having:
        return False
    lacking = [n["name"] for n in plan["nodes"] if n["reachable"] and n["name"] not in having]
    if lacking:
        names = ", ".join(recorded) or "secrets"
        problems.add(f"dsc_secrets: run {run_id!r} was launched with {names}, and its secrets file "
                     f"({secrets_path(plan['run_root'], run_id)}) is gone on {', '.join(lacking)}: "
                     f"its ranks would start without {'them' if recorded else 'theirs'}. Fix: give "
                     f"dsc_secrets again ({names}: the vault file, or -e @file); the resume "
                     f"writes them anew on every node.")
    return True


def _rendered(paths, plan, env, problems):
    """The hostfile and .deepspeed_env from templates/, checked with DeepSpeed's own parsing."""
    hostfile = render(paths["templates"], "hostfile.j2", nodes=plan["nodes"])
    env_text = render(paths["templates"], "deepspeed_env.j2", env=env)
    try:
        if len(parse_hostfile(hostfile)) != plan["num_nodes"]:
            problems.add("templates/hostfile.j2 renders a node count other than the cluster's. "
                         "Fix: one line per node in dsc_plan.nodes.")
        if parse_ds_env(env_text) != {k: str(v) for k, v in env.items() if str(v) != ""}:
            problems.add("templates/deepspeed_env.j2 renders another environment than the plan's. "
                         "Fix: one KEY=VALUE line per variable, nothing else.")
    except ValueError as e:
        problems.add(f"a rendered template breaks DeepSpeed's parser: {e}. Fix: restore "
                     f"templates/hostfile.j2 or templates/deepspeed_env.j2.")
    return hostfile, env_text


def _commands(plan, s, run_dir, entry, config_arg, resume):
    """{node: the DeepSpeed launcher's argv}: the master alone (pdsh), or every node (no_ssh).
    Each rank runs the node helper's entry shim (secrets, progress), which runs the user's
    script or module in the same process."""
    launcher = [posixpath.dirname(plan["python"]) + "/deepspeed",
                "--hostfile", f"{run_dir}/hostfile", "--master_addr", plan["master_addr"]]
    if len(plan["ssh_ports"]) == 1 and plan["ssh_ports"][0] != 22:
        launcher += ["--ssh_port", str(plan["ssh_ports"][0])]
    if plan["num_nodes"] == 1:
        launcher += ["--no_ssh_check"]
    if any(n["gpu_ids"] for n in plan["nodes"]):  # DeepSpeed's NAME:SLOT[,SLOT]@NAME...
        launcher += ["--include", "@".join(
            f"{n['name']}:{','.join(map(str, n['gpu_ids'] or range(n['slots'])))}" for n in plan["nodes"])]
    launcher += entry["launcher_args"]
    train_run = entry["module"] == "train.run" and not entry["script"]
    program = [plan["helper"], "entry"] \
        + (["--script", entry["script"]] if entry["script"] else ["--module", entry["module"]]) \
        + ([config_arg, f"{run_dir}/ds_config.json"] if config_arg.startswith("--") else []) \
        + (["--config", f"{run_dir}/train.json"] if train_run else []) \
        + entry["args"] + (entry["resume_args"] if resume else [])
    if s["dsc_launch_mode"] == "no_ssh":
        return {n["name"]: launcher + ["--no_ssh", "--node_rank", str(n["rank"])] + program
                for n in plan["nodes"]}
    return {plan["master"]: launcher + program}


# preset=auto: the candidates, fastest first at one micro-batch (measured on H200s: zero1 and
# zero2 within a few per cent, zero3 slower on two GPUs; offload about 3x slower, the last resort),
# the micro-batches tried (largest first: throughput grew with it), and the room a prediction of
# max_memory_allocated needs (docs/memory.md: reserved ran up to 1.29x allocated; the CUDA context
# and NCCL's buffers are outside the allocator).
AUTO_PRESETS = ("zero1", "zero2", "zero3")
# Offload, faster first. On one GPU ZeRO-3's layer-by-layer parameter prefetch hides the
# host-to-device copies that ZeRO-2 makes of every updated parameter after the CPU step (8.47 B
# model, one H200, micro-batch 8: 5,473 against 5,025 tokens/s; docs/benchmarks.md). With more
# ranks ZeRO-3 adds a parameter all-gather per layer on every pass, so ZeRO-2 goes first there.
AUTO_OFFLOAD = {"one_gpu": ("zero3-offload", "zero2-offload"), "more": ("zero2-offload", "zero3-offload")}
AUTO_MICRO_BATCHES = (32, 16, 8, 4, 2, 1)
AUTO_FACTOR, AUTO_RESERVE_MIB = 1.3, 1536
MODEL_SHAPE_KEYS = ("layers", "hidden", "heads", "vocab", "seq_len")
# What else dsc_model_shape takes (-> a check: the value or None when refused).
MODEL_SHAPE_OPTIONS = ("activation_checkpointing", "attention", "dropout", "attention_dropout", "logits",
                       "tied", "intermediate", "gated", "params", "activation", "config")
LOGITS = ("fp32", "bf16", "fp16")


def _shape_value(key, value):
    """A dsc_model_shape value as the prediction takes it, or None when it is not one."""
    if key in MODEL_SHAPE_KEYS + ("intermediate", "params"):
        return int(value) if _is_int(value) and int(value) > 0 else None
    if key in ("activation_checkpointing", "tied", "gated"):
        return value if isinstance(value, bool) else None
    if key in ("dropout", "attention_dropout"):  # a probability, or true/false
        if isinstance(value, bool):
            return value
        return float(value) > 0 if isinstance(value, (int, float)) and 0 <= value < 1 else None
    if key == "attention":
        import dsc_memory
        return dsc_memory.ATTENTION_KINDS.get(str(value))
    if key == "logits":
        return str(value) if str(value) in LOGITS else None
    if key == "activation":  # transformers' ACT2FN name, as an HF config's activation_function
        import dsc_memory
        return str(value) if str(value) in dsc_memory.ACTIVATIONS else None
    if key == "config":
        return str(value) if isinstance(value, str) and value and "\n" not in value else None
    return None


def _hf_config(given, entry, s, problems):
    """(an HF config.json's dict, its path) for a user's model: dsc_model_shape.config (relative
    to dsc_code_dir or dsc_data_dir, or absolute), else config.json at the top of dsc_code_dir,
    then of dsc_data_dir (control-node paths); ({}, None) where there is none."""
    data_dir = str(s.get("dsc_data_dir") or "") if s else ""
    roots = [d for d in (entry["code_dir"], data_dir) if d and os.path.isdir(d)]
    named = given.get("config") if isinstance(given, dict) else None
    if named:
        places = [named] if os.path.isabs(named) else [os.path.join(d, named) for d in roots]
        found = next((p for p in places if os.path.isfile(p)), None)
        if not found:
            problems.add(f"dsc_model_shape.config is {named!r}, which is not a file in dsc_code_dir or "
                         f"dsc_data_dir on the control node. Fix: the path of your model's config.json.")
            return {}, None
    else:
        found = next((p for p in (os.path.join(d, "config.json") for d in roots) if os.path.isfile(p)), None)
        if not found:
            return {}, None
    try:
        cfg = json.loads(Path(found).read_text())
    except (OSError, ValueError) as e:
        if named:
            problems.add(f"dsc_model_shape.config {found} cannot be read as JSON: {e}. Fix: the "
                         f"model's config.json (transformers' save_pretrained writes one).")
        return {}, None
    # Only a transformers config counts (another program's config.json says nothing of a model).
    import dsc_memory
    if not isinstance(cfg, dict) or not any(k in cfg for keys in dsc_memory.HF_KEYS.values() for k in keys):
        if named:
            problems.add(f"dsc_model_shape.config {found} names no model size (n_layer or "
                         f"num_hidden_layers, ...). Fix: the model's config.json from transformers.")
        return {}, None
    return cfg, found


def _model_shape(opt, entry, problems, s=None):
    """What preset=auto (and the run's predicted peak) knows of the model: {shape, checkpointing,
    attention, dropout, attention_dropout, logits_fp32, assumed: [what was assumed, in words],
    source}; train.run's from dsc_train_config, a script's from dsc_model_shape over its HF
    config.json (dsc_code_dir or dsc_data_dir); None (with a problem) where neither tells it."""
    import dsc_memory
    given = opt.get("dsc_model_shape") or {}
    if not entry["script"] and entry["module"] == "train.run" and not given:
        try:
            shape, ckpt = dsc_memory.train_shape(opt["dsc_train_config"] or {})
        except (ValueError, TypeError) as e:
            problems.add(f"preset=auto: dsc_train_config gives no model: {e}. Fix: train/config.py's keys.")
            return None
        # train/model.py: scaled_dot_product_attention, no dropout, logits cast to fp32
        return {"shape": shape, "checkpointing": ckpt, "attention": "sdpa", "dropout": False,
                "attention_dropout": False, "logits_fp32": True, "assumed": [], "source": "dsc_train_config"}
    fix = ("-e '{\"dsc_model_shape\": {\"layers\": 24, \"hidden\": 2048, \"heads\": 16, "
           "\"vocab\": 50304, \"seq_len\": 2048, \"attention\": \"sdpa\", \"dropout\": 0}}' (yours)")
    if not isinstance(given, dict):
        problems.add(f"dsc_model_shape is {given!r}. Fix: a mapping, e.g. {fix}.")
        return None
    unknown = sorted(set(map(str, given)) - set(MODEL_SHAPE_KEYS + MODEL_SHAPE_OPTIONS))
    bad = sorted(k for k in set(given) - set(unknown) if _shape_value(k, given[k]) is None)
    if unknown or bad:
        problems.add(f"dsc_model_shape is {given!r}: " + "; ".join(
            ([f"unknown keys {unknown}"] if unknown else []) + ([f"bad values for {bad}"] if bad else []))
            + f". Fix: {', '.join(MODEL_SHAPE_KEYS)} (positive whole numbers), and optionally "
            f"attention ({' | '.join(dsc_memory.ATTENTION_KINDS)}), dropout and attention_dropout "
            f"(a probability or true/false), logits ({' | '.join(LOGITS)}), tied, gated and "
            f"activation_checkpointing (true/false), intermediate and params (whole numbers), activation "
            f"(the MLP's, as an HF config's activation_function: "
            f"{' | '.join(sorted(dsc_memory.ACTIVATIONS))}), config (the path of an HF config.json).")
        return None
    cfg, cfg_path = _hf_config(given, entry, s, problems)
    values, assumed = dsc_memory.hf_config_shape(cfg) if cfg else ({}, [])
    values.update({k: _shape_value(k, v) for k, v in given.items() if k != "config"})
    if "dropout" in given and "attention_dropout" not in given:  # dropout: all of it, unless said apart
        values["attention_dropout"] = values["dropout"]
    missing = [k for k in MODEL_SHAPE_KEYS if k not in values]
    if missing:
        told = " or ".join(["dsc_model_shape"] * bool(given) + [cfg_path] * bool(cfg_path))
        problems.add(f"preset=auto for {entry['script'] or entry['module']} needs the model's shape"
                     + (f" ({told} gives no {', '.join(missing)})" if told else "")
                     + f". Fix: {fix}, an HF config.json in dsc_code_dir or dsc_data_dir, or a preset.")
        return None
    # What neither said: the larger assumption, said in words (a wrong guess is safe, not an
    # out-of-memory error).
    if "attention" not in values:
        values["attention"] = "eager"
        assumed.append("attention eager (" + ("config.json names no attn_implementation; "
                       "transformers runs eager where a model is built without one" if cfg_path
                       else "not given") + "); give dsc_model_shape.attention: sdpa where yours runs "
                       "scaled_dot_product_attention or flash")
    if "dropout" not in values:
        values["dropout"] = True
        assumed.append("dropout on (its masks counted); give dsc_model_shape.dropout: 0 "
                       "where your model has none")
    if "attention_dropout" not in values:
        values["attention_dropout"] = values["dropout"]
    if "logits" not in values:
        values["logits"] = "fp32"
        assumed.append("logits fp32 in the loss (the larger); give dsc_model_shape.logits: "
                       "bf16 where your loss takes 16-bit logits")
    if "activation" not in values:
        values["activation"] = dsc_memory.ASSUMED_ACTIVATION
        assumed.append(f"activation {dsc_memory.ASSUMED_ACTIVATION} (" + (
                       "config.json names no activation_function or hidden_act" if cfg_path else "not given")
                       + f"; GPT2Config's default, composed of tensor ops that keep "
                       f"{dsc_memory.ACTIVATIONS[dsc_memory.ASSUMED_ACTIVATION]} tensors of the MLP's width "
                       f"for backward where a fused GELU keeps 2); give dsc_model_shape.activation: gelu "
                       f"(or yours: silu, gelu_pytorch_tanh, ...) where your MLP runs a fused one")
    if "tied" not in values:
        values["tied"] = False
        assumed.append("untied embeddings: an output layer of its own (the larger); give "
                       "dsc_model_shape.tied: true where it shares the embedding's weight")
    shape = dsc_memory.model_shape(
        *(values[k] for k in MODEL_SHAPE_KEYS), tied=values["tied"], params=values.get("params"),
        intermediate=values.get("intermediate"), gated=bool(values.get("gated")),
        positions=values.get("positions", True), activation=values["activation"])
    return {"shape": shape, "checkpointing": bool(values.get("activation_checkpointing", False)),
            "attention": values["attention"], "dropout": bool(values["dropout"]),
            "attention_dropout": bool(values["attention_dropout"]),
            "logits_fp32": values["logits"] == "fp32", "assumed": assumed,
            "source": "dsc_model_shape" + (f" over {cfg_path}" if cfg_path else "") if given else cfg_path}


def code_fingerprint(code_dir):
    """sha256 of the code directory's files (names and contents, what code_archive packs): the
    same code reads the same, whenever and wherever it was packed; "" where it is not here."""
    digest = hashlib.sha256()
    if not os.path.isdir(code_dir):
        return ""
    for dirpath, dirnames, filenames in os.walk(code_dir):
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", ".git", ".ipynb_checkpoints"))
        for name in sorted(f for f in filenames if not f.endswith(".pyc")):
            path = os.path.join(dirpath, name)
            try:
                data = Path(path).read_bytes() if not os.path.islink(path) else os.readlink(path).encode()
            except OSError:
                continue
            digest.update(os.path.relpath(path, code_dir).encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


def model_key(entry, model):
    """What makes two runs' measured peaks comparable: the same code, entry point and model inputs
    (a corrected dsc_model_shape makes a new key: its earlier error is not applied twice)."""
    inputs = {k: model[k] for k in ("shape", "checkpointing", "attention", "dropout", "attention_dropout",
                                    "logits_fp32")}
    text = json.dumps({"code": code_fingerprint(entry["code_dir"]) or entry["code_dir"],
                       "entry": entry["script"] or entry["module"], "model": inputs}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# A measured peak more than this over the prediction is recorded as such, and a later preset=auto
# of the same code and model scales its predictions by it.
MEASURED_TOLERANCE = 1.05


def _earlier_measured(plan, key):
    """The largest measured-over-predicted ratio (above MEASURED_TOLERANCE) of earlier runs of the
    same key on any node, and those runs' records ({preset, micro_batch, world, measured, ...})."""
    records = [dict(m, node=n["name"]) for n in plan["nodes"] for m in n.get("memory_records") or []
               if m.get("key") == key and m.get("ratio")]
    worst = max((m["ratio"] for m in records), default=1.0)
    return (worst if worst > MEASURED_TOLERANCE else 1.0), records


def predicted_peak(model, config, micro_batch, plan, bits):
    import dsc_memory
    per_node = max(n["slots"] for n in plan["nodes"])
    return dsc_memory.predict(model["shape"], config, micro_batch, plan["world_size"], per_node, precision=bits,
                              attention=model["attention"], activation_checkpointing=model["checkpointing"],
                              dropout=model["dropout"], attention_dropout=model["attention_dropout"],
                              logits_fp32=model["logits_fp32"])["total"]


def step_down_ladder(candidates, chosen, room_mib):
    """The configurations an out-of-memory error in the first steps steps down to, in auto's own
    order after the chosen one: each the next candidate predicted to fit even when the prediction
    is as far off as the failed one's must have been (its peak passed the memory, room_mib: the
    next must be predicted under (room - reserve) / factor x failed / room)."""
    ladder, last = [chosen], chosen
    for c in candidates[candidates.index(chosen) + 1:]:
        if c["use"] <= last["use"] * (room_mib - AUTO_RESERVE_MIB) / AUTO_FACTOR / room_mib:
            ladder.append(c)
            last = c
    return ladder


def _auto_preset(plan, opt, options, paths, entry, problems, s=None):
    """preset=auto: the first candidate (AUTO_PRESETS at each micro-batch, largest first, then the
    offload presets in AUTO_OFFLOAD's order for the world size) whose predicted peak per GPU
    (train/memory.py; scaled by an earlier run's measured ratio of the same code and model) x
    AUTO_FACTOR + AUTO_RESERVE fits the smallest GPU of the cluster (or dsc_auto_memory_gib); (preset,
    micro-batch, the reason as lines, the step-down ladder, the model and its key), or Nones."""
    none = None, None, [], [], None
    budget = opt.get("dsc_auto_memory_gib") or 0
    try:
        budget = float(budget)
    except (TypeError, ValueError):
        budget = -1
    if not 0 <= budget < 1e6:
        problems.add(f"dsc_auto_memory_gib is {opt.get('dsc_auto_memory_gib')!r}. Fix: the memory per "
                     f"rank preset=auto plans for, in GiB (e.g. 80), or 0 for the smallest GPU's.")
        return none
    if plan["accelerator"] != "cuda" and not budget:
        problems.add("preset=auto chooses by GPU memory and the cluster has CPU nodes. Fix: name a "
                     "preset (-e preset=zero2), or give the memory per rank it may plan for "
                     "(-e dsc_auto_memory_gib=N: on CPU nodes the ranks share the host's memory).")
        return none
    sizes = [n["gpu_memory_mib"] for n in plan["nodes"]]
    if not budget and not all(sizes):
        problems.add("preset=auto: nvidia-smi did not report the GPUs' memory on every node. Fix: "
                     "name a preset, or give -e dsc_auto_memory_gib=N.")
        return none
    model = _model_shape(opt, entry, problems, s)
    if model is None:
        return none
    if budget:
        smallest, where = budget * 1024, "dsc_auto_memory_gib"
    else:
        smallest = min(sizes)
        where = next(n["name"] for n in plan["nodes"] if n["gpu_memory_mib"] == smallest)
    key = model_key(entry, model)
    ratio, records = _earlier_measured(plan, key)
    fixed = "dsc_micro_batch" in options
    micro_batches = [int(opt["dsc_micro_batch"])] if fixed and _is_int(opt["dsc_micro_batch"]) else AUTO_MICRO_BATCHES
    caps = [c for n in plan["nodes"] for c in n["compute_caps"]]
    dtype = precision(plan["accelerator"], caps)
    bits = "bf16" if dtype["bf16"]["enabled"] else "fp16" if dtype["fp16"]["enabled"] else "fp32"
    overrides = opt["dsc_ds_config_overrides"] if isinstance(opt["dsc_ds_config_overrides"], dict) else {}
    candidates, chosen = [], None
    # On CPU nodes the offload presets would move states into the same memory: not candidates.
    offload = AUTO_OFFLOAD["one_gpu" if plan["world_size"] == 1 else "more"] if plan["accelerator"] == "cuda" else ()
    for group in (AUTO_PRESETS, offload):
        for mb in micro_batches:
            sizes_mb = batch(mb, opt["dsc_grad_accum"] if "dsc_grad_accum" in options else None,
                             opt["dsc_train_batch"] if "dsc_train_batch" in options else None, plan["world_size"])
            if "error" in sizes_mb:
                continue
            for name in group:
                config = ds_config(paths["templates"], name, plan["accelerator"], caps, sizes_mb, overrides)
                need = predicted_peak(model, config, mb, plan, bits)
                same = [m["measured"] for m in records if (m.get("preset"), m.get("micro_batch"), m.get("world"))
                        == (name, mb, plan["world_size"]) and m.get("measured")]
                use = max(same) if same else int(need * ratio)
                want = use / 2**20 * AUTO_FACTOR + AUTO_RESERVE_MIB
                c = {"preset": name, "micro_batch": mb, "batch": sizes_mb, "predicted": int(need), "use": use,
                     "fits": want <= smallest,
                     "line": f"{name} micro-batch {mb}: predicted {need / 2**30:.1f} GiB"
                             + (f", measured {use / 2**30:.1f} GiB" if same else
                                f" x{ratio:.2f} measured = {use / 2**30:.1f} GiB" if ratio > 1 else "")
                             + f", wants {want / 1024:.1f} GiB"}
                candidates.append(c)
                if c["fits"] and chosen is None:
                    chosen = c
    room = f"{where}: {smallest / 1024:.1f} GiB" if budget else f"the smallest GPU ({where}: {smallest / 1024:.1f} GiB)"
    if chosen is None:
        problems.add(f"preset=auto: nothing fits {room}, "
                     f"not even {candidates[-1]['line'] if candidates else 'micro-batch 1'}. Fix: more GPUs, activation "
                     f"checkpointing, a shorter sequence, or a smaller model.")
        return none
    ladder = step_down_ladder(candidates, chosen, smallest)
    tried = [c["line"] for c in candidates[:candidates.index(chosen)]]
    measured = [f"  measured before (run {m['run_id']} on {m['node']}, {m['preset']} micro-batch "
                f"{m['micro_batch']}): {m['measured'] / 2**30:.1f} GiB against the predicted "
                f"{m['predicted'] / 2**30:.1f} GiB (x{m['ratio']:.2f})" for m in records if m["ratio"] > MEASURED_TOLERANCE]
    shown_use = (f"{chosen['use'] / 2**30:.1f} GiB per GPU (predicted {chosen['predicted'] / 2**30:.1f} GiB by "
                 f"train/memory.py, scaled by the measured x{ratio:.2f})" if chosen["use"] != chosen["predicted"]
                 else f"{chosen['predicted'] / 2**30:.1f} GiB per GPU (train/memory.py)")
    want = chosen["use"] / 2**20 * AUTO_FACTOR + AUTO_RESERVE_MIB
    reason = [f"preset=auto chose {chosen['preset']} at micro-batch {chosen['micro_batch']}: predicted peak "
              f"{shown_use}, x{AUTO_FACTOR} + {AUTO_RESERVE_MIB / 1024:.1f} GiB = {want / 1024:.1f} GiB, within "
              f"{room}."] + [f"  no room: {t}" for t in tried[-6:]] + measured + \
             [f"  model ({model['source']}): {model['shape']['layers']} layers, hidden {model['shape']['hidden']}, "
              f"{model['shape']['heads']} heads, vocab {model['shape']['vocab']}, seq_len {model['shape']['seq_len']}, "
              f"attention {model['attention']}, dropout {'on' if model['dropout'] else 'off'}"
              f"{' (attention dropout on)' if model['attention_dropout'] and not model['dropout'] else ''}, "
              f"activation {model['shape'].get('activation', 'gelu')}, "
              f"logits {'fp32' if model['logits_fp32'] else bits}, {'tied' if model['shape']['tied'] else 'untied'} "
              f"embeddings{', activation checkpointing' if model['checkpointing'] else ''}"] + \
             [f"  assumed: {a}" for a in model["assumed"]]
    return chosen["preset"], chosen["micro_batch"], reason, ladder, dict(model, key=key, bits=bits)


def _memory_record(plan, opt, entry, s, config, model, resume):
    """memory.json: the run's predicted peak per GPU (train/memory.py) for its configuration, with
    the key that a later preset=auto of the same code and model looks its measured peak up by;
    None where the model or the batch is not known (a script without a shape, HF's "auto"), on CPU
    nodes, and on resume (the run keeps its own)."""
    if resume or config is None or plan["accelerator"] != "cuda" or plan["world_size"] is None:
        return None
    micro = config.get("train_micro_batch_size_per_gpu")
    if not _is_int(micro) or not _is_int(config.get("gradient_accumulation_steps", 1)):
        return None
    if model is None:
        try:
            model = _model_shape(opt, entry, Problems(), s)  # quietly: a preset needs no shape
        except (ValueError, TypeError, KeyError):
            model = None
        if model is None:
            return None
        dtype = precision(plan["accelerator"], [c for n in plan["nodes"] for c in n["compute_caps"]])
        model = dict(model, key=model_key(entry, model),
                     bits="bf16" if dtype["bf16"]["enabled"] else "fp16" if dtype["fp16"]["enabled"] else "fp32")
    try:
        predicted = predicted_peak(model, config, int(micro), plan, model["bits"])
    except (ValueError, KeyError, TypeError):
        return None
    return {"key": model["key"], "preset": str(opt["preset"]), "micro_batch": int(micro),
            "world": plan["world_size"], "predicted": int(predicted), "tolerance": MEASURED_TOLERANCE,
            "assumed": model["assumed"]}


def _step_down(plan, s, opt, options, paths, mode, ladder, overrides, user_config, run_dir, auto):
    """auto.json for the supervisor: preset=auto's ladder (the chosen configuration first), each
    step with its ds_config, predicted peak and batch; the steps are said in auto's lines. None
    (and said why) where an out-of-memory error cannot step down."""
    if len(ladder) < 2:
        if ladder:
            auto.append("  no step down: nothing below it is predicted to fit when this prediction is "
                        "wrong enough to run out of memory")
        return None
    why = ("dsc_launch_mode no_ssh (each node's launcher runs on its own)" if s["dsc_launch_mode"] == "no_ssh"
           and len(plan["nodes"]) > 1 else
           f"dsc_ds_config_mode {mode} (the script sets its own batch)" if mode not in ("preset", "file") else "")
    if why:
        auto.append(f"  no step down after an out-of-memory error: {why}")
        return None
    caps = [c for n in plan["nodes"] for c in n["compute_caps"]]
    steps = []
    for c in ladder:
        cfg = compose_config(mode, paths["templates"], c["preset"], set(options) | {"dsc_micro_batch"},
                             plan["accelerator"], caps, c["batch"], overrides, user_config,
                             plan["world_size"], Problems())
        if cfg is None:
            return None
        _run_sections(cfg, run_dir, as_bool(opt["dsc_tensorboard"]))
        steps.append({"preset": c["preset"], "micro_batch": c["micro_batch"],
                      "grad_accum": c["batch"]["grad_accum"], "train_batch": c["batch"]["train_batch"],
                      "predicted": c["predicted"], "ds_config": cfg})
    auto.append("  an out-of-memory error in the first steps steps down to: " + ", then ".join(
        f"{c['preset']} micro-batch {c['micro_batch']}" for c in ladder[1:]))
    return {"ladder": steps, "index": 0}


def _run(plan, s, options, defaults, paths, problems, runs_seen, now, refuse_active=True, extra_vars=()):
    """The run's part of the plan: id, directory, ds_config, files and the launcher command.
    `extra_vars`: the names given with -e (a resume refuses the LAUNCH_ONLY ones)."""
    opt = _run_options(options, defaults, runs_seen)
    resume = as_bool(opt["resume"])
    known = presets(paths["templates"])
    preset = str(opt["preset"])
    entry = _entry(opt, paths, problems)
    auto, ladder, model = [], [], None
    if preset == "auto" and not resume and plan["world_size"] is not None:
        chosen, micro_batch, auto, ladder, model = _auto_preset(plan, opt, options, paths, entry, problems, s)
        if chosen:
            # launch.json keeps the choice: resume and restarts take the same preset and batch.
            preset = opt["preset"] = chosen
            opt["dsc_micro_batch"] = micro_batch
            options = dict(options, dsc_micro_batch=micro_batch)
    elif preset not in known:
        problems.add(f"preset is {preset!r}. Fix: one of {', '.join(known)} (or add "
                     f"templates/ds_config/{preset}.json).")
    run_id = _run_id(opt, preset, plan, runs_seen, now, problems)
    if resume:
        _refused_on_resume(extra_vars, opt, run_id, problems)
    for var in ("max_restarts", "restart_backoff_s", "dsc_stall_timeout_s"):
        if not _is_int(opt[var]) or int(opt[var]) < 0:
            problems.add(f"{var} is {opt[var]!r}. Fix: a whole number, 0 or more.")
    if s["dsc_launch_mode"] == "no_ssh" and _is_int(opt["max_restarts"]) and int(opt["max_restarts"]) > 0:
        problems.add(f"max_restarts is {opt['max_restarts']} with dsc_launch_mode no_ssh. Fix: 0 "
                     f"(each node's launcher runs on its own there, and a restart must restart every "
                     f"node's ranks together: the pdsh mode's supervisor does), or dsc_launch_mode pdsh.")
    overrides = opt["dsc_ds_config_overrides"] or {}
    if not isinstance(overrides, dict):
        problems.add(f"dsc_ds_config_overrides is {overrides!r}. Fix: a mapping of DeepSpeed "
                     f"config keys, e.g. {{zero_optimization: {{stage: 1}}}}.")
        overrides = {}
    mode, config_arg, user_config = _config_choice(opt, problems)
    sizes = {}
    if plan["world_size"] is not None:  # None: the nodes' own problems come first
        sizes = batch(opt["dsc_micro_batch"], opt["dsc_grad_accum"], opt["dsc_train_batch"],
                      plan["world_size"])
        # The toolkit's batch applies to presets, and to a user's config only where given (-e).
        if "error" in sizes and (mode == "preset" or any(
                k in options for k in ("dsc_micro_batch", "dsc_grad_accum", "dsc_train_batch"))):
            problems.add(sizes["error"])
    _refused_starts(opt, run_id, plan, runs_seen, refuse_active, problems)
    secrets = resume and _resume_secrets(run_id, plan, runs_seen, problems)
    archive = ""
    if not entry["shared"] and not resume and os.path.isdir(entry["code_dir"]):
        try:
            archive = code_archive(entry["code_dir"])
        except ValueError as e:
            problems.add(str(e))
    if problems.messages:
        return None
    run_dir = f"{plan['run_root']}/{run_id}"
    config = compose_config(mode, paths["templates"], preset, set(options), plan["accelerator"],
                            [c for n in plan["nodes"] for c in n["compute_caps"]], sizes, overrides,
                            user_config, plan["world_size"], problems)
    # The code lands in <run_dir>/code; a package entry (train.run from train/) keeps its folder
    # name so that `python -m train.run` finds it.
    code_base = os.path.basename(os.path.normpath(entry["code_dir"]))
    package_dir = not entry["script"] and entry["module"].split(".")[0] == code_base
    if as_bool(opt["dsc_tensorboard"]) and config is None:
        problems.add("dsc_tensorboard is true but dsc_ds_config_mode is 'none'. Fix: enable "
                     "DeepSpeed's tensorboard section in the config your script passes, or "
                     "use a mode the toolkit writes the config for.")
    if config is not None:
        _run_sections(config, run_dir, as_bool(opt["dsc_tensorboard"]))
    memory = _memory_record(plan, opt, entry, s, config, model, resume)
    step_down = _step_down(plan, s, opt, options, paths, mode, ladder, overrides, user_config, run_dir, auto)
    env = dict(plan["rank_env"], DSC_RUN_ID=run_id, DSC_RUN_DIR=run_dir)
    if secrets:  # the run's own, kept beside it (the supervisor's restarts keep this env)
        env["DSC_SECRETS"] = "1"
    if config_arg == "env":  # accelerate's own variables, as `accelerate launch` sets them; its
        # "auto" precision follows ACCELERATE_MIXED_PRECISION: the hardware's, as for presets
        dtype = precision(plan["accelerator"], [c for n in plan["nodes"] for c in n["compute_caps"]])
        env.update(ACCELERATE_USE_DEEPSPEED="true",
                   ACCELERATE_DEEPSPEED_CONFIG_FILE=f"{run_dir}/ds_config.json",
                   ACCELERATE_MIXED_PRECISION="bf16" if dtype["bf16"]["enabled"]
                   else "fp16" if dtype["fp16"]["enabled"] else "no")
    hostfile, env_text = _rendered(paths, plan, env, problems)
    return {
        "id": run_id, "dir": run_dir, "preset": preset, "resume": resume, "auto": auto,
        "replace": as_bool(opt["replace"]), "dry_run": as_bool(opt["dry_run"]),
        "follow": as_bool(opt["follow"]), "preflight": as_bool(opt["preflight"]),
        "max_restarts": int(opt["max_restarts"]),
        "restart_backoff_s": int(opt["restart_backoff_s"]), "batch": sizes,
        "stall_timeout_s": int(opt["dsc_stall_timeout_s"]), "stall_fail": as_bool(opt["dsc_stall_fail"]),
        "ds_config": config, "config_mode": mode, "resume_args": entry["resume_args"],
        "ds_config_file": str(opt["dsc_ds_config_file"] or ""),
        "code_dir": entry["code_dir"], "code_shared": entry["shared"],
        "code_dest": f"{run_dir}/{RunDir.CODE}" + (f"/{code_base}" if package_dir else ""),
        "workdir": entry["code_dir"] if entry["shared"] else f"{run_dir}/{RunDir.CODE}", "env": env,
        "secrets_file": secrets_path(plan["run_root"], run_id),
        "commands": _commands(plan, s, run_dir, entry, config_arg, resume), "code_archive": archive,
        # Written into the run directory on every node (name -> text).
        "files": {
            **({"ds_config.json": json.dumps(config, indent=2, sort_keys=True) + "\n"} if config else {}),
            "hostfile": hostfile,
            "train.json": json.dumps(opt["dsc_train_config"] or {}, indent=2, sort_keys=True) + "\n",
            # the predicted peak per GPU, beside which each rank records its measured one
            **({RunDir.MEMORY: json.dumps(memory, indent=2, sort_keys=True) + "\n"} if memory else {}),
            # preset=auto's step-down ladder (the node helper's supervisor reads it)
            **({RunDir.AUTO: json.dumps(step_down, sort_keys=True) + "\n"} if step_down else {}),
            "run_id": run_id + "\n",
            # with the names (never the values) of its secrets: resume checks they are there
            RunDir.LAUNCH: json.dumps(dict({k: opt[k] for k in LAUNCH_SPEC},
                                           secret_names=plan["secret_names"]),
                                      indent=2, sort_keys=True) + "\n",
            ".deepspeed_env": env_text,
        },
    }


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


def run_reference(run_id, runs, run_root):
    """The run that status, stop and logs act on: run_id if given, else the active run, else
    none (those playbooks then refuse and list the runs: the newest directory is not
    necessarily the run going on, and a stop of the wrong one would report "none left" while
    the real one trains); (id, dir, problem)."""
    if run_id:
        if not RUN_ID.fullmatch(run_id) or run_id in (".", ".."):
            return None, None, (f"run_id is {run_id!r}. Fix: 1-64 letters, digits, '.', '_' and "
                                f"'-', starting with a letter or digit.")
    else:
        run_id = next((r["id"] for r in runs if r.get("active")), "")
    return (run_id or None), (f"{run_root}/{run_id}" if run_id else None), None


def _plot_runs(given, run_id, plan, problems):
    """The runs plot.yml draws: those given (each a run on the master), else the run (run_id)."""
    if not isinstance(given, list):
        problems.add(f"plot_runs is {given!r}. Fix: a list of run ids, e.g. [\"zero2-a\", \"zero3-b\"].")
        return []
    known = [r["id"] for r in plan.runs]
    for wanted in map(str, given):
        if wanted not in known:
            problems.add(f"plot_runs: no run {wanted!r} under {plan.run_root} on {plan.master}. "
                         f"Fix: one of {', '.join(known[:8]) or 'none there yet'} (runs.yml lists them).")
    newest = [run_id] if run_id else known[:1]
    return [str(r) for r in given] or newest


def code_archive(code_dir, limit=64 * 2**20):
    """The code directory as base64 of a tar.gz (caches and VCS folders left out), or raise."""

    def keep(info):
        parts = info.name.split("/")
        if any(p in ("__pycache__", ".git", ".ipynb_checkpoints") for p in parts) or info.name.endswith(".pyc"):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(code_dir, arcname=".", filter=keep)
    if buf.tell() > limit:
        raise ValueError(f"dsc_code_dir {code_dir} packs to {buf.tell() / 2**20:.0f} MiB, more than "
                         f"{limit / 2**20:.0f} MiB. Fix: keep data and checkpoints out of the code "
                         f"directory, or put it on a shared filesystem (dsc_code_shared: true).")
    return base64.b64encode(buf.getvalue()).decode()


@dataclass
class Plan:
    """The plan: what every play after the first reads as `dsc_plan` (make_plan hands Ansible
    asdict() of it). Its fields are the keys roles/, playbooks/ and templates/ may read; a unit
    test fails on a `dsc_plan.<key>` there that is not one of them, and on a field none reads."""
    cluster_name: str
    nodes: list[dict]  # a record per node in rank order (_nodes): name, rank, addr, slots, gpus, iface, ...
    node: dict[str, dict]  # the same records by inventory name
    node_names: list[str]  # in rank order, the master first
    addrs: list[str]  # the training addresses, in rank order
    master: str  # the inventory name of rank 0's node
    master_addr: str
    num_nodes: int
    world_size: int  # ranks on all nodes together
    ssh_ports: list[int]  # the nodes' sshd ports, each once (the launcher's --ssh_port)
    accelerator: str  # cuda when every node has a GPU, else cpu
    cuda_arch_list: str  # the GPUs' compute capabilities, TORCH_CUDA_ARCH_LIST's format
    env_manager: str  # venv, conda or existing (dsc_env_manager)
    install_root: str
    run_root: str
    cache_dir: str  # node-local caches (op builds, Triton) under the install root
    torch_extensions_dir: str
    env_prefix: str  # the Python env's prefix: its bin/ leads every rank's PATH
    python: str  # the env's interpreter
    pip: str  # the env's pip script; empty for an existing interpreter, which may have none: pip tasks use its module
    env_owner: str  # who runs pip in the env (and owns it)
    install_packages: bool  # torch and DeepSpeed installed into the env (an existing one: dsc_existing_install)
    manage_packages: bool  # the OS packages installed (base_packages)
    train_user: str
    python_version: str
    torch_version: str
    torch_variant: str  # the CUDA variant of torch's wheel index (TORCH_INDEXES)
    deepspeed_version: str
    conda_env_name: str
    conda_installer_file: str
    conda_installer_sha256: str
    conda_accept_tos: bool
    wheelhouse: str  # on the control node; empty: installs come from an index
    node_wheelhouse: str  # where the wheelhouse is pushed on every node
    torch_requirements: list[str]  # dsc_requirements' torchvision/torchaudio: installed with torch, from its index
    requirements: list[str]  # the rest of dsc_requirements: installed with DeepSpeed (both at torch's pin)
    data_dir: str
    data_shared: bool
    secret_names: list[str]  # the names in dsc_secrets, never the values
    pip_source_args: str  # pip's source (pip_sources) for DeepSpeed, the requirements, a lock's sdists
    pip_lock_args: str  # pip's source for a lock's wheels (torch's index beside the index)
    pip_torch_args: str  # pip's source for an unlocked torch (its CUDA-variant index)
    lock: dict  # the wheelhouse's lock or dsc_node_lock ({} without): installed exactly, sha256 checked
    locked: bool
    master_port_first: int
    master_port_last: int
    launch_mode: str  # pdsh or no_ssh (dsc_launch_mode)
    firewall: bool  # roles/cluster_network manages the host firewall (cluster_network_firewall)
    ssh_sources: list[str]  # cluster_network_ssh_sources
    node_env: dict[str, str]  # the environment of every DeepSpeed process on a node (op builds, probes)
    rank_env: dict[str, str]  # the ranks' environment (.deepspeed_env)
    helper: str  # the node helper's path on the nodes
    helper_src: str  # the built node helper on the control node (node_helper)
    helper_sha256: str
    runs: list[dict]  # the runs under run_root on the master, newest first (its probe)
    run: dict | None  # launch, resume, preflight: the run to start (_run); None for the other playbooks


# Plan fields that no role, playbook or template reads, by design: ssh_ports is the plan's own
# input to the launcher command (_commands); cuda_arch_list tells a person reading the plan (-v)
# which architectures the op builds target (node_env's TORCH_CUDA_ARCH_LIST carries them).
PLAN_FIELDS_NOT_READ_BY_ROLES = ("ssh_ports", "cuda_arch_list")


@dataclass
class CompanionPlan(Plan):
    """The plan of a playbook that starts no run (provision, runs, status, stop, logs, plot), with
    the run status, stop, logs and plot act on."""
    run_id: str | None  # -e run_id, else the active run; None: neither (they refuse, listing the runs)
    run_dir: str | None
    plot_runs: list[str]  # the runs plot.yml draws: -e plot_runs, else the run


def make_plan(hostvars, groups, probes, defaults, paths, options=None, now="00000000-000000",
              check_dir=os.path.isdir, full_run=False, refuse_active=True, firewall=False,
              variables=None, extra_vars=()):
    """(plan, errors): everything the roles apply, or every reason it can't be made. `options`
    are the run options; `full_run` (launch, resume) derives the whole run, else only which run
    status, stop and logs act on; `firewall` (provision) refuses a node whose firewall the
    toolkit would not manage alone. `variables` ({node: the names of its variables}; default
    hostvars' own) and `extra_vars` (the names given with -e) find undeclared settings, and the
    -e options a resume cannot apply."""
    problems = Problems()
    names = node_order(groups)
    if not names:
        return None, [f"inventory: the group '{CLUSTER_GROUP}' is empty or missing. Fix: list "
                      f"your nodes under 'all: children: {CLUSTER_GROUP}: hosts:' (see "
                      f"inventory/example/hosts.yml), and check the -i path."]
    control_characters(hostvars, names, options, problems)
    undeclared_settings(variables if variables is not None else {n: list(hostvars.get(n) or {}) for n in names},
                        extra_vars, declared_settings(paths["repo"]), problems)
    s = _cluster_settings(hostvars, defaults, names, problems)
    _check_settings(s, names[0], problems, check_dir)
    torch_requirements, requirements = _requirements(s, f"on host {names[0]}", problems, check_dir)
    lock = _lock(s, torch_requirements + requirements, f"on host {names[0]}", problems, check_dir)
    data = _data(s, f"on host {names[0]}", problems, check_dir)
    secrets = secret_names(hostvars, names, problems)
    nodes = _nodes(names, hostvars, defaults, probes, problems)
    _firewall_backends(nodes, probes, s, firewall, problems)
    for node in nodes:
        # The control node itself (a local connection, the one-node default): dsc_data_dir there is
        # the source, never created, changed or synced (launch skips it on this node).
        node["local"] = str((hostvars.get(node["name"]) or {}).get("ansible_connection") or "") == "local"
        if node["reachable"]:
            for message in root_path_problems(
                    node["name"], (probes.get(node["name"]) or {}).get("root_paths"), str(s["dsc_train_user"]),
                    data=full_run and not as_bool(s["dsc_data_shared"]) and not node["local"]):
                problems.add(message)
    for node in nodes:
        if node["reachable"] and not node["iface"] and "NCCL_SOCKET_IFNAME" not in (s["dsc_rank_env"] or {}) \
                and not training_address(node["name"], hostvars.get(node["name"]) or {})[1]:
            seen = ", ".join(a for addrs in ((probes.get(node["name"]) or {}).get("interfaces")
                                             or {}).values() for a in addrs or [])
            problems.add(f"dsc_addr on host {node['name']} is {node['addr']}, which no interface "
                         f"there holds. Fix: set dsc_addr to an address of this node ({seen}).")
    env_owner = None
    if s["dsc_env_manager"] == "existing" and not any(
            m.startswith("dsc_existing_python") for m in problems.messages):
        owners = {}
        for node in nodes:
            if node["reachable"]:
                owner, problem = existing_owner(node["name"], str(s["dsc_existing_python"]),
                                                (probes.get(node["name"]) or {}).get("existing_python"))
                if problem:
                    problems.add(problem)
                else:
                    owners.setdefault(owner, []).append(node["name"])
        if len(owners) > 1:
            detail = "; ".join(f"{o} on {', '.join(h)}" for o, h in owners.items())
            problems.add(f"dsc_existing_python is {s['dsc_existing_python']!r}, owned by {detail}: it "
                         f"runs as its owner, who must be the same on every node. Fix: the same "
                         f"ownership everywhere (root's, or one user's).")
        env_owner = next(iter(owners), "root")
    if problems.messages:
        if full_run:  # the run options' own problems too, all at once
            partial = {"run_root": str(s["dsc_run_root"] or f"{s['dsc_install_root']}/runs"),
                       "master": names[0], "world_size": None}
            runs = (probes.get(names[0]) or {}).get("runs") or []
            _run(partial, s, options or {}, defaults, paths, problems, runs, now, refuse_active, extra_vars)
        else:
            problem = run_reference(str((options or {}).get("run_id") or ""), [], "")[2]
            if problem:
                problems.add(problem)
        return None, problems.messages

    helper_src, helper_sha256 = node_helper(paths["repo"])
    install_root = str(s["dsc_install_root"]).rstrip("/") or "/"
    prefix, python = _env_paths(s, install_root)
    cache_dir = f"{install_root}/cache"
    accelerator = "cuda" if all(n["gpus"] > 0 for n in nodes) else "cpu"
    caps = sorted({c for n in nodes for c in n["compute_caps"]})
    # The environment every DeepSpeed process on a node needs (op builds, probes, ranks): the
    # env's PATH, the accelerator, node-local caches (JIT builds race on a shared filesystem),
    # and the arch list read from the GPUs (an image's "9.0a" breaks DeepSpeed's op builder).
    node_env = {"PATH": f"{prefix}/bin:{SYSTEM_PATH}", "DS_ACCELERATOR": accelerator,
                "TORCH_EXTENSIONS_DIR": f"{cache_dir}/torch_extensions",
                "TRITON_CACHE_DIR": f"{cache_dir}/triton"}
    if caps:
        node_env["TORCH_CUDA_ARCH_LIST"] = ";".join(caps)
    ifaces = ",".join(dict.fromkeys(n["iface"] for n in nodes))
    rank_env = dict(node_env, NCCL_SOCKET_IFNAME=ifaces, GLOO_SOCKET_IFNAME=ifaces,
                    NCCL_IB_DISABLE="0" if all(n["infiniband"] for n in nodes) else "1",
                    NCCL_DEBUG=str(s["dsc_nccl_debug"]),
                    DEEPSPEED_TIMEOUT=str(s["dsc_pg_timeout_min"]))
    rank_env.update({str(k): str(v) for k, v in (s["dsc_rank_env"] or {}).items()})
    if secrets:  # the entry shim loads them from a 0600 file beside the run directory
        rank_env["DSC_SECRETS"] = "1"
    manager = s["dsc_env_manager"]
    wheelhouse = str(s["dsc_wheelhouse"] or "")
    plan = Plan(
        cluster_name=str(s["dsc_cluster_name"]),
        nodes=nodes, node={n["name"]: n for n in nodes},
        node_names=[n["name"] for n in nodes], addrs=[n["addr"] for n in nodes],
        master=nodes[0]["name"], master_addr=nodes[0]["addr"], num_nodes=len(nodes),
        world_size=sum(n["slots"] for n in nodes),
        ssh_ports=sorted({n["ssh_port"] for n in nodes}),
        accelerator=accelerator, cuda_arch_list=";".join(caps),
        env_manager=manager, install_root=install_root,
        run_root=str(s["dsc_run_root"] or f"{install_root}/runs").rstrip("/"),
        cache_dir=cache_dir, torch_extensions_dir=node_env["TORCH_EXTENSIONS_DIR"],
        env_prefix=prefix, python=python,
        pip="" if manager == "existing" else f"{prefix}/bin/pip",
        # An existing interpreter runs only as its one owner, or root when it is root's alone
        # (existing_owner).
        env_owner=env_owner if manager == "existing" else str(s["dsc_train_user"]),
        install_packages=manager != "existing" or as_bool(s["dsc_existing_install"]),
        manage_packages=as_bool(s["dsc_manage_packages"]),
        train_user=str(s["dsc_train_user"]),
        python_version=str(s["dsc_python_version"]),
        torch_version=str(s["dsc_torch_version"]),
        torch_variant=str(s["dsc_torch_variant"]),
        deepspeed_version=str(s["dsc_deepspeed_version"]),
        conda_env_name=str(s["dsc_conda_env_name"]),
        conda_installer_file=str(s["dsc_conda_installer_file"] or ""),
        conda_installer_sha256=str(s["dsc_conda_installer_sha256"] or ""),
        conda_accept_tos=as_bool(s["dsc_conda_accept_tos"]),
        wheelhouse=wheelhouse, node_wheelhouse=f"{install_root}/wheelhouse",
        torch_requirements=torch_requirements, requirements=requirements,
        data_dir=data["dir"], data_shared=data["shared"], secret_names=secrets,
        **pip_sources(f"{install_root}/wheelhouse" if wheelhouse else "", str(s["dsc_pip_index_url"] or ""),
                      TORCH_INDEXES.get(s["dsc_torch_variant"], "")),
        lock=lock or {}, locked=bool(lock),
        master_port_first=int(s["dsc_master_port"]),
        master_port_last=int(s["dsc_master_port_last"]),
        launch_mode=s["dsc_launch_mode"],
        firewall=as_bool(s["cluster_network_firewall"]),
        ssh_sources=s["cluster_network_ssh_sources"],
        node_env=node_env, rank_env=rank_env,
        helper=INSTALLED_PATH, helper_src=helper_src, helper_sha256=helper_sha256,
        runs=(probes.get(nodes[0]["name"]) or {}).get("runs") or [],
        run=None,
    )
    options = options or {}
    if full_run:
        plan.run = _run(asdict(plan), s, options, defaults, paths, problems, plan.runs, now,
                        refuse_active, extra_vars)
    else:
        run_id, run_dir, problem = run_reference(str(options.get("run_id") or ""), plan.runs, plan.run_root)
        if problem:
            problems.add(problem)
        plan = CompanionPlan(**vars(plan), run_id=run_id, run_dir=run_dir,
                             plot_runs=_plot_runs(options.get("plot_runs") or [], run_id, plan, problems))
    if problems.messages:
        return None, problems.messages
    return asdict(plan), []
