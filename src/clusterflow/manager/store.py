"""``python -m clusterflow.manager.store FD``: hosts torch's TCPStore on a reserved socket.

torchrun's agent hosts the store on ``MASTER_PORT`` and tells every rank to connect as
a client (``TORCHELASTIC_USE_AGENT_STORE=True``); clusterflow does the same. The store
lives in its own process because importing torch takes ~2.5 s of CPU holding the GIL,
which would stall the manager's RPC loop while tasks register. The manager reserved the
port and passes the bound socket, so there is no bind-close-rebind race. The process
exits when its stdin (a pipe from the manager) closes, so it never outlives the manager.
"""

from __future__ import annotations

import datetime
import socket
import sys


def main() -> int:
    fd = int(sys.argv[1])
    sock = socket.socket(fileno=fd)
    host, port = sock.getsockname()[:2]
    sock.listen(1024)
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
