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
