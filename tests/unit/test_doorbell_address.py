"""Where other nodes ring a rank: :func:`hpcsplit.runtime.doorbell.node_address`."""

from __future__ import annotations

import socket

import pytest

from hpcsplit.runtime.doorbell import _interface_addresses, node_address


def test_interface_and_network_pick_this_hosts_address() -> None:
    addrs = _interface_addresses()
    assert addrs.get("lo") == "127.0.0.1"  # Linux always has it
    assert node_address("lo") == "127.0.0.1"
    assert node_address("127.0.0.0/8") == "127.0.0.1"
    assert node_address(None) == socket.gethostbyname(socket.gethostname())


def test_missing_interface_or_network_says_what_there_is() -> None:
    with pytest.raises(ValueError, match=r"no interface 'nope0'.*lo 127\.0\.0\.1"):
        node_address("nope0")
    with pytest.raises(ValueError, match=r"no interface of .* has an address in 203\.0\.113\.0/24.*lo 127\.0\.0\.1"):
        node_address("203.0.113.0/24")
