"""Where other nodes reach this node: the address of an interface or IPv4 network (no MPI, no torch).

The doorbell binds its UDP socket there (:mod:`hpcsplit.runtime.doorbell`) and ``stage=probe`` reports it
per rank.  The network is ``runtime.doorbell_network``, else ``$HPCSPLIT_DOORBELL_NETWORK`` (a cluster
preset's ``slurm.setup`` exports it: ``cluster=dev2`` names the dev cluster's bridge), else the address the
hostname resolves to.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

__all__ = ["NETWORK_ENV", "job_network", "node_address"]

NETWORK_ENV = "HPCSPLIT_DOORBELL_NETWORK"  # a site's job network, when runtime.doorbell_network is null
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def _interface_addresses() -> dict[str, str]:
    """IPv4 address of every interface of this host that has one (Linux)."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            out[name] = socket.inet_ntoa(res[20:24])
    return out


def job_network(network: str | None = None) -> str | None:
    """The network the nodes share: ``network`` (``runtime.doorbell_network``), else ``$HPCSPLIT_DOORBELL_NETWORK``
    (a cluster preset's setup lines export it), else None (the address the hostname resolves to)."""
    return network or os.environ.get(NETWORK_ENV) or None


def node_address(network: str | None = None) -> str:
    """The IPv4 address other nodes ring this node's ranks at.

    ``network``: an interface name (``hsn0``) or an IPv4 network (``10.100.0.0/16``, the first interface
    address inside it); None: the address this host's name resolves to.  Raises ValueError saying what
    was not found (and what there is).

    Examples
    --------
    >>> node_address("127.0.0.0/8").startswith("127.")
    True
    """
    if not network:
        return socket.gethostbyname(socket.gethostname())
    addrs = _interface_addresses()
    have = ", ".join(f"{k} {v}" for k, v in addrs.items()) or "none"
    if "/" in network:
        net = ipaddress.IPv4Network(network, strict=False)
        for ip in addrs.values():
            if ipaddress.IPv4Address(ip) in net:
                return ip
        raise ValueError(f"no interface of {socket.gethostname()} has an address in {network} (interfaces: {have})")
    if network not in addrs:
        raise ValueError(f"{socket.gethostname()} has no interface {network!r} with an IPv4 address "
                         f"(interfaces: {have})")
    return addrs[network]
