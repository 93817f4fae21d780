"""The plan as a typed record: Plan (launch, resume, preflight) and CompanionPlan (the other
playbooks). Their fields are the roles' contract: every key a role reads is declared here."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from .launchers import LauncherRecord


@dataclass
class NodeRecord:
    """One node as the plan derives it from its inventory values and its probe (topology.node_records),
    in rank order; the roles read it as `dsc_plan.node[<name>]` and `dsc_plan.nodes[]`."""
    name: str  # its inventory name (the hostfile's, /etc/hosts', ssh's)
    rank: int  # its place in the hostfile: DeepSpeed's node rank
    addr: str  # its training address (dsc_addr, else ansible_host)
    slots: int  # ranks on it
    ssh_port: int  # where its sshd listens for the master (dsc_ssh_port)
    gpus: int  # GPUs nvidia-smi reports there
    gpu_ids: list[int]  # dsc_gpus: the GPUs it uses ([]: all, or the first `slots`)
    used_gpus: list[int]  # the GPUs its ranks take (gpu_ids, else the first `slots`; [] without a GPU): the health gate judges these
    hostfile_slots: int  # the hostfile's slots= (its GPU count where dsc_gpus chooses)
    compute_caps: list[str]  # its GPUs' compute capabilities
    driver: str  # its NVIDIA driver ("" without a GPU)
    gpu_memory_mib: int | None  # the smallest of the GPUs it uses (preset=auto)
    iface: str  # the interface that holds its training address
    infiniband: bool  # an InfiniBand device is there
    rdma: list[dict]  # its RDMA ports (dscnode.probe.rdma): device, port, state, link_layer, rate_gbps, gid_index
    link_mbps: int | None  # its training interface's stated speed (/sys/class/net/<iface>/speed; None: not stated)
    reachable: bool  # its probe answered (status.yml plans with nodes that did not)
    ssh_host_keys: list[str]  # its SSH host keys ("type base64"), pinned in the master's known_hosts
    probe_error: str  # why its probe gave no report ("" where it did)
    helper_sha256: str | None  # the installed node helper's (the plan's own: no install)
    run_root_links: list[str]  # links in its run root (never a run directory)
    runs_with_secrets: list[str]  # the runs whose secrets file is there
    memory_records: list[dict]  # each run's measured peaks there against its prediction (preset=auto)
    firewall_backend: str = ""  # ufw or firewalld (cluster_network_firewall_backend; auto from its OS)
    ipv6: bool = False  # the kernel has IPv6 (ufw's own test)
    ufw_enabled: bool = False
    ufw_rules: list[str] = field(default_factory=lambda: ["", ""])  # ufw's user.rules, user6.rules as the probe read them
    local: bool = False  # the control node itself (ansible_connection local)
    lock_current: bool = False  # it holds the lock's files as provision would write them
    wheelhouse_current: bool = False  # its wheelhouse copy is the control node's
    rsync: bool = False  # its probe found rsync (the dataset's sync needs it; the wheelhouse goes as one tar archive without)
    ops_kind: str = ""  # what its JIT-built ops depend on (packages.op_sources)
    ops_source: str = ""  # the node of its kind that builds them
    network_env: dict[str, str] = field(default_factory=dict)  # its own network settings for the ranks


@dataclass
class SlurmRecord:
    """roles/slurm's configuration (dsc_slurm_install; dscplan.slurm.slurm_plan): the files are
    empty where the toolkit does not install Slurm."""
    install: bool
    partition: str
    account: str
    controller: str  # the node slurmctld runs on (the master)
    conf: str  # slurm.conf
    gres_conf: str
    cgroup_conf: str


@dataclass
class RunSeen:
    """A run the master's probe found under the run root (dscnode.records.runs), newest first."""
    id: str
    mtime: float
    started: bool  # its launcher log exists
    active: bool  # its supervisor lives
    finished: bool  # it exited 0
    launch: dict | None  # its launch.json (what resume reads back: checked as typed)
    trained: dict | None  # what it trains with after preset=auto's steps down (dscnode.records.trained_with)
    memory: dict | None  # its predicted and measured peaks (dscnode.records.memory_summary)
    secrets: bool  # its secrets file is there


