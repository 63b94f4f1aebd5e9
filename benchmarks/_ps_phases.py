"""Where a 64 MiB push+pull's time goes, phase by phase, on both ends of the call.

One process holds the ps (a real ``PSService`` on a loopback ``RpcServer``) and the
worker (an ``RpcClient``); the phases are timed by wrapping the functions that run them,
on the thread that runs them. Rounds alternate the ps replying from snapshots (as
before ``ps/loans.py``) and from its lent live variables, and the raw-TCP round trip of
the same bytes (an echo process, as in ``benchmarks.ps``) is the floor. A ZeroMQ echo
of the same 16 frames of 4 MiB (ROUTER and DEALER, zero-copy, no decode, no auth)
says what the transport alone costs above raw TCP. Each phase prints as its median ms
per call over the rounds.

    python -m benchmarks._ps_phases [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import zmq

from benchmarks.ps import PAYLOAD_BYTES, _raw_tcp_echo, _start
from clusterflow.ps import store as store_module
from clusterflow.ps.service import PSService
from clusterflow.rpc import Credentials, RpcClient, codec
from clusterflow.rpc import server as server_module
from clusterflow.server import create_local_server

_lock = threading.Lock()
_spent: dict[str, float] = defaultdict(float)


def _timing(name: str, fn: Callable[..., Any], per_side: bool = False) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            side = ""
            if per_side:
                main = threading.current_thread() is threading.main_thread()
                side = "worker: " if main else "ps: "
            with _lock:
                _spent[side + name] += time.perf_counter() - start

    return timed


def _zmq_echo(ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> None:
    """Sends every message back as it came, frame for frame, without copying."""
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(address)
    try:
        while True:
            frames = router.recv_multipart(copy=False)
            router.send_multipart(frames, copy=False)
            del frames
    except zmq.ContextTerminated:
        router.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(1)
    # The ps's phases, where they run (rpc/server.py, ps/store.py); the client's decode
    # is codec.decode_tensors on the calling thread.
    codec.decode_tensors = _timing("decode (zero-copy views)", codec.decode_tensors, True)
    codec.Framed.copy_into = _timing("frames -> parameter", codec.Framed.copy_into, True)  # type: ignore[method-assign]
    server_module.codec = codec
    store_module.VariableStore._check = _timing("check (finite)", store_module.VariableStore._check)
    store_module.VariableStore._step = _timing(
        "apply (SGD, per chunk)", store_module.VariableStore._step
    )
    store_module.pooled_copy = _timing("snapshot / copy on write", store_module.pooled_copy)
    encode = codec.encode
    codec.encode = _timing("encode (zero-copy views)", encode, True)
    # Whole turns of the ps's two threads: what they spend beyond the phases above is
    # request parsing, locking and hand-offs; the rest of the round trip is transport.
    rpc = server_module.RpcServer
    rpc._dispatch = _timing("ps loop thread: receive side, whole", rpc._dispatch)  # type: ignore[method-assign]
    rpc._run_blocking = _timing("ps handler thread, whole", rpc._run_blocking)  # type: ignore[method-assign]

    credentials = Credentials.generate()
    server = create_local_server(credentials=credentials)
    service = PSService(server)
    dispatch = service.handler.dispatch
    client = RpcClient(server.target, credentials, deadline=120)
    raw_proc, _, raw_port = _start(_raw_tcp_echo)
    import socket

    sock = socket.create_connection(("127.0.0.1", raw_port))
    out = memoryview(bytearray(PAYLOAD_BYTES))
    back = memoryview(bytearray(PAYLOAD_BYTES))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    echo_port = socket.socket()
    echo_port.bind(("127.0.0.1", 0))
    echo_address = f"tcp://127.0.0.1:{echo_port.getsockname()[1]}"
    echo_port.close()
    threading.Thread(target=_zmq_echo, args=(ctx, echo_address), daemon=True).start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(echo_address)
    chunks = [out[i : i + codec.FRAME_BYTES] for i in range(0, PAYLOAD_BYTES, codec.FRAME_BYTES)]

    def zmq_echo() -> float:
        start = time.perf_counter()
        dealer.send_multipart([b"", *chunks], copy=False)
        dealer.recv_multipart(copy=False)
        return time.perf_counter() - start

    n = PAYLOAD_BYTES // 4
    config = {"mode": "async", "num_replicas": 1}
    decl = [{"name": "w", "shape": [n], "dtype": "float32"}]
    client.call("ps.create", {"config": config, "vars": decl}, {"w": torch.zeros(n)})
    client.call(
        "ps.optimizer", {"spec": {"name": "SGD", "groups": [{"lr": 0.01}]}, "group_of": {"w": 0}}
    )
    grad = torch.full((n,), 1e-3)
    param = torch.zeros(n)
    version = 0

    def push() -> float:
        nonlocal version
        start = time.perf_counter()
        reply = client.call(
            "ps.push",
            {"worker": "w", "version": version, "want_values": True},
            {"g/w": grad},
            framed=True,
        )
        version = reply.body["version"]
        values = reply.tensors["w"]  # as load_into writes a pulled value
        if isinstance(values, codec.Framed):
            values.copy_into(param)
        else:
            param.copy_(values)
        return time.perf_counter() - start

    def raw() -> float:
        start = time.perf_counter()
        sock.sendall(out)
        got = 0
        while got < PAYLOAD_BYTES:
            got += sock.recv_into(back[got:])
        return time.perf_counter() - start

    def snapshots(method: str, body: Any, tensors: Any, lend: Any = None, **rest: Any) -> Any:
        return dispatch(method, body, tensors, **rest)  # no loan: the ps replies from snapshots

    per_round: dict[str, list[dict[str, float]]] = {"snapshot": [], "lent": []}
    floor: list[float] = []
    transport: list[float] = []
    try:
        for _ in range(2):  # warm the pools and the connection
            push()
            raw()
            zmq_echo()
        for r in range(args.rounds):
            order = ("snapshot", "lent") if r % 2 == 0 else ("lent", "snapshot")
            for kind in order:
                service.handler.dispatch = snapshots if kind == "snapshot" else dispatch  # type: ignore[method-assign]
                with _lock:
                    _spent.clear()
                total = push()
                with _lock:
                    phases = {k: v * 1e3 for k, v in _spent.items()}
                phases["total round trip"] = total * 1e3
                per_round[kind].append(phases)
            floor.append(raw() * 1e3)
            transport.append(zmq_echo() * 1e3)
    finally:
        dealer.close()
        ctx.term()
        client.close()
        sock.close()
        server.stop()
        raw_proc.kill()
    names = sorted({k for rounds in per_round.values() for p in rounds for k in p})
    print(f"64 MiB push+pull, median ms per call over {args.rounds} alternating rounds")
    print(f"{'phase':44} {'snapshot':>9} {'lent':>9}")
    for name in names:
        cells = [
            statistics.median(p.get(name, 0.0) for p in per_round[kind])
            for kind in ("snapshot", "lent")
        ]
        print(f"{name:44} {cells[0]:9.1f} {cells[1]:9.1f}")
    print(f"{'raw TCP round trip (the floor)':44} {statistics.median(floor):9.1f}")
    print(f"{'ZeroMQ echo, same frames (the transport)':44} {statistics.median(transport):9.1f}")
    ratios = [f / t for f, t in zip(floor, transport, strict=True)]
    print(
        f"ratio raw/ZeroMQ echo: median {statistics.median(ratios):.3f} "
        f"({min(ratios):.3f}-{max(ratios):.3f})"
    )
    for kind in ("snapshot", "lent"):
        ratios = [f / p["total round trip"] for f, p in zip(floor, per_round[kind], strict=True)]
        print(
            f"ratio raw/ours, {kind}: median {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f})"
        )
    print("ps stats:", service.store.snapshot_stats())


if __name__ == "__main__":
    main()
