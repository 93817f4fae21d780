"""The toolkit's vocabulary of settings: which names are settings (cluster-wide, per node, secret,
run options, playbook inputs), which a node's probe reads before any plan, which earlier names were
retired, the CUDA variants of torch's index, and where every default comes from (the roles'
meta/argument_specs.yml, the pins). The one place a setting's name is listed."""
from __future__ import annotations

import difflib
from pathlib import Path


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
    "dsc_launcher_args", "dsc_stall_timeout_s", "dsc_stall_fail", "dsc_checkpoint_copies", "dsc_checkpoint_shared_dir",
    "dsc_min_nodes", "plot_runs",
    "dsc_tensorboard", "dsc_model_shape", "dsc_auto_memory_gib", "steps",
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
