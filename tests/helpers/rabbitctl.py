"""The broker's own view of connections, through rabbitmqctl (the tests run beside the
broker they use): which connections carry a client's name, and closing them as a broker
restart or a network cut would."""

from __future__ import annotations

import subprocess


def connection_pids(name: str) -> list[str]:
    """The broker's pids of the connections whose client properties carry ``name``."""
    listing = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "pid", "client_properties"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [line.split("\t", 1)[0] for line in listing.splitlines() if f'"{name}"' in line]
