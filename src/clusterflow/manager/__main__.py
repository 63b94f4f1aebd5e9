"""``python -m clusterflow.manager CLUSTER_DIR``: a detached manager (``start --detach``)."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from types import FrameType

from clusterflow.backends.api import Backend
from clusterflow.backends.local import LocalBackend
from clusterflow.manager.config import RunConfig
from clusterflow.manager.controller import Controller
from clusterflow.manager.registry import ClusterDir

log = logging.getLogger("clusterflow.manager")


def main() -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cluster = ClusterDir(Path(sys.argv[1]))
    config = RunConfig.from_dict(cluster.read_config())
    backend: Backend = LocalBackend.split_gpus(config.gpu_hosts())
    if config.backend == "hosts":  # each task in an emulated host (testing/hosts_backend.py)
        from clusterflow.testing.hosts_backend import for_run

        config, backend = for_run(config)
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
