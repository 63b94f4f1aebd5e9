"""``python -m clusterflow.ps``: the built-in task of ``ps`` jobs (``clusterflow start --ps N``).

Serves the variables of the task ``TF_CONFIG`` names until SIGTERM or SIGINT.
"""

from __future__ import annotations

import logging
import sys

from clusterflow.errors import ClusterflowError
from clusterflow.ps.service import PSService
from clusterflow.server import server_from_env
from clusterflow.server.__main__ import serve_until_signalled


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        server = server_from_env()
    except ClusterflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    PSService(server)
    return serve_until_signalled(
        server, f"parameter server {server.task} serving at {server.target}"
    )


if __name__ == "__main__":
    sys.exit(main())
