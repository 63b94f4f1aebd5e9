"""Serving the dashboard with uvicorn on a socket bound here first.

The socket is bound before uvicorn starts, so a taken port is a one-line ``ConfigError``
(not a log line from inside the server), ``--port 0`` works (the URL names the port
the kernel chose), and the URL is printed only once the port is really ours.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Final

from clusterflow.errors import ConfigError
from clusterflow.ui.access import Access, is_loopback

log = logging.getLogger(__name__)

__all__ = ["Bound", "bind", "serve"]

GRACEFUL_S: Final = 2.0
"""Open event streams never end by themselves: Ctrl-C closes them after this."""


@dataclass(frozen=True, slots=True)
class Bound:
    """A listening socket and the URL a person opens."""

    sock: socket.socket
    access: Access

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    @property
    def url(self) -> str:
        """The address to open, with the token (it sets the page's cookie)."""
        host = self.access.bind_host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/?token={self.access.token}"


def bind(host: str, port: int, token: str) -> Bound:
    """Binds ``host:port`` for the dashboard.

    Raises:
        ConfigError: the port is out of range, taken, or the address is not this host's.
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be 0 to 65535, got {port}")
    access = Access(host, token)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot bind the dashboard to {host!r}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot bind the dashboard to {host}:{port}: {exc.strerror or exc}"
        ) from None
    if not is_loopback(host):
        log.warning("the dashboard listens on %s: every request needs its token", host)
    return Bound(sock, access)


def serve(bound: Bound, *, interval_s: float = 1.0) -> None:
    """Serves until SIGINT or SIGTERM (uvicorn's own handlers), then closes the socket."""
    import uvicorn

    from clusterflow.ui.app import Settings, make_app

    app = make_app(Settings(access=bound.access, interval_s=interval_s))
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(GRACEFUL_S),
        lifespan="on",
    )
    try:
        uvicorn.Server(config).run(sockets=[bound.sock])
    finally:
        bound.sock.close()
