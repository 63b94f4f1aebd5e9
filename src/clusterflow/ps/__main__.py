"""``python -m clusterflow.ps``: the built-in task of ``ps`` jobs (``clusterflow start --ps N``).

Serves the variables of the task ``TF_CONFIG`` names until SIGTERM or SIGINT.
"""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType

from clusterflow.errors import ClusterflowError
from clusterflow.ps.service import PSService
from clusterflow.server import server_from_env


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        server = server_from_env()
    except ClusterflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    PSService(server)

    def _stop(signum: int, frame: FrameType | None) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"parameter server {server.task} serving at {server.target}", flush=True)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
