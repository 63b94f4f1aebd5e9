"""``python -m clusterflow.server``: the built-in task of ``ps`` jobs.

Serves the task that ``TF_CONFIG`` names until SIGTERM or SIGINT.
"""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType

from clusterflow.errors import ClusterflowError
from clusterflow.server.server import Server, server_from_env


def serve_until_signalled(server: Server, banner: str) -> int:
    """Serves until SIGTERM or SIGINT, then stops cleanly: every task's entry point."""

    def _stop(signum: int, frame: FrameType | None) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(banner, flush=True)
    server.join()
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        server = server_from_env()
    except ClusterflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve_until_signalled(server, f"serving {server.task} at {server.target}")


if __name__ == "__main__":
    sys.exit(main())
