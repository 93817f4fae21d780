"""Addresses and networks as the firewall rules take them (cluster_network_ssh_sources, the nodes'
training addresses)."""
from __future__ import annotations

import ipaddress

from .hygiene import CONTROL


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


def ssh_source(text):
    """An entry of cluster_network_ssh_sources: 'any', or an address or network of either family
    (nothing around it: no space or control character)."""
    if not isinstance(text, str) or text.lower() == "any":
        return isinstance(text, str)
    try:
        ip_network(text)
        return True
    except ValueError:
        return False


# A pair's throughput against what its interfaces promise: below this share of the slower stated
# speed, the network is slow whatever the other pairs do (a cluster slow alike has no outlier).
PROMISE = 0.4
# Above this stated speed one host's TCP stack, not the link, limits iperf3 (a 400 Gbit/s port
# gives ~100 over TCP): the link is judged by NCCL's all-reduce over RDMA instead.
TCP_JUDGED_MBPS = 100_000


# What to look at where the links give less than they state.
NETWORK_FIX = ("check what the links negotiated and what carries them: `ethtool <nic>` on each node "
               "(speed, duplex), the switch ports, a shaper (`tc qdisc show`), the MTU on every hop "
               "(`ping -M do -s 8972`), and for RDMA `ibstat` (rate, state) and NCCL's transport "
               "(NCCL_DEBUG=INFO: NET/IB, not NET/Socket)")


def promised(node_a, node_b, backend=None):
    """What a pair's link promises, from the plan's node records: {"iperf_gbps": the slower
    training interface's stated speed in Gbit/s, where both state one and the slower is at most
    TCP_JUDGED_MBPS;
    "allreduce_gbps": the slower node's fastest ACTIVE RDMA port in GB/s (an all-reduce's bus
    bandwidth), where both have one and the all-reduce ran on NCCL (`backend`: gloo, on CPU, is not
    held to the RDMA ports' rate)}; None where not stated."""
    speeds = [n.get("link_mbps") for n in (node_a, node_b)]
    tcp = min(speeds) / 1000 if all(speeds) and min(speeds) <= TCP_JUDGED_MBPS else None
    rates = [max((p.get("rate_gbps") or 0 for p in n.get("rdma") or [] if p.get("state") == "ACTIVE"), default=0)
             for n in (node_a, node_b)]
    return {"iperf_gbps": tcp, "allreduce_gbps": min(rates) / 8 if all(rates) and backend == "nccl" else None}


def below_promise(measured, promise, label, unit):
    """Why a figure is below PROMISE of what the link states, or None."""
    if measured is None or not promise or measured >= PROMISE * promise:
        return None
    return f"{label} {measured:g} {unit} = {measured / promise:.2g}x the slower interface's stated {promise:g} {unit}"
