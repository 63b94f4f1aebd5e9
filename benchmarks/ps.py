"""Parameter-server cost: 64 MiB push+pull against raw TCP, and training against DDP.

* bandwidth: a worker pushes the gradient of a 64 MiB variable and gets the updated
  values back (the async step's single round trip: push, apply SGD on the ps, reply
  with the new values, written into the worker's parameter as ``load_into`` writes
  them), against a raw TCP socket moving the same bytes both ways. Both servers stay
  up; each round times one round trip of each. (Before 2026-11-27 the values ended in a
  buffer the client joined from the frames, and the write into the parameter, a second
  copy then, was not timed; now the frames go straight into the parameter: one copy
  either way.) Since 2026-11-28 the push travels as ``RemotePS`` sends it: in parts of
  ``codec.PART_BYTES``, each checked on the ps as it arrives, and the values come back
  a group of chunks at a time as the ps steps them (``streamed``).
* training: samples/s on the MLP 784-512-512-10 (and 784-4096-4096-10 without
  --quick), batch 128 per worker, synthetic data: async ps (2 workers + 1 ps) and sync
  ps (2 workers + 1 ps) against hand-written ``DistributedDataParallel`` with 2 workers.
  All three sides' processes start first and stay up; then each round runs one timed
  window of every side in turn (the others wait, idle, on a pipe), in an order reversed
  each round. ``async_vs_ddp`` is the median over rounds of that round's async/DDP
  ratio. Every process runs torch on one thread, as two workers on two cores should.

Each ratio prints as ``key=median key_min=... key_max=...`` over the rounds.
``--bandwidth-only`` runs the first part alone (about a minute); ``benchmarks._ps_phases``
splits its round trip into phases on both ends.

TensorFlow's ParameterServerStrategy is not measured here: ``benchmarks.scale`` measures
it on emulated hosts, where a Python with TensorFlow is named (``--tf-python``).

    python -m benchmarks.ps [--quick] [--rounds N] [--verbose] [--bandwidth-only]
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import psutil

from benchmarks.common import (
    MachineLoad,
    Spread,
    alternate,
    best_of,
    one_thread_per_process,
    parser,
    ratio,
    report,
    settle,
)

PAYLOAD_BYTES = 64 * 1024 * 1024
BATCH = 128
WORKERS = 2
BURST = 3
"""64 MiB round trips per side per round; the best counts."""
CORES = os.cpu_count() or 1
REPLY_TIMEOUT_S = 300.0
"""A side that does not answer within this fails the run instead of hanging it."""


def _recv(conn: Connection, what: str) -> Any:
    try:
        if conn.poll(REPLY_TIMEOUT_S):
            return conn.recv()
    except EOFError:
        raise SystemExit(f"benchmark failed: the process died before its {what}") from None
    raise SystemExit(f"benchmark failed: no {what} within {REPLY_TIMEOUT_S:g}s")


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


def _ps_task(conn: Connection, secret: bytes) -> None:
    import torch

    torch.set_num_threads(1)
    from clusterflow.ps.service import PSService
    from clusterflow.rpc import Credentials
    from clusterflow.server import create_local_server

    server = create_local_server(credentials=Credentials(secret))
    PSService(server)
    conn.send(server.target)
    settle()
    conn.recv()


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def _start(target: Callable[..., None], *args: Any) -> tuple[Any, Connection, Any]:
    """A daemon process running ``target(pipe, *args)``; it sends one greeting first."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return proc, parent, _recv(parent, f"greeting from {target.__name__}")


