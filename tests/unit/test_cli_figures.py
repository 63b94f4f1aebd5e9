"""The live figures `clusterflow ps` and `describe` show, from a state as the manager writes it."""

from __future__ import annotations

from clusterflow.cli.show import figures, task_figures
from clusterflow.manager.state import ClusterState, TaskState


def _state(*tasks: dict[str, object]) -> ClusterState:
    return ClusterState.from_dict({"id": "abc", "tasks": list(tasks)})


def test_ps_shows_the_furthest_step_and_the_summed_rate_of_running_tasks() -> None:
    state = _state(
        {"task": "worker:0", "exit_code": None, "step": 40, "samples_per_s": 1000.4},
        {"task": "worker:1", "exit_code": None, "step": 38, "samples_per_s": 990.0},
        {"task": "worker:2", "exit_code": 0, "step": 41, "samples_per_s": 5000.0},
        {"task": "ps:0", "exit_code": None},
    )
    # The finished worker's step counts (it got furthest); its rate no longer does.
    assert figures(state) == ("41", "1990")
    assert figures(_state({"task": "worker:0", "exit_code": None})) == ("-", "-")


def test_an_ended_cluster_shows_the_figures_it_ended_on() -> None:
    """Once every task exited, ``ps`` (and the dashboard's list, through the same
    ``ClusterState.figures``) shows the last step and the last rates the tasks
    reported, not ``-``: an ended run's figures end true."""
    state = _state(
        {"task": "worker:0", "exit_code": 0, "step": 120, "samples_per_s": 812.4},
        {"task": "worker:1", "exit_code": 0, "step": 119, "samples_per_s": 800.0},
        {"task": "ps:0", "exit_code": -15},
    )
    assert figures(state) == ("120", "1612")


def test_describe_shows_each_tasks_figures_and_restarts() -> None:
    task = TaskState(task="worker:0", step=12, loss=0.123456, samples_per_s=812.6, restarts=2)
    assert task_figures(task) == "  step 12, loss 0.1235, 813 samples/s, restarts 2"
    assert task_figures(TaskState(task="worker:0", restarts=0)) == ""
