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

import os
import posixpath
from dataclasses import asdict

from dscnode import INSTALLED_PATH, ROOT_PACKAGES, warm_record
from dscnode.entry import NODE_ENV_PREFIX
from dscnode.probe import EXT_DIR, WHEELHOUSE_DIR, tree_digest

from .deepspeed_config import batch, ds_config, precision, presets
from .launchers import chosen
from .packages import node_lock, split_requirements, already_there, existing_owner, lock_texts, node_helper, op_sources, pip_sources
from .problems import Problems, as_bool
from .record import PLAN_FIELDS_NOT_READ_BY_ROLES, CompanionPlan, Plan, SlurmRecord, runs_seen
from .rendered import env_paths, code_archive, parse_ds_env, parse_hostfile
from .run import LAUNCH_ONLY, Unplanned, plot_runs, plan_run, run_reference, secrets_path
from .vocabulary import CLUSTER_GROUP, CLUSTER_SETTINGS, declared_settings, JSON_ONLY, load_defaults, NODE_SETTINGS, PLAYBOOK_INPUTS, PROBE_SETTINGS, read_pins, RETIRED_SETTINGS, RUN_OPTIONS, SECRET_SETTINGS, SETTING_PREFIXES, TOOLKIT_VARIABLES, TORCH_INDEXES, undeclared_settings
from .settings import check_settings, cluster_settings, secret_names
from .paths import data_dir, root_path_problems
from .network import ip_network, ssh_source
from .hygiene import control_characters, literal_extra_vars, templates_in
from .shrink import resume_without
from .slurm import slurm_plan, slurm_problems
from .topology import firewall_backends, node_records, network_env, node_order, training_address

# What the action plugin, the filters, the tests and bench/ use: make_plan and the names below.
__all__ = ["PROBE_SETTINGS", "probe_arguments", "ssh_source", "as_bool", "batch", "CLUSTER_SETTINGS", "code_archive", "CompanionPlan", "declared_settings", "ds_config", "existing_owner", "ip_network", "JSON_ONLY", "LAUNCH_ONLY", "literal_extra_vars", "load_defaults", "make_plan", "node_helper", "node_order", "NODE_SETTINGS", "parse_ds_env", "parse_hostfile", "Plan", "PLAN_FIELDS_NOT_READ_BY_ROLES", "PLAYBOOK_INPUTS", "precision", "presets", "read_pins", "resume_without", "RETIRED_SETTINGS", "root_path_problems", "RUN_OPTIONS", "SECRET_SETTINGS", "secrets_path", "SETTING_PREFIXES", "templates_in", "TOOLKIT_VARIABLES", "TORCH_INDEXES"]


SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _check_nodes(nodes, s, hostvars, probes, full_run, problems):
    """Each reachable node's own refusals: the paths root would write into, and a dsc_addr no
    interface there holds; marks the control node itself as "local". Notes the files its probe
    refused to read (the playbook goes on without them)."""
    for node in nodes:
        for refused in (probes.get(node.name) or {}).get("refused_reads") or []:
            problems.note(f"host {node.name}: {refused.get('path')} was left unread: {refused.get('why')}. "
                          f"Root reads only regular files of their kind's size there, never through a link, "
                          f"and what needs the file goes on without it. Fix: remove it, or ask who put "
                          f"it there (the directory is the training user's).")
    for node in nodes:
        # The control node itself (a local connection, the one-node default): dsc_data_dir there is
        # the source, never created, changed or synced (launch skips it on this node).
        node.local = str((hostvars.get(node.name) or {}).get("ansible_connection") or "") == "local"
        synced = full_run and bool(s["dsc_data_dir"]) and not as_bool(s["dsc_data_shared"]) and not node.local
        if node.reachable:
            for message in root_path_problems(
                    node.name, (probes.get(node.name) or {}).get("root_paths"), str(s["dsc_train_user"]), data=synced):
                problems.add(message)
            if synced and not node.rsync:
                problems.add(f"dsc_data_dir on host {node.name}: launch syncs the dataset there with rsync, which "
                             f"{node.name} lacks. Fix: install rsync there (provision.yml does with "
                             f"dsc_manage_packages: true), or put the dataset where every node has it and set "
                             f"dsc_data_shared: true.")
    for node in nodes:
        if node.reachable and not node.iface and "NCCL_SOCKET_IFNAME" not in (s["dsc_rank_env"] or {}) \
                and not training_address(node.name, hostvars.get(node.name) or {})[1]:
            seen = ", ".join(a for addrs in ((probes.get(node.name) or {}).get("interfaces")
                                             or {}).values() for a in addrs or [])
            problems.add(f"dsc_addr on host {node.name} is {node.addr}, which no interface "
                         f"there holds. Fix: set dsc_addr to an address of this node ({seen}).")


