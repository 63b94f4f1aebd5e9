"""RPC cost: a no-op round trip and a 64 MiB tensor, against raw ZeroMQ and raw TCP.

Each server runs in its own process (as in a cluster: no GIL shared with the caller).
The peers are the thinnest loops pyzmq and the socket module allow:

* raw ZeroMQ: a DEALER that sends one frame and waits in ``recv``, to a ROUTER that
  echoes each message (``recv_multipart``, ``send_multipart``, both copying: cheaper
  than zero-copy frames at this size). Its frame is as long as our request's header,
  and both sockets use the same security mechanism as ours (``--auth``), so the two
  sides move the same messages, of the same size, through the same ZeroMQ code;
* raw TCP: ``sendall`` of the 64 MiB buffer, ``recv_into`` a preallocated buffer on the
  other side, a one-byte acknowledgement back.

Ours: ``RpcClient.call`` to an ``RpcServer``, a no-op handler for latency, and a handler
that receives the 64 MiB tensor for throughput. ``--auth plain`` (the default, what a
cluster on loopback uses: checked at connect, no per-message cost) or ``curve``
(authenticated and encrypted, the default beyond loopback); the raw ZeroMQ peer gets the
same mechanism (for PLAIN with pyzmq's ZAP handler, as ours has). Raw TCP is never
encrypted: under ``curve``, ``throughput_ratio`` compares encrypted bytes with plain ones.

Each round times every side once, in an order reversed each round; each ratio is the
median over rounds of that round's ratio, printed with its smallest and largest.

    python -m benchmarks.rpc [--quick] [--rounds N] [--verbose] [--auth plain|curve]
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.common import MachineLoad, Spread, alternate, best_of, parser, ratio, result

PAYLOAD_BYTES = 64 * 1024 * 1024
BURST = 3
"""Windows (of 200 calls, or one 64 MiB transfer) per side per round; the best counts."""


def _secure(sock: Any, auth: str, secret: bytes, *, server: bool) -> None:
    """Gives a raw socket our mechanism, its keys or password from the same secret.

    A PLAIN server needs a ZAP handler (ZeroMQ refuses every peer without one), so the
    raw one gets pyzmq's, checking the same password; a CURVE server without one admits
    any peer that knows its key. Either way the per-message work is what ours does.
    """
    from clusterflow.rpc import Credentials

    credentials = Credentials(secret, auth)  # type: ignore[arg-type]
    if auth == "plain":
        if server:
            import zmq.auth.thread

            authenticator = zmq.auth.thread.ThreadAuthenticator(sock.context)
            authenticator.start()
            authenticator.configure_plain("*", {"bench": credentials.password})
            sock.plain_server = True
        else:
            sock.plain_username = b"bench"
            sock.plain_password = credentials.password.encode()
        return
    public, secret_key = credentials.curve_keypair
    sock.curve_publickey = public
    sock.curve_secretkey = secret_key
    if server:
        sock.curve_server = True
    else:
        sock.curve_serverkey = public


def _serve_raw_zmq(conn: Connection, auth: str, secret: bytes) -> None:
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    _secure(router, auth, secret, server=True)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    conn.send(port)
    while True:
        router.send_multipart(router.recv_multipart())


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


def _serve_ours(conn: Connection, auth: str, secret: bytes) -> None:
    from clusterflow.rpc import Credentials, RpcServer

    server = RpcServer(Credentials(secret, auth))  # type: ignore[arg-type]
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
    cli = parser("rpc", __doc__)
    cli.add_argument(
        "--auth",
        choices=("plain", "curve"),
        default="plain",
        help="security mechanism of both ZeroMQ sides (plain: what loopback uses)",
    )
    args = cli.parse_args()
    calls = 200
    rounds = args.rounds or (15 if args.quick else 40)
    import torch
    import zmq

    from clusterflow.rpc import Credentials, RpcClient
    from clusterflow.rpc.codec import KIND_REQUEST, encode

    load = MachineLoad()
    payload = torch.ones(PAYLOAD_BYTES // 4, dtype=torch.float32)
    raw = memoryview(payload.numpy()).cast("B")
    credentials = Credentials.generate(args.auth)
    # The raw request is as long as ours: our header for this call, as bytes.
    raw_request = bytes(encode(KIND_REQUEST, 1, "noop")[0])

    # All three peers stay up and are measured in alternating rounds, so a stretch of
    # noise from the other core (this VM's wake-up latency varies several-fold between
    # stretches) lands on both sides of a round instead of on one phase.
    zmq_proc, _, zmq_port = _start(_serve_raw_zmq, args.auth, credentials.secret)
    tcp_proc, _, tcp_port = _start(_serve_raw_tcp)
    our_proc, our_pipe, our_port = _start(_serve_ours, args.auth, credentials.secret)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    _secure(dealer, args.auth, credentials.secret, server=False)
    dealer.connect(f"tcp://127.0.0.1:{zmq_port}")
    sock = socket.create_connection(("127.0.0.1", tcp_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client = RpcClient(f"127.0.0.1:{our_port}", credentials)

    def raw_zmq_rtt() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            dealer.send(raw_request)
            dealer.recv()
        return (time.perf_counter() - start) / calls

    def ours_rtt() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            client.call("noop")
        return (time.perf_counter() - start) / calls

    def raw_tcp_transfer() -> float:
        start = time.perf_counter()
        sock.sendall(raw)
        sock.recv(1)
        return time.perf_counter() - start

    def ours_transfer() -> float:
        start = time.perf_counter()
        client.call("sink", tensors={"t": payload})
        return time.perf_counter() - start

    try:
        figures = alternate(
            {
                # Each turn is a few short windows and the best counts: a window takes
                # tens of ms, and the best leaves out the moments a neighbour held a core.
                "zmq_rtt": lambda: best_of(raw_zmq_rtt, BURST),
                "our_rtt": lambda: best_of(ours_rtt, BURST),
                "tcp_s": lambda: best_of(raw_tcp_transfer, BURST),
                "our_s": lambda: best_of(ours_transfer, BURST),
            },
            rounds,
            verbose=args.verbose,
        )
    finally:
        client.close()
        dealer.close(0)
        sock.close()
        our_pipe.send("done")
        our_proc.join(5)
        for proc in (zmq_proc, tcp_proc, our_proc):
            proc.kill()

    med = {key: Spread.of(values).median for key, values in figures.items()}
    gb = PAYLOAD_BYTES / 1e9
    latency = ratio(figures["our_rtt"], figures["zmq_rtt"])
    throughput = ratio(figures["tcp_s"], figures["our_s"])
    print(f"medians over {rounds} rounds, {args.auth} auth on both ZeroMQ sides:")
    print(
        f"no-op round trip: raw ZeroMQ {med['zmq_rtt'] * 1e6:.0f} us, "
        f"clusterflow {med['our_rtt'] * 1e6:.0f} us; ratio {latency}"
    )
    print(
        f"64 MiB transfer: raw TCP {gb / med['tcp_s']:.2f} GB/s, "
        f"clusterflow {gb / med['our_s']:.2f} GB/s; ratio {throughput}"
    )
    print(load.describe(), flush=True)
    result("rpc", latency_ratio=latency, throughput_ratio=throughput)


if __name__ == "__main__":
    main()
