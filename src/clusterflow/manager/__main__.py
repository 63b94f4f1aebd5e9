"""``python -m clusterflow.manager CLUSTER_DIR``: a detached manager (``start --detach``)."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from types import FrameType

from clusterflow.backends import forkserver, kinds
from clusterflow.manager.config import RunConfig
from clusterflow.manager.controller import Controller
from clusterflow.manager.handle import task_backend
from clusterflow.manager.registry import ClusterDir

log = logging.getLogger("clusterflow.manager")


def main() -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cluster = ClusterDir(Path(sys.argv[1]))
    config = RunConfig.from_dict(cluster.read_config())
    if kinds.named(config.backend).name == kinds.LOCAL.name:
        # Each local task forked warm, restarts too (backends/local.py).
        forkserver.ensure(cluster.id)
    config, backend = task_backend(config)
    controller = Controller(cluster, config, backend, echo=False)

    def _stop(signum: int, frame: FrameType | None) -> None:
        controller.request_stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    code = controller.run()
    if controller.failure:
        log.error("%s", controller.failure)
    return code


if __name__ == "__main__":
    sys.exit(main())