def _existing_env_owner(s, nodes, probes, problems):
    """The user an existing interpreter (dsc_env_manager existing) runs as: its owner, the same on
    every node; None for the other env managers."""
    env_owner = None
    if s["dsc_env_manager"] == "existing" and not any(
            m.startswith("dsc_existing_python") for m in problems.messages):
        owners = {}
        for node in nodes:
            if node.reachable:
                owner, problem = existing_owner(node.name, str(s["dsc_existing_python"]),
                                                (probes.get(node.name) or {}).get("existing_python"))
                if problem:
                    problems.add(problem)
                else:
                    owners.setdefault(owner, []).append(node.name)
        if len(owners) > 1:
            detail = "; ".join(f"{o} on {', '.join(h)}" for o, h in owners.items())
            problems.add(f"dsc_existing_python is {s['dsc_existing_python']!r}, owned by {detail}: it "
                         f"runs as its owner, who must be the same on every node. Fix: the same "
                         f"ownership everywhere (root's, or one user's).")
        env_owner = next(iter(owners), "root")
    return env_owner


def _node_and_rank_env(s, nodes, prefix, install_root, secrets):
    """(accelerator, compute capabilities, node_env, rank_env) for the nodes the plan holds."""
    accelerator = "cuda" if all(n.gpus > 0 for n in nodes) else "cpu"
    caps = sorted({c for n in nodes for c in n.compute_caps})
    # The environment every DeepSpeed process on a node needs (op builds, probes, ranks): the
    # env's PATH, the accelerator, node-local caches (JIT builds race on a shared filesystem),
    # and the arch list read from the GPUs (an image's "9.0a" breaks DeepSpeed's op builder).
    node_env = {"PATH": f"{prefix}/bin:{SYSTEM_PATH}", "DS_ACCELERATOR": accelerator,
                "TORCH_EXTENSIONS_DIR": f"{install_root}/{EXT_DIR}",
                "TRITON_CACHE_DIR": f"{install_root}/cache/triton"}
    if caps:
        node_env["TORCH_CUDA_ARCH_LIST"] = ";".join(caps)
    given = {str(k): str(v) for k, v in (s["dsc_rank_env"] or {}).items()}
    rank_env = dict(node_env)
    # Each node's own network settings (its record's network_env, which preflight shows); where
    # they differ between nodes, the entry shim gives each node's ranks their own
    # (NODE_ENV_PREFIX). dsc_rank_env's value wins everywhere.
    own = {var: per_node for var, per_node in network_env(nodes).items() if var not in given}
    for i, node in enumerate(nodes):
        node.network_env = {var: per_node[i] for var, per_node in own.items()}
    for var, per_node in own.items():
        if len(set(per_node)) > 1:
            rank_env[NODE_ENV_PREFIX + var] = "/".join(per_node)
        elif per_node[0]:
            rank_env[var] = per_node[0]
    rank_env.update(NCCL_IB_DISABLE="0" if all(n.infiniband for n in nodes) else "1",
                    NCCL_DEBUG=str(s["dsc_nccl_debug"]),
                    DEEPSPEED_TIMEOUT=str(s["dsc_pg_timeout_min"]))
    rank_env.update(given)
    if secrets:  # the entry shim loads them from a 0600 file beside the run directory
        rank_env["DSC_SECRETS"] = "1"
    return accelerator, caps, node_env, rank_env


