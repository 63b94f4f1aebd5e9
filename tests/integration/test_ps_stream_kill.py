"""A ps process killed between two chunks of a push: after recovery, all of it or none.

The ps steps a large variable chunk by chunk (``ps/chunks.py``), in place; a ps killed
halfway through leaves half a push in its memory, which dies with it. What survives is
the checkpoint, and a checkpoint never reads part of a push (``state`` waits for the
lock the push holds). So the recovered ps holds the push entirely or not at all, and
the worker's retry (its split went back: its key is not in the checkpoint) applies it
exactly once. The test kills a real ps process (SIGKILL) while it is parked between two
chunks of a push, with a checkpoint asked for at that very moment, recovers a fresh ps
from the checkpoint it got, retries, and compares the result bit for bit with the
unstreamed path (torch's optimizer on the whole variable, each push once).
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
"""8 MiB of float32: the gradient travels in 17 frames, the ps steps 17 chunks."""
SGD = {"name": "SGD", "groups": [{"lr": 0.1, "momentum": 0.9}]}

PS = """
import sys, threading, torch
from clusterflow.ps.service import PSService
from clusterflow.rpc import Credentials
from clusterflow.server import create_local_server

torch.set_num_threads(1)
server = create_local_server(credentials=Credentials(bytes.fromhex(sys.argv[1])))
service = PSService(server)
if sys.argv[2] == "park":  # the second push parks between two chunks, until killed
    step, steps = service.store._step, []

    def parked(grads, hyper, lr_scale):
        steps.append(1)
        if len(steps) < 2:
            return step(grads, hyper, lr_scale)
        half = {n: [g if k < len(c) // 2 else None for k, g in enumerate(c)]
                for n, c in grads.items()}
        step(half, hyper, lr_scale)  # the first chunks, applied in place
        print("between", flush=True)
        threading.Event().wait()

    service.store._step = parked
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
    body = {"worker": "w", "version": version, "keys": [["d", 0, split]]}
    return client.call("ps.push", body, {"g/w": grad}).body


def test_a_ps_killed_between_two_chunks_of_a_push_recovers_all_of_it_or_none() -> None:
    credentials = Credentials.generate()
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(N, generator=gen) * 1e-2 for _ in range(2)]
    start = torch.linspace(-1, 1, N)
    procs: list[subprocess.Popen[str]] = []
    clients: list[RpcClient] = []
    try:
        first, target = _ps(credentials.secret, "park")
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
        # A checkpoint asked for now must wait for the push (or the kill): were it
        # read now, it would hold half of the push. (Bounded so the broken case ends.)
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
