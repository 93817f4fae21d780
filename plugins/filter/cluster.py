"""The cluster model: the one place that derives master, rank order, addresses, slots and world size.

Every role and template reads the model through these filters:

    {{ hostvars | dsc_cluster_model(groups) }}      -> dict (see cluster_model below)
    {{ hostvars | dsc_cluster_errors(groups) }}     -> list of messages, empty when valid
    {{ text | dsc_parse_hostfile }}                 -> [(host, slots)], DeepSpeed's rules
    {{ text | dsc_parse_ds_env }}                   -> {name: value}, DeepSpeed's runner rules
"""
from __future__ import annotations

import ipaddress
import os
import posixpath
import re

CLUSTER_GROUP = "cluster"
MASTER_GROUP = "master"
ENV_MANAGERS = ("conda", "venv", "existing")
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
HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")
DS_ENV_SAFE = re.compile(r"^[\w@%+=:,./-]*$")
EXACT_VERSION = re.compile(r"^\d+(\.\d+)+([a-z0-9.+-]*)$")
USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")


def _nodes(groups):
    nodes = list(groups.get(CLUSTER_GROUP, []))
    masters = [h for h in groups.get(MASTER_GROUP, []) if h in nodes]
    if masters:
        # An explicit master goes first: host order is DeepSpeed's node rank order.
        nodes.remove(masters[0])
        nodes.insert(0, masters[0])
    return nodes


def _node(hostvars, name):
    """The per-node settings the cluster_model role recorded (role defaults applied)."""
    return hostvars[name].get("__dsc_node") or {}


def _slots(hv):
    slots = hv.get("slots", "auto")
    if str(slots) == "auto":
        return hv.get("gpus_detected")
    return slots


def cluster_model(hostvars, groups):
    """Derive the model. Call dsc_cluster_errors first: this assumes valid input."""
    nodes = []
    for name in _nodes(groups):
        hv = _node(hostvars, name)
        slots = _slots(hv)
        nodes.append({
            "name": name,
            "addr": str(hv["addr"]),
            "slots": int(slots) if slots is not None else None,
            "ssh_port": int(hv["ssh_port"]),
            "gpus": int(hv.get("gpus_detected") or 0),
            "compute_caps": list(hv.get("compute_caps") or []),
            "driver": hv.get("driver") or "",
        })
    master = nodes[0] if nodes else None
    world = sum(n["slots"] or 0 for n in nodes)
    return {
        "master": master["name"] if master else None,
        "master_addr": master["addr"] if master else None,
        "nodes": nodes,
        "node_names": [n["name"] for n in nodes],
        "addrs": [n["addr"] for n in nodes],
        "num_nodes": len(nodes),
        "world_size": world,
        "ssh_ports": sorted({n["ssh_port"] for n in nodes}),
        # cuda when every node has GPUs; cpu (gloo) otherwise.
        "accelerator": "cuda" if nodes and all(n["gpus"] > 0 for n in nodes) else "cpu",
        # TORCH_CUDA_ARCH_LIST for JIT op builds, from the detected GPUs ("9.0", never "9.0a").
        "cuda_arch_list": ";".join(sorted({c for n in nodes for c in n["compute_caps"]})),
    }


def _group_by(names, value_of):
    """{str(value): [names having it]}, in inventory order: more than one key means a mismatch."""
    groups = {}
    for name in names:
        groups.setdefault(str(value_of(name)), []).append(name)
    return groups


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool) or (
        isinstance(value, str) and value.strip().lstrip("-").isdigit())


def cluster_errors(hostvars, groups, check_wheelhouse=os.path.isdir):
    """Every problem with the inventory, each naming the variable, the host and the fix."""
    errors = []
    names = _nodes(groups)
    if not names:
        return [f"inventory: the group '{CLUSTER_GROUP}' is empty or missing. Fix: list your nodes "
                f"under 'all: children: {CLUSTER_GROUP}: hosts:' (see inventory/example/hosts.yml)."]
    seen_addr = {}
    for name in names:
        hv = _node(hostvars, name)
        slots = hv.get("slots", "auto")
        if str(slots) != "auto":
            if not _is_int(slots) or int(slots) <= 0:
                errors.append(f"dsc_slots on host {name} is {slots!r}. Fix: a positive number of "
                              f"GPUs (or of ranks on a CPU-only node), or 'auto' to detect GPUs "
                              f"with nvidia-smi.")
        elif int(hv.get("gpus_detected") or 0) == 0:
            errors.append(f"dsc_slots on host {name} is 'auto' but nvidia-smi found no GPU there. "
                          f"Fix: set dsc_slots to the rank count for a CPU-only node.")
        addr = str(hv.get("addr"))
        if addr in seen_addr:
            errors.append(f"dsc_addr on host {name} is {addr}, the same as on host "
                          f"{seen_addr[addr]}. Fix: give each node its own training-network "
                          f"address.")
        seen_addr.setdefault(addr, name)
        if re.fullmatch(r"[0-9.]+", addr):
            try:
                ipaddress.IPv4Address(addr)
            except ValueError:
                errors.append(f"dsc_addr on host {name} is {addr!r}, not an IPv4 address. Fix: the "
                              f"node's address on the training network, e.g. 10.0.0.11.")
        port = hv.get("ssh_port")
        if not _is_int(port) or not 0 < int(port) < 65536:
            errors.append(f"dsc_ssh_port on host {name} is {port!r}. Fix: a TCP port 1-65535.")
        errors.extend(_cluster_wide_errors(name, hv, check_wheelhouse))
    # Cluster-wide settings must agree on every node: the launcher runs the master's paths.
    for var in ("dsc_env_manager", "dsc_install_root", "dsc_torch_version",
                "dsc_deepspeed_version", "dsc_torch_variant", "dsc_train_user",
                "dsc_master_port", "dsc_run_root"):
        values = _group_by(names, lambda name: _node(hostvars, name).get(var))
        if len(values) > 1:
            detail = "; ".join(f"{v!r} on {', '.join(h)}" for v, h in values.items())
            errors.append(f"{var} differs between nodes ({detail}). Fix: set it once for the "
                          f"group '{CLUSTER_GROUP}' (group_vars), not per host: the launcher "
                          f"runs the master's paths on every node.")
    # Cluster-wide messages come once per host with the same text: keep one, in order.
    return list(dict.fromkeys(errors))


def _cluster_wide_errors(name, hv, check_wheelhouse):
    errors = []
    manager = hv.get("dsc_env_manager", "venv")
    if manager not in ENV_MANAGERS:
        errors.append(f"dsc_env_manager on host {name} is {manager!r}. Fix: one of "
                      f"{', '.join(ENV_MANAGERS)}.")
    root = str(hv.get("dsc_install_root", ""))
    if not posixpath.isabs(root):
        errors.append(f"dsc_install_root on host {name} is {root!r}, not an absolute path. Fix: "
                      f"an absolute path such as /opt/dscluster, the same on every node.")
    run_root = str(hv.get("dsc_run_root", "/"))
    if not posixpath.isabs(run_root):
        errors.append(f"dsc_run_root on host {name} is {run_root!r}, not an absolute path. Fix: "
                      f"an absolute path such as /opt/dscluster/runs.")
    for var, example in (("dsc_torch_version", "2.13.0"), ("dsc_deepspeed_version", "0.19.8")):
        value = str(hv.get(var, example))
        if not EXACT_VERSION.match(value):
            errors.append(f"{var} on host {name} is {value!r}, not an exact version. Fix: pin one "
                          f"release, e.g. {example!r}: the same on every node, no range.")
    pyver = str(hv.get("dsc_python_version", "3.11"))
    if not re.fullmatch(r"3\.\d+(\.\d+)?", pyver):
        errors.append(f"dsc_python_version on host {name} is {pyver!r}. Fix: a Python 3 version "
                      f"such as '3.11' (quoted in YAML).")
    user = str(hv.get("dsc_train_user", "dstrain"))
    if user == "root" or not USER_NAME.match(user):
        errors.append(f"dsc_train_user on host {name} is {user!r}. Fix: a non-root user name "
                      f"(lower case, e.g. dstrain): ranks must not run as root.")
    cname = str(hv.get("dsc_cluster_name", "default"))
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", cname) or cname in (".", ".."):
        errors.append(f"dsc_cluster_name on host {name} is {cname!r}. Fix: letters, digits, '.', "
                      f"'_' and '-' only (it names key and report files).")
    variant = hv.get("dsc_torch_variant", "cpu")
    if variant not in TORCH_INDEXES:
        errors.append(f"dsc_torch_variant on host {name} is {variant!r}. Fix: one of "
                      f"{', '.join(TORCH_INDEXES)}.")
    if manager == "conda":
        if not hv.get("dsc_conda_installer_file") and not hv.get("dsc_conda_installer_sha256"):
            errors.append(f"dsc_conda_installer_sha256 on host {name} is empty. Fix: set the "
                          f"sha256 of the Miniconda installer named by dsc_conda_installer_url "
                          f"(published beside it on repo.anaconda.com), or give "
                          f"dsc_conda_installer_file.")
    if manager == "existing":
        py = str(hv.get("dsc_existing_python", ""))
        if not posixpath.isabs(py):
            errors.append(f"dsc_existing_python on host {name} is {py!r}. Fix: the absolute "
                          f"path of the interpreter already on the node, e.g. "
                          f"/opt/torch/.venv/bin/python.")
    wheelhouse = hv.get("dsc_wheelhouse") or ""
    if wheelhouse and check_wheelhouse is not None and not check_wheelhouse(str(wheelhouse)):
        errors.append(f"dsc_wheelhouse on host {name} is {wheelhouse!r}, which does not exist on "
                      f"the control node. Fix: build it (scripts/wheelhouse.sh) or point it at "
                      f"a directory of wheels.")
    first, last = hv.get("dsc_master_port", 29500), hv.get("dsc_master_port_last", 29510)
    if not _is_int(first) or not 1024 <= int(first) < 65536:
        errors.append(f"dsc_master_port on host {name} is {first!r}. Fix: a TCP port 1024-65535.")
    elif not _is_int(last) or not int(first) <= int(last) < 65536:
        errors.append(f"dsc_master_port_last on host {name} is {last!r}. Fix: a port from "
                      f"dsc_master_port ({first}) to 65535; the range is tried in order.")
    return errors


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
    for n, line in enumerate(text.split("\n"), 1):
        if line == "" and n == len(text.split("\n")):
            continue  # the final newline
        if "=" not in line:
            raise ValueError(f".deepspeed_env line {n} has no '=' (blank or comment lines crash "
                             f"the launcher): {line!r}")
        key, val = line.split("=", 1)
        if key.startswith("export ") or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise ValueError(f".deepspeed_env line {n}: {key!r} is not a plain variable name")
        env[key] = val
    return env


