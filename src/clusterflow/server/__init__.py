"""Per-task servers: ``Server`` and ``create_local_server``, as in ``tf.distribute``."""

from __future__ import annotations

from clusterflow.server.server import Server, create_local_server, server_from_env

__all__ = ["Server", "create_local_server", "server_from_env"]
