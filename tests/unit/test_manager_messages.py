"""The manager's contract (``server/manager_messages.py``): one type per message, both ends.

The manager's bodies were dicts built by hand in five clients and read by hand in its
handlers (issue 29): a list, a missing task or a string pid was an ``AttributeError`` or
a silent default. Each request now goes out and comes in through its type, each
structured reply too, and a body that breaks the contract is ``MalformedBody`` naming the
field, which a caller receives typed by its wire code while the manager keeps serving.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from clusterflow.cluster.contract import MANAGER_METHODS, ManagerMethod
from clusterflow.manager.config import RunConfig
from clusterflow.manager.controller import Controller
from clusterflow.manager.output import OutputRouter
from clusterflow.manager.registry import ClusterDir
from clusterflow.rpc import Credentials, MalformedBody, RemoteError, Request, RpcClient, RpcServer
from clusterflow.server.manager_link import ManagerLink
from clusterflow.server.manager_messages import (
    REQUESTS,
    CheckpointsReply,
    CheckpointsRequest,
    DeclareReply,
    DeclareRequest,
    ExitedRequest,
    HeartbeatRequest,
    RegisterReply,
    RegisterRequest,
    ReportRequest,
    ScaleReply,
    ScaleRequest,
    SpecReply,
    SpecRequest,
    StandbyReply,
    StandbyRequest,
    StatusRequest,
    StopRequest,
    TrialReportRequest,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "message",
    [
        RegisterRequest(task="worker:0", address="127.0.0.1:4000", pid=12),
        RegisterRequest(task="worker:0", address="127.0.0.1:4000"),
        RegisterReply(
            spec={"worker": ["127.0.0.1:4000"]},
            spec_version=3,
            env={"A": "1"},
            command=("python", "train.py"),
            replicas=({"RANK": "0"}, {"RANK": "1"}),
        ),
        HeartbeatRequest(task="ps:0", pid=7),
        ExitedRequest(task="worker:1", code=127, error="cannot run 'x'"),
        ExitedRequest(task="worker:1", code=0),
        StandbyRequest(pid=9, wait_s=20.0),
        StandbyRequest(pid=9),
        StandbyReply(task="worker:2"),
        StandbyReply(),
        StandbyReply(exit=True),
        DeclareRequest(task="worker:0", respawnable=True, resizable=False),
        DeclareRequest(task="worker:0", respawnable=False),
        DeclareReply(max_restarts=2, elastic=True),
        CheckpointsRequest(task="chief:0", url="s3://b/ckpt"),
        CheckpointsReply(url="s3://b/ckpt"),
        SpecRequest(),
        SpecReply(spec={"ps": ["h:1"], "worker": ["h:2"]}, spec_version=1),
        SpecReply(spec=None, spec_version=0),
        ReportRequest(task="worker:0", step=5, loss=0.25, samples_per_s=100.0),
        ReportRequest(task="worker:0", step=5),
        TrialReportRequest(step=3, metrics={"accuracy": 0.9}),
        StopRequest(grace_s=2.5),
        StopRequest(),
        StatusRequest(),
        ScaleRequest(workers=3),
        ScaleRequest(workers=3, automatic=True),
        ScaleReply(workers=4, spec_version=3, joined=("worker:2", "worker:3"), restarted=True),
        ScaleReply(workers=2, spec_version=5, left=("worker:2", "worker:3")),
    ],
    ids=lambda m: type(m).__name__,
)
def test_each_message_comes_back_as_it_went(message: Any) -> None:
    assert type(message).from_wire(message.to_wire()) == message


def test_the_bodies_keep_the_keys_the_manager_always_read() -> None:
    """The wire is unchanged: a peer of the previous version reads the same keys."""
    assert RegisterRequest(task="w:0", address="a:1", pid=3).to_wire() == {
        "task": "w:0",
        "address": "a:1",
        "pid": 3,
    }
    assert ExitedRequest(task="w:0", code=1).to_wire() == {"task": "w:0", "code": 1}
    assert StandbyReply(exit=True).to_wire() == {"exit": True}
    assert StandbyReply().to_wire() == {"task": None}
    assert DeclareRequest(task="w:0", respawnable=True).to_wire() == {
        "task": "w:0",
        "respawnable": True,
    }
    assert SpecRequest().to_wire() is None and StatusRequest().to_wire() is None
    # A figure that is not finite arrives as NaN: the tuner drops it (a diverged step).
    diverged = TrialReportRequest.from_wire({"step": 1, "metrics": {"x": 1e999}})
    assert math.isnan(diverged.metrics["x"])


MALFORMED = [
    (RegisterRequest, [1, 2], "manager.register body must be a map"),
    (RegisterRequest, None, "manager.register body must be a map"),
    (RegisterRequest, {"address": "h:1"}, "manager.register: task must be a task name"),
    (RegisterRequest, {"task": "worker:0"}, "manager.register: address must be"),
    (RegisterRequest, {"task": "worker:0", "address": 5}, "manager.register: address must be"),
    (
        RegisterRequest,
        {"task": "worker:0", "address": "h:1", "pid": "7"},
        "manager.register: pid must be a whole number",
    ),
    (RegisterReply, [1], "manager.register reply must be a map"),
    (
        RegisterReply,
        {"spec": {}, "spec_version": 1, "env": {}},
        "manager.register reply: command must be a list of strings",
    ),
    (
        RegisterReply,
        {"spec": {}, "spec_version": 1, "env": {"A": 1}, "command": ["x"]},
        "manager.register reply: env must map names to strings",
    ),
    (
        RegisterReply,
        {"spec": {}, "env": {}, "command": ["x"]},
        "manager.register reply: spec_version must be a whole number",
    ),
    (
        RegisterReply,
        {"spec": [], "spec_version": 1, "env": {}, "command": ["x"]},
        "manager.register reply: spec must map job names",
    ),
    (HeartbeatRequest, "worker:0", "manager.heartbeat body must be a map"),
    (HeartbeatRequest, {}, "manager.heartbeat: task must be a task name"),
    (HeartbeatRequest, {"task": "worker:0", "pid": True}, "manager.heartbeat: pid must be"),
    (ExitedRequest, {"task": "worker:0"}, "manager.exited: code must be a whole number"),
    (ExitedRequest, {"task": "worker:0", "code": 1, "error": 5}, "manager.exited: error must"),
    (StandbyRequest, {}, "manager.standby: pid must be a whole number"),
    (StandbyRequest, {"pid": 1, "wait_s": "20"}, "manager.standby: wait_s must be a number"),
    (StandbyReply, {"task": 3}, "manager.standby reply: task must be"),
    (StandbyReply, {"exit": "yes"}, "manager.standby reply: exit must be true or false"),
    (DeclareRequest, {"task": "worker:0"}, "manager.declare: respawnable must be true or false"),
    (
        DeclareRequest,
        {"task": "worker:0", "respawnable": True, "resizable": 1},
        "manager.declare: resizable must be true or false",
    ),
    (DeclareRequest, {"task": 0, "respawnable": True}, "manager.declare: task must be"),
    (DeclareReply, {"max_restarts": 1}, "manager.declare reply: elastic must be"),
    (DeclareReply, {"elastic": True}, "manager.declare reply: max_restarts must be"),
    (CheckpointsRequest, {"task": "chief:0", "url": ""}, "manager.checkpoints: url must be"),
    (CheckpointsRequest, {"url": "/c"}, "manager.checkpoints: task must be"),
    (CheckpointsReply, {}, "manager.checkpoints reply: url must be"),
    (SpecRequest, [1], "manager.spec body must be a map"),
    (SpecReply, {"spec": None}, "manager.spec reply: spec_version must be"),
    (SpecReply, {"spec": ["h:1"], "spec_version": 1}, "manager.spec reply: spec must map"),
    (ReportRequest, {"task": "worker:0"}, "task.report: step must be a whole number"),
    (ReportRequest, {"task": "worker:0", "step": 1, "loss": "0.5"}, "task.report: loss must"),
    (
        ReportRequest,
        {"task": "worker:0", "step": 1, "samples_per_s": True},
        "task.report: samples_per_s must be a number",
    ),
    (TrialReportRequest, {"metrics": {}}, "trial.report: step must be a whole number"),
    (TrialReportRequest, {"step": 1, "metrics": [1]}, "trial.report: metrics must map"),
    (TrialReportRequest, {"step": 1, "metrics": {"": 1}}, "trial.report: bad figure name"),
    (TrialReportRequest, {"step": 1, "metrics": {"a": "x"}}, "trial.report: figure a is not"),
    (StopRequest, 3, "manager.stop body must be a map"),
    (StopRequest, {"grace_s": "10"}, "manager.stop: grace_s must be a number"),
    (StatusRequest, "x", "manager.status body must be a map"),
    (ScaleRequest, [4], "manager.scale body must be a map"),
    (ScaleRequest, {"workers": "4"}, "manager.scale: workers must be a whole number"),
    (ScaleRequest, {"workers": True}, "manager.scale: workers must be a whole number"),
    (ScaleRequest, {"workers": 2, "ps": 1}, r"manager.scale: a body is \{'workers': N\["),
    (ScaleRequest, {"workers": 2, "automatic": 1}, "manager.scale: automatic must be true"),
    (ScaleReply, {"workers": 2, "spec_version": 1}, "manager.scale reply: joined must be a list"),
    (
        ScaleReply,
        {"workers": 2, "spec_version": 1, "joined": [""], "left": [], "restarted": False},
        "manager.scale reply: joined must be a list of task names",
    ),
    (
        ScaleReply,
        {"workers": 2, "spec_version": 1, "joined": [], "left": [], "restarted": 1},
        "manager.scale reply: restarted must be true or false",
    ),
]


@pytest.mark.parametrize(
    ("kind", "body", "words"),
    MALFORMED,
    ids=[f"{k.__name__}-{i}" for i, (k, _, _) in enumerate(MALFORMED)],
)
def test_a_body_that_breaks_the_contract_is_malformed_naming_the_field(
    kind: Any, body: Any, words: str
) -> None:
    with pytest.raises(MalformedBody, match=words):
        kind.from_wire(body)


def test_every_method_of_the_manager_has_its_request_type() -> None:
    assert set(REQUESTS) == MANAGER_METHODS
    assert all(method == kind.METHOD for method, kind in REQUESTS.items())


def test_the_message_types_load_nothing_of_the_manager() -> None:
    """The supervisor and the jobs import the types; the manager must not come with them."""
    probe = (
        "import sys, clusterflow.server.manager_messages;"
        "print(sorted(m for m in sys.modules if m.startswith('clusterflow.manager')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# Through a real manager --------------------------------------------------------------


@pytest.fixture
def credentials() -> Credentials:
    return Credentials.generate()


@pytest.fixture
def manager(tmp_path: Path, credentials: Credentials) -> Iterator[tuple[Controller, str]]:
    """A controller of one worker, its RPC server serving and its loop never run (no
    task is launched); stopped when the test ends, failure or not."""
    folder = tmp_path / "cluster"
    (folder / "logs").mkdir(parents=True)
    rpc = RpcServer(credentials, name="manager", tensors=False)
    backend: Any = SimpleNamespace(name="local", job_env=lambda task: {})
    controller = Controller(
        ClusterDir(folder),
        RunConfig(command=("true",)),
        backend,
        rpc=rpc,
        output=OutputRouter(folder / "output.log", echo=False),
    )
    rpc.start()
    try:
        yield controller, rpc.address
    finally:
        rpc.stop()
        controller.standby.close()
        controller.output.close()


WRONG_FIELD = {
    ManagerMethod.REGISTER: ({"task": "worker:0", "address": "h:1", "pid": "1"}, "pid"),
    ManagerMethod.HEARTBEAT: ({"task": ["worker:0"]}, "task"),
    ManagerMethod.EXITED: ({"task": "worker:0", "code": "1"}, "code"),
    ManagerMethod.STANDBY: ({"pid": 1.5}, "pid"),
    ManagerMethod.DECLARE: ({"task": "worker:0", "respawnable": "yes"}, "respawnable"),
    ManagerMethod.CHECKPOINTS: ({"task": "worker:0", "url": 5}, "url"),
    ManagerMethod.SPEC: ([], "body must be a map"),
    ManagerMethod.REPORT: ({"task": "worker:0", "step": 1.5}, "step"),
    ManagerMethod.TRIAL_REPORT: ({"step": 1, "metrics": None}, "metrics"),
    ManagerMethod.STOP: ({"grace_s": [1]}, "grace_s"),
    ManagerMethod.STATUS: (7, "body must be a map"),
    ManagerMethod.SCALE: ({"workers": 2.0}, "workers"),
}


def test_each_handler_refuses_a_malformed_body_typed_and_the_manager_keeps_serving(
    manager: tuple[Controller, str], credentials: Credentials
) -> None:
    """Every method the manager serves, through its RPC server: not a map, then a field
    of another type. The caller gets ``MalformedBody`` by its wire code (``malformed``)
    naming the method and the field, never ``internal``; status answers after each."""
    assert set(WRONG_FIELD) == set(REQUESTS)
    _, address = manager
    with RpcClient(address, credentials, deadline=10) as client:
        for method, (body, field) in WRONG_FIELD.items():
            for bad in ([1, 2], body):
                with pytest.raises(RemoteError) as info:
                    client.call(method, bad)
                error = info.value
                assert isinstance(error, MalformedBody), (method, bad, error)
                assert error.code == "app" and error.method == method
                assert method in str(error)
                if bad is body:
                    assert field in str(error), (method, error)
            status = client.call(ManagerMethod.STATUS).body
            assert status["status"] == "starting" and status["id"] == "cluster"
        # Well-formed calls are served as before the types: the spec (none yet), a
        # heartbeat of an unknown task ignored, a declaration of an unknown task refused
        # as a registration error, not as a malformed body.
        assert SpecReply.from_wire(client.call(SpecRequest.METHOD).body) == SpecReply(
            spec=None, spec_version=0
        )
        beat = HeartbeatRequest(task="worker:9", pid=1)
        assert client.call(beat.METHOD, beat.to_wire()).body is None
        declared = DeclareRequest(task="worker:9", respawnable=True)
        with pytest.raises(RemoteError) as refused:
            client.call(declared.METHOD, declared.to_wire())
        assert not isinstance(refused.value, MalformedBody)
        assert refused.value.error_type == "RegistrationError"


def test_the_link_builds_each_request_and_reads_the_reply_by_its_type(
    manager: tuple[Controller, str], credentials: Credentials
) -> None:
    """``ManagerLink`` and the supervisor's and the CLI's requests against the manager:
    each lands where its handler puts it (the declaration on the task, the figures, the
    checkpoints' new place, a run's error, the grace period) and the replies come back
    typed."""
    controller, address = manager
    link = ManagerLink(address, credentials, "worker:0")
    try:
        reply = link.declare(respawnable=True, resizable=True)
        assert reply == DeclareReply(max_restarts=controller.config.max_restarts, elastic=False)
        record = controller.tasks.find("worker:0")
        assert (record.respawnable, record.resizable) == (True, True)
        assert link.spec() == SpecReply(spec=None, spec_version=0)
        url = str(controller.cluster.path / "elsewhere")
        controller.cluster.config_file.write_text("{}")
        assert link.checkpoints_at(url)
        assert controller.restore_points.url == url
        link.report(step=4, loss=0.5, samples_per_s=None)
        assert record.figures == {"step": 4, "loss": 0.5}
        with RpcClient(address, credentials, deadline=10) as client:
            exited = ExitedRequest(task="worker:0", code=127, error="cannot run 'x'")
            client.call(exited.METHOD, exited.to_wire())
            assert record.error == "cannot run 'x'"
            waiting = StandbyRequest(pid=1, wait_s=0.1)  # not the standby kept: exit
            reply = client.call(waiting.METHOD, waiting.to_wire()).body
            assert StandbyReply.from_wire(reply) == StandbyReply(exit=True)
            stop = StopRequest(grace_s=3.0)
            assert client.call(stop.METHOD, stop.to_wire()).body == {"stopping": True}
            assert controller.config.grace_s != 3.0 and controller._grace_s == 3.0
    finally:
        link.close()


def _serving(credentials: Credentials, handlers: dict[str, Callable[[Request], Any]]) -> RpcServer:
    server = RpcServer(credentials, name="not-a-manager")
    for method, handler in handlers.items():
        server.register(method, handler)
    return server.start()


def test_a_reply_that_breaks_the_contract_is_no_answer_for_the_link(
    credentials: Credentials,
) -> None:
    """A job never fails over its manager's answer: a reply of another shape is read as
    no answer (None, one warning), as a manager that does not answer is."""
    server = _serving(
        credentials,
        {
            ManagerMethod.SPEC: lambda request: {"spec": "nonsense"},
            ManagerMethod.DECLARE: lambda request: [1],
            ManagerMethod.CHECKPOINTS: lambda request: {"url": None},
        },
    )
    link = ManagerLink(server.address, credentials, "worker:0")
    try:
        assert link.spec() is None
        assert link.declare(respawnable=True) is None
        assert link.checkpoints_at("/x") is False
    finally:
        link.close()
        server.stop()
