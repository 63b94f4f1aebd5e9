"""Fencing (docs/failure-semantics.md, "Fencing"): a replaced task applies nothing more.

Two processes' worth of clients stand for one task name: the *zombie* (incarnation 0,
cut off, declared dead, still alive) and its *replacement* (incarnation 1, launched by
the manager). Against a live ps and a live dispatcher: once the replacement has spoken
to the ps (its strategy's first step), or once the manager raised the dispatcher's bar
(at the relaunch), every request of the zombie is refused; its training loop raises
``TaskFenced`` and stops, and the ps's version moves only by the replacement's pushes.
Partitions that heal after the replacement runs: tests/integration/test_hostile_partitions.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from clusterflow.cluster import ClusterSpec
from clusterflow.cluster.contract import ENV_INCARNATION, ENV_SECRET, ENV_TASK
from clusterflow.data.api import DatasetSpec
from clusterflow.data.dispatcher import DispatcherService
from clusterflow.data.dispatcher_client import DispatcherClient
from clusterflow.rpc import Credentials, RpcClient, RpcServer
from clusterflow.rpc.fencing import TaskFenced
from clusterflow.server import Server
from clusterflow.strategies.parameter_server import ParameterServerStrategy

pytestmark = pytest.mark.integration


def _strategy(
    monkeypatch: pytest.MonkeyPatch, ps: str, creds: Credentials, incarnation: int
) -> ParameterServerStrategy:
    """worker:1 of a cluster whose one ps is ``ps``, as launch ``incarnation`` sees it."""
    spec = {"ps": [ps], "worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    tf_config = {"cluster": spec, "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    monkeypatch.setenv(ENV_SECRET, creds.to_hex())
    monkeypatch.setenv(ENV_TASK, "worker:1")
    monkeypatch.setenv(ENV_INCARNATION, str(incarnation))
    return ParameterServerStrategy(mode="async", deadline_s=30)


def _trainer(strategy: ParameterServerStrategy) -> tuple[torch.nn.Module, object]:
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    return model, step


def _ps_version(address: str, creds: Credentials) -> int:
    with RpcClient(address, creds, deadline=10) as client:
        return int(client.call("ps.stats").body["version"])


def test_a_replaced_worker_is_fenced_by_the_ps_and_stops_itself(
    ps_server: tuple[Server, Credentials], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, creds = ps_server
    address = server.target.removeprefix("tcp://")
    zombie = _strategy(monkeypatch, address, creds, incarnation=0)
    _, zombie_step = _trainer(zombie)
    for _ in range(3):
        zombie.run(zombie_step)
    zombie.settled(wait=True)  # a push overlaps the next step: wait for its answer
    assert _ps_version(address, creds) == 3

    # The manager relaunched worker:1 (the zombie was cut off, not dead); the
    # replacement's first step speaks to the ps.
    replacement = _strategy(monkeypatch, address, creds, incarnation=1)
    _, replacement_step = _trainer(replacement)
    replacement.run(replacement_step)
    replacement.settled(wait=True)
    assert _ps_version(address, creds) == 4

    # The partition heals: the zombie's next push is refused, and it stops there (a push
    # overlaps the next step's compute: its answer is read by that step at the latest).
    with pytest.raises(TaskFenced, match="worker:1 incarnation 0 is fenced"):
        zombie.run(zombie_step)
        zombie.run(zombie_step)
    assert _ps_version(address, creds) == 4
    replacement.run(replacement_step)
    replacement.settled(wait=True)
    assert _ps_version(address, creds) == 5


def test_a_relaunched_worker_is_fenced_by_the_dispatcher_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    creds = Credentials.generate()
    service = DispatcherService()
    server = RpcServer(creds, name="dispatcher")
    service.register_on(server)
    server.start()
    try:
        spec = DatasetSpec(
            name="d", source="range://64", num_records=64, split_size=8, seed=0, epochs=1
        )
        monkeypatch.setenv(ENV_TASK, "worker:1")
        monkeypatch.setenv(ENV_INCARNATION, "0")
        zombie = DispatcherClient(RpcClient(server.address, creds, deadline=10))
        zombie.register(spec, [])
        lease_id = zombie.lease("d", "worker:1", None)["lease"][0]

        # The manager relaunches worker:1: from this moment the zombie is refused.
        service.fences.raise_to("worker:1", 1)
        with pytest.raises(TaskFenced):
            zombie.ack("d", [lease_id], "worker:1")
        with pytest.raises(TaskFenced):
            zombie.lease("d", "worker:1", None)
        assert service.status("d")["live"]["0"]["acked"] == 0

        monkeypatch.setenv(ENV_INCARNATION, "1")
        replacement = DispatcherClient(RpcClient(server.address, creds, deadline=10))
        assert replacement.lease("d", "worker:1", None)["status"] == "lease"
    finally:
        server.stop()


def test_requests_without_a_fence_are_served_as_before(
    ps_server: tuple[Server, Credentials], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, creds = ps_server
    monkeypatch.delenv(ENV_INCARNATION, raising=False)
    spec = ClusterSpec({"ps": [server.target.removeprefix("tcp://")]})
    with RpcClient(spec.task_address("ps", 0), creds, deadline=10) as client:
        assert client.call("ps.stats").body is not None
        bad = {"names": [], "fence": ["worker:1", "zero"]}
        with pytest.raises(Exception, match="malformed fence"):
            client.call("ps.pull", bad)