def report_row(pair):
    versions, name = pair
    v = versions or {}
    return " | ".join([name] + [str(v.get(k, "?")) for k in
                                ("python", "torch", "cuda", "deepspeed", "gpus", "driver", "prefix")])


def version_diff(hostvars, names):
    """Messages for each version that is not the same on every node, naming the nodes."""
    diffs = []
    for key in ("python", "torch", "cuda", "deepspeed", "nccl", "prefix"):
        values = _group_by(names, lambda name: (hostvars[name].get("dsc_versions") or {}).get(key))
        if len(values) > 1:
            diffs.append(f"{key}: " + ", ".join(f"{v} on {'/'.join(h)}" for v, h in values.items()))
    return diffs


def batch(micro, accum, total, world):
    """train_batch = micro x accum x world: derive what is missing (0 = not given), check the rest."""
    micro, accum, total, world = int(micro or 0), int(accum or 0), int(total or 0), int(world)
    where = (f"(dsc_micro_batch={micro or 'unset'}, dsc_grad_accum={accum or 'unset'}, "
             f"dsc_train_batch={total or 'unset'}, world size {world})")
    if world <= 0:
        return {"error": f"world size is {world}: no slots in the cluster model"}
    if micro and accum and total:
        if micro * accum * world != total:
            return {"error": f"batch settings disagree: {micro} x {accum} x {world} = "
                             f"{micro * accum * world}, not {total} {where}. Fix: give any two."}
    elif micro and total:
        accum, rem = divmod(total, micro * world)
        if rem or not accum:
            return {"error": f"dsc_train_batch {total} is not a multiple of micro-batch x world "
                             f"size = {micro * world} {where}."}
    elif accum and total:
        micro, rem = divmod(total, accum * world)
        if rem or not micro:
            return {"error": f"dsc_train_batch {total} is not a multiple of grad-accum x world "
                             f"size = {accum * world} {where}."}
    elif micro:
        accum = accum or 1
    else:
        return {"error": f"set dsc_micro_batch (and optionally one of dsc_grad_accum, "
                         f"dsc_train_batch) {where}."}
    return {"micro_batch": micro, "grad_accum": accum, "train_batch": micro * accum * world}


def status_row(st):
    st = st or {}
    if st.get("state") == "unreachable":
        return f"{st.get('host', '?')}: unreachable (node down or sshd stopped)"
    last = st.get("last") or {}
    mem = last.get("mem_allocated_gib", last.get("rss_max_gib", "-"))
    return (f"{st.get('host', '?')}: {st.get('state', '?')}, ranks alive {st.get('ranks_alive', 0)}, "
            f"step {last.get('step', '-')}, loss {last.get('loss', '-')}, "
            f"tokens/s {last.get('tokens_per_s', '-')}, memory {mem} GiB")


class FilterModule:
    def filters(self):
        return {
            "dsc_cluster_model": cluster_model,
            "dsc_cluster_errors": cluster_errors,
            "dsc_parse_hostfile": parse_hostfile,
            "dsc_parse_ds_env": parse_ds_env,
            "dsc_torch_index": lambda variant: TORCH_INDEXES.get(variant, ""),
            "dsc_report_row": report_row,
            "dsc_version_diff": version_diff,
            "dsc_batch": batch,
            "dsc_status_row": status_row,
        }
