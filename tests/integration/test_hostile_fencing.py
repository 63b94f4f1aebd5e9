"""Fencing (docs/failure-semantics.md, "Fencing"): a replaced task applies nothing more.

Two processes' worth of clients stand for one task name: the *zombie* (incarnation 0,
cut off, declared dead, still alive) and its *replacement* (incarnation 1, launched by
the manager). Against a live ps and a live dispatcher: once the manager raised the
task's fence (at the relaunch: ``manager/fences.py`` for each ps, in process for the
dispatcher), or once the replacement has spoken to the ps, every request of the zombie
is refused; its training loop raises ``TaskFenced`` and stops, and the ps's version
moves only by the replacement's pushes.

A zombie whose connection died with its request in flight learns it too: its client
asks ``<service>.fence`` when the connection comes back (``ReconnectProbe``). Proved on
loopback (a server restarted under a waiting call) and across a real partition of
emulated hosts that heals after the replacement ran (``benchmarks/scenarios/partition``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
import torch
from benchmarks.scenarios import partition

from clusterflow.cluster import ClusterSpec, TaskId
from clusterflow.cluster.contract import ENV_INCARNATION, ENV_SECRET, ENV_TASK
from clusterflow.data.api import DatasetSpec
from clusterflow.data.dispatcher import DispatcherService
from clusterflow.data.dispatcher_client import DispatcherClient
from clusterflow.manager.config import RunConfig
from clusterflow.manager.fences import fence_ps_tasks
from clusterflow.manager.registry import ClusterDir
from clusterflow.manager.tasks import TaskRecord
from clusterflow.rpc import (
    Credentials,
    DeadlineExceeded,
    RemoteError,
    Request,
    RpcClient,
    RpcServer,
)
from clusterflow.rpc.client import ReconnectProbe
from clusterflow.rpc.fencing import FenceBook, TaskFenced
from clusterflow.server import Server
from clusterflow.strategies.parameter_server import ParameterServerStrategy
from clusterflow.testing import available

if TYPE_CHECKING:
    from conftest import Clusterflow

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
    opened: list[RpcClient] = []

    def client() -> DispatcherClient:  # it reads its incarnation when it is built
        opened.append(RpcClient(server.address, creds, deadline=10))
        return DispatcherClient(opened[-1])

    try:
        spec = DatasetSpec(
            name="d", source="range://64", num_records=64, split_size=8, seed=0, epochs=1
        )
        monkeypatch.setenv(ENV_TASK, "worker:1")
        monkeypatch.setenv(ENV_INCARNATION, "0")
        zombie = client()
        zombie.register(spec, [])
        lease_id = zombie.lease("d", "worker:1", None).leases[0].lease_id

        # The manager relaunches worker:1: from this moment the zombie is refused.
        service.fences.raise_to("worker:1", 1)
        with pytest.raises(TaskFenced):
            zombie.ack("d", [lease_id], "worker:1")
        with pytest.raises(TaskFenced):
            zombie.lease("d", "worker:1", None)
        assert service.status("d")["live"]["0"]["acked"] == 0

        monkeypatch.setenv(ENV_INCARNATION, "1")
        replacement = client()
        assert replacement.lease("d", "worker:1", None).status == "lease"
    finally:
        for rpc in opened:
            rpc.close()
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


def test_the_manager_fences_the_ps_before_the_replacement_speaks(
    ps_server: tuple[Server, Credentials], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server, creds = ps_server
    address = server.target.removeprefix("tcp://")
    zombie = _strategy(monkeypatch, address, creds, incarnation=0)
    _, zombie_step = _trainer(zombie)
    zombie.run(zombie_step)
    zombie.settled(wait=True)
    assert _ps_version(address, creds) == 1

    # The manager relaunches worker:1 (recovery._respawn): every ps takes the new
    # incarnation before the replacement is even launched; it never speaks here.
    cluster = ClusterDir(tmp_path / "cluster")
    cluster.path.mkdir()
    creds.to_file(cluster.secret_file)
    spec = ClusterSpec({"ps": [address], "worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    relaunched = TaskRecord(TaskId("worker", 1), tracked=True, restarts=1)
    assert fence_ps_tasks(cluster, RunConfig(command=("true",)), spec, relaunched) == {}
    assert not cluster.events_file.exists()  # no fence_missed

    with pytest.raises(TaskFenced, match="worker:1 incarnation 0 is fenced"):
        zombie.run(zombie_step)
        zombie.run(zombie_step)
    assert _ps_version(address, creds) == 1


def _probe(incarnation: int) -> ReconnectProbe:
    return ReconnectProbe(
        method="svc.fence",
        body={"fence": ["worker:1", incarnation]},
        refusals=frozenset({TaskFenced.wire_code}),
    )


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "current"])
def test_a_call_whose_connection_died_asks_the_probe_when_it_is_back(fenced: bool) -> None:
    """The call's request dies with its connection (its server stops); a server on the
    same port comes back. A fenced task's call fails with the probe's refusal, long
    before its deadline; a current one's call waits on, to its deadline."""
    creds = Credentials.generate()
    entered, never = threading.Event(), threading.Event()

    def hang(request: Request) -> None:
        entered.set()
        never.wait(60)

    first = RpcServer(creds, name="first")
    first.register("svc.hang", hang, blocking=True)
    first.start()
    deadline = 60.0 if fenced else 3.0
    client = RpcClient(first.address, creds, deadline=deadline)
    client.probe_on_reconnect(_probe(0))
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            client.call("svc.hang")
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    book = FenceBook()
    second: RpcServer | None = None
    try:
        caller.start()
        assert entered.wait(30)
        first.stop()  # the connection dies with the request on it
        if fenced:
            book.raise_to("worker:1", 1)  # its replacement took over meanwhile
        second = RpcServer(creds, port=first.port, name="second")
        book.register_on(second, "svc")
        second.start()
        caller.join(deadline + 30)
        assert not caller.is_alive()
        if fenced:
            assert isinstance(outcome[0], RemoteError), outcome
            assert isinstance(outcome[0], TaskFenced), outcome  # typed by its wire code
            assert "svc.hang" in str(outcome[0])
            assert book.counts("worker:1")["refused"] == {0: 1}
        else:
            assert isinstance(outcome[0], DeadlineExceeded), outcome
            assert book.counts("worker:1")["refused"] == {}
            assert book.highest("worker:1") == 0  # the probe was answered
    finally:
        never.set()
        client.close()
        first.stop()
        if second is not None:
            second.stop()


