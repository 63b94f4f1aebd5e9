"""A new strategy plugs into ``fit`` and the consistent cut through ``strategies/api.py``
alone: nothing in ``train/`` knows it by type (a pipeline's stages would do this)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from clusterflow.data import SplitKey
from clusterflow.strategies.api import CutRole, Part, ReadPart, Replicas, Strategy, StrategyError
from clusterflow.train import Checkpoint, TrainConfigError, TrainingSession, fit


class Stages(Strategy):
    """A toy two-stage strategy that holds the model's state itself, as pipeline stages
    hold their layers: the cut writes its ``stage-<i>`` parts, not a ``model`` part."""

    def __init__(self, model: nn.Sequential) -> None:
        self.model = model
        self.calls: list[str] = []

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    @property
    def is_chief(self) -> bool:
        return True

    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        return contextlib.nullcontext(self)

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        completes: Sequence[SplitKey] = (),
    ) -> Any:
        result = fn(*args, **(kwargs or {}))
        self._applied_now(completes)
        return result

    def reduce(self, op: Any, value: Any) -> Any:
        return value

    def distribute(
        self, dataset: Iterable[Any], global_batch_size: int | None = None
    ) -> Iterator[Any]:
        return iter(dataset)

    def replicas(self) -> Replicas:
        return Replicas(0, 1, averaged=True, collective=False)

    def check_placed(self, model: nn.Module) -> None:
        if model is not self.model:
            raise StrategyError("the model was not given to Stages")

    def finish(self, error: BaseException | None, leave: bool) -> None:
        self.calls.append("finish")

    def cut_role(self) -> CutRole:
        return CutRole("stages", rank=0, replicas=1, holds_model=True)

    def quiesce(self) -> int | None:
        self.calls.append("quiesce")
        return None

    def parts(self) -> list[Part]:
        return [
            (f"stage-{i}", {"stage": i}, {k: v.detach().clone() for k, v in m.state_dict().items()})
            for i, m in enumerate(self.model)
        ]

    def resume(self) -> None:
        self.calls.append("resume")

    def restore(self, meta: dict[str, Any], read: ReadPart, *, named: bool) -> None:
        for i, stage in enumerate(self.model):
            _, tensors = read(f"stage-{i}")
            stage.load_state_dict(tensors)
        self.calls.append("restore")


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))


def test_a_strategy_checkpoints_and_restores_through_the_contract_alone(tmp_path: Path) -> None:
    x, y = torch.randn(32, 3), torch.randn(32, 1)
    first = model()
    strategy = Stages(first)
    opt = torch.optim.SGD(first.parameters(), lr=0.1)
    fit(first, nn.MSELoss(), opt, (x, y), strategy=strategy, epochs=2,
        global_batch_size=8, hooks=[Checkpoint(tmp_path, every_steps=4)])  # fmt: skip
    assert strategy.calls.count("quiesce") == strategy.calls.count("resume") >= 2
    assert strategy.calls[-1] == "finish"
    newest = sorted(tmp_path.glob("ckpt-*"))[-1]
    manifest = json.loads((newest / "MANIFEST.json").read_text())
    names = set(manifest["parts"])
    assert manifest["meta"]["kind"] == "stages"
    assert {"stage-0", "stage-1"} <= names and "model" not in names

    second = model()
    again = Stages(second)
    with TrainingSession(strategy=again, model=second, hooks=[Checkpoint(tmp_path)]) as s:
        assert s.step == 8  # restored: 2 epochs of 4 steps
    assert "restore" in again.calls
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_strategy_says_whether_the_model_was_built_in_its_scope() -> None:
    strategy = Stages(model())
    with (
        pytest.raises(TrainConfigError, match="TrainingSession: the model was not given"),
        TrainingSession(strategy=strategy, model=nn.Linear(2, 2)),
    ):
        pass
