"""Which transport NCCL chose, read from its INFO lines (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET):
the network it uses ("Using network IB" / "Socket" / a plugin's name), the devices it bound
("NET/IB : Using [0]mlx5_0:1/IB ..." / "NET/Socket : Using [0]eth0:10.0.0.4<0>"), and the
channels between nodes ("Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA": GDRDMA is
GPUDirect RDMA, the NIC reading GPU memory itself; without it NCCL stages through host memory).

preflight.yml's and doctor.yml's all-reduce (train.allreduce) keeps each rank's lines and says
per node what NCCL used; preflight warns where a node has an ACTIVE RDMA port but NCCL used sockets."""
import re

NETWORK = re.compile(r"NCCL INFO Using network (\S.*?)\s*$")
BOUND = re.compile(r"NCCL INFO NET/(IB|Socket) : Using (\[\d+\].*?)(?: ; OOB .*)?\s*$")
DEVICE = re.compile(r"\[\d+\]([^\s\[]+)")
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
    with open(path, "rb") as f:
        return f.read(limit).decode(errors="replace").splitlines()
