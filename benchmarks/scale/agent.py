"""One emulated host's process for ``benchmarks.scale``: a ps shard, a worker, or both.

Started inside a host's network namespace (``ip netns exec``); reads one JSON command a
line on stdin and answers one JSON line on stdout, prefixed ``@@`` (anything else on
stdout is library noise, skipped). It keeps what the commands built (ps servers, the
gloo group, one model per side) so windows of every side alternate without rebuilding.

Compute is **emulated**: a step sleeps for its compute time, a third before the forward
pass and two thirds spread over the backward pass (a sleep in each layer's backward
hook), as a GPU computes while the CPU waits. So DDP's buckets can all-reduce during
the backward pass as on a GPU, and the two cores are left to the communication, which
is real: clusterflow's RPC and ps, gloo's ring.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.scale.hosts import LAYERS

torch.set_num_threads(1)
BATCH = 16


class Emulated:
    """The compute time of a step, without the CPU: sleeps placed as a GPU's work is."""

    def __init__(self) -> None:
        self.step_s = 0.0

    def forward(self) -> None:
        time.sleep(self.step_s / 3)

    def hook(self, *_: Any) -> None:
        time.sleep(2 * self.step_s / 3 / LAYERS)


def _model(width: int, emulated: Emulated) -> nn.Module:
    """``LAYERS`` square layers: equal variables, so 1/2/4/8 shards split them evenly."""
    torch.manual_seed(0)
    layers = [nn.Linear(width, width, bias=False) for _ in range(LAYERS)]
    for layer in layers:
        layer.register_full_backward_hook(emulated.hook)
    return nn.Sequential(*layers)


class Agent:
    def __init__(self, address: str) -> None:
        self.address = address
        self.servers: dict[str, Any] = {}
        self.sides: dict[str, Any] = {}
        self.emulated = Emulated()
        self.x = torch.randn(BATCH, 1)

    # ps ----------------------------------------------------------------------------

    def ps_start(self, name: str, spec: dict[str, list[str]], index: int, secret: str) -> Any:
        from clusterflow.cluster import ClusterSpec
        from clusterflow.ps.service import PSService
        from clusterflow.rpc import Credentials
        from clusterflow.server import Server

        server = Server(
            ClusterSpec(spec), "ps", index, credentials=Credentials(bytes.fromhex(secret))
        )
        PSService(server)
        self.servers[name] = server
        return server.target

    def ps_stop(self, name: str) -> None:
        self.servers.pop(name).stop()

    # workers -----------------------------------------------------------------------

    def _step_of(self, model: nn.Module, width: int) -> Any:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(BATCH, width)
        y = torch.randn(BATCH, width)

        def step() -> None:
            self.emulated.forward()
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        return step

    def ps_join(self, name: str, spec: dict[str, Any], rank: int, secret: str, **opts: Any) -> None:
        from clusterflow.rpc import Credentials
        from clusterflow.strategies import SimpleClusterResolver
        from clusterflow.strategies.parameter_server import ParameterServerStrategy
        from clusterflow.strategies.parameter_server.config import ParameterServerConfig

        width = int(opts.pop("width"))
        split = int(opts.pop("split", 1))
        if split > 1:  # more shards than layers: each layer in ``split`` equal pieces
            from clusterflow.ps.placement import MinSizePartitioner

            opts["variable_partitioner"] = MinSizePartitioner(min_shard_bytes=1, max_shards=split)
        resolver = SimpleClusterResolver(
            spec,
            task_type="worker",
            task_id=rank,
            credentials=Credentials(bytes.fromhex(secret)),
        )
        strategy = ParameterServerStrategy(resolver, config=ParameterServerConfig(**opts))
        with strategy.scope():
            model = _model(width, self.emulated)
        step = self._step_of(model, width)
        self.sides[name] = ("ps", strategy, lambda: strategy.run(step))

    def dist_init(
        self,
        master: str,
        port: int,
        rank: int,
        world: int,
        local_rank: int = 0,
        local_world: int = 1,
    ) -> None:
        import torch.distributed as dist

        os.environ.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(local_world),
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "eth0",
            }
        )
        store = dist.TCPStore(master, port, world, rank == 0, datetime.timedelta(seconds=120))
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        self._store = store

    def ring_join(
        self, name: str, width: int, bf16: bool, bucket_bytes: int, algorithm: str = "backend"
    ) -> None:
        """clusterflow's MultiWorkerMirroredStrategy (gloo ring) adopting the group."""
        from clusterflow.strategies import (
            CommunicationOptions,
            Compression,
            MultiWorkerMirroredStrategy,
        )

        options = CommunicationOptions(
            compression=Compression.BF16 if bf16 else Compression.NONE,
            bytes_per_pack=bucket_bytes,
            algorithm=algorithm,
        )
        strategy = MultiWorkerMirroredStrategy(options)
        with strategy.scope():
            model = _model(width, self.emulated)
        step = self._step_of(model, width)
        self.sides[name] = ("ring", strategy, lambda: strategy.run(step))

    def ddp_join(self, name: str, width: int, bucket_bytes: int) -> None:
        """Hand-written DDP on the same group, torch's defaults but the bucket size."""
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            _model(width, self.emulated), bucket_cap_mb=bucket_bytes / 2**20
        )
        self.sides[name] = ("ddp", None, self._step_of(model, width))

    def dist_destroy(self) -> None:
        import torch.distributed as dist

        for name in [n for n, side in self.sides.items() if side[0] in ("ring", "ddp")]:
            _, strategy, _ = self.sides.pop(name)
            if strategy is not None:
                strategy.shutdown()
        dist.destroy_process_group()

    def drop(self, name: str) -> None:
        kind, strategy, _ = self.sides.pop(name)
        if kind == "ps":
            strategy.close()

    def window(self, name: str, steps: int, compute_s: float) -> list[float]:
        """``steps`` steps of side ``name`` in steady state; (start, end, cpu seconds).

        One untimed step first, so the first timed step waits for what an earlier step
        left in flight (an overlapped push, a sync prefetch, peers of the ring starting
        together), as every later one does. The window ends when the last step returns,
        where the next step would start: its overlapped push travels during that next
        step in a continuous run, so its answer is awaited after the window.
        """
        kind, strategy, step = self.sides[name]
        self.emulated.step_s = compute_s
        step()
        cpu = time.process_time()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        end = time.perf_counter()
        cpu = time.process_time() - cpu
        if kind == "ps":
            strategy.flush()  # the last push's answer, outside the window
        return [start, end, cpu]

    def warm(self, name: str, steps: int, compute_s: float) -> list[float]:
        return self.window(name, steps, compute_s)


def main() -> None:
    agent = Agent(sys.argv[1])
    print("@@ " + json.dumps({"ok": agent.address}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "exit":
            break
        try:
            value = getattr(agent, op)(**request)
            reply: dict[str, Any] = {"ok": value}
        except Exception as exc:  # the coordinator fails the run, naming it
            reply = {"error": f"{op}: {type(exc).__name__}: {exc}"}
        print("@@ " + json.dumps(reply), flush=True)
    for server in agent.servers.values():
        server.stop()
    os._exit(0)  # strategies' daemon threads need no orderly exit here


if __name__ == "__main__":
    main()
