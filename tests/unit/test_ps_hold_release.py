"""A ps held still by a chief that is then replaced resumes at the replacement's fence.

The chief quiesces every ps while it cuts a checkpoint, then resumes them. Worker 0 of a
cluster without a ``chief`` job is such a chief and is respawned alone: killed between
its ``quiesce`` and its ``resume``, it left the ps held for good, every push waited
until its deadline, and the run stalled (found by ``test_chaos.py``'s chief-less sync
shape). The manager raises the dead task's fence on every ps before it launches the
replacement (``fence_ps_tasks``); that fence now ends the dead holder's hold.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from clusterflow.cluster import ClusterSpec
from clusterflow.ps.service import PSService
from clusterflow.rpc import Credentials, RpcClient, RpcServer
from clusterflow.rpc.errors import RemoteError
from clusterflow.server import Server

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ps() -> Iterator[tuple[RpcClient, RpcClient]]:
    credentials = Credentials.generate()
    rpc = RpcServer(credentials, name="server-ps:0")
    spec = ClusterSpec({"ps": [rpc.address], "worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    server = Server(spec, "ps", 0, credentials=credentials, _rpc=rpc)
    PSService(server)
    chief = RpcClient(server.target, credentials, deadline=10)
    other = RpcClient(server.target, credentials, deadline=10)
    try:
        config = {"mode": "async", "num_replicas": 2}
        decl = [{"name": "w", "shape": [2], "dtype": "float32"}]
        chief.call("ps.create", {"config": config, "vars": decl}, {"w": torch.zeros(2)})
        chief.call(
            "ps.optimizer",
            {"spec": {"name": "SGD", "groups": [{"lr": 1.0}]}, "group_of": {"w": 0}},
        )
        yield chief, other
    finally:
        chief.close()
        other.close()
        server.stop()


def _push(client: RpcClient, timeout: float, incarnation: int = 0) -> int:
    fence = ["worker:1", incarnation]
    body = {"worker": "worker:1", "version": 0, "timeout": timeout, "fence": fence}
    return int(client.call("ps.push", body, {"g/w": torch.ones(2)}).body["version"])


def test_the_fence_of_a_replaced_holder_lets_pushes_through_again(
    ps: tuple[RpcClient, RpcClient],
) -> None:
    """Pins ``PSService._release_a_replaced_holder`` (registered with
    ``FenceBook.on_raise``): without it the push after the fence still finds the ps
    held and fails with ``stayed quiesced``."""
    chief, other = ps
    chief.call("ps.quiesce", {"timeout": 5.0, "fence": ["worker:0", 0]})
    with pytest.raises(RemoteError, match="stayed quiesced"):
        _push(other, timeout=0.2)  # held: the push waits its timeout out
    # the chief dies mid-checkpoint; the manager fences it before the respawn
    other.call("ps.fence", {"fence": ["worker:0", 1]})
    assert _push(other, timeout=5.0) == 1


def test_another_tasks_fence_or_the_holders_own_leaves_the_hold(
    ps: tuple[RpcClient, RpcClient],
) -> None:
    """Only the holder's replacement ends a hold: another task's relaunch, or the
    holder's current incarnation asking again, must not let pushes into a cut."""
    chief, other = ps
    chief.call("ps.quiesce", {"timeout": 5.0, "fence": ["worker:0", 0]})
    other.call("ps.fence", {"fence": ["worker:1", 1]})
    other.call("ps.fence", {"fence": ["worker:0", 0]})
    with pytest.raises(RemoteError, match="stayed quiesced"):
        _push(other, timeout=0.2, incarnation=1)
    chief.call("ps.resume", {"fence": ["worker:0", 0]})
    assert _push(other, timeout=5.0, incarnation=1) == 1


def test_a_replacements_first_request_ends_the_hold_when_the_fence_was_missed(
    ps: tuple[RpcClient, RpcClient],
) -> None:
    """The manager could not reach this ps while fencing (``fence_missed``): the
    replacement's own first request carries its newer incarnation and ends the hold
    (``FenceBook._serving`` tells the listeners). Pins that call: without it the
    replacement's push waits out the hold."""
    chief, other = ps
    chief.call("ps.quiesce", {"timeout": 5.0, "fence": ["worker:0", 0]})
    body = {"worker": "worker:0", "version": 0, "timeout": 5.0, "fence": ["worker:0", 1]}
    reply = other.call("ps.push", body, {"g/w": torch.ones(2)})
    assert int(reply.body["version"]) == 1
