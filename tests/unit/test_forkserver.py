"""Which requests the warm fork server serves (backends/forkserver.py ``refusal``): a
job it runs in-process must see what a fresh ``python`` would, so a command it cannot
run that way, or an environment whose start-up variables differ from its own, is
refused and started as before."""

from __future__ import annotations

import sys

import pytest

from clusterflow.backends import forkserver
from clusterflow.backends.forkserver import refusal
from clusterflow.cluster.contract import ENV_WARM_FORK

PY = sys.executable
OWN = {"PATH": "/usr/bin", "PYTHONPATH": "/a", "OMP_NUM_THREADS": "2"}


def test_a_python_command_in_the_same_environment_is_served() -> None:
    env = {**OWN, "RANK": "1", "CUDA_VISIBLE_DEVICES": "3", "PYTHONUNBUFFERED": "1"}
    assert refusal([PY, "-u", "train.py", "--epochs", "3"], env, OWN) is None
    assert refusal([PY, "-m", "clusterflow.ps"], env, OWN) is None


@pytest.mark.parametrize(
    "argv",
    [["sh", "-c", "echo"], [PY, "-I", "train.py"], [PY], []],
    ids=["another-program", "a-flag-it-cannot-apply", "no-script", "empty"],
)
def test_a_command_it_cannot_run_in_process_is_refused(argv: list[str]) -> None:
    reason = refusal(argv, OWN, OWN)
    assert reason is not None and "in-process" in reason


@pytest.mark.parametrize(
    "change",
    [
        {"PYTHONPATH": "/b"},
        {"OMP_NUM_THREADS": "8"},
        {"LD_PRELOAD": "/x.so"},
        {"TORCH_LOGS": "+dynamo"},
        {"PYTHONHASHSEED": "0"},
    ],
    ids=lambda change: next(iter(change)),
)
def test_a_start_up_variable_that_differs_is_refused_by_name(change: dict[str, str]) -> None:
    (name,) = change
    assert refusal([PY, "train.py"], {**OWN, **change}, OWN) == (
        f"{name} differs from the warm process's"
    )


def test_a_start_up_variable_the_job_lacks_is_refused_too() -> None:
    env = {k: v for k, v in OWN.items() if k != "PYTHONPATH"}
    assert refusal([PY, "train.py"], env, OWN) == "PYTHONPATH differs from the warm process's"


def test_start_only_for_a_foreground_start_and_not_when_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[str] = []
    monkeypatch.setattr(forkserver, "ensure", lambda: started.append("yes") or None)
    forkserver.start_early(["clusterflow", "ps"])
    forkserver.start_early(["clusterflow", "start", "--detach", "--", "python", "x.py"])
    forkserver.start_early(["clusterflow", "start", "-h"])
    forkserver.start_early(["clusterflow", "start", "--backend", "ray", "--", "python"])
    forkserver.start_early(["clusterflow", "start", "--backend=hosts", "--", "python"])
    assert started == []  # nothing of this machine's to fork, or not yet
    forkserver.start_early(["clusterflow", "start", "--", "python", "x.py", "--detach"])
    assert started == ["yes"]  # a --detach after -- is the job's, not start's
    forkserver.start_early(["clusterflow", "start", "--backend", "local", "--", "python"])
    forkserver.start_early(["clusterflow", "start", "--", "python", "--backend", "ray"])
    assert started == ["yes"] * 3
    monkeypatch.undo()
    monkeypatch.setenv(ENV_WARM_FORK, "0")
    assert forkserver.ensure() is None
