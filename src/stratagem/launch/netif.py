"""Which local network interface owns an IPv4 address (for GLOO_SOCKET_IFNAME).

Pure Python: ``socket.if_nameindex`` + ``ioctl(SIOCGIFADDR)`` gives each interface's primary
address; ``ip -o -4 addr`` (when installed) adds secondary ones. Works inside network
namespaces, where it sees the namespace's interfaces.
"""

from __future__ import annotations

import contextlib
import ipaddress
import shutil
import socket
import struct
import subprocess
import sys

SIOCGIFADDR = 0x8915  # linux/sockios.h


def _ioctl_address(name: str) -> str | None:
    """Primary IPv4 address of interface ``name`` (None if it has none)."""
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ip_command_addresses() -> list[tuple[str, str]]:
    """(interface, address) pairs from ``ip -o -4 addr show``; empty without ``ip``."""
    if shutil.which("ip") is None:
        return []
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                             text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    pairs = []
    for line in out.splitlines():
        words = line.split()
        if len(words) >= 4 and words[2] == "inet":
            pairs.append((words[1].split("@")[0], words[3].split("/")[0]))
    return pairs


def local_ipv4_addresses() -> dict[str, str]:
    """Every IPv4 address of this machine (or network namespace) -> its interface name."""
    found: dict[str, str] = {}
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            for _, name in socket.if_nameindex():
                addr = _ioctl_address(name)
                if addr:
                    found.setdefault(addr, name)
    for name, addr in _ip_command_addresses():
        found.setdefault(addr, name)
    return found


def resolve_ipv4(address: str) -> str | None:
    """``address`` as a dotted IPv4 string (resolving host names); None if it cannot be."""
    try:
        return str(ipaddress.IPv4Address(address))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(address)
    except OSError:
        return None


def interface_for_address(address: str) -> str | None:
    """Name of the local interface that owns ``address`` (an IPv4 address or host name).

    Any 127.0.0.0/8 address maps to the loopback interface. None if no interface has it.
    """
    ip = resolve_ipv4(address)
    if ip is None:
        return None
    local = local_ipv4_addresses()
    if ip in local:
        return local[ip]
    if ipaddress.IPv4Address(ip).is_loopback:
        return local.get("127.0.0.1")
    return None


def is_local_address(address: str) -> bool:
    """True if ``address`` names this machine (loopback, or owned by a local interface)."""
    if address == "localhost":
        return True
    return interface_for_address(address) is not None
