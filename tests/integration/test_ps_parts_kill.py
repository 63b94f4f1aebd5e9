"""A ps process killed between two parts of a push: after recovery, all of it or none.

A push sent in parts (``codec.encode_parts``, as ``RemotePS`` sends one) reaches the
store only once its last part came, and its reply streams back a group of chunks at a
time as the step writes them (``VariableStore._streamed_step``). So a ps can die in two
places between two parts: while the push's parts arrive (nothing of it is applied; its
checked frames die with the process), or while its reply streams (the step is halfway
through, in memory, under the lock a checkpoint waits for). Either way what survives is
the last checkpoint, which holds none of the push; the worker's retry (its split went
back) applies it once. The test kills a real ps process (SIGKILL) parked at each place,
recovers a fresh ps from the checkpoint, retries, and compares bit for bit with
torch's optimizer on the whole variable, each push once.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

from clusterflow.rpc import Credentials, RpcClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

N = 2 * 1024 * 1024 + 999
"""8 MiB of float32: 17 frames; the reply streams in two groups (16 chunks, then 1)."""
PART = 1024 * 1024
"""The push travels in 9 parts of 1 MiB."""
SGD = {"name": "SGD", "groups": [{"lr": 0.1, "momentum": 0.9}]}

PS = """
import sys, threading, torch
from clusterflow.ps.service import PSService
from clusterflow.ps.store import VariableStore
from clusterflow.rpc import Credentials
from clusterflow.server import create_local_server

torch.set_num_threads(1)
server = create_local_server(credentials=Credentials(bytes.fromhex(sys.argv[1])))
service = PSService(server)
seen = []

def park():
    print("between", flush=True)
    threading.Event().wait()

if sys.argv[2] == "request":  # parks the loop while the second push's parts arrive
    check = service.store.check_piece

    def parked(name, piece):
        seen.append(1)
        if len(seen) == 17 + 3:  # the first push's 17 frames, then 3 of the second's
            park()
        check(name, piece)

    service.store.check_piece = parked
elif sys.argv[2] == "reply":  # parks the second push's step after its first group left
    group = VariableStore._step_group

    def parked(opt, stream, params, frames):
        group(opt, stream, params, frames)
        seen.append(1)
        if len(seen) == 2 + 1:  # the first push's two groups, then one of the second's
            park()

    VariableStore._step_group = staticmethod(parked)
print(server.target, flush=True)
threading.Event().wait()
"""


def _ps(secret: bytes, mode: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PS, secret.hex(), mode], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _push(client: RpcClient, version: int, grad: torch.Tensor, split: int) -> Any:
    body = {"worker": "w", "version": version, "keys": [["d", 0, split]], "want_values": True}
    return client.call(
        "ps.push", body, {"g/w": grad}, framed=True, part_bytes=PART, streamed=True
    ).body


@pytest.mark.parametrize("where", ["request", "reply"])
def test_a_ps_killed_between_two_parts_of_a_push_recovers_all_of_it_or_none(where: str) -> None:
    credentials = Credentials.generate()
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(N, generator=gen) * 1e-2 for _ in range(2)]
    start = torch.linspace(-1, 1, N)
    procs: list[subprocess.Popen[str]] = []
    clients: list[RpcClient] = []
    try:
        first, target = _ps(credentials.secret, where)
        procs.append(first)
        client, control = (RpcClient(target, credentials, deadline=60) for _ in range(2))
        clients += [client, control]
        decl = [{"name": "w", "shape": [N], "dtype": "float32"}]
        config = {"mode": "async", "num_replicas": 1}
        client.call("ps.create", {"config": config, "vars": decl}, {"w": start})
        client.call("ps.optimizer", {"spec": SGD, "group_of": {"w": 0}})
        assert _push(client, 0, grads[0], split=1)["applied"]
        saved = control.call("ps.state")  # the last checkpoint before the kill
        checkpoint = (saved.body, dict(saved.tensors))

        dying = RpcClient(target, credentials, deadline=10)
        clients.append(dying)
        pushed = threading.Thread(
            target=lambda: _quietly(lambda: _push(dying, 1, grads[1], split=2)), daemon=True
        )
        pushed.start()
        assert first.stdout is not None and first.stdout.readline().strip() == "between"
        # A checkpoint asked for now must not hold part of the push: it waits (for the
        # step's lock, or for the parked loop) until the kill. (Bounded for the broken
        # case.)
        mid: list[Any] = []
        reading = threading.Thread(
            target=lambda: _quietly(lambda: mid.append(control.call("ps.state", deadline=10))),
            daemon=True,
        )
        reading.start()
        reading.join(5)
        first.kill()
        first.wait(30)
        pushed.join(30)
        reading.join(30)
        if mid:  # a checkpoint that came back is the newest: recover from it
            checkpoint = (mid[0].body, dict(mid[0].tensors))

        second, target = _ps(credentials.secret, "serve")
        procs.append(second)
        fresh = RpcClient(target, credentials, deadline=60)
        clients.append(fresh)
        fresh.call("ps.load_state", *checkpoint)
        # The worker retries the push whose reply never came: its split went back. A
        # checkpoint that already held the push refuses it as a duplicate.
        _push(fresh, int(checkpoint[0]["version"]), grads[1], split=2)
        got = fresh.call("ps.pull").tensors["w"]
    finally:
        for c in clients:
            c.close()
        for p in procs:
            p.kill()
            p.wait(30)

    var = start.clone()
    reference = torch.optim.SGD([var], lr=0.1, momentum=0.9)
    for grad in grads:  # the unstreamed path: each push once, on the whole variable
        var.grad = grad
        reference.step()
    assert torch.equal(got.view(torch.int32), var.view(torch.int32))


def _quietly(call: Any) -> None:
    """Runs ``call``; its failure is the kill this test makes (the ps went away)."""
    try:
        call()
    except Exception:
        return