@pytest.mark.skipif(not available(), reason="needs root and iproute2 to make network namespaces")
@pytest.mark.timeout(300)
def test_a_zombie_healed_after_its_replacement_ran_applies_nothing_and_stops(
    tmp_path: Path,
) -> None:
    """A real partition: worker:0 trains on host 1 against a ps and a dispatcher on host
    0; host 1 is cut off; the "manager" raises the fence and relaunches worker:0 on host
    2; the link heals after the replacement trained. The zombie's request in flight
    died with its connection (the cut outlasts the kernel's retries); once the link is
    back its clients ask whether it was fenced, and it stops with ``TaskFenced``: it
    learnt it was replaced, it did not wait out its own 60 s deadline (it would end by
    ``DeadlineExceeded`` then; how long it took is ``benchmarks/hostile.py``'s figure,
    not this test's). Nothing of it was served after the fence; every record of the
    counter model is counted exactly once."""
    outcome = partition.run(
        "zombie_heals_after_replacement", tmp_path / "zombie", cut_s=10.0, prefix="fence"
    )
    assert outcome.fenced, outcome
    assert outcome.served_after_fence == 0, outcome
    assert outcome.refused >= 1, outcome
    assert outcome.lost == 0 and outcome.duplicated == 0, outcome
    assert "DeadlineExceeded" not in outcome.first_exit, outcome


# Through the real manager ----------------------------------------------------------

