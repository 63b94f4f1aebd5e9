"""``TrainingSession``: the order of hook calls, stopping, restoring and a clean exit."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from clusterflow.strategies import Strategy
from clusterflow.strategies.central_storage import CentralStorageStrategy
from clusterflow.train import (
    Hook,
    StepInfo,
    StopAtStep,
    TrainConfigError,
    TrainError,
    TrainingSession,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("bare_env")]


class Recorder(Hook):
    def __init__(self, name: str, calls: list[str], *, fail_in: str = "") -> None:
        self.name, self.calls, self.fail_in = name, calls, fail_in
        self.infos: list[StepInfo] = []
        self.error: BaseException | None = None

    def _call(self, what: str) -> None:
        self.calls.append(f"{self.name}.{what}")
        if what == self.fail_in:
            raise RuntimeError(f"{self.name} failed in {what}")

    def begin(self, session: TrainingSession) -> None:
        self._call("begin")

    def after_step(self, session: TrainingSession, info: StepInfo) -> None:
        self.infos.append(info)
        self._call("after_step")

    def end(self, session: TrainingSession, error: BaseException | None) -> None:
        self.error = error
        self._call("end")


class Restorer(Recorder):
    restores = True

    def __init__(self, step: int, calls: list[str]) -> None:
        super().__init__("restore", calls)
        self.step = step

    def begin(self, session: TrainingSession) -> None:
        super().begin(session)
        session.restored(self.step)


def test_hooks_run_in_order_restoring_first_and_stop_at_step() -> None:
    calls: list[str] = []
    first, restorer = Recorder("a", calls), Restorer(3, calls)
    seen_at_begin: list[int] = []

    class Look(Hook):
        def begin(self, session: TrainingSession) -> None:
            seen_at_begin.append(session.step)

    with TrainingSession(hooks=[first, Look(), restorer, StopAtStep(5)]) as session:
        assert session.step == session.initial_step == 3
        assert session.max_steps == 5
        while not session.should_stop():
            session.step_done(loss=torch.tensor(0.5), samples=4, metrics={"m": torch.tensor(1.0)})
    assert seen_at_begin == [3]  # the other hooks began after the restore
    assert session.step == 5
    assert calls[:2] == ["restore.begin", "a.begin"]
    assert calls[-2:] == ["restore.end", "a.end"]  # in the order they began
    assert calls.count("a.after_step") == 2
    info = first.infos[-1]
    assert info.step == 5 and info.samples == 4
    assert info.loss == 0.5 and info.metrics() == {"m": 1.0}
    assert first.error is None


def test_restored_at_or_past_the_stop_step_takes_no_step() -> None:
    calls: list[str] = []
    with TrainingSession(hooks=[StopAtStep(4), Restorer(4, calls)]) as session:
        assert session.should_stop()


def test_run_step_runs_the_function_and_counts() -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, str]:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss, "extra"

    recorder = Recorder("r", [])
    with TrainingSession(model=model, optimizer=opt, hooks=[recorder]) as session:
        result = session.run_step(step, torch.ones(8, 3))
    assert result[1] == "extra"
    assert session.step == 1
    assert recorder.infos[0].samples == 8
    assert recorder.infos[0].loss == pytest.approx(float(result[0].detach()))


def test_an_error_in_the_loop_ends_every_hook_and_propagates() -> None:
    calls: list[str] = []
    a = Recorder("a", calls, fail_in="end")  # its failure is logged, not raised
    b = Recorder("b", calls)
    with pytest.raises(ValueError, match="boom"), TrainingSession(hooks=[a, b]) as session:
        session.step_done()
        raise ValueError("boom")
    assert calls[-2:] == ["a.end", "b.end"]
    assert isinstance(b.error, ValueError)


def test_a_failing_begin_ends_only_the_hooks_that_began() -> None:
    calls: list[str] = []
    hooks = [Recorder("a", calls), Recorder("b", calls, fail_in="begin"), Recorder("c", calls)]
    with pytest.raises(RuntimeError, match="b failed in begin"), TrainingSession(hooks=hooks):
        pytest.fail("the body must not run")
    assert calls == ["a.begin", "b.begin", "a.end"]


def test_a_hook_failing_at_a_clean_end_is_raised_after_all_ended() -> None:
    calls: list[str] = []
    hooks = [Recorder("a", calls, fail_in="end"), Recorder("b", calls)]
    with pytest.raises(RuntimeError, match="a failed in end"), TrainingSession(hooks=hooks):
        pass
    assert calls[-2:] == ["a.end", "b.end"]


def test_misuse_is_one_clear_error() -> None:
    with pytest.raises(TrainConfigError, match="hooks must be"):
        TrainingSession(hooks=[lambda: None])  # type: ignore[list-item]
    session = TrainingSession()
    with pytest.raises(TrainError, match="inside `with TrainingSession"):
        session.step_done()
    with session:
        pass
    with pytest.raises(TrainError, match="entered once"), session:
        pass
    with pytest.raises(TrainConfigError, match="StopAtStep"):
        StopAtStep(-1)


def test_a_ps_replica_leaves_on_error_and_pulls_values_on_success() -> None:
    strategy = CentralStorageStrategy()
    with strategy.scope():
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)

    def step() -> torch.Tensor:
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    try:
        before = model.weight.detach().clone()
        with TrainingSession(strategy=strategy, model=model, optimizer=opt) as session:
            session.run_step(step)
        # The update was applied on the (in-process) ps; leaving pulled it into the model.
        torch.testing.assert_close(model.weight.detach(), before - 1.0)
        assert strategy._left
    finally:
        strategy.close()

    strategy = CentralStorageStrategy()
    with strategy.scope():
        model = nn.Linear(2, 1)
    try:
        with pytest.raises(KeyError), TrainingSession(strategy=strategy, model=model):
            raise KeyError("x")
        assert strategy._left
    finally:
        strategy.close()


def test_a_model_outside_the_scope_is_refused_on_entering() -> None:
    strategy = CentralStorageStrategy()
    with strategy.scope():
        nn.Linear(2, 2)
    try:
        with (
            pytest.raises(TrainConfigError, match=r"outside strategy\.scope"),
            TrainingSession(strategy=strategy, model=nn.Linear(2, 2)),
        ):
            pass
    finally:
        strategy.close()


class FakeStrategy(Strategy):
    """One replica that is or is not the chief: for hooks that act on the chief alone."""

    def __init__(self, chief: bool) -> None:
        self._chief = chief

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    @property
    def is_chief(self) -> bool:
        return self._chief

    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        return contextlib.nullcontext(self)

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        completes: Any = (),
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


def test_is_chief_follows_the_strategy_else_tf_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TrainingSession().is_chief
    assert not TrainingSession(strategy=FakeStrategy(False)).is_chief
    spec = '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}'
    monkeypatch.setenv("TF_CONFIG", spec)
    assert not TrainingSession().is_chief
