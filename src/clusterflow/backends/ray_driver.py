"""Joining a Ray cluster as a driver: the CLI, the manager's host and the cache's commands.

Ray's driver prints the cluster's error messages (a node marked dead, a worker killed) to
``sys.stdout`` from a background thread, whatever ``log_to_driver`` says (ray 2.60,
``ray._private.worker.listen_error_messages``). clusterflow's CLI writes data there:
``describe --json`` printed while a node died came out as JSON followed by Ray's line,
which no reader parses. Those messages go to this module's log instead (stderr), so a
command's stdout holds only what the command says.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from clusterflow.errors import ConfigError

log = logging.getLogger(__name__)

NAMESPACE = "clusterflow"
"""The Ray namespace of every actor clusterflow creates (managers, supervisors, caches)."""


def join(address: str | None, *, runtime_env: dict[str, Any] | None = None) -> None:
    """Joins the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else ``auto``) once.

    Raises:
        ConfigError: Ray is not installed, or the cluster cannot be reached.
    """
    try:
        import ray
    except ImportError:
        raise ConfigError("--backend ray needs Ray: pip install 'clusterflow[ray]'") from None
    if ray.is_initialized():
        return
    _errors_to_log()  # before init: its listener thread may print at once
    try:
        ray.init(
            address=address or os.environ.get("RAY_ADDRESS") or "auto",
            namespace=NAMESPACE,
            runtime_env=runtime_env or None,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"cannot join the Ray cluster at {address or 'auto'}: {exc}") from exc


def _errors_to_log() -> None:
    """Sends what Ray's driver would print to stdout into the log (see the module doc)."""
    try:
        from ray._private import worker
    except ImportError:  # a Ray without that module prints nothing there to reroute
        return
    printer = getattr(worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "clusterflow_log", False):
        return

    def to_log(data: dict[str, Any], ignore_prefix: bool) -> None:
        for line in data.get("lines") or ():
            log.warning("ray (%s): %s", data.get("pid", "?"), line)

    to_log.clusterflow_log = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = to_log
