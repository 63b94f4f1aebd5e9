"""Parameter-server cost: 64 MiB push+pull against raw TCP, and training against DDP.

* bandwidth: a worker pushes the gradient of a 64 MiB variable and gets the updated
  values back (the async step's single round trip: push, apply SGD on the ps, reply
  with the new values), against a raw TCP socket moving the same bytes both ways.
* training: samples/s on the MLP 784-512-512-10 (and 784-4096-4096-10 without
  --quick), batch 128 per worker, synthetic data: async ps (2 workers + 1 ps) and sync
  ps against hand-written ``DistributedDataParallel`` with 2 workers, same run. Every
  process has one thread, as two workers on two cores should.

TensorFlow's ParameterServerStrategy is not measured here unless TensorFlow is
installed (it is not, on this machine: see docs/architecture.md section 8 for its figure).

    python -m benchmarks.ps [--quick]
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
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
    client.call(
        "ps.optimizer", {"spec": {"name": "SGD", "groups": [{"lr": 0.01}]}, "group_of": {"w": 0}}
    )
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


# -- training ---------------------------------------------------------------------------


def _mlp(hidden: int) -> Any:
    from torch import nn

    return nn.Sequential(
        nn.Linear(784, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def _batches(rank: int, count: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(rank)
    return [
        (torch.randn(BATCH, 784, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(count)
    ]


def _ddp_worker(
    rank: int, port: int, hidden: int, warmup: int, steps: int, barrier: Any, out: Any
) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DistributedDataParallel(_mlp(hidden))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = _batches(rank, 4)
    for i in range(warmup + steps):
        if i == warmup:
            barrier.wait()
            start = time.perf_counter()
        x, y = data[i % len(data)]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out.put(time.perf_counter() - start)
    dist.destroy_process_group()


def _ps_worker(
    rank: int,
    spec: dict[str, Any],
    secret: bytes,
    mode: str,
    hidden: int,
    warmup: int,
    steps: int,
    barrier: Any,
    out: Any,
) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    from clusterflow.rpc import Credentials
    from clusterflow.strategies import SimpleClusterResolver
    from clusterflow.strategies.parameter_server import ParameterServerStrategy

    resolver = SimpleClusterResolver(
        spec, task_type="worker", task_id=rank, credentials=Credentials(secret)
    )
    strategy = ParameterServerStrategy(resolver, mode=mode)  # type: ignore[arg-type]
    with strategy.scope():
        torch.manual_seed(0)
        model = _mlp(hidden)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x: Any, y: Any) -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    data = _batches(rank, 4)
    for i in range(warmup + steps):
        if i == warmup:
            barrier.wait()
            start = time.perf_counter()
        strategy.run(step, data[i % len(data)])
    out.put(time.perf_counter() - start)
    strategy.leave()
    strategy.close()


def _throughput(kind: str, hidden: int, warmup: int, steps: int) -> float:
    """Samples/s of 2 workers: ``ddp``, or a ps ``async``/``sync`` run with 1 ps task."""
    import torch.distributed as dist

    from clusterflow.rpc import Credentials

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    extra: list[Any] = []
    if kind == "ddp":
        store = dist.TCPStore(
            "127.0.0.1", 0, 3, True, datetime.timedelta(seconds=60), wait_for_workers=False
        )
        workers = [
            ctx.Process(
                target=_ddp_worker, args=(r, store.port, hidden, warmup, steps, barrier, out)
            )
            for r in range(2)
        ]
        extra.append(store)
    else:
        credentials = Credentials.generate()
        parent, child = ctx.Pipe()
        ps = ctx.Process(target=_ps_task, args=(child, credentials.secret), daemon=True)
        ps.start()
        spec = {
            "ps": [parent.recv().removeprefix("tcp://")],
            "worker": ["127.0.0.1:1", "127.0.0.1:2"],
        }
        workers = [
            ctx.Process(
                target=_ps_worker,
                args=(r, spec, credentials.secret, kind, hidden, warmup, steps, barrier, out),
            )
            for r in range(2)
        ]
        extra += [ps, parent]
    for w in workers:
        w.start()
    elapsed = max(out.get(timeout=600) for _ in workers)
    for w in workers:
        w.join(60)
    if kind != "ddp":
        extra[1].send("done")
        extra[0].join(5)
        extra[0].kill()
    return 2 * steps * BATCH / elapsed


def main() -> None:
    args = parser("ps", __doc__).parse_args()
    raw_s, ours_s = bandwidth(5 if args.quick else 15)
    gb = 2 * PAYLOAD_BYTES / 1e9
    print(f"64 MiB push+pull: raw TCP {gb / raw_s:.2f} GB/s, clusterflow {gb / ours_s:.2f} GB/s")
    figures = {"bandwidth_ratio": raw_s / ours_s}
    sizes = [512] if args.quick else [512, 4096]
    for hidden in sizes:
        warmup, steps = (5, 60) if hidden == 512 else (2, 10)
        if args.quick:
            steps //= 2
        rates = {
            kind: _throughput(kind, hidden, warmup, steps) for kind in ("ddp", "async", "sync")
        }
        print(
            f"MLP 784-{hidden}-{hidden}-10, batch {BATCH}/worker, samples/s: "
            + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items())
        )
        suffix = "" if hidden == 512 else "_large"
        figures[f"async_vs_ddp{suffix}"] = rates["async"] / rates["ddp"]
        figures[f"sync_vs_ddp{suffix}"] = rates["sync"] / rates["ddp"]
    result("ps", **figures)


if __name__ == "__main__":
    main()
