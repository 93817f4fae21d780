"""Preflight verdicts: turn what each node reported into rows of PASS / WARN / FAIL with a fix.

    {{ hostvars | dsc_preflight_rows(dsc_plan, settings) }}     -> [{check, node, status, detail, fix}]
    {{ rows | dsc_preflight_table }}                             -> lines of a readable table

Each node's facts come from the preflight role: __preflight_reach, __preflight_probe (the node
helper's `check`), __preflight_tcp (a connection to the master port); the master adds
__preflight_mesh, __preflight_iperf and __preflight_allreduce. One row per check and node, in the order of
DEEPSPEED_FACTS' failure modes; a check that could not run says why.
"""
from __future__ import annotations

import json
import re

from dscnode import nccllog  # node/dscnode, pure Python
from dscplan.network import NETWORK_FIX, below_promise, promised  # plugins/module_utils/dscplan, pure Python

# The oldest Linux driver each CUDA major release runs on (minor-version compatibility, from
# NVIDIA's CUDA toolkit release notes, table 2).
MIN_DRIVER = {"11": "450.80.02", "12": "525.60.13", "13": "580.65.06"}
VERSION_KEYS = ("python", "torch", "cuda", "deepspeed", "nccl")
PROVISION_FIX = "re-run provision.yml for the whole cluster (the same pins reach every node)"


def _ver(text):
    return tuple(int(x) for x in str(text).split(".") if x.isdigit())


def _row(check, node, status, detail, fix=""):
    return {"check": check, "node": node, "status": status, "detail": detail,
            "fix": fix if status != "PASS" else ""}


def _iface_matches(name, spec):
    if spec.startswith("="):
        return name == spec[1:]
    return name.startswith(spec)


def _holds(addrs, addr):
    """Whether an interface with these IPv4 addresses answers on addr: the loopback interface
    answers on all of 127.0.0.0/8 (two nodes on one host: 127.0.0.1 and 127.0.0.2)."""
    return addr in addrs or (addr.startswith("127.") and any(a.startswith("127.") for a in addrs))


def interface_verdict(node, addr, interfaces, configured):
    """(status, detail, fix) for the interface NCCL and gloo will use on a node."""
    fix_auto = ("unset NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME in dsc_rank_env (the toolkit "
                "then names the interface holding dsc_addr), or name one that exists here")
    specs = [s for s in str(configured or "").split(",") if s and not s.startswith("^")]
    if specs:
        chosen = {n: a for n, a in interfaces.items() if any(_iface_matches(n, s) for s in specs)}
        if not chosen:
            return ("FAIL", f"interface {configured} (NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME) does "
                            f"not exist on {node}; it has {', '.join(sorted(interfaces))}", fix_auto)
        addrs = [x for a in chosen.values() if a for x in a]
        if all(a is None for a in chosen.values()) or _holds(addrs, addr):
            return ("PASS", f"{', '.join(sorted(chosen))} holds {addr}", "")
        return ("FAIL", f"interface {', '.join(sorted(chosen))} on {node} holds {', '.join(addrs) or 'no IPv4'}, "
                        f"not the training address {addr}", fix_auto)
    holding = sorted(n for n, a in interfaces.items() if a and _holds(a, addr))
    if holding:
        return ("PASS", f"{holding[0]} holds {addr}", "")
    if addr.startswith("127."):
        return ("PASS", f"loopback address {addr} (nodes on one host)", "")
    return ("FAIL", f"no interface on {node} holds its training address {addr}",
            "set dsc_addr to an address of this node, or add that address to an interface")


