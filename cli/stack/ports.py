"""Free loopback ports for the local stack, the demo job and the tests.

A port handed out by the kernel for ``bind(port 0)`` comes from the ephemeral range, the one every outgoing
connection on the machine draws its local port from. Between being chosen and being bound by the server that
wanted it, such a port can be taken by any client's connection: with three test lanes on two cores, each with
a broker and dozens of clients, a Kafka controller failed to start on "Address already in use". So a port is
drawn at random below the ephemeral range, where no client connection lands, and checked free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32_768


def ephemeral_low(path: Path = EPHEMERAL_RANGE) -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None, tries: int = 200) -> int:
    """A TCP port on ``host`` that was free a moment ago, below the ephemeral range when one is found there."""
    rng = rng or random.SystemRandom()
    top = ephemeral_low()
    if top > LOWEST:
        for _ in range(tries):
            port = rng.randrange(LOWEST, top)
            if is_free(port, host):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
