"""Which transport NCCL chose, read from its INFO lines (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET):
the network it uses ("Using network IB" / "Socket" / a plugin's name), the devices it bound
("NET/IB : Using [0]mlx5_0:1/IB ..." / "NET/Socket : Using [0]eth0:10.0.0.4<0>"), and the
channels between nodes ("Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA": GDRDMA is
GPUDirect RDMA, the NIC reading GPU memory itself; without it NCCL stages through host memory).

preflight.yml's and doctor.yml's all-reduce (train.allreduce) keeps each rank's lines and says
per node what NCCL used; preflight warns where a node has an ACTIVE RDMA port but NCCL used sockets.
A training run's ranks on GPUs keep the same lines in the run directory's nccl_debug/ (the entry shim,
where the run leaves NCCL_DEBUG at its default WARN), and status.yml says the same per node."""
import re

from dscnode.rundir import entries, open_regular

NETWORK = re.compile(r"NCCL INFO Using network (\S.*?)\s*$")
BOUND = re.compile(r"NCCL INFO NET/(IB|Socket) : Using (\[\d+\].*?)(?: ; OOB .*)?\s*$")
DEVICE = re.compile(r"\[\d+\]([^\s\[]+)")
WARN = re.compile(r"NCCL WARN (.*\S)")
FILES_LIMIT = 64  # a node's newest debug files read for status (a rank each, per attempt)
# "Channel 01/0 : 0[0] -> 9[1] [send] via NET/IB/9/GDRDMA"; NCCL 2.5 and older: "Ring 00 : ... via NET/IB/0"
CHANNEL = re.compile(r"NCCL INFO (?:Channel|Ring) \d+(?:/\d+)? : .* via NET/([A-Za-z]+)/\d+(?:\(\d+\))?(/GDRDMA)?")


def transport(lines):
    """{network, devices, channels: {"IB/GDRDMA"|"IB"|"Socket": count}, gdr} of one rank's lines
    (every communicator's: their channels are counted together). network: NCCL's "Using network" line,
    else (NCCL before 2.6 prints none) the kind its channels used; devices: those it bound for
    that network (an old NCCL binds sockets first, then InfiniBand)."""
    network, bound, channels = None, {}, {}
    for line in lines:
        if m := NETWORK.search(line):
            network = network or m.group(1)
        elif m := BOUND.search(line):
            bound.setdefault(m.group(1), [d.split("<")[0] for d in DEVICE.findall(m.group(2))])
        elif m := CHANNEL.search(line):
            key = m.group(1) + (m.group(2) or "")
            channels[key] = channels.get(key, 0) + 1
    kinds = sorted({k.split("/")[0] for k in channels})
    network = network or (kinds[0] if len(kinds) == 1 else None) or next((k for k in ("IB", "Socket") if k in bound), None)
    return {"network": network, "devices": bound.get(network, []), "channels": channels, "gdr": _gdr(channels)}


def _gdr(channels):
    """Whether every channel between nodes read GPU memory directly (GDRDMA); None without one."""
    return all(k.endswith("/GDRDMA") for k in channels) if channels else None


def merge(transports):
    """One node's ranks' transports as one: the network and devices the first that names them,
    every rank's channels."""
    out = {"network": None, "devices": [], "channels": {}, "gdr": None}
    for t in transports:
        out["network"] = out["network"] or t["network"]
        out["devices"] = out["devices"] or (t["devices"] if t["network"] == out["network"] else [])
        for k, n in t["channels"].items():
            out["channels"][k] = out["channels"].get(k, 0) + n
    return dict(out, gdr=_gdr(out["channels"]))


def summary(t):
    """One line for a node's row: what crossed between nodes, over what."""
    if not t or not t["network"]:
        return "no NCCL network line (NCCL not used, or its INFO lines were not kept)"
    over = f" over {', '.join(t['devices'])}" if t["devices"] else ""
    if not t["channels"]:
        return f"NET/{t['network']}{over} chosen; no channel left the node (one node)"
    nets = sorted({k.split("/")[0] for k in t["channels"]})
    gdr = "" if nets != ["IB"] else " with GPUDirect RDMA" if t["gdr"] else " without GPUDirect RDMA (through host memory)"
    return f"NET/{'+'.join(nets)}{over}{gdr}"


def read(path, limit=4 << 20):
    """A rank's NCCL debug file's first `limit` bytes as lines (the first init is at its start)."""
    with open_regular(path) as f:  # no link, no FIFO: a regular file's start, however long it grew
        return f.read(limit).decode(errors="replace").splitlines()


def debug_env(folder):
    """The environment that makes NCCL write its INIT and NET lines (the transport it chose) to a
    file per process in `folder`: WARN lines go there too, and NCCL's last error also reaches the
    rank's own exception ("Last error: ..."), which the run's log keeps."""
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": f"{folder}/%h-%p.log"}


def judge(t, rdma, node="this node"):
    """(PASS|WARN, fix) for a node's transport `t` where `rdma` are its RDMA ports (probe.rdma):
    WARN where a port is ACTIVE but NCCL sent over sockets, or used InfiniBand without GPUDirect
    RDMA."""
    active = [f"{p['device']}/{p['port']}" for p in rdma or [] if p.get("state") == "ACTIVE"]
    if active and ("Socket" in t["channels"] or (not t["channels"] and t["network"] == "Socket")):
        return "WARN", (f"{node} has ACTIVE RDMA ports ({', '.join(active)}) that NCCL left unused: check NCCL_IB_DISABLE "
                        "(the plan sets 1 unless every node has InfiniBand), NCCL_IB_HCA, and that the env's "
                        "NCCL finds libibverbs (rdma-core)")
    if t["gdr"] is False and "IB" in t["channels"]:
        return "WARN", ("load nvidia-peermem (GPUDirect RDMA) on the node, and check NCCL_NET_GDR_LEVEL against "
                        "the GPU-NIC distance (nvidia-smi topo -m)")
    return "PASS", ""


def node_report(folder, since, rdma):
    """What this node's ranks of the current attempt (debug files written since `since`, the
    newest FILES_LIMIT, each read up to read's limit) say: {summary, status, fix, warn: their last
    NCCL WARN line or None}; None where no rank kept a file."""
    files = []
    for e in entries(folder):
        try:
            if e.name.endswith(".log") and e.is_file(follow_symlinks=False) and e.stat().st_mtime >= since:
                files.append((e.stat().st_mtime, e.path))
        except OSError:
            continue
    ranks, warn = [], None
    for _, path in sorted(files)[-FILES_LIMIT:]:
        try:
            lines = read(path)
        except OSError:
            continue
        ranks.append(transport(lines))
        warn = next((m.group(1) for line in reversed(lines) if (m := WARN.search(line))), warn)
    if not ranks:
        return None
    t = merge(ranks)
    status, fix = judge(t, rdma) if t["network"] else ("PASS", "")
    return {"summary": summary(t), "status": status, "fix": fix, "warn": warn}
