"""A real ps process killed in the middle of a push, recovered from its last checkpoint.

Shared by ``test_ps_stream_kill.py`` (killed between two chunks of the step) and
``test_ps_parts_kill.py`` (killed between two parts of the push, or of its streamed
reply): each module brings the ps script that parks the push where it wants and
prints ``between``, and the way it pushes; the scenario and the check are the same.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from clusterflow.rpc import Credentials, RpcClient

N = 2 * 1024 * 1024 + 999
"""8 MiB of float32: 17 frames of 512 KiB, 17 chunks."""
SGD = {"name": "SGD", "groups": [{"lr": 0.1, "momentum": 0.9}]}

Push = Callable[[RpcClient, int, torch.Tensor, int], Any]
"""``push(client, version, gradient, split)``: the reply's body."""


def spawn_ps(script: str, secret: bytes, mode: str) -> tuple[subprocess.Popen[str], str]:
    """Starts ``script`` (a ps that prints its target) in a process; it and its target."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, secret.hex(), mode], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def killed_mid_push_then_recovered(script: str, mode: str, push: Push) -> None:
    """Pushes once, checkpoints, pushes again into a ps parked mid-push (``mode``) while
    a checkpoint is asked for, kills it, recovers a fresh ps from the newest checkpoint
    it got, retries the push (its split went back), and checks the result bit for bit
    against torch's optimizer on the whole variable, each push once."""
    credentials = Credentials.generate()
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(N, generator=gen) * 1e-2 for _ in range(2)]
    start = torch.linspace(-1, 1, N)
    procs: list[subprocess.Popen[str]] = []
    clients: list[RpcClient] = []
    try:
        first, target = spawn_ps(script, credentials.secret, mode)
        procs.append(first)
        client, control = (RpcClient(target, credentials, deadline=60) for _ in range(2))
        clients += [client, control]
        decl = [{"name": "w", "shape": [N], "dtype": "float32"}]
        config = {"mode": "async", "num_replicas": 1}
        client.call("ps.create", {"config": config, "vars": decl}, {"w": start})
        client.call("ps.optimizer", {"spec": SGD, "group_of": {"w": 0}})
        assert push(client, 0, grads[0], 1)["applied"]
        saved = control.call("ps.state")  # the last checkpoint before the kill
        checkpoint = (saved.body, dict(saved.tensors))

        dying = RpcClient(target, credentials, deadline=10)
        clients.append(dying)
        pushed = threading.Thread(
            target=lambda: _quietly(lambda: push(dying, 1, grads[1], 2)), daemon=True
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

        second, target = spawn_ps(script, credentials.secret, "serve")
        procs.append(second)
        fresh = RpcClient(target, credentials, deadline=60)
        clients.append(fresh)
        fresh.call("ps.load_state", *checkpoint)
        # The worker retries the push whose reply never came: its split went back. A
        # checkpoint that already held the push refuses it as a duplicate.
        push(fresh, int(checkpoint[0]["version"]), grads[1], 2)
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
