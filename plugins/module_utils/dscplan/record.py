"""The plan as a typed record: Plan (launch, resume, preflight) and CompanionPlan (the other
playbooks). Their fields are the roles' contract: every key a role reads is declared here."""
from __future__ import annotations

from dataclasses import dataclass

from .launchers import LauncherRecord


@dataclass
class Plan:
    """The plan: what every play after the first reads as `dsc_plan` (make_plan hands Ansible
    asdict() of it). Its fields are the keys roles/, playbooks/ and templates/ may read; a unit
    test fails on a `dsc_plan.<key>` there that is not one of them, and on a field none reads."""
    cluster_name: str
    nodes: list[dict]  # a record per node in rank order (_nodes): name, rank, addr, slots, gpus, iface, probe_error, lock_current, wheelhouse_current, ...
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
    py_spy: str  # the env's py-spy beside it (dsc_py_spy_version): reads the ranks' stacks at a stall and for status.yml -e stacks=true
    pip: str  # the env's pip script; empty for an existing interpreter, which may have none: pip tasks use its module
    env_owner: str  # who runs pip in the env (and owns it); anything else runs the env as train_user
    install_packages: bool  # torch and DeepSpeed installed into the env (an existing one: dsc_existing_install)
    packages_dir: str  # where pip installs from (the lock's files, the wheelhouse): the install root, or root's own folder for an env of root's
    packages_owner: str  # who writes packages_dir: the training user, or root
    root_state: str  # root's own directory on every node (dscnode.ROOT_STATE)
    warm_record: str  # root's record of the last op warm-up (dscnode.WARM_RECORD)
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
    lock_texts: dict  # {wheels, sdists}: the lock's files as written on the nodes (roles/pytorch)
    master_port_first: int
    master_port_last: int
    slurm: dict  # roles/slurm's configuration (dsc_slurm_install; dscplan.slurm): install, partition, account, controller, conf, gres_conf, cgroup_conf
    launcher: LauncherRecord  # how runs start, are read and stop (the launch mode's module in dscplan.launchers)
    firewall: bool  # roles/cluster_network manages the host firewall (cluster_network_firewall)
    ssh_sources: list[str]  # cluster_network_ssh_sources
    node_env: dict[str, str]  # the environment of every DeepSpeed process on a node (op builds, probes)
    rank_env: dict[str, str]  # the ranks' environment (.deepspeed_env)
    pip_env: dict[str, str]  # pip's environment (builds of source packages): node_env without the training user's caches
    helper: str  # the node helper's path on the nodes
    helper_src: str  # the built node helper on the control node (node_helper)
    helper_sha256: str
    runs: list[dict]  # the runs under run_root on the master, newest first (its probe)
    notes: list[str]  # what the plan saw and worked around (a file a probe left unread), said before the playbook goes on
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