def rank_network_verdict(node, cluster):
    """(status, detail, fix): the network settings this node's ranks get (the plan's network_env,
    each node's own where they differ) and its RDMA ports; WARN for a port that is not ACTIVE
    (NCCL leaves it out) and for RDMA that NCCL will not use because another node has none."""
    own = node.get("network_env") or {}
    per_node = sorted(k for k in own if f"DSC_NODE_{k}" in cluster["rank_env"])
    detail = ", ".join(f"{k}={v}" for k, v in own.items() if v) or "NCCL's own choice"
    if per_node:
        detail += f" (this node's own: {', '.join(per_node)} differ between nodes)"
    ports = node.get("rdma") or []
    if ports:
        detail += "; RDMA " + ", ".join(f"{p['device']}/{p['port']} {p['state']} ({p['link_layer']})" for p in ports)
    down = [p for p in ports if p.get("state") != "ACTIVE"]
    if down:
        p = down[0]
        return ("WARN", detail, f"{p['device']} port {p['port']} is {p['state']}, so NCCL leaves it out: check "
                                f"its cable and link (ibstat {p['device']}) and the subnet manager")
    if ports and cluster["rank_env"].get("NCCL_IB_DISABLE") == "1":
        return ("WARN", detail + "; NCCL_IB_DISABLE=1: not every node has RDMA, so all use TCP sockets",
                "give every node an RDMA port, or set NCCL_IB_DISABLE in dsc_rank_env if NCCL should try it")
    return ("PASS", detail, "")


def owner_verdict(owners):
    """(status, detail, fix): the node helper root runs, and its directory, must be root's alone."""
    bad = {p: o for p, o in owners.items() if not o.get("safe")}
    if bad:
        path, o = next(iter(bad.items()))
        why = o.get("error") or f"owner uid {o['uid']}, mode {o['mode']}"
        return ("FAIL", f"{path}: {why}; root runs the node helper, so whoever can write it runs code as root",
                "re-run provision.yml (it installs the helper root-owned, 0755), and find who changed it")
    return ("PASS", "the node helper and its directory are root's, not writable by others", "")


def root_paths_verdict(node, report, train_user):
    """(status, detail, fix) for the paths root creates or writes into on a node (the node
    helper's root_paths): FAIL naming the first link or foreign owner, with the plan's own words
    (dscplan.settings.root_path_problems: the plan refuses the same)."""
    import dscplan  # noqa: PLC0415 - pure Python, only for this verdict
    if report is None:
        return ("WARN", "the node helper did not report them (older helper)", "re-run provision.yml")
    # The only data dir preflight sees is a shared one (dsc_data_shared), which nothing writes.
    problems = dscplan.root_path_problems(node, report, train_user, data=False)
    if problems:
        detail, _, fix = problems[0].partition(" Fix: ")
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return ("FAIL", detail + more, fix.replace("; nothing was changed.", ""))
    return ("PASS", f"{len(report)} paths: no link, each owned by root or {train_user} as expected", "")


def lock_verdict(node, locks):
    """(status, detail, fix) for torch's op-build locks on a node (the node helper's jit_locks)."""
    stale = [x for x in locks if x.get("stale")]
    unread = [x for x in locks if x.get("error")]
    if stale:
        paths = ", ".join(f"{x['path']} ({x['age_s']:.0f} s old)" for x in stale)
        return ("FAIL", f"stale op-build lock {paths}, no build running: every run that builds that "
                        f"op on {node} waits for it forever",
                "ansible-playbook stop.yml removes it (or rm it by hand while nothing builds)")
    if unread:
        return ("WARN", f"op-build locks not read: {unread[0]['error']}", "check the training user can read "
                        f"{unread[0]['path']}")
    held = [x["path"] for x in locks]
    return ("PASS", f"a build holds {', '.join(held)}" if held else "no stale op-build lock", "")


def driver_verdict(cuda, driver):
    if not cuda or cuda == "cpu":
        return ("PASS", "CPU build of torch: no driver needed", "")
    if not driver:
        return ("FAIL", f"torch is built for CUDA {cuda} but nvidia-smi reports no driver",
                "install the NVIDIA driver, or use the cpu torch variant on CPU-only nodes")
    need = MIN_DRIVER.get(str(cuda).split(".")[0])
    if need and _ver(driver) < _ver(need):
        return ("FAIL", f"driver {driver} is older than {need}, the minimum for CUDA {cuda}",
                f"upgrade the driver to {need} or newer, or pick an older dsc_torch_variant")
    return ("PASS", f"driver {driver} runs CUDA {cuda} (needs {need or '?'})", "")


