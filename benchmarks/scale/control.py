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
  service's simple mode does), one in flight per task: ``dispatcher_leases_per_s``;
  then ``LEASES_PER_CALL`` splits per call (``count``), each acked on the next call,
  counted per lease: ``dispatcher_leases_batched_per_s``.

Each phase also reports the CPU seconds the manager (and, within it, its ZeroMQ I/O
thread) and the generator spent, and per call: the generator shares the machine's two
cores with the manager, so its share says how much of the rate it held back.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

TASKS = 1000
PACED_HZ = 10.0
"""Heartbeats per task per second in the paced phase (10,000/s in all)."""
PHASE_S = 3.0
"""Seconds each measured phase runs."""
LEASES_PER_CALL = 8
"""Splits a simulated task asks for per ``data.lease`` call in the batched phase."""


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
    """The simulated tasks: TASKS DEALER sockets in one process, on one epoll.

    Made as cheap as it can be, so that the figures measure the manager: a heartbeat's
    frame is encoded once per task and sent as it is (the request id only matches a
    reply to its call, and a task has one call out); replies are checked for an error
    by a byte search before anything is decoded; only sockets with news are visited.
    """
    import heapq
    import select

    import msgpack
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
    # epoll over the sockets' descriptors costs per ready socket; zmq.Poller would walk
    # all 1,000 sockets on every call. A ZeroMQ descriptor only signals that the socket
    # has news, and a send may take that news in: a socket sent on is checked again.
    epoll = select.epoll()
    task_of: dict[int, int] = {}
    for i, s in enumerate(socks):
        fd = s.get(zmq.FD)
        task_of[fd] = i
        epoll.register(fd, select.EPOLLIN)
    recheck: list[int] = []
    error_mark = msgpack.packb("k") + msgpack.packb(codec.KIND_ERROR)

    def frame(i: int, method: str, body: Any) -> bytes:
        return bytes(codec.encode(codec.KIND_REQUEST, i + 1, method, body)[0])

    def send(i: int, raw: bytes) -> None:
        socks[i].send(raw)
        recheck.append(i)

    def drain(tasks: list[int], out: list[tuple[int, bytes]]) -> None:
        for i in tasks:
            s = socks[i]
            while s.get(zmq.EVENTS) & zmq.POLLIN:
                raw = s.recv(zmq.NOBLOCK)
                if error_mark in raw:
                    header = codec.decode_header(raw)
                    if header["k"] == codec.KIND_ERROR:
                        raise SystemExit(f"benchmark failed: {header['m']}: {header.get('b')}")
                out.append((i, raw))

    def replies(timeout_ms: float) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        if recheck:
            tasks = recheck.copy()
            recheck.clear()
            drain(tasks, out)
            if out:
                return out
        drain([task_of[fd] for fd, _ in epoll.poll(timeout_ms / 1e3)], out)
        return out

    def closed_loop(first: list[bytes], following: Any, seconds: float) -> float:
        """One call in flight per task, for ``seconds``; what was answered per second.

        ``following(i, reply)`` gives the frame task ``i`` sends after ``reply``, and
        how much ``reply`` answered (a heartbeat, or each lease it lent).
        """
        for i in range(TASKS):
            send(i, first[i])
        done, start = 0, time.perf_counter()
        while (now := time.perf_counter()) - start < seconds:
            for i, reply in replies(100):
                ask, units = following(i, reply)
                done += units
                send(i, ask)
        rate = done / (now - start)
        pending = TASKS
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            pending -= len(replies(100))
        return rate

    figures: dict[str, float] = {}
    # register: every task at once; the barrier answers all when the last arrives
    conn.send(("begin", "register"))
    start = time.perf_counter()
    for i in range(TASKS):
        address = f"10.1.{i // 250}.{i % 250 + 1}:2222"
        send(i, frame(i, "manager.register", {"task": f"worker:{i}", "address": address}))
    got = 0
    while got < TASKS:
        batch = replies(60_000)
        if not batch:
            raise SystemExit("benchmark failed: registrations not answered in 60 s")
        got += len(batch)
    figures["register_1000_s"] = time.perf_counter() - start
    conn.send(("end", "register"))

    beats = [frame(i, "manager.heartbeat", {"task": f"worker:{i}"}) for i in range(TASKS)]
    conn.send(("begin", "heartbeat"))
    figures["manager_heartbeats_per_s"] = closed_loop(beats, lambda i, _: (beats[i], 1), PHASE_S)
    conn.send(("end", "heartbeat"))

    # paced: every task every 1/PACED_HZ s, staggered; latency of each reply. A task
    # whose beat is due while its last one is unanswered sends when the answer comes.
    interval = 1.0 / PACED_HZ
    sent_at: dict[int, float] = {}
    late: set[int] = set()
    latencies: list[float] = []
    start = time.perf_counter()
    due = [(start + interval * i / TASKS, i) for i in range(TASKS)]
    end = start + PHASE_S
    answered = 0
    conn.send(("begin", "paced"))
    while (now := time.perf_counter()) < end:
        while due[0][0] <= now:
            when, i = heapq.heappop(due)
            if i in sent_at:
                late.add(i)
                continue
            sent_at[i] = now
            send(i, beats[i])
            heapq.heappush(due, (when + interval, i))
        timeout = max(0.0, min(100.0, 1e3 * (due[0][0] - time.perf_counter())))
        got_back = replies(timeout)
        now = time.perf_counter()
        for i, _ in got_back:
            latencies.append(now - sent_at.pop(i))
            answered += 1
            if i in late:
                late.discard(i)
                sent_at[i] = now
                send(i, beats[i])
                heapq.heappush(due, (now + interval, i))
    while sent_at:
        got_back = replies(1000)
        now = time.perf_counter()
        for i, _ in got_back:
            latencies.append(now - sent_at.pop(i))
    conn.send(("end", "paced"))
    latencies.sort()
    figures["heartbeat_paced_per_s"] = answered / PHASE_S
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
    send(0, frame(0, "data.register", {"spec": spec}))
    while not replies(1000):
        pass

    def asks(count: int | None) -> list[bytes]:
        more = {} if count is None else {"count": count}
        return [
            frame(i, "data.lease", {"name": "bench", "worker": f"worker:{i}", **more})
            for i in range(TASKS)
        ]

    def lease_after(count: int | None) -> Any:
        more = {} if count is None else {"count": count}

        def following(i: int, raw: bytes) -> tuple[bytes, int]:
            reply = codec.decode_header(raw)["b"]
            if reply.get("status") != "lease":
                raise SystemExit(f"benchmark failed: data.lease answered {reply}")
            lent = reply["leases"] if count is not None else [reply["lease"]]
            acks = [lease[0] for lease in lent]
            body = {"name": "bench", "worker": f"worker:{i}", "acks": acks, **more}
            return frame(i, "data.lease", body), len(lent)

        return following

    # one split per call, as the data service's client asks today
    conn.send(("begin", "lease"))
    figures["dispatcher_leases_per_s"] = closed_loop(asks(None), lease_after(None), PHASE_S)
    conn.send(("end", "lease"))
    # LEASES_PER_CALL splits per call, each its own lease (and ack): counted per lease
    conn.send(("begin", "lease_batched"))
    figures["dispatcher_leases_batched_per_s"] = closed_loop(
        asks(LEASES_PER_CALL), lease_after(LEASES_PER_CALL), PHASE_S
    )
    conn.send(("end", "lease_batched"))
    conn.send(figures)
    for s in socks:
        s.close(linger=0)
    ctx.term()


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def _io_cpu(proc: psutil.Process) -> float:
    """CPU seconds of the process's ZeroMQ I/O threads (libzmq names them ``ZMQbg/IO/n``):
    TCP, framing and curve encryption, apart from the Python threads' share."""
    total = 0.0
    for thread in proc.threads():
        try:
            name = Path(f"/proc/{proc.pid}/task/{thread.id}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("ZMQbg/IO"):
            total += thread.user_time + thread.system_time
    return total


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
            marks[message]["manager_io"] = _io_cpu(procs["manager"])
        figures: dict[str, float] = message
        # CPU each side spent, per phase and per call: what a quiet core would sustain,
        # whatever the load of the shared machine did to the wall-clock rates above.
        for phase in ("register", "heartbeat", "paced", "lease", "lease_batched"):
            for name in (*procs, "manager_io"):
                used = marks[("end", phase)][name] - marks[("begin", phase)][name]
                figures[f"{phase}_{name}_cpu_s"] = used
        for phase, rate_key in (
            ("heartbeat", "manager_heartbeats_per_s"),
            ("lease", "dispatcher_leases_per_s"),
            ("lease_batched", "dispatcher_leases_batched_per_s"),
        ):
            calls = figures[rate_key] * PHASE_S
            for name in (*procs, "manager_io"):
                used = figures[f"{phase}_{name}_cpu_s"]
                figures[f"{phase}_{name}_cpu_us"] = 1e6 * used / max(calls, 1.0)
        client.join(30)
        return figures
    finally:
        manager_pipe.send("stop")
        manager.join(30)
        if manager.is_alive():
            manager.kill()
        shutil.rmtree(home, ignore_errors=True)  # the manager's cluster folder
