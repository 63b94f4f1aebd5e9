"""The manager tells the ps tasks who a sync step's replicas are (``manager/ps_membership.py``,
issue 32), over the wire to a real ``PSService`` on loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch

from clusterflow.cluster import ClusterSpec
from clusterflow.manager.ps_membership import tell_ps_tasks
from clusterflow.ps.api import PSConfig
from clusterflow.ps.client import RemotePS
from clusterflow.ps.optimizer import OptimizerSpec
from clusterflow.ps.protocol import STATS, CreateRequest, OptimizerRequest, PushReply, PushRequest
from clusterflow.ps.service import PSService
from clusterflow.rpc import Credentials
from clusterflow.server import create_local_server

THREE = ["chief:0", "worker:0", "worker:1"]


@pytest.fixture
def ps() -> Iterator[tuple[ClusterSpec, Credentials, RemotePS]]:
    credentials = Credentials.generate()
    server = create_local_server(credentials=credentials)
    PSService(server)
    spec = ClusterSpec({"ps": [server.target.removeprefix("tcp://")]})
    connection = RemotePS(spec, credentials, deadline=10)
    create = CreateRequest(
        config=PSConfig(mode="sync", num_replicas=3),
        variables=[{"name": "w", "shape": [2], "dtype": "float32"}],
        values={"w": torch.zeros(2)},
    )
    connection.call(0, create.METHOD, *create.to_wire())
    optimizer = OptimizerRequest(
        spec=OptimizerSpec.from_dict({"name": "SGD", "groups": [{"lr": 1.0}]}), group_of={"w": 0}
    )
    connection.call(0, optimizer.METHOD, *optimizer.to_wire())
    yield spec, credentials, connection
    connection.close()
    server.stop()


def _push(connection: RemotePS, worker: str, version: int) -> PushReply:
    request = PushRequest(worker=worker, version=version, grads={"w": torch.ones(2)}, commit=True)
    return connection.push(0, request)


def _version(connection: RemotePS) -> int:
    return int(connection.call(0, STATS.METHOD)[0]["version"])


@pytest.mark.timeout(60)
def test_a_leaver_is_waited_for_no_more_and_newcomers_count_from_the_next_step(
    ps: tuple[ClusterSpec, Credentials, RemotePS],
) -> None:
    """Pins ``tell_ps_tasks``' ``ps.leave``: step 0 has the commits of two of three
    replicas when the third is removed; without the leave it would wait for it for
    good. Then two newcomers are named while step 1 is collected: it is taken without
    them (a newcomer's push to it is refused), and step 2 waits for them."""
    spec, credentials, connection = ps
    assert [_push(connection, w, 0).reason for w in THREE[:2]] == ["committed", "committed"]
    missed = tell_ps_tasks(spec, credentials, before=THREE, after=THREE[:2], left="worker:1")
    assert missed == {}
    assert _version(connection) == 1  # step 0 taken without worker:1

    grown = [*THREE[:2], "worker:2", "worker:3"]
    assert tell_ps_tasks(spec, credentials, before=THREE[:2], after=grown) == {}
    early = _push(connection, "worker:2", 1)
    assert (early.applied, early.reason) == (False, "not_member")
    assert [_push(connection, w, 1).reason for w in THREE[:2]] == ["committed", "applied"]
    replies = [_push(connection, w, 2).reason for w in grown]
    assert replies == ["committed", "committed", "committed", "applied"]
    assert _version(connection) == 3


@pytest.mark.timeout(60)
def test_a_ps_that_does_not_answer_is_named_with_why(
    ps: tuple[ClusterSpec, Credentials, RemotePS],
) -> None:
    """A dead ps does not stop the resize: it is named, the others are told."""
    spec, credentials, connection = ps
    with socket.socket() as held:  # bound, never listening: nobody answers there
        held.bind(("127.0.0.1", 0))
        silent = f"127.0.0.1:{held.getsockname()[1]}"
        both = ClusterSpec({"ps": [spec.task_address("ps", 0), silent]})
        missed = tell_ps_tasks(
            both, credentials, before=THREE, after=THREE[:2], left="worker:1", deadline_s=0.5
        )
    assert list(missed) == [silent] and missed[silent]
    assert [_push(connection, w, 0).reason for w in THREE[:2]] == ["committed", "applied"]