def bandwidth(rounds: int, verbose: bool) -> dict[str, Spread]:
    """Per round, raw TCP's seconds / ours for one 64 MiB round trip each way: over the
    ps's side channel (``bandwidth_ratio``, as ``RemotePS`` pushes on loopback) and over
    ZeroMQ (``bandwidth_ratio_zmq``, as under CURVE auth, without its encryption)."""
    import torch

    from clusterflow.ps.api import Shard, VariableSpec
    from clusterflow.rpc import Credentials, RpcClient
    from clusterflow.rpc.codec import PART_BYTES
    from clusterflow.strategies.parameter_server.shards import TrackedVar, load_into

    credentials = Credentials.generate()
    raw_proc, _, raw_port = _start(_raw_tcp_echo)
    ps_proc, ps_pipe, target = _start(_ps_task, credentials.secret)
    sock = socket.create_connection(("127.0.0.1", raw_port))
    out = memoryview(bytearray(PAYLOAD_BYTES))
    back = memoryview(bytearray(PAYLOAD_BYTES))
    client = RpcClient(target, credentials)
    zmq_client = RpcClient(target, credentials)
    try:

        def raw_once() -> float:
            start = time.perf_counter()
            sock.sendall(out)
            got = 0
            while got < PAYLOAD_BYTES:
                got += sock.recv_into(back[got:])
            return time.perf_counter() - start

        n = PAYLOAD_BYTES // 4
        config = {"mode": "async", "num_replicas": 1}
        decl = [{"name": "w", "shape": [n], "dtype": "float32"}]
        client.call("ps.create", {"config": config, "vars": decl}, {"w": torch.zeros(n)})
        client.call(
            "ps.optimizer",
            {"spec": {"name": "SGD", "groups": [{"lr": 0.01}]}, "group_of": {"w": 0}},
        )
        grad = torch.full((n,), 1e-3)
        param = torch.zeros(n)
        tracked = TrackedVar(
            tensor=param,
            spec=VariableSpec(name="w", shape=(n,), dtype="float32"),
            shards=(Shard(variable="w", name="w", ps=0, start=0, stop=n, shape=(n,)),),
        )
        version = [0]

        def ours_once(client: RpcClient, side: bool) -> float:
            # As a worker's step does (``RemotePS.push``, ``shards.load_into``): the
            # reply's values come as the frames received, written into the parameter.
            start = time.perf_counter()
            reply = client.call(
                "ps.push",
                {"worker": "w", "version": version[0], "want_values": True},
                {"g/w": grad},
                framed=True,
                part_bytes=PART_BYTES,  # in parts, as RemotePS sends a push,
                streamed=True,  # and its values back as the ps steps them
                side=side,  # over the ps's side channel (rpc/side.py), as RemotePS
            )
            version[0] = reply.body["version"]
            load_into([tracked], reply.tensors)
            return time.perf_counter() - start

        # A round trip takes about 0.1 s: the best of a few per turn leaves out the
        # moments a neighbour held the core, which alone moved a round's ratio 2x.
        # CPU per round trip, both ends (this process and the server's): a figure the
        # neighbours' load moves far less than the wall time on a busy 2-core host.
        me = psutil.Process()
        servers = {"raw": psutil.Process(raw_proc.pid), "side": psutil.Process(ps_proc.pid)}
        servers["zmq"] = servers["side"]
        cpu = {name: [0.0, 0] for name in servers}

        def burst(name: str, once: Callable[[], float]) -> float:
            before = _cpu(me) + _cpu(servers[name])
            best = best_of(once, BURST)
            cpu[name][0] += _cpu(me) + _cpu(servers[name]) - before
            cpu[name][1] += BURST
            return best

        times = alternate(
            {
                "raw": lambda: burst("raw", raw_once),
                "side": lambda: burst("side", lambda: ours_once(client, True)),
                "zmq": lambda: burst("zmq", lambda: ours_once(zmq_client, False)),
            },
            rounds,
            verbose=verbose,
        )
        per_trip = {name: 1e3 * total / max(1, count) for name, (total, count) in cpu.items()}
        print(
            "CPU per round trip, both ends: "
            + ", ".join(f"{name} {ms:.1f} ms" for name, ms in per_trip.items())
        )
        # Replies send the ps's live values (ps/loans.py); a push that met the previous
        # reply still in flight paid a copy instead. Here each push waits for its reply.
        stats = client.call("ps.stats").body
        print(f"ps: {stats.get('copied_on_write', 0)} copies on write in {stats['applied']} pushes")
    finally:
        client.close()
        zmq_client.close()
        sock.close()
        ps_pipe.send("done")
        ps_proc.join(5)
        for proc in (raw_proc, ps_proc):
            proc.kill()
    gb = 2 * PAYLOAD_BYTES / 1e9
    print(
        f"64 MiB push+pull, best round: raw TCP {gb / min(times['raw']):.2f} GB/s, "
        f"clusterflow {gb / min(times['side']):.2f} GB/s (side channel), "
        f"{gb / min(times['zmq']):.2f} GB/s (ZeroMQ)"
    )
    return {
        "bandwidth_ratio": ratio(times["raw"], times["side"]),
        "bandwidth_ratio_zmq": ratio(times["raw"], times["zmq"]),
    }


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


