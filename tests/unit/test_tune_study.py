"""The study's settings on Optuna: samplers, pruners, storage, orphaned trials."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import optuna  # a test dependency (the `test` extra): its absence is a failure, not a skip
import pytest

from clusterflow.errors import ConfigError
from clusterflow.tune.space import parse_params
from clusterflow.tune.study import (
    INTERRUPTED,
    StudyRunner,
    TuneSettings,
    _pruner,
    _sampler,
    default_storage,
)


def _settings(**kw: object) -> TuneSettings:
    base: dict[str, object] = {
        "study": "s",
        "metric": "score",
        "params": parse_params(["x=uniform:0:1", "n=int:1:3"]),
        "command": ("true", "{x}", "{n}"),
    }
    return TuneSettings(**{**base, **kw})  # type: ignore[arg-type]


def test_samplers_and_pruners_are_optunas() -> None:
    kinds = {
        "tpe": optuna.samplers.TPESampler,
        "gp": optuna.samplers.GPSampler,
        "random": optuna.samplers.RandomSampler,
        "grid": optuna.samplers.GridSampler,
    }
    for name, kind in kinds.items():
        assert isinstance(_sampler(optuna, _settings(sampler=name)), kind)
    assert isinstance(_pruner(optuna, _settings(pruner="median")), optuna.pruners.MedianPruner)
    assert isinstance(
        _pruner(optuna, _settings(pruner="asha")), optuna.pruners.SuccessiveHalvingPruner
    )
    assert isinstance(_pruner(optuna, _settings(pruner="none")), optuna.pruners.NopPruner)


def test_the_gp_sampler_suggests_from_the_space() -> None:
    study = optuna.create_study(sampler=_sampler(optuna, _settings(sampler="gp", seed=0)))
    for _ in range(4):
        trial = study.ask()
        x = trial.suggest_float("x", 0, 1)
        study.tell(trial, -((x - 0.3) ** 2))
    assert len(study.trials) == 4


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"sampler": "cmaes"}, "unknown sampler 'cmaes'"),
        ({"pruner": "hyperband"}, "unknown pruner 'hyperband'"),
        ({"direction": "up"}, "unknown direction 'up'"),
        ({"study": "a/b"}, "--study 'a/b'"),
        ({"trials": 0}, "--trials"),
        ({"params": []}, "at least one --param"),
        ({"command": ()}, "command after `--`"),
    ],
)
def test_bad_settings_are_refused(kw: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        _settings(**kw).check()


def test_the_study_lives_in_sqlite_under_the_home(home: Path) -> None:
    assert default_storage() == f"sqlite:///{home / 'studies.db'}"
    runner = StudyRunner(_settings())
    assert (home / "studies.db").is_file()
    stored = optuna.load_study(study_name="s", storage=default_storage())
    assert stored.user_attrs["clusterflow"]["params"] == ["x=uniform:0.0:1.0", "n=int:1:3"]
    assert runner.parallel == 1
    with pytest.raises(ConfigError, match="was made to maximize, not minimize"):
        StudyRunner(_settings(direction="minimize"))


def test_only_a_dead_tuners_running_trials_are_queued_again(home: Path) -> None:
    runner = StudyRunner(_settings())
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    host = socket.gethostname()
    owners = [f"{host}:{dead}", f"{host}:{os.getpid()}", f"elsewhere:{dead}"]
    for i, owner in enumerate(owners):
        trial = runner.study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
        trial.set_user_attr("tuner", owner)
        trial.set_user_attr("mark", i)
    runner._requeue_orphans()
    trials = runner.study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "RUNNING", "RUNNING", "WAITING"]
    assert trials[0].user_attrs[INTERRUPTED] is True
    assert trials[3].system_attrs["fixed_params"] == trials[0].params  # asked first, next
