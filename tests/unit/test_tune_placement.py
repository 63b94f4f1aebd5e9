"""How many trials run at once: whole trial clusters by cores, memory and GPUs, locally
and packed onto a Ray cluster's nodes (``ray.nodes()`` entries as Ray gives them)."""

from __future__ import annotations

from typing import Any

import pytest

from clusterflow.backends.ray_placement import TaskRequest
from clusterflow.cluster import TaskId
from clusterflow.errors import ConfigError
from clusterflow.manager.config import RunConfig
from clusterflow.manager.memory_sizing import ESTIMATE
from clusterflow.tune.placement import (
    fit_local,
    fit_ray,
    gpus_per_trial,
    local_needs,
    ray_requests,
    visible_gpus,
)

G = float(2**30)


def _config(**kw: Any) -> RunConfig:
    return RunConfig.merge({"command": ("python", "train.py")}, kw)


def test_a_local_trial_takes_a_core_per_tracked_process_and_memory_per_process() -> None:
    config = _config(ps=1, workers=2, replicas_per_host=2)
    needs = local_needs(config, gpus=False)
    assert needs == {"CPU": 4.0, "memory": ESTIMATE * 5, "GPU": 0.0}  # the ps: memory only
    assert local_needs(config, gpus=True)["GPU"] == 4.0  # each worker's two replicas
    assert gpus_per_trial(_config(workers=2)) == 1  # lone processes share the trial's one
    assert gpus_per_trial(_config(ps=1, workers=0, chief=True)) == 1
    assert gpus_per_trial(_config(workers=1, env={"CUDA_VISIBLE_DEVICES": "3"})) == 0


def test_the_scarcest_of_cores_memory_and_gpus_bounds_local_trials() -> None:
    needs = {"CPU": 1.0, "memory": 2 * G, "GPU": 1.0}
    assert fit_local(needs, {"CPU": 16.0, "memory": 64 * G, "GPU": 8.0}, 4).trials == 4
    by_gpu = fit_local(needs, {"CPU": 16.0, "memory": 64 * G, "GPU": 2.0}, 4)
    assert by_gpu.trials == 2 and by_gpu.why.startswith("this machine has GPU=2;")
    by_memory = fit_local(needs, {"CPU": 16.0, "memory": 5 * G, "GPU": 8.0}, 4)
    assert by_memory.trials == 2 and "memory=5G" in by_memory.why
    by_cpu = fit_local({"CPU": 2.0, "memory": G, "GPU": 0.0}, {"CPU": 5.0, "memory": 9 * G}, 4)
    assert by_cpu.trials == 2 and "a trial takes CPU=2,memory=1G" in by_cpu.why


def test_a_local_trial_the_machine_cannot_hold_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"needs GPU=2 and this machine has 1$"):
        fit_local({"CPU": 1.0, "GPU": 2.0}, {"CPU": 4.0, "GPU": 1.0}, 2)


def test_visible_gpus_come_from_cuda_visible_devices() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0, 2,5"}) == ["0", "2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []


def _node(labels: dict[str, str] | None = None, alive: bool = True, **res: float) -> dict[str, Any]:
    return {"Alive": alive, "Labels": labels or {}, "Resources": res}


def _requests(**jobs: tuple[int, dict[str, float], dict[str, str]]) -> list[TaskRequest]:
    return [
        TaskRequest(task=TaskId(job, i), resources=res, labels=labels)
        for job, (n, res, labels) in jobs.items()
        for i in range(n)
    ]


def test_ray_trials_are_packed_whole_onto_the_nodes() -> None:
    nodes = [
        _node(CPU=4, memory=8 * G),
        _node(CPU=2, GPU=2, memory=8 * G),
        _node(alive=False, CPU=64),
    ]
    cpu_only = _requests(worker=(2, {"CPU": 1, "memory": G}, {}))
    assert fit_ray(cpu_only, nodes, 8).trials == 3  # six CPUs; the dead node's count for nothing
    gpu = _requests(worker=(1, {"GPU": 1, "CPU": 1}, {}))
    fit = fit_ray(gpu, nodes, 8)
    assert fit.trials == 2 and "a trial takes GPU=1,CPU=1" in fit.why
    memory = _requests(worker=(1, {"CPU": 0.5, "memory": 3 * G}, {}))
    assert fit_ray(memory, nodes, 8).trials == 4  # two a node, by memory
    assert fit_ray(cpu_only, nodes, 2).trials == 2  # and never more than --parallel


def test_ray_labels_bound_where_a_trials_tasks_go() -> None:
    nodes = [_node({"zone": "a"}, CPU=8), _node({"zone": "b"}, CPU=2)]
    pinned = _requests(worker=(1, {"CPU": 1}, {"zone": "b"}), ps=(1, {"CPU": 1}, {}))
    assert fit_ray(pinned, nodes, 8).trials == 2


def test_a_ray_trial_no_node_can_run_is_one_line() -> None:
    nodes = [_node(CPU=4)]
    with pytest.raises(ConfigError, match="job worker needs GPU=1: no node has it"):
        fit_ray(_requests(worker=(1, {"GPU": 1}, {})), nodes, 2)
    # Each task fits the node, both do not (ray_placement's check, node by node).
    with pytest.raises(ConfigError, match="task worker:1 needs CPU=3: no node has room for it"):
        fit_ray(_requests(worker=(2, {"CPU": 3}, {})), nodes, 2)


def test_ray_requests_are_starts_with_memory_sized(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("CLUSTERFLOW_HOME", str(tmp_path))
    config = _config(backend="ray", workers=2, resources={"worker": {"GPU": 1.0}})
    requests = ray_requests(config)
    assert [r.bundle() for r in requests] == [{"CPU": 1.0, "GPU": 1.0, "memory": ESTIMATE}] * 2
    sized = ray_requests(_config(backend="ray", workers=1, memory="3G"))
    assert sized[0].bundle()["memory"] == 3 * G