def gpu_health_rows(node, health):
    """The GPU gate's row for a node (dscnode.gpuhealth's findings): its worst finding's status,
    every finding and its fix in it, else a PASS; none where the node has no nvidia-smi."""
    if not health:
        return []
    if not health["findings"]:
        gpus = health["gpus"]
        return [_row("gpu health", node, "PASS", f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} "
                     f"({', '.join(sorted({g['name'] for g in gpus}))}): no ECC, row remapping, PCIe link, "
                     f"clock, NVLink or Xid fault ({health['seconds']:.1f} s)")]
    found = health["findings"]
    status = "FAIL" if any(f["status"] == "FAIL" for f in found) else "WARN"
    return [_row("gpu health", node, status, "; ".join(f["what"] for f in found),
                 "; ".join(dict.fromkeys(f["fix"] for f in found)))]


def _ssh_rows(names, master, hv, mesh, launcher, train_user):
    """ssh from the master to each node as the training user (more than one node; a single "not
    used" row where the launch mode uses no ssh between nodes)."""
    rows, ssh = [], launcher["ssh_mesh"]
    if len(names) > 1 and not ssh:
        rows.append(_row("ssh from master", "all", "PASS",
                         f"not used: the {launcher['name']} launch mode starts no ssh between nodes"))
    for n in names if len(names) > 1 and ssh else []:
        m = mesh.get(n)
        if m is None:
            why = hv[master].get("__preflight_mesh_error") or "the master did not report"
            rows.append(_row("ssh from master", n, "FAIL", f"not checked: {why}",
                             f"make {master} reachable and re-run provision.yml (it creates the "
                             f"training user {train_user} and its ssh setup)"))
        elif m["ok"]:
            rows.append(_row("ssh from master", n, "PASS",
                             f"{train_user}@{master} -> {n} ({m['hostname']}), no prompt"))
        else:
            rows.append(_row("ssh from master", n, "FAIL",
                             f"{train_user}@{master} cannot ssh to {n}: {m['error']}",
                             "start sshd there, then re-run provision.yml (keys, known_hosts, "
                             "~/.ssh/config for the training user)"))
    return rows


def _name_rows(ok, probe, nodes):
    """Every node name resolves to its training address on each node (pdsh mode)."""
    rows = []
    want = {node["name"]: node["addr"] for node in nodes}
    for n in ok:
        res = probe[n].get("resolve", {})
        bad = [f"{name} -> {', '.join(res.get(name, ['?']))} (want {addr})"
               for name, addr in want.items() if addr not in res.get(name, [])]
        rows.append(_row("names", n, "FAIL" if bad else "PASS",
                         "; ".join(bad) if bad else "every node name resolves to its training address",
                         "let provision.yml manage /etc/hosts (cluster_network_manage_hosts) or fix DNS"))
    return rows


def _version_rows(ok, probe, master, settings):
    """Versions and paths: each node against the master (the launcher runs the master's paths)."""
    rows = []
    ref = probe.get(master, {}).get("versions") or {}
    for n in ok:
        v = probe[n].get("versions") or {}
        if "error" in v or not probe[n].get("env_prefix_exists"):
            detail = v.get("error") or f"env prefix {settings['env_prefix']} missing"
            rows.append(_row("env and versions", n, "FAIL", detail,
                             f"{PROVISION_FIX}; the env must be at {settings['env_prefix']} on every node"))
            continue
        diff = [f"{k} {v.get(k)} here, {ref.get(k)} on {master}" for k in VERSION_KEYS
                if ref and "error" not in ref and v.get(k) != ref.get(k)]
        detail = ("; ".join(diff) if diff else
                  "python {python}, torch {torch} ({cuda}), DeepSpeed {deepspeed}, NCCL {nccl}".format(**v)
                  + f", env {settings['env_prefix']}")
        rows.append(_row("env and versions", n, "FAIL" if diff else "PASS", detail, PROVISION_FIX))
    return rows


