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

from typing import Any

import ps_kill_checks as checks
import pytest
import torch

from clusterflow.rpc import RpcClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


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


def _push(client: RpcClient, version: int, grad: torch.Tensor, split: int) -> Any:
    body = {"worker": "w", "version": version, "keys": [["d", 0, split]]}
    return client.call("ps.push", body, {"g/w": grad}).body


def test_a_ps_killed_between_two_chunks_of_a_push_recovers_all_of_it_or_none() -> None:
    checks.killed_mid_push_then_recovered(PS, "park", _push)