def _train_worker(
    conn: Connection, kind: str, rank: int, hidden: int, where: Any, barrier: Any
) -> None:
    """One worker of one side; per request ``n``, times ``n`` steps; ``None`` ends it.

    ``where`` is the TCPStore's port for ``ddp``, else ``(cluster spec, secret)``.
    """
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    data = _batches(rank, 4)
    strategy: Any = None
    if kind == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        store = dist.TCPStore("127.0.0.1", where, WORKERS, False, datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORKERS)
        torch.manual_seed(0)
        model = DistributedDataParallel(_mlp(hidden))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        from clusterflow.rpc import Credentials
        from clusterflow.strategies import SimpleClusterResolver
        from clusterflow.strategies.parameter_server import ParameterServerStrategy

        spec, secret = where
        resolver = SimpleClusterResolver(
            spec, task_type="worker", task_id=rank, credentials=Credentials(secret)
        )
        strategy = ParameterServerStrategy(resolver, mode=kind)
        with strategy.scope():
            torch.manual_seed(0)
            model = _mlp(hidden)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x: Any, y: Any) -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    conn.send("ready")
    settle()
    i = 0
    while (n := conn.recv()) is not None:
        barrier.wait()
        cpu = time.process_time()  # every thread of this process
        start = time.perf_counter()
        for _ in range(n):
            if strategy is None:
                step(*data[i % len(data)])
            else:
                strategy.run(step, data[i % len(data)])
            i += 1
        if strategy is not None:
            strategy.flush()  # the window's last push counts (async overlaps it)
        conn.send((start, time.perf_counter(), time.process_time() - cpu))
    if strategy is not None:
        strategy.close()
    else:
        import torch.distributed as dist

        # The DDP wrapper first: its reducer would free the group from C++ with the GIL
        # held when this returns, which can hang on a gloo thread (examples/digits_ddp.py).
        del model, opt, step
        group = dist.group.WORLD
        dist.destroy_process_group()
        del group