def _shared_path_rows(ok, probe, settings):
    """The data and code directories, where they are shared, on each node."""
    rows = []
    if settings.get("data_dir"):
        for n in ok:
            readable = probe[n].get("data_readable")
            rows.append(_row("data path", n, "PASS" if readable else "FAIL",
                             f"{settings['data_dir']} {'readable' if readable else 'missing or not readable'}"
                             f" by {settings['train_user']}",
                             "mount the dataset at the same path on every node, readable by the "
                             "training user, or set dsc_data_shared: false to sync it at launch"))
    if settings.get("code_dir"):
        for n in ok:
            exists = probe[n].get("code_dir_exists")
            rows.append(_row("code path", n, "PASS" if exists else "FAIL",
                             f"{settings['code_dir']} {'exists' if exists else 'is missing'}",
                             "mount the shared code directory at the same path on every node, "
                             "or set dsc_code_shared: false to sync the code at launch"))
    return rows


def _slot_rows(nodes, ok, probe):
    """dsc_slots against the GPUs (or CPUs) each node has."""
    rows = []
    for node in nodes:
        n = node["name"]
        if n not in ok:
            continue
        slots, gpus, cpus = node["slots"], node["gpus"], probe[n].get("cpus") or 0
        # The fast checks read versions without importing torch: no GPU count from torch there.
        torch_gpus = (probe[n].get("versions") or {}).get("torch_gpus")
        if gpus:
            if slots > gpus:
                st, d = "FAIL", f"dsc_slots={slots} but nvidia-smi sees {gpus} GPUs on {n}"
            elif torch_gpus is not None and torch_gpus != gpus:
                st, d = "FAIL", f"nvidia-smi sees {gpus} GPUs but torch sees {torch_gpus} on {n}"
            elif slots < gpus:
                st, d = "WARN", f"{slots} of {gpus} GPUs used on {n}"
            else:
                st, d = "PASS", f"{slots} slots = {gpus} GPUs"
            fix = "set dsc_slots to the GPU count (or auto); check CUDA_VISIBLE_DEVICES and the driver"
        else:
            st, d = ("FAIL", f"dsc_slots={slots} CPU ranks but {n} has {cpus} CPUs") if slots > cpus \
                else ("PASS", f"{slots} CPU ranks on {cpus} CPUs")
            fix = f"set dsc_slots on {n} to at most its CPU count ({cpus})"
        rows.append(_row("slots", n, st, d, fix))
    return rows


def _master_port_rows(probe, master, settings):
    """The master port range and an active run on the master (none where the master was not probed)."""
    port = probe.get(master, {}).get("port")
    if not port:
        return []
    rows = []
    first, last = settings["port_first"], settings["port_last"]
    if port["wanted_free"]:
        rows.append(_row("master port", master, "PASS", f"{first} is free"))
    elif port["first_free"]:
        rows.append(_row("master port", master, "WARN",
                         f"{first} is in use on {master}; launch will take {port['first_free']} "
                         f"(the next free port in {first}-{last})",
                         f"stop what holds {first} (ss -ltnp 'sport = :{first}') if it is a stale run"))
    else:
        rows.append(_row("master port", master, "FAIL", f"every port {first}-{last} is in use on {master}",
                         "stop the runs holding them, or widen dsc_master_port_last"))
    active = probe[master].get("active_run")
    rows.append(_row("active run", master, "WARN" if active else "PASS",
                     f"run {active} is active" if active else "no run is active",
                     f"stop it (stop.yml -e run_id={active}) or launch with -e replace=true"))
    return rows


def _firewall_rows(ok, probe):
    """Each node's firewall, with or without the toolkit's rules."""
    rows = []
    for n in ok:
        fw = probe[n].get("firewall") or {}
        if fw.get("state") == "active" and fw.get("master_rule") is False:
            rows.append(_row("firewall", n, "WARN", f"{fw['tool']} active without the toolkit's rules",
                             "re-run provision.yml (cluster_network_firewall) or open the ports yourself"))
        else:
            rules = " with the toolkit's rules" if fw.get("master_rule") else ""
            rows.append(_row("firewall", n, "PASS", f"{fw.get('tool') or 'no firewall tool'}: "
                             f"{fw.get('state')}{rules}"))
    return rows


