"""A sync ps step of more replicas than the RPC server's default handler threads (8).

Each replica's pull of the next version waits on a handler thread of the ps until the
step's last push arrives. Found by ``benchmarks.scale`` at 16 workers: with the default
pool, the first pulls held every thread and the last pushes queued behind them until
the pulls timed out. The ps now reserves threads for every replica task of its spec.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from clusterflow.cluster import ClusterSpec
from clusterflow.ps.service import PSService
from clusterflow.rpc import Credentials, RpcClient, RpcServer
from clusterflow.server import Server

pytestmark = pytest.mark.timeout(60)
REPLICAS = 12


def _handler_threads(name: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(f"{name}-handler-"))


def test_a_sync_step_of_twelve_replicas_completes() -> None:
    credentials = Credentials.generate()
    rpc = RpcServer(credentials, name="server-ps:0")  # the spec names its own address
    spec = ClusterSpec(
        {"ps": [rpc.address], "worker": [f"127.0.0.1:{i + 1}" for i in range(REPLICAS)]}
    )
    server = Server(spec, "ps", 0, credentials=credentials, _rpc=rpc)
    PSService(server)
    # a replica's push and its pull travel on clients of their own (one call in flight each)
    clients = [RpcClient(server.target, credentials, deadline=30) for _ in range(2 * REPLICAS)]
    try:
        config = {"mode": "sync", "num_replicas": REPLICAS}
        decl = [{"name": "w", "shape": [4], "dtype": "float32"}]
        clients[0].call("ps.create", {"config": config, "vars": decl}, {"w": torch.zeros(4)})
        clients[0].call(
            "ps.optimizer",
            {"spec": {"name": "SGD", "groups": [{"lr": 1.0}]}, "group_of": {"w": 0}},
        )

        def push(i: int) -> None:
            body = {"worker": f"worker:{i}", "version": 0, "commit": True}
            clients[i].call("ps.push", body, {"g/w": torch.full((4,), float(i))})

        def pull(i: int) -> int:
            reply = clients[REPLICAS + i].call("ps.pull", {"min_version": 1, "timeout": 20.0})
            return int(reply.body["version"])

        early = REPLICAS - 3
        with ThreadPoolExecutor(REPLICAS) as pool:
            for i in range(early):
                push(i)
            pulls = [pool.submit(pull, i) for i in range(REPLICAS)]
            # the pulls now wait on handler threads: more than the default 8 of them
            deadline = threading.Event()
            while _handler_threads("server-ps:0") < 8 and not deadline.wait(0.02):
                pass
            for i in range(early, REPLICAS):
                push(i)
            assert [p.result(timeout=40) for p in pulls] == [1] * REPLICAS
        values = clients[0].call("ps.pull", {}).tensors["w"]
        assert torch.allclose(values, torch.full((4,), -sum(range(REPLICAS)) / REPLICAS))
    finally:
        for client in clients:
            client.close()
        server.stop()