FENCE_JOB = '''
import json, os, subprocess, sys, time

out = sys.argv[1]
task = os.environ["CLUSTERFLOW_TASK"]
incarnation = int(os.environ["CLUSTERFLOW_INCARNATION"])


def path(name):
    return os.path.join(out, name)


def wait_file(name):  # this job's own pacing, driven by the test
    while not os.path.exists(path(name)):
        time.sleep(0.02)


def put(name, text=""):
    with open(path(name) + ".tmp", "w") as f:
        f.write(text)
    os.replace(path(name) + ".tmp", path(name))


def trainer():
    import torch
    from clusterflow.strategies.parameter_server import ParameterServerStrategy
    strategy = ParameterServerStrategy(mode="async", deadline_s=30)
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    def push():
        strategy.run(step)
        strategy.settled(wait=True)

    return push


def zombie():
    """worker:1's launch 0 as the ps and the dispatcher see it, outside its task's
    process group: what a partition leaves alive. It acts only when the test asks."""
    from clusterflow.data.api import DatasetSpec
    from clusterflow.data.dispatcher_client import DispatcherClient
    from clusterflow.rpc import Credentials, RpcClient
    from clusterflow.rpc.fencing import TaskFenced

    push = trainer()
    rpc = RpcClient(os.environ["CLUSTERFLOW_MANAGER"], Credentials.from_env(), deadline=30)
    data = DispatcherClient(rpc)
    spec = DatasetSpec(
        name="d", source="range://64", num_records=64, split_size=8, seed=0, epochs=1
    )
    data.register(spec, [])

    def lease():
        data.lease("d", task, None)

    put("zombie.ready")
    for n in range(1000):
        wait_file(f"cmd-{n}")
        command = open(path(f"cmd-{n}")).read()
        if command == "exit":
            return
        try:
            {"push": push, "lease": lease}[command]()
            put(f"res-{n}", "done")
        except TaskFenced as exc:
            put(f"res-{n}", f"fenced: {exc}")


if sys.argv[2:] == ["zombie"]:
    zombie()
elif task == "worker:1" and incarnation == 0:
    child = subprocess.Popen([sys.executable, __file__, out, "zombie"], start_new_session=True)
    from clusterflow.server.manager_link import ManagerLink
    link = ManagerLink.from_env()
    for n in range(1_000_000):  # its step advances until it hangs
        link.report(step=n, loss=None, samples_per_s=None)
        if n == 0:  # the manager has its first step: the stall clock runs from here
            put("zombie.pid", str(child.pid))
        time.sleep(0.1)
elif task == "worker:1":
    put("replacement", str(incarnation))
    wait_file("go")  # held: it must not speak to the ps before the test says
    trainer()()
    put("replacement.trained")
    wait_file("done")
else:
    wait_file("done")
'''


class _Zombie:
    """The test's side of ``FENCE_JOB``'s zombie: numbered commands, one answer each."""

    def __init__(self, cf: Clusterflow, out: Path) -> None:
        self.cf, self.out, self.sent = cf, out, 0

    def pid(self) -> int:
        return int(self.cf.wait_until(lambda: _read(self.out / "zombie.pid"), 90, "the zombie"))

    def __call__(self, command: str) -> str:
        n, self.sent = self.sent, self.sent + 1
        (self.out / f"cmd-{n}.tmp").write_text(command)
        (self.out / f"cmd-{n}.tmp").rename(self.out / f"cmd-{n}")
        if command == "exit":
            return ""
        return str(self.cf.wait_until(lambda: _read(self.out / f"res-{n}"), 60, command))


def _fenced(answer: str) -> bool:
    """Whether the zombie's call was refused as worker:1's launch 0."""
    return answer.startswith("fenced: ") and "worker:1 incarnation 0 is fenced" in answer


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def _touch(path: Path) -> None:
    path.write_text("")


def _start_fence_cluster(cf: Clusterflow, out: Path) -> tuple[str, ClusterDir, Credentials]:
    script = cf.script("fence_job.py", FENCE_JOB)
    cluster_id = cf.start_detached(
        "--ps", "1", "--workers", "2", "--max-restarts", "1", "--stall-timeout", "5",
        "--", sys.executable, str(script), str(out),
    )  # fmt: skip
    cluster = ClusterDir(cf.path(cluster_id))
    return cluster_id, cluster, Credentials.from_file(cluster.secret_file)


def _respawned(cf: Clusterflow, cluster: ClusterDir, out: Path) -> dict[str, Any]:
    """Waits for the manager to respawn worker:1 and its replacement to be held."""
    event = cf.wait_until(
        lambda: next(
            (e for e in cluster.read_events() if e.get("event") == "task_respawned"), None
        ),
        90,
        "worker:1 respawned",
    )
    cf.wait_until(lambda: _read(out / "replacement") == "1", 90, "the replacement held")
    return dict(event)


def _ended(cf: Clusterflow, cluster_id: str) -> None:
    """Waits for the run to succeed and its manager process to exit."""
    cf.wait_until(lambda: cf.state(cluster_id)["status"] == "succeeded", 90, "the run's end")
    manager = cf.state(cluster_id)["manager"]["pid"]
    cf.wait_until(lambda: not cf.alive([manager]), 30, "the manager's exit")


def _hang(state: dict[str, Any], task: str, zombie_pid: int) -> None:
    """SIGSTOP to ``task``'s whole process group (its supervisor leads it) and to the
    zombie beside it: the task hangs; its steps stop."""
    supervisor = next(t["pid"] for t in state["tasks"] if t["task"] == task)
    os.killpg(supervisor, signal.SIGSTOP)
    os.kill(zombie_pid, signal.SIGSTOP)


