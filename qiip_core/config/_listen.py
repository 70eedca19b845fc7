"""The daemon's listening socket, bound the way the server binds it."""

from __future__ import annotations

import socket

__all__ = ["bind_listener"]


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind a TCP socket to `host:port` as uvicorn would (SO_REUSEADDR, so connections of a previous run
    still in TIME-WAIT do not count).

    The socket is not inheritable: the daemon's event loop (uvloop, through libuv) passes every inheritable
    descriptor to the processes it spawns, and a llama-server holding the gateway's port would keep the port bound
    after the daemon stops.

    Args:
        host: a name or address of this machine (`server.host`).
        port: the port (`server.port`).

    Returns:
        The bound socket, not yet listening; the caller closes it.

    Raises:
        socket.gaierror: `host` cannot be resolved.
        OSError: the bind failed (`errno.EADDRINUSE`: the port is taken; `EADDRNOTAVAIL`: not an address
            of this machine).
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock
