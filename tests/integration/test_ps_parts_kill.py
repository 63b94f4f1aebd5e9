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

from typing import Any

import ps_kill_checks as checks
import pytest
import torch

from clusterflow.rpc import RpcClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PART = 1024 * 1024
"""The push travels in 9 parts of 1 MiB."""

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

mode = sys.argv[2].removeprefix("side-")
if mode == "request":  # parks the receive while the second push's parts arrive
    check = service.store.check_piece
    # ZeroMQ: the first push's 17 frames, then 3 of the second's. The side channel
    # checks 1 MiB pieces: the first push's 9, then 3 of the second's.
    at = 9 + 3 if sys.argv[2].startswith("side-") else 17 + 3

    def parked(name, piece):
        seen.append(1)
        if len(seen) == at:
            park()
        check(name, piece)

    service.store.check_piece = parked
elif mode == "reply":  # parks the second push's step after its first group left
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


def _pusher(side: bool) -> checks.Push:
    def push(client: RpcClient, version: int, grad: torch.Tensor, split: int) -> Any:
        body = {"worker": "w", "version": version, "keys": [["d", 0, split]], "want_values": True}
        return client.call(
            "ps.push", body, {"g/w": grad}, framed=True, part_bytes=PART, streamed=True, side=side
        ).body

    return push


@pytest.mark.parametrize("where", ["request", "reply"])
def test_a_ps_killed_between_two_parts_of_a_push_recovers_all_of_it_or_none(where: str) -> None:
    checks.killed_mid_push_then_recovered(PS, where, _pusher(side=False))


@pytest.mark.parametrize("where", ["request", "reply"])
def test_a_ps_killed_mid_push_on_the_side_channel_recovers_all_of_it_or_none(where: str) -> None:
    """The same over the ps's side channel (``rpc/side.py``): killed while the push's
    bytes are received (after its first checked piece), or while its reply streams."""
    checks.killed_mid_push_then_recovered(PS, f"side-{where}", _pusher(side=True))
