"""``clusterflow tune``: real Optuna studies on a real SQLite file, each trial a cluster.

The objective (tune_job.py) is known: ``score = -(x - 0.3)**2``, reported per step. The
trials record themselves how many of them were alive at once, so parallelism is judged
by overlap the trials saw, not by timings.
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna  # a test dependency (the `test` extra): its absence is a failure, not a skip
import pytest

from clusterflow.manager.registry import TERMINAL

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

PY = sys.executable
JOB = str(Path(__file__).with_name("tune_job.py"))


def _job(mode: str, steps: int, marks: Path) -> list[str]:
    return [PY, JOB, mode, "{x}", str(steps), str(marks)]


def _tune(
    cf: Clusterflow, study: str, *args: str, command: list[str], env: dict[str, str] | None = None
) -> Any:
    return cf.run(
        "tune", "--study", study, "--param", "x=uniform:0:1", "--metric", "score",
        *args, "--", *command, timeout=120, env=env,
    )  # fmt: skip


def _study(cf: Clusterflow, name: str) -> Any:
    storage = f"sqlite:///{cf.home / 'studies.db'}"
    return optuna.load_study(study_name=name, storage=storage)


def _reports(cf: Clusterflow, cluster_id: str) -> list[dict[str, Any]]:
    path = cf.path(cluster_id) / "trial-report.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _gone(cf: Clusterflow, cluster_id: str) -> bool:
    return cf.state(cluster_id)["status"] in TERMINAL and not cf.live(cluster_id)


@pytest.mark.timeout(120)
def test_parallel_trials_are_clusters_that_run_at_once(cf: Clusterflow, tmp_path: Path) -> None:
    # Two GPUs for the tuner to hand out (no GPU is touched: the job only reads the
    # variable): each running trial gets one of its own.
    done = _tune(
        cf, "par", "--trials", "4", "--parallel", "2", "--pruner", "none", "--seed", "1",
        command=_job("meet", 3, tmp_path / "marks"), env={"CUDA_VISIBLE_DEVICES": "5,7"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    study = _study(cf, "par")
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    seen = []
    for t in trials:
        cluster_id = t.user_attrs["cluster_id"]
        assert cluster_id.startswith("par-t") and cluster_id in cf.ids()
        assert _gone(cf, cluster_id)
        reports = _reports(cf, cluster_id)
        assert t.value == pytest.approx(-((t.params["x"] - 0.3) ** 2))
        assert t.intermediate_values == {r["step"]: r["metrics"]["score"] for r in reports}
        seen.append(max(r["metrics"]["alive"] for r in reports))
        assert {r["metrics"]["gpu"] for r in reports} <= {5.0, 7.0}
        assert not any(r["metrics"]["shared"] for r in reports)  # never another's GPU
        # The job saves nothing: no checkpoint folder is named (StudyRunner._tell asks
        # for a committed one; an empty folder once sent users looking).
        assert "checkpoint" not in t.user_attrs
    assert max(seen) == 2, seen  # two trials saw each other alive ...
    assert all(n <= 2 for n in seen), seen  # ... and never more than --parallel
    listing = cf.run("ps", "--all")
    assert all(t.user_attrs["cluster_id"] in listing.stdout for t in trials)
    described = cf.run("tune", "describe", "par")
    assert described.returncode == 0, described.stderr
    best = study.best_trial
    assert f"{best.number} (best)" in described.stdout
    assert best.user_attrs["cluster_id"] in described.stdout
    ls = cf.run("tune", "ls")
    assert ls.stdout.splitlines()[1].split()[:6] == ["par", "maximize", "4", "0", "0", "0"]


@pytest.mark.timeout(120)
def test_tpe_beats_the_median_random_trial(cf: Clusterflow, tmp_path: Path) -> None:
    from clusterflow import tune

    values = {}
    for sampler in ("random", "tpe"):
        code = tune.run(
            sampler,
            params={"x": "uniform:0:1"},
            command=_job("score", 1, tmp_path / sampler),
            metric="score",
            trials=8,
            parallel=2,
            sampler=sampler,
            pruner="none",
            seed=7,
        )
        assert code == 0
        values[sampler] = [t.value for t in _study(cf, sampler).get_trials()]
    assert len(values["tpe"]) == 8
    assert max(values["tpe"]) > statistics.median(values["random"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pruner", ["median", "asha"])
def test_pruned_trials_stop_early_and_their_clusters_are_gone(
    cf: Clusterflow, tmp_path: Path, pruner: str
) -> None:
    steps, count = 8, {"median": "6", "asha": "4"}[pruner]
    done = _tune(
        cf, pruner, "--trials", count, "--sampler", "random", "--seed", "3",
        "--pruner", pruner, command=_job("score", steps, tmp_path / "marks"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    trials = _study(cf, pruner).get_trials()
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    assert pruned, [(t.state.name, t.params) for t in trials]
    for t in pruned:
        cluster_id = t.user_attrs["cluster_id"]
        assert len(_reports(cf, cluster_id)) < steps  # stopped before its last step
        assert _gone(cf, cluster_id)
        assert cf.state(cluster_id)["status"] == "stopped"
    assert f"trial {pruned[0].number} pruned: pruned" in done.stdout
    if pruner == "asha":
        # Successive halving: a trial is stopped at a rung (step min_resource * 4**k)
        # unless its value there is among the best quarter of the trials that reached it.
        for t in pruned:
            last = max(t.intermediate_values)
            rung_values = [
                o.intermediate_values[last]
                for o in trials
                if o.number < t.number and last in o.intermediate_values
            ]
            assert rung_values, t.number  # pruned against trials seen at the same rung
            assert t.intermediate_values[last] < max(rung_values)


@pytest.mark.timeout(120)
def test_a_crash_is_a_failed_trial_and_the_study_goes_on(cf: Clusterflow, tmp_path: Path) -> None:
    done = _tune(
        cf, "crash", "--trials", "5", "--parallel", "2", "--sampler", "random", "--seed", "1",
        "--pruner", "none", "--max-failures", "5", command=_job("crash", 2, tmp_path / "marks"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    trials = _study(cf, "crash").get_trials()
    assert len(trials) == 5
    for t in trials:
        if t.params["x"] > 0.5:
            assert t.state.name == "FAIL"
            assert "worker:0 exited with code 3" in t.user_attrs["summary"]
        else:
            assert t.state.name == "COMPLETE"
    assert any(t.state.name == "FAIL" for t in trials)
    strict = _tune(
        cf, "strict", "--trials", "5", "--sampler", "random", "--seed", "1",
        "--pruner", "none", "--max-failures", "0", command=_job("crash", 2, tmp_path / "marks2"),
    )  # fmt: skip
    assert strict.returncode == 1
    assert strict.stderr.strip().splitlines()[-1] == (
        "error: 1 trials failed (more than --max-failures 0)"
    )


@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_trial_and_resume_loses_none(cf: Clusterflow, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    args = ["--trials", "3", "--parallel", "2", "--pruner", "none", "--seed", "2"]
    command = _job("hold", 2, marks)
    run = ["tune", "--study", "cc", "--param", "x=uniform:0:1", "--metric", "score", *args]

    def reporting(n: int, among: set[str]) -> Any:
        def found() -> list[str]:
            ids = [i for i in cf.ids() if i not in among and _reports(cf, i)]
            return ids if len(ids) == n else []

        return found

    def interrupt(proc: Any, running: list[str]) -> list[Any]:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "--resume` continues" in err
        for cluster_id in running:
            assert _gone(cf, cluster_id)
        return [t for t in _study(cf, "cc").get_trials() if t.user_attrs.get("interrupted")]

    proc = cf.popen(*run, "--", *command)
    first = cf.wait_until(reporting(2, set()), 60, "two trials running")
    interrupted = interrupt(proc, first)
    assert len(interrupted) == 2 and all(t.state.name == "FAIL" for t in interrupted)

    # The same command again continues the study: it runs the interrupted trials first.
    proc = cf.popen(*run, "--", *command)
    second = cf.wait_until(reporting(2, set(first)), 60, "the two again")
    again = [t for t in _study(cf, "cc").get_trials() if t.user_attrs.get("cluster_id") in second]
    assert sorted(t.params["x"] for t in again) == sorted(t.params["x"] for t in interrupted)
    interrupted = interrupt(proc, second)
    assert len(interrupted) == 4

    (marks / "release").touch()
    done = cf.run("tune", "--study", "cc", "--resume", timeout=120)  # as stored with the study
    assert done.returncode == 0, done.stderr + done.stdout
    trials = _study(cf, "cc").get_trials()
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(complete) == 3
    assert {t.params["x"] for t in interrupted} <= {t.params["x"] for t in complete}
    ls = cf.run("tune", "ls").stdout.splitlines()[1].split()
    assert ls[:6] == ["cc", "maximize", "3", "0", "0", "0"]


FIT_JOB = """
import torch
from torch import nn
from clusterflow.train import Checkpoint, fit