def _clock_rows(names, mesh, master, settings):
    """Each node's clock offset against the master's."""
    rows = []
    for n in names:
        m = mesh.get(n) or {}
        if "offset_s" not in m:
            continue
        off, err = abs(m["offset_s"]), m["rtt_s"] / 2
        st = ("FAIL" if off - err > settings["clock_fail_s"] else
              "WARN" if off - err > settings["clock_warn_s"] else "PASS")
        rows.append(_row("clock", n, st, f"offset {m['offset_s']:+.4f} s against {master} (+-{err:.4f})",
                         "run chrony or systemd-timesyncd on every node"))
    return rows


def iperf_row(node, ip, records):
    """A node's iperf3 to the next one (ip: iperf_result's), held against the slower interface's
    stated speed (records: the plan's nodes by name)."""
    if ip.get("gbps") is None:  # an error that names its own fix (the port's holder) keeps it
        error, _, fix = str(ip.get("error")).partition(". Fix: ")
        return _row("iperf3", node, "WARN", f"{node} -> {ip['to']}: {error}",
                    fix or "install iperf3 (base_packages) and allow the cluster's addresses")
    promise = promised(records.get(node) or {}, records.get(ip["to"]) or {})["iperf_gbps"]
    slow = below_promise(ip["gbps"], promise, "iperf3", "Gbit/s")
    return _row("iperf3", node, "WARN" if slow else "PASS", f"{node} -> {ip['to']}: {ip['gbps']:.2f} Gbit/s"
                + (f", {slow}" if slow else f" (stated {promise:g})" if promise else ""), NETWORK_FIX if slow else "")


def _allreduce_rows(ar, nodes):
    """The all-reduce measured across the cluster, where it ran (ar: its report), its largest size
    held against the RDMA ports where NCCL ran it and every node has one: the slowest of the
    nodes' fastest ACTIVE ports (dscplan.network.promised, which holds gloo to none)."""
    if ar is None:
        return []
    rows = []
    if ar.get("skipped"):
        rows.append(_row("all-reduce", "all", "WARN", f"not measured: {ar['skipped']}",
                         "fix what the rows above name, then run preflight.yml again"))
    elif ar.get("busbw_gbps_max") is not None:
        big = ar["rows"][-1]
        promises = [promised(a, b, ar.get("backend"))["allreduce_gbps"] for a in nodes for b in nodes if a is not b]
        promise = min(promises) if promises and None not in promises else None
        slow = below_promise(big["busbw_gbps"], promise, "busbw", "GB/s")
        rows.append(_row("all-reduce", "all", "WARN" if slow else "PASS",
                         f"{ar['world_size']} ranks ({ar['backend']}): busbw {big['busbw_gbps']:.3f} GB/s "
                         f"at {big['bytes'] // 2**20} MiB" + (f": {slow}" if slow else ""),
                         NETWORK_FIX if slow else ""))
    else:
        rows.append(_row("all-reduce", "all", "FAIL", ar.get("error", "did not finish"),
                         "read the run's launcher.log (kept in the report); fix the FAILs above first"))
    return rows


def transport_rows(ar, nodes):
    """What NCCL used on each node in the all-reduce (train.allreduce's "transport", GPU nodes
    only), judged against the node's RDMA ports (dscnode.nccllog.judge)."""
    rows = []
    for i, node in enumerate(nodes):
        t = ((ar or {}).get("transport") or {}).get(str(i))
        if t is not None:
            status, fix = nccllog.judge(t, node.get("rdma"), node["name"])
            rows.append(_row("nccl transport", node["name"], status, t["summary"], fix))
    return rows