def _cluster_plan(s, nodes, probes, paths, secrets, env_owner, torch_requirements, requirements, data, lock,
                  launcher, notes):
    """The Plan of valid settings and nodes, without its run (make_plan adds it)."""
    helper_src, helper_sha256 = node_helper(paths["repo"])
    install_root = str(s["dsc_install_root"]).rstrip("/") or "/"  # as run_root_of takes it
    prefix, python = env_paths(s, install_root)
    cache_dir = f"{install_root}/cache"
    accelerator, caps, node_env, rank_env = _node_and_rank_env(s, nodes, prefix, install_root, secrets)
    manager = s["dsc_env_manager"]
    train_user = str(s["dsc_train_user"])
    env_owner = env_owner if manager == "existing" else train_user
    install_packages = manager != "existing" or as_bool(s["dsc_existing_install"])
    # Where pip installs from (the lock, the wheelhouse): the install root where the training user
    # installs into an env of theirs; root's own folder where root (or another user) does, so that
    # nothing the training user can write is installed.
    root_packages = install_packages and env_owner != train_user
    packages_dir = ROOT_PACKAGES if root_packages else install_root
    wheelhouse, node_wheelhouse = str(s["dsc_wheelhouse"] or ""), f"{packages_dir}/{WHEELHOUSE_DIR}"
    wheelhouse_digest = tree_digest(wheelhouse) if wheelhouse else None
    for n in nodes:
        n.lock_current, n.wheelhouse_current = already_there(probes.get(n.name), lock, wheelhouse_digest, root_packages)
    op_sources(nodes, probes, [accelerator, prefix, str(s["dsc_python_version"]), str(s["dsc_torch_version"]),
                               str(s["dsc_torch_variant"]), str(s["dsc_deepspeed_version"]), node_env.get("TORCH_CUDA_ARCH_LIST", "")])
    slurm = SlurmRecord(**slurm_plan(s, str(s["dsc_cluster_name"]), nodes, probes))
    return Plan(
        cluster_name=str(s["dsc_cluster_name"]),
        nodes=nodes, node={n.name: n for n in nodes},
        node_names=[n.name for n in nodes], addrs=[n.addr for n in nodes],
        master=nodes[0].name, master_addr=nodes[0].addr, num_nodes=len(nodes),
        world_size=sum(n.slots for n in nodes),
        ssh_ports=sorted({n.ssh_port for n in nodes}),
        accelerator=accelerator, cuda_arch_list=";".join(caps),
        env_manager=manager, install_root=install_root,
        run_root=run_root_of(s),
        cache_dir=cache_dir, torch_extensions_dir=node_env["TORCH_EXTENSIONS_DIR"],
        env_prefix=prefix, python=python, py_spy=posixpath.join(posixpath.dirname(python), "py-spy"),
        pip="" if manager == "existing" else f"{prefix}/bin/pip",
        # pip into an existing env runs as its one owner, or root when it is root's alone
        # (existing_owner); whatever else runs the env runs as the training user.
        env_owner=env_owner,
        install_packages=install_packages,
        packages_dir=packages_dir, packages_owner="root" if root_packages else train_user,
        warm_record=warm_record(node_env["TORCH_EXTENSIONS_DIR"]),
        manage_packages=as_bool(s["dsc_manage_packages"]),
        train_user=train_user,
        python_version=str(s["dsc_python_version"]),
        torch_version=str(s["dsc_torch_version"]),
        torch_variant=str(s["dsc_torch_variant"]),
        deepspeed_version=str(s["dsc_deepspeed_version"]),
        conda_env_name=str(s["dsc_conda_env_name"]),
        conda_installer_file=str(s["dsc_conda_installer_file"] or ""),
        conda_installer_sha256=str(s["dsc_conda_installer_sha256"] or ""),
        conda_accept_tos=as_bool(s["dsc_conda_accept_tos"]),
        wheelhouse=wheelhouse, node_wheelhouse=node_wheelhouse,
        torch_requirements=torch_requirements, requirements=requirements,
        data_dir=data["dir"], data_shared=data["shared"], secret_names=secrets,
        **pip_sources(node_wheelhouse if wheelhouse else "", str(s["dsc_pip_index_url"] or ""),
                      TORCH_INDEXES.get(s["dsc_torch_variant"], "")),
        lock=lock or {}, locked=bool(lock), lock_texts=lock_texts(lock),
        master_port_first=int(s["dsc_master_port"]),
        master_port_last=int(s["dsc_master_port_last"]),
        slurm=slurm,
        launcher=launcher.record(nodes, nodes[0].name, slurm),
        firewall=as_bool(s["cluster_network_firewall"]),
        ssh_sources=s["cluster_network_ssh_sources"],
        node_env=node_env, rank_env=rank_env,
        # pip's (root's, for an env of root's): no cache of the training user's
        pip_env={k: v for k, v in node_env.items() if k not in ("TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR")},
        helper=INSTALLED_PATH, helper_src=helper_src, helper_sha256=helper_sha256,
        runs=runs_seen(probes.get(nodes[0].name)),
        notes=notes,
        run=None,
    )


def run_root_of(settings):
    """dsc_run_root, else the install root's runs/, without a trailing slash: the one place the
    default is made (the plan, the probe's argument, a plan that stopped at a problem)."""
    install_root = str(settings["dsc_install_root"]).rstrip("/")
    return str(settings["dsc_run_root"] or f"{install_root}/runs").rstrip("/") or "/"


