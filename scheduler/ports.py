"""Whether a TCP port is free on every address a host name stands for, asked before listening.

gRPC listens on each address `host` resolves to that it can bind and reports success if any one
worked: with another program on 127.0.0.1's port, a server on "localhost" would listen on ::1
alone while IPv4 clients reached that program. Both the launcher (before it starts anything) and
the scheduler (before it binds) ask first.
"""

from __future__ import annotations

import errno
import socket


def addresses_in_use(host: str, port: int) -> list[str]:
    """Those of the addresses `host` names (localhost: 127.0.0.1 and ::1) on which `port` is
    taken by another socket; none for port 0 or a host that does not resolve."""
    if port == 0:
        return []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return []  # gRPC reports it
    taken = []
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listener does
            try:
                probe.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    taken.append(f"{address[0]}:{port}")
    return taken
