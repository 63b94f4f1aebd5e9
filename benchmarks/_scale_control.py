"""The control-plane half of ``benchmarks.scale``: one manager, 1,000 simulated tasks.

The manager is clusterflow's own ``Controller`` (its RPC server, task table, rendezvous
and data dispatcher, with the handlers a real cluster has), built for 1,000 workers on a
backend that launches nothing: the 1,000 tasks are **simulated registrants**, one
ZeroMQ DEALER socket each (its own TCP connection, curve-encrypted as between real
machines, though both ends are on loopback here), in one client process that speaks
clusterflow's wire format (``rpc/codec.py``) without torch. They:

* register (``manager.register``): all 1,000 are held at the barrier until the last
  arrives, then every one gets its spec and environment: ``register_1000_s``;
* heartbeat (``manager.heartbeat``) as fast as the manager answers, one call in flight
  per task: ``manager_heartbeats_per_s``; then paced at 10 per task per second (10,000/s
  offered, ten times a real cluster's 1 s interval), whose reply latency gives
  ``heartbeat_p99_ms``;
* take leases (``data.lease``, acking the previous one on the same call, as the data
  service's simple mode does), one in flight per task: ``dispatcher_leases_per_s``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

TASKS = 1000
PACED_HZ = 10.0
"""Heartbeats per task per second in the paced phase (10,000/s in all)."""


class _Process:
    """A simulated task's process: never started, alive until signalled."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self.pid = 0
        self.output = None
        self._code: int | None = None

    def poll(self) -> int | None:
        return self._code

    def wait(self, timeout: float) -> int | None:
        return self._code

    def signal(self, signum: int) -> None:
        self._code = -signum

    def memory_kill(self) -> bool:
        return False


class SimulatedBackend:
    name = "simulated"

    def launch(self, launch: Any) -> _Process:
        return _Process(launch.task)

    def adopt(self, process: Any, task: Any) -> None:
        """Standbys never come: nothing to adopt."""

    def job_env(self, task: Any) -> dict[str, str]:
        return {}


def _manager(conn: Connection, home: str) -> None:
    """The manager process: a Controller for TASKS workers, serving until told to stop."""
    os.environ["CLUSTERFLOW_HOME"] = home
    from clusterflow.manager import registry
    from clusterflow.manager.config import RunConfig
    from clusterflow.manager.controller import Controller
    from clusterflow.rpc import Credentials, RpcServer

    cluster = registry.create()
    # curve, as a manager and its tasks on separate machines use (loopback would be plain)
    credentials = Credentials.generate(mode="curve")
    credentials.to_file(cluster.secret_file)
    config = RunConfig(command=("true",), workers=TASKS, register_timeout_s=120.0)
    rpc = RpcServer(credentials, name="manager", workers=TASKS + 16)
    Controller(cluster, config, SimulatedBackend(), rpc=rpc)  # type: ignore[arg-type]
    rpc.start()
    conn.send((rpc.endpoint, credentials.secret))
    conn.recv()
    rpc.stop()


def _client(conn: Connection, endpoint: str, secret: bytes) -> None:
    """The simulated tasks: TASKS DEALER sockets on one poller."""
    import zmq

    from clusterflow.rpc import Credentials, codec

    ctx = zmq.Context()
    credentials = Credentials(secret, mode="curve")
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    socks = []
    for _ in range(TASKS):
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        credentials.apply_client(s, host)
        s.connect(endpoint)
        socks.append(s)
    index = {s: i for i, s in enumerate(socks)}
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    ids = iter(range(1, 1 << 62))

    def send(i: int, method: str, body: Any) -> None:
        socks[i].send_multipart(codec.encode(codec.KIND_REQUEST, next(ids), method, body))

    def replies(timeout_ms: int) -> list[tuple[int, dict[str, Any]]]:
        out = []
        for s, _ in poller.poll(timeout_ms):
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                header = codec.decode_header(frames[0])
                if header["k"] == codec.KIND_ERROR:
                    raise SystemExit(f"benchmark failed: {header['m']}: {header.get('b')}")
                out.append((index[s], header))
        return out

    def closed_loop(method: str, body_of: Any, seconds: float) -> tuple[float, Any]:
        """One call in flight per task, for ``seconds``; calls/s and the last replies."""
        last: dict[int, Any] = {}
        for i in range(TASKS):
            send(i, method, body_of(i, None))
        done, start = 0, time.perf_counter()
        while (now := time.perf_counter()) - start < seconds:
            for i, header in replies(100):
                done += 1
                last[i] = header.get("b")
                send(i, method, body_of(i, last[i]))
        rate = done / (now - start)
        pending = TASKS
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            pending -= len(replies(100))
        return rate, last

    figures: dict[str, float] = {}
    # register: every task at once; the barrier answers all when the last arrives
    start = time.perf_counter()
    for i in range(TASKS):
        send(
            i,
            "manager.register",
            {"task": f"worker:{i}", "address": f"10.1.{i // 250}.{i % 250 + 1}:2222"},
        )
    got = 0
    while got < TASKS:
        batch = replies(60_000)
        if not batch:
            raise SystemExit("benchmark failed: registrations not answered in 60 s")
        got += len(batch)
    figures["register_1000_s"] = time.perf_counter() - start

    def heartbeat(i: int, _: Any) -> dict[str, str]:
        return {"task": f"worker:{i}"}

    conn.send(("begin", "heartbeat"))
    figures["manager_heartbeats_per_s"], _ = closed_loop("manager.heartbeat", heartbeat, 3.0)
    conn.send(("end", "heartbeat"))

    # paced: every task every 1/PACED_HZ s, staggered; latency of each reply
    interval = 1.0 / PACED_HZ
    sent_at: dict[int, float] = {}
    latencies: list[float] = []
    start = time.perf_counter()
    due = [start + interval * i / TASKS for i in range(TASKS)]
    end = start + 3.0
    answered = 0
    while (now := time.perf_counter()) < end:
        for i in range(TASKS):
            if due[i] <= now and i not in sent_at:
                sent_at[i] = now
                send(i, "manager.heartbeat", heartbeat(i, None))
                due[i] += interval
        for i, _ in replies(1):
            latencies.append(time.perf_counter() - sent_at.pop(i))
            answered += 1
    while sent_at:
        for i, _ in replies(1000):
            latencies.append(time.perf_counter() - sent_at.pop(i))
    latencies.sort()
    figures["heartbeat_paced_per_s"] = answered / 3.0
    figures["heartbeat_p50_ms"] = 1e3 * latencies[len(latencies) // 2]
    figures["heartbeat_p99_ms"] = 1e3 * latencies[int(len(latencies) * 0.99)]

    # leases: one dataset of many small splits; each call acks the previous lease
    spec = {
        "name": "bench",
        "source": "range://10000000",
        "num_records": 1_000_000,
        "split_size": 10,
        "seed": 0,
        "epochs": None,
    }
    send(0, "data.register", {"spec": spec})
    while not replies(1000):
        pass

    def lease(i: int, last: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"name": "bench", "worker": f"worker:{i}"}
        if last and last.get("lease"):
            body["acks"] = [last["lease"][0]]
        return body

    conn.send(("begin", "lease"))
    figures["dispatcher_leases_per_s"], _ = closed_loop("data.lease", lease, 3.0)
    conn.send(("end", "lease"))
    conn.send(figures)
    for s in socks:
        s.close(linger=0)
    ctx.term()


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def run() -> dict[str, float]:
    """The control-plane figures; the manager and the tasks each in a process of their own."""
    ctx = mp.get_context("spawn")
    home = tempfile.mkdtemp(prefix="cf-scale-home-")
    manager_pipe, child = ctx.Pipe()
    manager = ctx.Process(target=_manager, args=(child, home), daemon=True)
    manager.start()
    try:
        if not manager_pipe.poll(120):
            raise SystemExit("benchmark failed: the manager did not start")
        endpoint, secret = manager_pipe.recv()
        client_pipe, child = ctx.Pipe()
        client = ctx.Process(target=_client, args=(child, endpoint, secret), daemon=True)
        client.start()
        procs = {"manager": psutil.Process(manager.pid), "tasks": psutil.Process(client.pid)}
        marks: dict[tuple[str, str], dict[str, float]] = {}
        while True:
            if not client_pipe.poll(300):
                raise SystemExit("benchmark failed: the simulated tasks did not finish")
            message = client_pipe.recv()
            if isinstance(message, dict):
                break
            marks[message] = {name: _cpu(proc) for name, proc in procs.items()}
        figures: dict[str, float] = message
        # CPU seconds each side spent per call: what a quiet core would sustain, whatever
        # the load of the shared machine did to the wall-clock rates above.
        for phase, rate_key in (
            ("heartbeat", "manager_heartbeats_per_s"),
            ("lease", "dispatcher_leases_per_s"),
        ):
            calls = figures[rate_key] * 3.0
            for name in procs:
                used = marks[("end", phase)][name] - marks[("begin", phase)][name]
                figures[f"{phase}_{name}_cpu_us"] = 1e6 * used / max(calls, 1.0)
        client.join(30)
        return figures
    finally:
        manager_pipe.send("stop")
        manager.join(30)
        if manager.is_alive():
            manager.kill()
        _ = Path(home)
