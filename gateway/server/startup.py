"""What ``loraplex serve`` does before it serves: the listening sockets first, progress lines.

The address is bound (and listened on) before anything heavy is imported or loaded, so a port
already in use fails in the first second instead of after the model has loaded; connections made
while the model loads wait in the listen backlog and are answered once the server is ready.
Nothing here imports more than the standard library.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from loraplex.engine.triton_guard import keep_triton_out  # noqa: F401 - re-exported

_IMPORTED = time.monotonic()


def process_age() -> float:
    """Seconds since this process was launched.

    From ``/proc/self/stat``'s start time and ``/proc/uptime`` (10 ms resolution) where they
    exist, else since this module was imported.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def progress(message: str) -> None:
    """Print ``loraplex: MESSAGE`` on stderr at once (start-up progress, for people)."""
    print(f"loraplex: {message}", file=sys.stderr, flush=True)


def bind_listeners(host: str, port: int, backlog: int = 2048) -> list[socket.socket]:
    """Bind and listen on ``host:port`` as asyncio's ``create_server`` would, before serving.

    One socket per address ``host`` resolves to (``localhost``: IPv4 and IPv6), each with
    ``SO_REUSEADDR`` (a restart does not wait for TIME_WAIT), IPv6 sockets ``IPV6_V6ONLY``. They
    are handed to uvicorn, which serves on them once the app is ready.

    Args:
        host: An address or a name (``""``: every interface).
        port: TCP port (0: any free one).
        backlog: Connections the kernel queues before they are accepted (uvicorn's default).

    Returns:
        The listening sockets (inheritable, blocking).

    Raises:
        OSError: the name does not resolve, the address is in use or not ours, or a port below
            1024 without the privilege; every socket opened so far is closed.
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.set_inheritable(True)
            if port == 0:  # one port for every address
                port = sock.getsockname()[1]
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def url_of(host: str, port: int) -> str:
    """``http://HOST:PORT`` (IPv6 addresses bracketed)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
