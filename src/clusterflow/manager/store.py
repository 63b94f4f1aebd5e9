"""``python -m clusterflow.manager.store FD``: hosts torch's TCPStore on a reserved socket.

torchrun's agent hosts the store on ``MASTER_PORT`` and tells every rank to connect as
a client (``TORCHELASTIC_USE_AGENT_STORE=True``); clusterflow does the same. The manager
reserved the port (``store_host.StoreHost``) and passes the bound, listening socket, so
there is no bind-close-rebind race, and ranks that connected before this process was up
are in its accept queue. The process exits when its stdin (a pipe from the manager)
closes, so it never outlives the manager.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

from clusterflow.cluster.contract import ENV_LISTEN_FD


def main() -> int:
    # "env": forked from the warm server, which gave the socket its own number there.
    fd = int(os.environ[ENV_LISTEN_FD] if sys.argv[1] == "env" else sys.argv[1])
    sock = socket.socket(fileno=fd)  # already listening: StoreHost made it so
    host, port = sock.getsockname()[:2]
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore(
        host,
        port,
        None,
        True,
        datetime.timedelta(seconds=300),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    sys.stdin.buffer.read()  # until the manager closes the pipe or dies
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
