"""RPC cost: a no-op round trip and a 64 MiB tensor, against raw ZeroMQ and raw TCP.

Each server runs in its own process (as in a cluster: no GIL shared with the caller).
The peers are the thinnest loops pyzmq and the socket module allow:

* raw ZeroMQ: a ROUTER that echoes each message to a DEALER, both with plain pyzmq;
* raw TCP: ``sendall`` of the 64 MiB buffer, ``recv_into`` a preallocated buffer on the
  other side, a one-byte acknowledgement back.

Ours: ``RpcClient.call`` to an ``RpcServer`` (plain auth, as on loopback), a no-op
handler for latency, and a handler that receives the 64 MiB tensor for throughput.

    python -m benchmarks.rpc [--quick]
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from multiprocessing.connection import Connection

from benchmarks._common import best_of, parser, result

PAYLOAD_BYTES = 64 * 1024 * 1024


def _serve_raw_zmq(conn: Connection) -> None:
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    conn.send(port)
    while True:
        frames = router.recv_multipart(copy=False)
        router.send_multipart([*frames[:1], b"ok"] if len(frames) > 2 else frames, copy=False)


def _serve_raw_tcp(conn: Connection) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    conn.send(listener.getsockname()[1])
    peer, _ = listener.accept()
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(PAYLOAD_BYTES)
    view = memoryview(buf)
    while True:
        got = 0
        while got < PAYLOAD_BYTES:
            n = peer.recv_into(view[got:])
            if n == 0:
                return
            got += n
        peer.sendall(b"k")


def _serve_ours(conn: Connection, secret: bytes) -> None:
    from clusterflow.rpc import Credentials, RpcServer

    server = RpcServer(Credentials(secret))
    server.register("noop", lambda request: None)
    server.register("sink", lambda request: len(request.tensors))
    server.start()
    conn.send(server.port)
    conn.recv()  # until the parent is done


def _start(target, *args):  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return proc, parent, parent.recv()


def main() -> None:
    args = parser("rpc", __doc__).parse_args()
    calls = 2000 if args.quick else 20000
    transfers = 5 if args.quick else 20
    import torch
    import zmq

    from clusterflow.rpc import Credentials, RpcClient

    payload = torch.ones(PAYLOAD_BYTES // 4, dtype=torch.float32)

    # raw ZeroMQ latency
    proc, _, port = _start(_serve_raw_zmq)
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")

    def raw_zmq_rtt() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            dealer.send(b"x")
            dealer.recv()
        return (time.perf_counter() - start) / calls

    raw_zmq_rtt()
    zmq_rtt = best_of(raw_zmq_rtt, 3)
    dealer.close(0)
    proc.kill()

    # raw TCP throughput
    proc, _, port = _start(_serve_raw_tcp)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw = memoryview(payload.numpy()).cast("B")

    def raw_tcp_transfer() -> float:
        start = time.perf_counter()
        sock.sendall(raw)
        sock.recv(1)
        return time.perf_counter() - start

    raw_tcp_transfer()
    tcp_s = best_of(raw_tcp_transfer, transfers)
    sock.close()
    proc.kill()

    # ours
    credentials = Credentials.generate()
    proc, parent, port = _start(_serve_ours, credentials.secret)
    client = RpcClient(f"127.0.0.1:{port}", credentials)

    def ours_rtt() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            client.call("noop")
        return (time.perf_counter() - start) / calls

    def ours_transfer() -> float:
        start = time.perf_counter()
        client.call("sink", tensors={"t": payload})
        return time.perf_counter() - start

    ours_rtt()
    our_rtt = best_of(ours_rtt, 3)
    ours_transfer()
    our_s = best_of(ours_transfer, transfers)
    client.close()
    parent.send("done")
    proc.join(5)
    proc.kill()

    gb = PAYLOAD_BYTES / 1e9
    print(
        f"no-op round trip: raw ZeroMQ {zmq_rtt * 1e6:.0f} us, clusterflow {our_rtt * 1e6:.0f} us"
    )
    print(f"64 MiB transfer: raw TCP {gb / tcp_s:.2f} GB/s, clusterflow {gb / our_s:.2f} GB/s")
    result("rpc", latency_ratio=our_rtt / zmq_rtt, throughput_ratio=tcp_s / our_s)


if __name__ == "__main__":
    main()