def preflight_rows(hostvars, cluster, settings):
    rows = [_row("inventory", "all", "PASS", "cluster model valid: "
                 f"{cluster['num_nodes']} nodes, world size {cluster['world_size']}, "
                 f"master {cluster['master']} ({cluster['master_addr']})")]
    names = cluster["node_names"]
    master = cluster["master"]
    hv = {n: hostvars[n] for n in names}
    reach = {n: bool(hv[n].get("__preflight_reach")) for n in names}
    probe = {n: hv[n].get("__preflight_probe") or {} for n in names}
    for n in names:
        if reach[n]:
            rows.append(_row("reachable", n, "PASS", "Ansible reached it"))
        else:
            rows.append(_row("reachable", n, "FAIL", f"Ansible cannot reach {n}: "
                             f"{hv[n].get('__preflight_unreachable_msg', 'unreachable')}",
                             "start sshd on the node, or fix ansible_host/ansible_port/the key"))
    ok = [n for n in names if reach[n] and probe[n]]
    records = {node["name"]: node for node in cluster["nodes"]}
    mesh = hv[master].get("__preflight_mesh") or {}
    # Without ssh between nodes, nothing resolves their names (the hostfile's names are only keys
    # there, the master an address).
    launcher = cluster["launcher"]
    rows += _ssh_rows(names, master, hv, mesh, launcher, settings["train_user"])
    if launcher["ssh_mesh"]:
        rows += _name_rows(ok, probe, cluster["nodes"])
    rows += _version_rows(ok, probe, master, settings)
    rows += package_rows(ok, probe, master)
    rows += _shared_path_rows(ok, probe, settings)
    rows += _slot_rows(cluster["nodes"], ok, probe)
    for node in cluster["nodes"]:
        n = node["name"]
        if n in ok:
            cuda = (probe[n].get("versions") or {}).get("cuda")
            rows.append(_row("driver", n, *driver_verdict(cuda, node["driver"])))
    for n in ok:
        rows += gpu_health_rows(n, probe[n].get("gpu_health"))
    for n in ok:
        disk = probe[n].get("disk") or {}
        free, need = disk.get("free_gib", 0), settings["min_free_gib"]
        st = "FAIL" if free < need else "WARN" if free < 2 * need else "PASS"
        rows.append(_row("disk", n, st, f"{free} GiB free at {disk.get('path')} (runs and checkpoints; "
                         f"want {need} GiB)", "free space there, or point dsc_run_root at a larger disk"))
    for n in ok:
        rows.append(_row("op build locks", n, *lock_verdict(n, probe[n].get("jit_locks") or [])))
        rows.append(_row("helper owner", n, *owner_verdict(probe[n].get("helper_owners") or {})))
        rows.append(_row("root paths", n, *root_paths_verdict(n, probe[n].get("root_paths"),
                                                              settings["train_user"])))
    rows += _master_port_rows(probe, master, settings)
    tcp_port = hv[master].get("__preflight_tcp_port")
    for n in ok:
        t = hv[n].get("__preflight_tcp")
        if not tcp_port or t is None:
            continue
        target = f"{cluster['master_addr']}:{tcp_port}"
        rows.append(_row("tcp to master port", n, "PASS" if t["ok"] else "FAIL",
                         f"{n} -> {target} {'connects' if t['ok'] else 'fails: ' + t['msg']}",
                         f"open {settings['port_first']}-{settings['port_last']}/tcp on {master} to "
                         f"the cluster's addresses (provision.yml's firewall does), and check routes"))
    rows += _firewall_rows(ok, probe)
    for node in cluster["nodes"]:
        n = node["name"]
        if n in ok:
            own = (node.get("network_env") or {}).get("NCCL_SOCKET_IFNAME", "")
            rows.append(_row("interface", n, *interface_verdict(
                n, node["addr"], probe[n].get("interfaces") or {}, settings.get("ifname") or own)))
            rows.append(_row("rank network", n, *rank_network_verdict(node, cluster)))
    rows += _clock_rows(names, mesh, master, settings)
    rows += [iperf_row(n, hv[n]["__preflight_iperf"], records) for n in names
             if hv[n].get("__preflight_iperf") is not None]
    rows += _allreduce_rows(hv[master].get("__preflight_allreduce"), cluster["nodes"])
    rows += transport_rows(hv[master].get("__preflight_allreduce"), cluster["nodes"])
    if (cluster.get("slurm") or {}).get("install") or cluster["launcher"]["queue"] is not None:
        rows += slurm_rows(cluster, {n: hv[n].get("__preflight_slurm") for n in ok})
    return rows