class _Side:
    """The worker processes of one side, idle on their pipes between windows."""

    def __init__(self, kind: str, hidden: int, where: Any, ps_pid: int | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.ps = psutil.Process(ps_pid) if ps_pid is not None else None
        self.shares: list[float] = []
        """Per window, the share of the machine's cores this side's processes used."""
        # Held here: a barrier the parent drops is unlinked before the children attach.
        self.barrier = barrier = ctx.Barrier(WORKERS)
        self.kind = kind
        self.pipes: list[Connection] = []
        self.procs = []
        for rank in range(WORKERS):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_train_worker,
                args=(child, kind, rank, hidden, where, barrier),
                daemon=True,
            )
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def ready(self) -> None:
        for pipe in self.pipes:
            if _recv(pipe, f"{self.kind} worker ready") != "ready":
                raise SystemExit(f"benchmark failed: a {self.kind} worker did not start")

    def window(self, steps: int) -> float:
        """Samples/s of both workers over ``steps`` steps each."""
        ps_cpu = self._ps_cpu()
        for pipe in self.pipes:
            pipe.send(steps)
        spans = [_recv(pipe, f"{self.kind} window") for pipe in self.pipes]
        elapsed = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
        cpu = sum(c for _, _, c in spans) + self._ps_cpu() - ps_cpu
        self.shares.append(cpu / (elapsed * CORES))
        return WORKERS * steps * BATCH / elapsed

    def _ps_cpu(self) -> float:
        if self.ps is None:
            return 0.0
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def stop(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for proc in self.procs:
            proc.join(30)
            proc.kill()


def training(hidden: int, steps: int, rounds: int, verbose: bool) -> dict[str, list[float]]:
    """Samples/s per round of each side: ``ddp``, ``async`` and ``sync``."""
    import torch.distributed as dist

    from clusterflow.rpc import Credentials

    credentials = Credentials.generate()
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, WORKERS + 1, True, datetime.timedelta(seconds=60), wait_for_workers=False
    )
    ps_tasks: list[tuple[Any, Connection]] = []
    sides: dict[str, _Side] = {}
    try:
        for kind in ("ddp", "async", "sync"):
            if kind == "ddp":
                where: Any = store.port
            else:
                proc, pipe, target = _start(_ps_task, credentials.secret)
                ps_tasks.append((proc, pipe))
                spec = {
                    "ps": [target.removeprefix("tcp://")],
                    "worker": ["127.0.0.1:1", "127.0.0.1:2"],
                }
                where = (spec, credentials.secret)
            sides[kind] = _Side(kind, hidden, where, ps_tasks[-1][0].pid if ps_tasks else None)
        for side in sides.values():
            side.ready()
        rates = alternate(
            {kind: (lambda s=side: s.window(steps)) for kind, side in sides.items()},
            rounds,
            verbose=verbose,
        )
        # Where a ratio moves with the load, this shows why: a side whose processes got
        # less of the cores than in a quiet run was waiting (a preempted peer) or starved.
        shares = {kind: side.shares[-rounds:] for kind, side in sides.items()}
        print(
            "median share of the cores used by each side's processes in its windows: "
            + ", ".join(f"{kind} {Spread.of(v).median:.0%}" for kind, v in shares.items())
        )
        for kind in ("async", "sync"):
            per_cpu = ratio(
                [r / c for r, c in zip(rates[kind], shares[kind], strict=True)],
                [r / c for r, c in zip(rates["ddp"], shares["ddp"], strict=True)],
            )
            print(f"{kind}_vs_ddp per share of the cores used (a diagnostic): {per_cpu}")
        return rates
    finally:
        for side in sides.values():
            side.stop()
        for proc, pipe in ps_tasks:
            pipe.send("done")
            proc.join(5)
            proc.kill()


def main() -> None:
    p = parser("ps", __doc__)
    p.add_argument("--bandwidth-only", action="store_true", help="the 64 MiB push+pull alone")
    args = p.parse_args()
    one_thread_per_process()
    load = MachineLoad()
    rounds = args.rounds or (7 if args.quick else 15)
    figures: dict[str, Spread] = bandwidth(rounds + 2, args.verbose)
    sizes = [] if args.bandwidth_only else [512] if args.quick else [512, 4096]
    for hidden in sizes:
        steps = 30 if hidden == 512 else 3
        rates = training(hidden, steps, rounds, args.verbose)
        print(
            f"MLP 784-{hidden}-{hidden}-10, batch {BATCH}/worker, {steps} steps a window, "
            f"median samples/s over {rounds} rounds: "
            + ", ".join(f"{k} {Spread.of(v).median:,.0f}" for k, v in rates.items())
        )
        suffix = "" if hidden == 512 else "_large"
        figures[f"async_vs_ddp{suffix}"] = ratio(rates["async"], rates["ddp"])
        figures[f"sync_vs_ddp{suffix}"] = ratio(rates["sync"], rates["ddp"])
    report("ps", figures, load.describe())


if __name__ == "__main__":
    main()