@pytest.mark.timeout(240)
def test_the_manager_fences_a_hung_worker_before_its_replacement_starts(
    cf: Clusterflow, tmp_path: Path
) -> None:
    """Pins ``Recovery._respawn`` (manager/recovery.py): ``self.data.fences.raise_to(...)`` and
    ``fence_ps_tasks(...)``, through a real manager (``clusterflow start
    --stall-timeout``). worker:1 hangs (SIGSTOP); the manager sees its step stand still,
    kills it and relaunches it, and the relaunch is held before it speaks to anyone. The
    zombie (worker:1's launch 0, outside the killed process group, as a partition
    leaves it) is resumed: its push and its lease are both refused, and the ps version
    moved only by the replacement. Without ``raise_to`` the lease is served; without
    ``fence_ps_tasks`` the push is applied: either fails here."""
    out = tmp_path / "out"
    out.mkdir()
    cluster_id, cluster, creds = _start_fence_cluster(cf, out)
    zombie = _Zombie(cf, out)
    zombie_pid = zombie.pid()
    cf.wait_until((out / "zombie.ready").exists, 90, "the zombie ready")
    assert zombie("push") == "done" and zombie("lease") == "done"
    state = cf.state(cluster_id)
    ps = state["spec"]["ps"][0]
    version = _ps_version(ps, creds)
    assert version == 1

    _hang(state, "worker:1", zombie_pid)
    event = _respawned(cf, cluster, out)
    assert event["task"] == "worker:1" and "made no step" in event["reason"], event
    os.kill(zombie_pid, signal.SIGCONT)
    assert _fenced(zombie("push"))
    assert _fenced(zombie("lease"))
    assert _ps_version(ps, creds) == version

    _touch(out / "go")
    cf.wait_until((out / "replacement.trained").exists, 90, "the replacement")
    assert _ps_version(ps, creds) == version + 1
    zombie("exit")
    _touch(out / "done")
    _ended(cf, cluster_id)
    assert not [e for e in cluster.read_events() if e.get("event") == "fence_missed"]


@pytest.mark.timeout(240)
def test_a_ps_that_misses_the_fence_learns_it_from_the_replacement(
    cf: Clusterflow, tmp_path: Path
) -> None:
    """Pins the ``fence_missed`` path (``manager/fences.py`` ``fence_ps_tasks`` and
    ``rpc/fencing.py`` ``announce``): the ps hangs (SIGSTOP) while the manager respawns
    worker:1, so it cannot take the fence. The manager records ``fence_missed`` naming
    it and launches the replacement all the same (an error out of the announcement
    would fail the run instead); the dispatcher refuses the zombie at once; the ps,
    resumed, learns of the relaunch from the replacement's first request (every
    request carries its fence), after which the zombie's push is refused and the ps
    moved only by the replacement. Dropping the event, raising on a missed ps, or a ps
    client that does not stamp its fence on every request fails here."""
    out = tmp_path / "out"
    out.mkdir()
    cluster_id, cluster, creds = _start_fence_cluster(cf, out)
    zombie = _Zombie(cf, out)
    zombie_pid = zombie.pid()
    cf.wait_until((out / "zombie.ready").exists, 90, "the zombie ready")
    assert zombie("push") == "done" and zombie("lease") == "done"
    state = cf.state(cluster_id)
    ps = state["spec"]["ps"][0]
    ps_supervisor = next(t["pid"] for t in state["tasks"] if t["task"] == "ps:0")
    (ps_server,) = psutil.Process(ps_supervisor).children()
    ps_server.suspend()  # the ps hangs; its supervisor heartbeats on
    try:
        _hang(state, "worker:1", zombie_pid)
        _respawned(cf, cluster, out)
        missed = cf.wait_until(
            lambda: [e for e in cluster.read_events() if e.get("event") == "fence_missed"],
            30,
            "fence_missed",
        )
        assert missed[0]["task"] == "worker:1" and missed[0]["ps"] == [ps], missed
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):  # the run may have ended
            ps_server.resume()
    os.kill(zombie_pid, signal.SIGCONT)
    assert _fenced(zombie("lease"))
    version = _ps_version(ps, creds)

    _touch(out / "go")
    cf.wait_until((out / "replacement.trained").exists, 90, "the replacement")
    assert _ps_version(ps, creds) == version + 1
    assert _fenced(zombie("push"))
    assert _ps_version(ps, creds) == version + 1
    zombie("exit")
    _touch(out / "done")
    _ended(cf, cluster_id)