SLURM_READY = ("idle", "mixed", "allocated", "completing")


def _answers(registered):
    """{name: (rc, text)} of roles/preflight/tasks/slurm.yml's loop; a skipped read is absent."""
    out = {}
    for r in (registered or {}).get("results") or []:
        if not r.get("skipped"):
            text = (r.get("stdout") or "").strip() if r.get("rc") == 0 else \
                (r.get("stderr") or r.get("msg") or "").strip().splitlines()[-1:] or [f"exit {r.get('rc')}"]
            out[r["item"]["name"]] = (r.get("rc"), text if isinstance(text, str) else text[0])
    return out


def slurm_rows(cluster, registered):
    """Per node, the Slurm the toolkit installed (dsc_slurm_install) or the site's own that slurm
    mode launches through: "munge" (the master's credential read there: the one key) and "slurm"
    (its slurmd answers, slurmctld lists it ready in the partition, with as many GPUs as gres as
    the plan gives it). `registered`: {node: the
    registered loop of roles/preflight/tasks/slurm.yml}, for the nodes that answered preflight."""
    master, partition = cluster["master"], cluster["slurm"]["partition"]
    # Where the toolkit did not install Slurm, the site's configuration is what to fix.
    ours = cluster["slurm"]["install"]
    answers = {n: _answers(r) for n, r in registered.items()}
    rc, text = answers.get(master, {}).get("sinfo", (None, "not asked"))
    listed = {}
    for line in text.splitlines() if rc == 0 else []:
        name, state, gres, reason = (line.split("|") + ["", "", ""])[:4]
        listed[name] = (state, gres, reason)
    rows = []
    if rc != 0:
        rows.append(_row("slurm", master, "FAIL", f"sinfo on {master} fails: {text}",
                         f"systemctl status slurmctld on {master} and /var/log/slurm/slurmctld.log"))
    for node in cluster["nodes"]:
        n = node["name"]
        if n not in answers:
            continue
        mrc, mtext = answers[n].get("unmunge", (None, "not asked"))
        rows.append(_row("munge", n, "PASS" if mrc == 0 else "FAIL",
                         f"a credential made on {master} verified" if mrc == 0 else f"unmunge: {mtext}",
                         f"the cluster's one key in /etc/munge/munge.key and munge running on {n} and "
                         f"{master}: " + ("provision.yml --tags slurm copies it" if ours else "the site's key")))
        drc, dtext = answers[n].get("slurmd", (None, "not asked"))
        want = len(node.get("gpu_ids") or []) or node.get("gpus", 0)
        if drc != 0:
            rows.append(_row("slurm", n, "FAIL", f"slurmd does not answer: {dtext}",
                             f"systemctl status slurmd on {n} and /var/log/slurm/slurmd.log; "
                             f"systemctl restart slurmd"))
        elif rc != 0:
            continue
        elif n not in listed:
            rows.append(_row("slurm", n, "FAIL", f"slurmctld does not list {n} in partition {partition}",
                             "provision.yml --tags slurm (slurm.conf from the inventory)" if ours else
                             f"the site's slurm.conf must list {n} (the inventory's name) in partition {partition}"))
        else:
            state, gres, reason = listed[n]
            have = sum(int(x) for x in re.findall(r"gpu(?::[\w.-]+)?:(\d+)", gres))
            if state not in SLURM_READY:
                rows.append(_row("slurm", n, "FAIL", f"{state} in partition {partition}"
                                 + (f": {reason}" if reason and reason != "none" else ""),
                                 f"fix that reason on {n}, then `scontrol update nodename={n} state=resume`"))
            elif have != want:
                rows.append(_row("slurm", n, "FAIL", f"Slurm gives gpu:{have}, the plan {want} (nvidia-smi, "
                                 f"dsc_gpus)", "provision.yml --tags slurm (gres.conf from the probe)" if ours else
                                 f"the site's gres.conf for {n}, or dsc_gpus"))
            else:
                rows.append(_row("slurm", n, "PASS", f"slurmd answers; {state} in partition {partition}"
                                 + (f", gres gpu:{have}" if have else "")))
    return rows


