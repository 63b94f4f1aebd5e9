"""A trial's reports: ``clusterflow.tune.report`` and ``History``'s own, sent to the
manager (``trial.report``), which appends them to the report file the tuner reads."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterflow.cluster import trial
from clusterflow.cluster.contract import ENV_MANAGER, ENV_SECRET, ManagerMethod
from clusterflow.errors import ClusterflowError
from clusterflow.manager.trial_reports import TrialReports, line
from clusterflow.rpc import Credentials, RpcClient, RpcServer
from clusterflow.server import trial_report
from clusterflow.train.history import History

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[tuple[RpcServer, Credentials]]:
    """A manager's RPC server taking trial reports into ``tmp_path``'s report file."""
    credentials = Credentials.generate()
    server = RpcServer(credentials, name="trial-manager")
    TrialReports(tmp_path).register_on(server)
    server.start()
    yield server, credentials
    server.stop()


@pytest.fixture
def in_trial(
    tmp_path: Path, manager: tuple[RpcServer, Credentials], monkeypatch: pytest.MonkeyPatch
) -> Path:
    server, credentials = manager
    monkeypatch.setenv(ENV_MANAGER, server.address)
    monkeypatch.setenv(ENV_SECRET, credentials.to_hex())
    monkeypatch.setenv(trial.ENV_TRIAL_REPORT, trial.REPORT_FILE)
    monkeypatch.setenv(trial.ENV_TRIAL_REPORTER, "worker:0")
    monkeypatch.setenv(trial.ENV_TRIAL_PARAMS, json.dumps({"lr": 0.1}))
    monkeypatch.setenv("CLUSTERFLOW_TASK", "worker:0")
    # This process's link and last step: a fresh process's, for each test.
    monkeypatch.setitem(trial_report._state, "step", -1)
    monkeypatch.setitem(trial_report._state, "pid", None)
    return tmp_path / trial.REPORT_FILE


def test_reports_reach_the_managers_file_the_tuner_reads(in_trial: Path) -> None:
    from clusterflow import tune

    assert tune.params() == {"lr": 0.1} and tune.in_trial()
    tune.report(step=0, acc=0.5, loss=1.0)
    tune.report(acc=0.7)  # the next step
    tune.report(step=5, acc=float("nan"))
    assert trial.read_reports(in_trial) == [
        (0, {"acc": 0.5, "loss": 1.0}),
        (1, {"acc": 0.7}),
        (5, {}),
    ]


def test_a_torn_last_line_is_not_read_yet(tmp_path: Path) -> None:
    path = tmp_path / trial.REPORT_FILE
    path.write_text('{"step": 0, "metrics": {"a": 1}}\n{"step": 1, "metr')
    assert trial.read_reports(path) == [(0, {"a": 1.0})]


def test_only_the_reporting_task_sends(in_trial: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERFLOW_TASK", "worker:1")
    trial_report.report(step=0, acc=1.0)
    assert not in_trial.exists()


def test_outside_a_trial_report_does_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(trial.ENV_TRIAL_REPORT, raising=False)
    monkeypatch.chdir(tmp_path)
    trial_report.report(step=0, acc=1.0)
    assert list(tmp_path.iterdir()) == []


def test_a_manager_that_does_not_answer_never_fails_the_job(
    in_trial: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENV_MANAGER, "127.0.0.1:9")  # nothing listens there
    monkeypatch.setitem(trial_report._state, "warned", False)
    trial_report.report(step=0, acc=1.0)
    trial_report.report(step=1, acc=1.0)
    assert sum("did not take a trial's report" in r.message for r in caplog.records) == 1


def test_history_reports_every_epoch_inside_a_trial(in_trial: Path) -> None:
    history = History()
    history.append(0, {"loss": 2.0, "val_accuracy": 0.4})
    history.append(1, {"loss": 1.0, "val_accuracy": 0.6})
    assert trial.read_reports(in_trial) == [
        (0, {"loss": 2.0, "val_accuracy": 0.4}),
        (1, {"loss": 1.0, "val_accuracy": 0.6}),
    ]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ([1, 2], "trial.report body must be a map"),
        ({"step": "1", "metrics": {}}, "step must be a whole number"),
        ({"step": 1, "metrics": {"a": "x"}}, "figure a is not a number"),
        ({"step": 1, "metrics": {"": 1}}, "bad figure name"),
        ({"step": 1, "metrics": {str(i): i for i in range(300)}}, "at most 256"),
    ],
)
def test_a_bad_report_is_refused_in_one_line(body: object, words: str) -> None:
    with pytest.raises(ClusterflowError, match=words):
        line(body)


def test_a_bad_report_over_the_wire_is_an_error_reply_and_writes_nothing(
    tmp_path: Path, manager: tuple[RpcServer, Credentials]
) -> None:
    server, credentials = manager
    with RpcClient(server.address, credentials, deadline=5.0) as client:
        with pytest.raises(ClusterflowError, match="step must be a whole number"):
            client.call(ManagerMethod.TRIAL_REPORT, {"step": None, "metrics": {}})
        client.call(ManagerMethod.TRIAL_REPORT, {"step": 3, "metrics": {"a": 2}})
    assert trial.read_reports(tmp_path / trial.REPORT_FILE) == [(3, {"a": 2.0})]


def test_the_tune_package_imports_without_optuna_or_torch() -> None:
    code = (
        "import sys; sys.modules['optuna'] = None\n"
        "import clusterflow as cf\n"
        "cf.tune.report(step=0, acc=1.0)\n"  # the job side: not even the manager loads
        "print('clusterflow.manager' in sys.modules)\n"
        "import clusterflow.cli.main\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_running_a_study_without_optuna_says_how_to_install(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['optuna'] = None\n"
        "from clusterflow.cli.main import main\n"
        "main(['tune', '--study', 's', '--param', 'x=uniform:0:1', '--metric', 'm', '--', 'true'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"CLUSTERFLOW_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "error: tuning needs Optuna: pip install 'clusterflow[tune]'"