# RunSeen's field types as values are checked against them; what a field of another shape is taken as.
_SEEN_SHAPES = {"str": (str, None), "float": ((int, float), 0.0), "bool": (bool, False), "dict | None": (dict, None)}


def runs_seen(probe):
    """A node probe's runs (dscnode.records.runs) as records, newest first. Their files are the
    training user's: a value of another shape than its field's (a launch.json rewritten as a list)
    is taken as absent, so that no plan (stop.yml's included) fails on it; a run without a name is
    left out."""
    def shaped(f, value):
        kind, absent = _SEEN_SHAPES[f.type]
        return value if isinstance(value, kind) and not (kind is not bool and isinstance(value, bool)) else absent
    seen = []
    for r in (probe or {}).get("runs") or []:
        if isinstance(r, dict) and isinstance(r.get("id"), str):
            seen.append(RunSeen(**{f.name: shaped(f, r.get(f.name)) for f in fields(RunSeen)}))
    return seen


@dataclass
class RunRecord:
    """The run a launch, resume or preflight starts (run.plan_run); the roles read it as
    `dsc_plan.run` (roles/runs reads it through an alias of its own)."""
    id: str
    dir: str  # its directory, the same path on every node
    preset: str
    resume: bool
    auto: list[str]  # what preset=auto chose and why (empty otherwise)
    dry_run: bool
    follow: bool
    preflight: bool  # launch's fast checks first
    max_restarts: int
    batch: dict  # micro_batch, grad_accum, train_batch (or error)
    ds_config: dict | None  # the composed ds_config (None: the script's own, or a resume's kept one)
    config_mode: str  # dsc_ds_config_mode
    ds_config_file: str  # the user's ds_config on the control node (file and hf modes)
    code_dir: str
    code_shared: bool
    code_dest: str  # where the code lands in the run directory
    workdir: str  # where the launcher runs (the code)
    env: dict[str, str]  # the ranks' environment for this run
    secrets_file: str
    commands: dict[str, list[str]]  # {node: the DeepSpeed launcher's argv} where the launch mode starts one
    start_args: dict[str, list[str]]  # {node: the node helper's start options}
    latest_globs: list[str]  # the {latest:GLOB}s every node is asked for before the start (no_ssh mode's)
    checkpoint_shared_dir: str  # dsc_checkpoint_shared_dir: every node must see it ("": node-local)
    code_archive: str  # the code as base64 tar.gz ("" when shared or on resume)
    files: dict[str, str]  # the run directory's files (name -> text)
    resume_files: dict[str, str]  # those a resume writes again (the launch mode's)
    ds_env_file: str
    log: str
    allreduce_result: str


@dataclass
class Plan:
    """The plan: what every play after the first reads as `dsc_plan` (make_plan hands Ansible
    asdict() of it). Its fields are the keys roles/, playbooks/ and templates/ may read; a unit
    test fails on a `dsc_plan.<key>` there that is not one of them, and on a field none reads."""
    cluster_name: str
    nodes: list[NodeRecord]  # a record per node, in rank order
    node: dict[str, NodeRecord]  # the same records by inventory name
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
    warm_record: str  # root's record of the last op warm-up of this install root's JIT cache (dscnode.warm_record), in root's own directory
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
    slurm: SlurmRecord  # roles/slurm's configuration (dsc_slurm_install)
    launcher: LauncherRecord  # how runs start, are read and stop (the launch mode's module in dscplan.launchers)
    firewall: bool  # roles/cluster_network manages the host firewall (cluster_network_firewall)
    ssh_sources: list[str]  # cluster_network_ssh_sources
    node_env: dict[str, str]  # the environment of every DeepSpeed process on a node (op builds, probes)
    rank_env: dict[str, str]  # the ranks' environment (.deepspeed_env)
    pip_env: dict[str, str]  # pip's environment (builds of source packages): node_env without the training user's caches
    helper: str  # the node helper's path on the nodes
    helper_src: str  # the built node helper on the control node (node_helper)
    helper_sha256: str
    runs: list[RunSeen]  # the runs under run_root on the master, newest first (its probe)
    notes: list[str]  # what the plan saw and worked around (a file a probe left unread), said before the playbook goes on
    run: RunRecord | None  # launch, resume, preflight: the run to start; None for the other playbooks


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