def probe_arguments(values, defaults):
    """The node probe's command line (dscnode.probe) from one node's own settings (`values`, as
    Ansible resolved them for it: PROBE_SETTINGS) and the settings' defaults (the argument spec):
    the roots it reports on, the training user, an existing interpreter, and what the launch mode
    reads. Unchecked yet (the plan checks the settings): each is one argument, never split."""
    given = {name: str(defaults.get(name) if values.get(name) in (None, "") else values[name])
             for name in PROBE_SETTINGS}
    root = given["dsc_install_root"]
    args = ["probe", "--run-root", run_root_of(given), "--install-root", root,
            "--train-user", given["dsc_train_user"]]
    args += chosen(given, "", Problems()).probe_options()
    if given["dsc_data_dir"]:
        args += ["--data-dir", given["dsc_data_dir"]]
    if given["dsc_env_manager"] == "existing" and given["dsc_existing_python"]:
        args += ["--existing-python", given["dsc_existing_python"]]
    return args


def make_plan(hostvars, groups, probes, defaults, paths, options=None, now="00000000-000000",
              check_dir=os.path.isdir, full_run=False, refuse_active=True, firewall=False,
              variables=None, extra_vars=(), probe_errors=None):
    """(plan, errors): everything the roles apply, or every reason it can't be made. `options`
    are the run options; `full_run` (launch, resume) derives the whole run, else only which run
    status, stop and logs act on; `firewall` (provision) refuses a node whose firewall the
    toolkit would not manage alone. `variables` ({node: the names of its variables}; default
    hostvars' own) and `extra_vars` (the names given with -e) find undeclared settings, and the
    -e options a resume cannot apply. `probe_errors` ({node: why its probe gave no report}) goes
    into each unreachable node's record (preflight's row says it)."""
    problems = Problems()
    names = node_order(groups)
    if not names:
        return None, [f"inventory: the group '{CLUSTER_GROUP}' is empty or missing. Fix: list "
                      f"your nodes under 'all: children: {CLUSTER_GROUP}: hosts:' (see "
                      f"inventory/example/hosts.yml), and check the -i path."]
    control_characters(hostvars, names, options, problems)
    undeclared_settings(variables if variables is not None else {n: list(hostvars.get(n) or {}) for n in names},
                        extra_vars, declared_settings(paths["repo"]), problems)
    s = cluster_settings(hostvars, defaults, names, problems)
    check_settings(s, names[0], problems, check_dir)
    torch_requirements, requirements = split_requirements(s, f"on host {names[0]}", problems, check_dir)
    lock = node_lock(s, torch_requirements + requirements, f"on host {names[0]}", problems, check_dir)
    data = data_dir(s, f"on host {names[0]}", problems, check_dir)
    secrets = secret_names(hostvars, names, problems)
    nodes = node_records(names, hostvars, defaults, probes, problems, probe_errors or {})
    firewall_backends(nodes, probes, s, firewall, problems)
    slurm_problems(s, nodes, probes, f"on host {names[0]}", problems)
    launcher = chosen(s, f"on host {names[0]}", problems)  # the launch mode, chosen once
    launcher.cluster_problems(nodes, f"on host {names[0]}", problems)
    _check_nodes(nodes, s, hostvars, probes, full_run, problems)
    env_owner = _existing_env_owner(s, nodes, probes, problems)
    if problems.messages:
        if full_run:  # the run options' own problems too, all at once
            partial = Unplanned(run_root=run_root_of(s), master=names[0])
            plan_run(partial, s, launcher, options or {}, defaults, paths, problems, runs_seen(probes.get(names[0])),
                     now, refuse_active, extra_vars)
        else:
            problem = run_reference(str((options or {}).get("run_id") or ""), [], "")[2]
            if problem:
                problems.add(problem)
        return None, problems.messages

    plan = _cluster_plan(s, nodes, probes, paths, secrets, env_owner, torch_requirements, requirements,
                         data, lock, launcher, problems.notes)
    options = options or {}
    if full_run:
        plan.run = plan_run(plan, s, launcher, options, defaults, paths, problems, plan.runs, now,
                            refuse_active, extra_vars)
        if plan.run:
            launcher.run_problems(plan.master, plan.nodes, plan.slurm, plan.run.id,
                                  probes.get(plan.master) or {}, problems)
    else:
        run_id, run_dir, problem = run_reference(str(options.get("run_id") or ""), plan.runs, plan.run_root)
        if problem:
            problems.add(problem)
        plan = CompanionPlan(**vars(plan), run_id=run_id, run_dir=run_dir,
                             plot_runs=plot_runs(options.get("plot_runs") or [], run_id, plan, problems))
    if problems.messages:
        return None, problems.messages
    return asdict(plan), []
