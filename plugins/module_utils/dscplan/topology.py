"""The nodes: order, training addresses, slots and GPUs, the master, the interfaces and the firewall
backend each node gets."""
from __future__ import annotations

import ipaddress
import re

from .record import NodeRecord
from .problems import as_bool, is_int, shown
from .vocabulary import CLUSTER_GROUP
from .settings import setting

MASTER_GROUP = "master"
HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})")


def node_order(groups):
    """Inventory order, the `master` group's first node moved to the front: host order is
    DeepSpeed's node rank order."""
    nodes = list(dict.fromkeys(groups.get(CLUSTER_GROUP) or []))
    masters = [h for h in groups.get(MASTER_GROUP) or [] if h in nodes]
    if masters:
        nodes.remove(masters[0])
        nodes.insert(0, masters[0])
    return nodes


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


def node_records(names, hostvars, defaults, probes, problems, probe_errors):
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
        elif not is_int(slots) or int(slots) <= 0:
            problems.add(f"dsc_slots on host {name} is {shown(slots)}. Fix: a positive number of GPUs "
                         f"(or of ranks on a CPU-only node), or 'auto' to detect GPUs with "
                         f"nvidia-smi.")
            slots = 0
        gpu_ids, slots = _gpu_selection(name, hv.get("dsc_gpus") or [], gpus, wanted_slots, slots,
                                        reachable, problems)
        port = hv.get("dsc_ssh_port", hv.get("ansible_port", 22))
        if not is_int(port) or not 0 < int(port) < 65536:
            problems.add(f"dsc_ssh_port on host {name} is {shown(port)}. Fix: a TCP port 1-65535.")
            port = 22
        nodes.append(NodeRecord(
            name=name, rank=rank, addr=addr, slots=int(slots), ssh_port=int(port),
            gpus=len(gpus), gpu_ids=gpu_ids, used_gpus=gpu_ids or list(range(int(slots) if gpus else 0)),
            # DeepSpeed's hostfile counts a node's GPUs from 0; a selection is passed as --include.
            hostfile_slots=len(gpus) if gpu_ids else int(slots),
            compute_caps=sorted({str(g.get("compute_cap", "")) for g in gpus} - {""}),
            driver=(gpus[0].get("driver") if gpus else "") or "",
            gpu_memory_mib=min((g.get("memory_mib") or 0 for g in gpus
                                if not gpu_ids or int(g.get("index", -1)) in gpu_ids), default=0) or None,
            iface=(iface := interface_for(addr, probe.get("interfaces") or {})),
            link_mbps=(probe.get("link_speeds") or {}).get(iface),
            infiniband=bool(probe.get("infiniband")), rdma=list(probe.get("rdma") or []),
            reachable=reachable, rsync=bool(probe.get("rsync")),
            ssh_host_keys=list(probe.get("ssh_host_keys") or []),
            probe_error="" if reachable else str(probe_errors.get(name, "")),
            helper_sha256=probe.get("helper_sha256"),
            run_root_links=list(probe.get("run_root_links") or []),
            runs_with_secrets=[r["id"] for r in probe.get("runs") or [] if r.get("secrets")],
            memory_records=[dict(r["memory"], run_id=r["id"]) for r in probe.get("runs") or []
                            if isinstance(r.get("memory"), dict)],
        ))
    return nodes


# cluster_network_firewall_backend auto: the firewall of the OS family (/etc/os-release's ID and
# ID_LIKE, as the probe reads them).
FIREWALL_AUTO = {"debian": "ufw", "ubuntu": "ufw", "rhel": "firewalld", "fedora": "firewalld",
                 "centos": "firewalld"}


def firewall_backends(nodes, probes, s, check, problems):
    """Each node's firewall (node.firewall_backend: cluster_network_firewall_backend, auto taken
    from its OS). With `check` and the firewall managed: refused where auto knows no firewall for
    the OS, or where the other firewall runs (two fight over the same tables, and the one not
    managed here keeps the site's rules in force unseen)."""
    wanted = str(s["cluster_network_firewall_backend"])
    for node in nodes:
        seen = (probes.get(node.name) or {}).get("firewalls") or {}
        ids = seen.get("os") or []
        backend = wanted if wanted != "auto" else next((FIREWALL_AUTO[i] for i in ids if i in FIREWALL_AUTO), "")
        node.firewall_backend = backend
        # What ufw.yml reads before it changes anything, as the probe read it (no module call).
        node.ipv6 = bool(seen.get("ipv6"))
        node.ufw_enabled = bool(seen.get("ufw"))
        rules = seen.get("ufw_rules") if backend == "ufw" else None
        node.ufw_rules = [str(t) for t in rules[:2]] if isinstance(rules, list) and len(rules) == 2 else ["", ""]
        if not check or not as_bool(s["cluster_network_firewall"]) or not node.reachable:
            continue
        where = f"cluster_network_firewall_backend on host {node.name} is {wanted!r}"
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
    if not isinstance(wanted, list) or not all(is_int(i) for i in wanted) \
            or len(set(map(int, wanted))) != len(wanted):
        problems.add(f"dsc_gpus on host {name} is {wanted!r}. Fix: a list of distinct GPU "
                     f"indices as nvidia-smi numbers them, e.g. [0, 1].")
        return [], slots
    ids = [int(i) for i in wanted]
    present = {int(g["index"]) for g in gpus if is_int(g.get("index"))}
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


def network_env(nodes):
    """The ranks' network settings read from each node, {variable: [value per node, rank order]}:
    the interface that holds its training address (NCCL's and gloo's), its ACTIVE RDMA ports
    (NCCL_IB_HCA, where a node has one) and, for RoCE, the index of their IPv4 RoCE v2 GID
    (NCCL_IB_GID_INDEX). A node without one gets ''."""
    ifaces = [n.iface for n in nodes]
    env = {"NCCL_SOCKET_IFNAME": ifaces, "GLOO_SOCKET_IFNAME": ifaces}
    active = [[p for p in n.rdma or [] if p.get("state") == "ACTIVE"] for n in nodes]
    if any(active):
        env["NCCL_IB_HCA"] = [",".join(f"{p['device']}:{p['port']}" for p in ports) for ports in active]
    gids = [next((str(p["gid_index"]) for p in ports if p.get("gid_index") is not None), "") for ports in active]
    if any(gids):
        env["NCCL_IB_GID_INDEX"] = gids
    return env
