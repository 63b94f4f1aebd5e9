"""Cutting a model into pipeline stages, and the one-line errors of bad pipelines."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import clusterflow as cf
from clusterflow.errors import ConfigError
from clusterflow.strategies.pipeline import PipelineError
from clusterflow.strategies.pipeline.api import PipelineConfig, check_microbatches
from clusterflow.strategies.pipeline.layout import Layout
from clusterflow.strategies.pipeline.split import (
    balanced,
    by_owner,
    by_points,
    children_of,
    measure_times,
)


def _one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_split_points_by_index_or_name() -> None:
    names = ["a", "b", "c", "d", "e"]
    assert by_points([2, 4], names, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert by_points(["c"], names, 2) == [range(0, 2), range(2, 5)]


@pytest.mark.parametrize(
    ("points", "match"),
    [
        ([0], "leaves stage 0 empty"),
        ([2, 2], "leaves stage 1 empty"),
        ([5], "leaves stage 1 empty"),
        ([1, 2, 3], "makes 4 stages"),
        (["zz"], "names no layer"),
    ],
)
def test_a_split_that_leaves_a_stage_empty_is_one_line(points: list[int | str], match: str) -> None:
    with pytest.raises(PipelineError, match=match) as error:
        by_points(points, ["a", "b", "c", "d", "e"], 3 if len(points) == 2 else 2)
    _one_line(error)


def test_device_blocks_cut_in_order() -> None:
    assert by_owner([0, None, 1, 1, None], 2) == [range(0, 2), range(2, 5)]
    with pytest.raises(PipelineError, match="stage 1 empty"):
        by_owner([0, 0, 2], 3)
    with pytest.raises(PipelineError, match="in order"):
        by_owner([1, 0], 2)


def test_balance_minimises_the_largest_stage() -> None:
    assert balanced([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert balanced([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 9)]
    assert balanced([1, 2, 3, 4, 5, 6], 3) == [range(0, 3), range(3, 5), range(5, 6)]
    with pytest.raises(PipelineError, match="too few for 4"):
        balanced([1, 1, 1], 4)


def test_only_sequential_models_are_cut() -> None:
    with pytest.raises(PipelineError, match=r"nn\.Sequential"):
        children_of(nn.Linear(2, 2))


def test_micro_batches_that_do_not_divide_the_batch() -> None:
    assert check_microbatches(12, 4) == 3
    with pytest.raises(PipelineError, match="4 micro-batches do not divide a batch of 10") as e:
        check_microbatches(10, 4)
    _one_line(e)


def test_more_stages_than_tasks_and_uneven_pipelines() -> None:
    with pytest.raises(PipelineError, match="stages=3 but the cluster has 2") as e:
        Layout.of(0, 2, 3)
    _one_line(e)
    with pytest.raises(PipelineError, match="does not divide the 4"):
        Layout.of(0, 4, 3)
    layout = Layout.of(3, 4, 2, chunks_per_task=2)
    assert (layout.pipeline, layout.stage, layout.my_chunks()) == (1, 1, [1, 3])
    assert layout.owner(2) == 2 and layout.first == 2 and layout.last == 3


def test_config_values_fail_at_the_edge() -> None:
    assert PipelineConfig(schedule="GPipe").schedule.value == "gpipe"  # type: ignore[arg-type]
    for bad, match in (
        ({"schedule": "zigzag"}, "unknown pipeline schedule 'zigzag'"),
        ({"microbatches": 0}, "microbatches must be an integer >= 1"),
        ({"stages": True}, "stages must be"),
        ({"balance": "flops"}, "unknown balance"),
        ({"split": (1.5,)}, "split point 1.5"),
    ):
        with pytest.raises(PipelineError, match=match):
            PipelineConfig(**bad)  # type: ignore[arg-type]
    assert issubclass(PipelineError, ConfigError)


def test_a_single_process_pipeline_trains_like_plain_fit() -> None:
    """One task, one stage: the micro-batches accumulate into the plain step's update."""
    x, y = torch.randn(32, 4, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 3

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    strategy = cf.PipelineStrategy("gpipe", microbatches=4)
    with strategy.scope():
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cf.fit(model, nn.CrossEntropyLoss(), opt, (x, y), strategy=strategy, global_batch_size=8)
    plain = build()
    cf.fit(
        plain,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(plain.parameters(), lr=0.1),
        (x, y),
        global_batch_size=8,
    )
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(PipelineError, match="4 micro-batches do not divide a batch of 6"):
        cf.fit(model, nn.CrossEntropyLoss(), opt, (x, y), strategy=strategy, global_batch_size=6)
    with pytest.raises(PipelineError, match="stages=2 but the cluster has 1 replica task"):
        cf.PipelineStrategy("1f1b", stages=2)


def test_device_blocks_place_layers_on_stages_in_one_process() -> None:
    strategy = cf.PipelineStrategy("1f1b", microbatches=2)
    with (
        pytest.raises(PipelineError, match="worker:3, but the cluster has 1"),
        strategy.scope(),
        cf.device("/job:worker/task:3"),
    ):
        model = nn.Sequential(nn.Linear(2, 2))
    assert isinstance(model, nn.Sequential)


def test_balance_by_measured_time_cuts_where_the_time_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layers that take long get stages of their own (a fake clock, advanced by each
    layer's forward, stands for the measurement)."""
    now = [0.0]
    monkeypatch.setattr("clusterflow.strategies.pipeline.split.time.perf_counter", lambda: now[0])

    class Slow(nn.Linear):
        def __init__(self, cost: float) -> None:
            super().__init__(4, 4)
            self.cost = cost

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            now[0] += self.cost
            return super().forward(x)

    layers = [Slow(8.0), Slow(3.0), Slow(3.0), Slow(3.0), Slow(8.0)]
    times = measure_times(layers, torch.randn(2, 4))
    assert times == [8.0, 3.0, 3.0, 3.0, 8.0]
    assert balanced(times, 3) == [range(0, 1), range(1, 4), range(4, 5)]
    with pytest.raises(PipelineError, match="example_input"):
        cf.PipelineStrategy("gpipe", balance="time")
