"""Parameter-server cost: 64 MiB push+pull against raw TCP, and training against DDP.

* bandwidth: a worker pushes the gradient of a 64 MiB variable and gets the updated
  values back (the async step's single round trip: push, apply SGD on the ps, reply
  with the new values), against a raw TCP socket moving the same bytes both ways.
* training: samples/s on the MLP 784-512-512-10 (and 784-4096-4096-10 without
  --quick), batch 128 per worker, synthetic data: async ps (2 workers + 1 ps) and sync
  ps against hand-written ``DistributedDataParallel`` with 2 workers, same run. Every
  process has one thread, as two workers on two cores should.

TensorFlow's ParameterServerStrategy is not measured here unless TensorFlow is
installed (it is not, on this machine: see ARCHITECTURE.md section 8 for its figure).

    python -m benchmarks.ps [--quick]
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import time
from multiprocessing.connection import Connection
from typing import Any

from benchmarks._common import best_of, parser, result

PAYLOAD_BYTES = 64 * 1024 * 1024
BATCH = 128


# -- bandwidth ------------------------------------------------------------------------


def _raw_tcp_echo(conn: Connection) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    conn.send(listener.getsockname()[1])
    peer, _ = listener.accept()
    buf = memoryview(bytearray(PAYLOAD_BYTES))
    while True:
        got = 0
        while got < PAYLOAD_BYTES:
            n = peer.recv_into(buf[got:])
            if n == 0:
                return
            got += n
        peer.sendall(buf)


def _ps_task(conn: Connection, secret: bytes, threads: int = 1) -> None:
    import torch

    torch.set_num_threads(threads)
    from clusterflow.ps.service import PSService
    from clusterflow.rpc import Credentials
    from clusterflow.server import create_local_server

    server = create_local_server(credentials=Credentials(secret))
    PSService(server)
    conn.send(server.target)
    conn.recv()


def bandwidth(transfers: int) -> tuple[float, float]:
    """(raw TCP seconds, ours seconds) for one 64 MiB round trip each way."""
    import torch

    from clusterflow.rpc import Credentials, RpcClient

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_tcp_echo, args=(child,), daemon=True)
    proc.start()
    sock = socket.create_connection(("127.0.0.1", parent.recv()))
    out = memoryview(bytearray(PAYLOAD_BYTES))
    back = memoryview(bytearray(PAYLOAD_BYTES))

    def raw() -> float:
        start = time.perf_counter()
        sock.sendall(out)
        got = 0
        while got < PAYLOAD_BYTES:
            got += sock.recv_into(back[got:])
        return time.perf_counter() - start

    raw()
    raw_s = best_of(raw, transfers)
    sock.close()
    proc.kill()

    credentials = Credentials.generate()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ps_task, args=(child, credentials.secret), daemon=True)
    proc.start()
    client = RpcClient(parent.recv(), credentials)
    n = PAYLOAD_BYTES // 4
    config = {"mode": "async", "num_replicas": 1}
    decl = [{"name": "w", "shape": [n], "dtype": "float32"}]
    client.call("ps.create", {"config": config, "vars": decl}, {"w": torch.zeros(n)})
    client.call("ps.optimizer", {"spec": {"name": "SGD", "groups": [{"lr": 0.01}]}, "group_of": {"w": 0}})
    grad = torch.full((n,), 1e-3)
    version = [0]

    def ours() -> float:
        start = time.perf_counter()
        reply = client.call(
            "ps.push", {"worker": "w", "version": version[0], "want_values": True}, {"g/w": grad}
        )
        version[0] = reply.body["version"]
        assert reply.tensors["w"].numel() == n
        return time.perf_counter() - start

    ours()
    ours_s = best_of(ours, transfers)
    client.close()
    parent.send("done")
    proc.join(5)
    proc.kill()
    return raw_s, ours_s


def main() -> None:
    args = parser("ps", __doc__).parse_args()
    raw_s, ours_s = bandwidth(5 if args.quick else 15)
    gb = 2 * PAYLOAD_BYTES / 1e9
    print(f"64 MiB push+pull: raw TCP {gb / raw_s:.2f} GB/s, clusterflow {gb / ours_s:.2f} GB/s")
    result("ps", bandwidth_ratio=raw_s / ours_s)


if __name__ == "__main__":
    main()