torch.manual_seed(0)
x = torch.randn(64, 4)
y = (x.sum(1) > 0).long()
model = nn.Linear(4, 2)
fit(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=float({lr!r})),
    (x, y), epochs=2, global_batch_size=16, validation_data=(x, y), metrics=["accuracy"],
    hooks=[Checkpoint()])
"""


@pytest.mark.timeout(120)
def test_fit_inside_a_trial_reports_with_no_extra_code(cf: Clusterflow) -> None:
    script = cf.script("train.py", FIT_JOB.replace("{lr!r}", "__import__('sys').argv[1]"))
    done = cf.run(
        "tune", "--study", "fit", "--trials", "1", "--param", "lr=loguniform:0.01:0.5",
        "--metric", "val_loss", "--direction", "minimize", "--", PY, str(script), "{lr}",
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    (t,) = _study(cf, "fit").get_trials()
    assert t.state.name == "COMPLETE"
    reports = _reports(cf, t.user_attrs["cluster_id"])
    assert [r["step"] for r in reports] == [0, 1]
    assert t.intermediate_values == {r["step"]: r["metrics"]["val_loss"] for r in reports}
    assert t.value == reports[-1]["metrics"]["val_loss"]
    # The best trial's checkpoint is kept, named by describe, and opens with load_module.
    checkpoint = t.user_attrs["checkpoint"]
    described = cf.run("tune", "describe", "fit").stdout
    assert "0 (best)" in described and checkpoint in described
    from torch import nn

    from clusterflow.train.cut import load_module

    loaded = load_module(checkpoint, lambda: nn.Linear(4, 2))
    assert loaded is not None and loaded[1] == 8  # 2 epochs of 4 batches


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--param", "x=gauss:0:1"], "error: --param 'x=gauss:0:1': unknown kind 'gauss'"),
        (["--param", "x"], "error: --param 'x': expected NAME="),
        (["--param", "x=uniform:0:1", "--sampler", "cmaes"], "error: unknown sampler 'cmaes'"),
        (["--param", "y=uniform:0:1"], "error: the command uses {x} but no --param x="),
    ],
)
def test_bad_input_is_one_line_and_exit_2(cf: Clusterflow, args: list[str], message: str) -> None:
    done = cf.run("tune", "--study", "bad", "--metric", "score", *args, "--", "echo", "{x}")
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith(message)
    assert cf.ids() == []  # nothing started


@pytest.mark.timeout(60)
def test_a_metric_never_reported_is_exit_2(cf: Clusterflow, tmp_path: Path) -> None:
    done = _tune(cf, "silent", "--trials", "3", command=_job("silent", 1, tmp_path / "m"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: metric 'score' was never reported by trial 0 (it reported: other)"
    )
