"""Which local network interface the collectives of a process group use. gloo, unless told, binds the
address the machine's hostname resolves to, on many Linux installs 127.0.1.1, which no other node
reaches; the interface whose address routes to the group's rendezvous is the one that works."""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Mapping, Optional, Sequence

# Variables a user sets when the choice is wrong (docs/cluster.md): gloo's (CPU tensors, every run),
# NCCL's (CUDA) and HCCL's (Ascend) own choices.
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME", "HCCL_IF_IP")


def source_address(peer: str) -> str:
    """The local address the routing table uses to reach `peer` (a host or IP): a UDP socket's
    connect picks the route and sends nothing."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # the discard port; no packet leaves
        return s.getsockname()[0]


def interface_addresses() -> dict[str, list[str]]:
    """{interface name: its IPv4 and IPv6 addresses} of this machine."""
    import psutil

    return {name: [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
            for name, addrs in psutil.net_if_addrs().items()}


def interface_with(address: str, interfaces: Mapping[str, Sequence[str]]) -> Optional[str]:
    """The name of the interface holding `address` (loopback addresses belong to the loopback
    interface, whatever 127.x address it is), or None."""
    ip = ipaddress.ip_address(address)
    for name, addresses in interfaces.items():
        if any(ipaddress.ip_address(a) == ip for a in addresses):
            return name
    if ip.is_loopback:
        return next((name for name, addresses in interfaces.items()
                     if any(ipaddress.ip_address(a).is_loopback for a in addresses)), None)
    return None


def choose_gloo_interface(rendezvous_host: str) -> str:
    """Set GLOO_SOCKET_IFNAME to the interface that reaches `rendezvous_host`, unless the environment
    sets it; returns a phrase for messages ("gloo on eth0 (10.0.0.7)")."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return f"gloo on {os.environ['GLOO_SOCKET_IFNAME']} (GLOO_SOCKET_IFNAME)"
    local = source_address(rendezvous_host)
    name = interface_with(local, interface_addresses())
    if name is None:
        return f"gloo on its default interface (none of this node's interfaces holds {local}; set GLOO_SOCKET_IFNAME)"
    os.environ["GLOO_SOCKET_IFNAME"] = name
    return f"gloo on {name} ({local})"
