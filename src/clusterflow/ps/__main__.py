"""``python -m clusterflow.ps``: the built-in task of ``ps`` jobs (``clusterflow start --ps N``).

Serves the variables of the task ``TF_CONFIG`` names until SIGTERM or SIGINT. Under a
restarted cluster (``CLUSTERFLOW_RESTORE``: the step of the checkpoint the manager chose)
it first loads its own shard from that checkpoint, before it answers anyone: a worker's
first pull then sees the restored values, never fresh ones. So the server starts
serving only after the ps's methods are registered and its shard restored: a worker
that calls at once (tasks forked warm call within milliseconds) waits on the bound
socket instead of being told "no method 'ps.create' here".
"""

from __future__ import annotations

import logging
import sys

from clusterflow.errors import ClusterflowError
from clusterflow.ps.restore import restore_shard
from clusterflow.ps.service import PSService
from clusterflow.server import server_from_env
from clusterflow.server.__main__ import serve_until_signalled


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        server = server_from_env(start=False)
    except ClusterflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    service = PSService(server)
    try:
        restore_shard(
            service.store, server.cluster_spec.num_tasks("ps"), tables=service.handler.tables
        )
    except ClusterflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        server.stop()
        return 1
    server.start()
    return serve_until_signalled(
        server, f"parameter server {server.task} serving at {server.target}"
    )


if __name__ == "__main__":
    sys.exit(main())