def package_rows(nodes, probe, master):
    """One row per node: every installed distribution at the master's version, or a FAIL naming
    each package that differs (or is missing) and where."""
    dists = {n: (probe[n].get("versions") or {}).get("distributions") for n in nodes}
    ref = dists.get(master)
    rows = []
    for n in nodes:
        if ref is None or dists[n] is None:
            continue  # the env itself failed: "env and versions" says so
        diff = [f"{name} {dists[n].get(name, 'missing')} here, {ref.get(name, 'missing')} on {master}"
                for name in sorted(set(ref) | set(dists[n])) if dists[n].get(name) != ref.get(name)]
        rows.append(_row("packages", n, "FAIL" if diff else "PASS",
                         "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "")
                         if diff else f"{len(dists[n])} distributions, the same versions as on {master}",
                         "re-run provision.yml (dsc_requirements installs the same versions on every "
                         "node); remove packages installed by hand on one node"))
    return rows


def preflight_facts(hostvars, cluster):
    """What the nodes reported, for the JSON report beside the verdicts."""
    names, master = cluster["node_names"], cluster["master"]
    return {
        "nodes": {n: hostvars[n].get("__preflight_probe") for n in names},
        "mesh": hostvars[master].get("__preflight_mesh"),
        "tcp": {n: hostvars[n].get("__preflight_tcp") for n in names},
        "iperf3": {n: hostvars[n].get("__preflight_iperf") for n in names
                   if hostvars[n].get("__preflight_iperf") is not None},
        "allreduce": hostvars[master].get("__preflight_allreduce"),
    }


def preflight_table(rows):
    widths = [max(len(r[k]) for r in rows + [{"check": "check", "node": "node", "status": "status"}])
              for k in ("check", "node", "status")]
    lines = [f"{'check':<{widths[0]}}  {'node':<{widths[1]}}  {'status':<{widths[2]}}  detail"]
    for r in rows:
        lines.append(f"{r['check']:<{widths[0]}}  {r['node']:<{widths[1]}}  {r['status']:<{widths[2]}}  {r['detail']}")
        if r["fix"]:
            lines.append(f"{'':<{widths[0] + widths[1] + widths[2] + 6}}fix: {r['fix']}")
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "WARN", "FAIL")}
    lines.append(f"{counts['PASS']} passed, {counts['WARN']} warnings, {counts['FAIL']} failed")
    return lines


def iperf_result(result, to, installed=True, server=None):
    """One iperf3 client run (the registered command result) as {to, gbps, retransmits, error}:
    a run that failed, or whose JSON lacks the totals (iperf3 reports its own errors in the
    JSON), becomes an error text for a WARN row, never a crash. `server`: the peer's node helper
    answer (iperf-server); where no server of ours listened there, nothing was measured, and its
    error (who holds the port) is the pair's."""
    out = {"to": to, "gbps": None, "retransmits": None}
    if not installed:
        return dict(out, error="iperf3 is not installed")
    if server is not None and not server.get("listening"):
        return dict(out, error=str(server.get("error") or f"no iperf3 server of ours started on {to}")[:300])
    text = (result or {}).get("stdout") or ""
    try:
        data = json.loads(text) if text.strip().startswith("{") else {}
    except ValueError:
        data = {}
    end = data.get("end") or {}
    bps = (end.get("sum_received") or {}).get("bits_per_second")
    if (result or {}).get("rc") == 0 and bps:
        return dict(out, gbps=round(bps / 1e9, 3),
                    retransmits=(end.get("sum_sent") or {}).get("retransmits"))
    why = data.get("error") or (result or {}).get("stderr") or text or f"exit {(result or {}).get('rc')}"
    return dict(out, error=" ".join(str(why).split())[:200])


class FilterModule:
    def filters(self):
        return {"dsc_preflight_rows": preflight_rows, "dsc_preflight_table": preflight_table,
                "dsc_preflight_facts": preflight_facts, "dsc_iperf_result": iperf_result}
