"""Memory sized within a run (``memory_watch.within_run``, ``RayBackend._sized``), a
standby held to the task it takes over, and trials of a study sized by earlier trials."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from clusterflow.backends.memory_watch import FLOOR, HEADROOM, MemoryWatch, within_run
from clusterflow.backends.ray_backend import RayBackend
from clusterflow.backends.ray_placement import TaskRequest
from clusterflow.cluster import TaskId
from clusterflow.manager import memory_sizing
from clusterflow.manager.config import RunConfig
from clusterflow.manager.ray_host import task_requests
from clusterflow.manager.state import ClusterState, TaskState

GIB = float(1 << 30)
MIB = float(1 << 20)


def test_a_later_placement_asks_for_the_peak_so_far_times_the_headroom() -> None:
    assert within_run(GIB, 400 * MIB) == 400 * MIB * HEADROOM  # not the first estimate
    assert within_run(GIB, 900 * MIB) == 900 * MIB * HEADROOM  # more than it, too
    assert within_run(GIB, 10 * MIB) == FLOOR
    assert within_run(GIB, 0.0) == GIB  # nothing measured yet: what it asked


def test_never_less_than_a_grown_request_nor_an_earlier_runs_peak_nor_above_the_node() -> None:
    grown = 1.5 * GIB
    assert within_run(grown, 1.1 * GIB, grown=True) == grown
    assert within_run(grown, 1.3 * GIB, grown=True) == 1.3 * GIB * HEADROOM
    # A restart early in a run whose earlier runs peaked higher keeps their size.
    assert within_run(2 * GIB, 300 * MIB, before=1.6 * GIB) == 1.6 * GIB * HEADROOM
    assert within_run(GIB, 3 * GIB, largest=2 * GIB) == 2 * GIB


@dataclass
class _Ran:
    """What ``RayBackend`` reads of a process it launched: its task and measured peak."""

    task: TaskId
    memory_peak: int


def _backend(*requests: TaskRequest) -> RayBackend:
    return RayBackend(list(requests), group=None)


def test_the_backend_sizes_automatic_jobs_by_their_peak_so_far_and_leaves_named_ones() -> None:
    auto = TaskRequest(task=TaskId("worker", 0), resources={"memory": GIB}, memory_named=False)
    named = TaskRequest(task=TaskId("ps", 0), resources={"memory": GIB})
    backend = _backend(auto, named)
    assert backend._sized(auto) == auto  # nothing measured: the first request
    backend._all.extend(
        [
            _Ran(TaskId("worker", 0), int(300 * MIB)),  # type: ignore[list-item]
            _Ran(TaskId("worker", 1), int(500 * MIB)),  # type: ignore[list-item]
            _Ran(TaskId("ps", 0), int(3 * GIB)),  # type: ignore[list-item]
        ]
    )
    assert backend.job_peak("worker") == 500 * MIB  # the largest of the job's tasks
    assert backend._sized(auto).resources["memory"] == 500 * MIB * HEADROOM
    assert backend._sized(named) == named  # the user's size is the user's
    backend._grown_jobs.add("worker")
    grown = TaskRequest(task=auto.task, resources={"memory": 2 * GIB}, memory_named=False)
    assert backend._sized(grown).resources["memory"] == 2 * GIB


def test_a_standby_held_to_a_task_is_killed_once_over_it() -> None:
    watch = MemoryWatch(None, vmstat=Path("/nonexistent"))  # a standby: no task yet
    assert not watch.sample(900)
    watch.limit = 1000.0  # SupervisorHost.hold_to, when it takes a task over
    assert not watch.sample(999)
    assert watch.sample(1001) and watch.killed_for_memory(-9)


def test_earlier_peaks_reach_the_requests_as_their_floor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLUSTERFLOW_HOME", str(tmp_path))
    config = RunConfig(command=("python", "train.py"), backend="ray", workers=2)
    state = _state(600 * MIB)
    memory_sizing.record(config, state)
    sized, automatic = memory_sizing.size(config)
    before = memory_sizing.earlier_peaks(config, automatic)
    assert before == {"worker": 600 * MIB}
    requests = task_requests(sized, automatic, before)
    assert [r.memory_before for r in requests] == [600 * MIB, 600 * MIB]
    assert requests[0].resources["memory"] == 600 * MIB * HEADROOM


def _state(peak: float) -> ClusterState:
    task = TaskState(task="worker:0", memory_peak=peak)
    return ClusterState(id="c", status="succeeded", tasks=(task,))


def test_trials_of_a_study_share_a_key_by_its_command_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLUSTERFLOW_HOME", str(tmp_path))
    template = "python train.py --lr {lr}"

    def trial(lr: str) -> RunConfig:
        command = ("python", "train.py", "--lr", lr)
        return RunConfig(command=command, backend="ray", memory_key=template)

    memory_sizing.record(trial("0.1"), _state(700 * MIB))
    sized, _ = memory_sizing.size(trial("0.01"))  # another trial: earlier trials' peak
    assert sized.resources["worker"]["memory"] == 700 * MIB * HEADROOM
    plain = RunConfig(command=("python", "train.py", "--lr", "0.01"), backend="ray")
    assert memory_sizing.size(plain)[0].resources["worker"]["memory"] == memory_sizing.ESTIMATE


def test_a_studys_trials_carry_its_command_template_as_their_memory_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clusterflow.tune.space import fill_command, parse_params
    from clusterflow.tune.study import StudyRunner, TuneSettings

    monkeypatch.setenv("CLUSTERFLOW_HOME", str(tmp_path))
    command = ("python", "train.py", "--lr", "{lr}")
    settings = TuneSettings(
        study="s", metric="loss", params=parse_params(["lr=uniform:0:1"]), command=command
    )
    runner = StudyRunner(settings)
    # Each trial's settings, as the runner makes them: its base with the values filled in.
    trials = [
        RunConfig.merge(runner.base.to_dict(), {"command": fill_command(command, {"lr": lr})})
        for lr in (0.1, 0.01)
    ]
    assert trials[0].command != trials[1].command
    assert {memory_sizing.job_key(t, "worker") for t in trials} == {
        memory_sizing.job_key(runner.base, "worker")
    }
    assert trials[0].memory_key == "python train.py --lr '{lr}'"  # shlex.join
