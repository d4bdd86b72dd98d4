"""Small socket helpers: parse HOST:PORT, find a free port, check a port is free."""

from __future__ import annotations

import socket


def parse_hostport(value: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """'HOST:PORT' or ':PORT' or 'PORT' -> (host, port); ValueError with the reason."""
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "", value
    host = host.strip("[]") or default_host
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"{value!r}: port must be a number") from None
    if not 0 <= p <= 65535:
        raise ValueError(f"{value!r}: port out of range")
    return host, p


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now (tests and internal engine ports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now.

    SO_REUSEADDR like the servers themselves: connections in TIME_WAIT from a previous
    run do not make a port busy, a listener does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
