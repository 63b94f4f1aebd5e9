"""The job side of a trial: ``clusterflow.tune.report`` and ``History``'s own report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clusterflow.cluster import trial
from clusterflow.train.history import History


@pytest.fixture
def in_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / trial.REPORT_FILE
    monkeypatch.setenv(trial.ENV_TRIAL_REPORT, str(path))
    monkeypatch.setenv(trial.ENV_TRIAL_REPORTER, "worker:0")
    monkeypatch.setenv(trial.ENV_TRIAL_PARAMS, json.dumps({"lr": 0.1}))
    monkeypatch.setenv("CLUSTERFLOW_TASK", "worker:0")
    return path


def test_report_appends_lines_the_tuner_reads(in_trial: Path) -> None:
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


def test_a_torn_last_line_is_not_read_yet(in_trial: Path) -> None:
    in_trial.write_text('{"step": 0, "metrics": {"a": 1}}\n{"step": 1, "metr')
    assert trial.read_reports(in_trial) == [(0, {"a": 1.0})]


def test_only_the_reporting_task_writes(in_trial: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERFLOW_TASK", "worker:1")
    trial.report(step=0, acc=1.0)
    assert not in_trial.exists()


def test_outside_a_trial_report_does_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(trial.ENV_TRIAL_REPORT, raising=False)
    monkeypatch.chdir(tmp_path)
    trial.report(step=0, acc=1.0)
    assert list(tmp_path.iterdir()) == []


def test_history_reports_every_epoch_inside_a_trial(in_trial: Path) -> None:
    history = History()
    history.append(0, {"loss": 2.0, "val_accuracy": 0.4})
    history.append(1, {"loss": 1.0, "val_accuracy": 0.6})
    assert trial.read_reports(in_trial) == [
        (0, {"loss": 2.0, "val_accuracy": 0.4}),
        (1, {"loss": 1.0, "val_accuracy": 0.6}),
    ]


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
