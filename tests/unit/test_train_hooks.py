"""The hooks: Summary (read back with TensorBoard's reader), Progress, Checkpoint, Evaluate.

``Checkpoint`` runs over the real ``Checkpointer`` with only its write recorded
(``RecordingCheckpointer``), so the save schedule under test is the real one;
``run_evaluator`` over stand-in commits. The real writes are exercised by
tests/unit/test_checkpointer.py and the restart tests in
tests/integration/test_session_in_cluster.py.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_train_session import FakeStrategy
from torch import nn

from clusterflow.train import (
    Checkpoint,
    Evaluate,
    Progress,
    StopAtStep,
    Summary,
    TrainConfigError,
    TrainingSession,
    fit,
    is_evaluator,
    run_evaluator,
)
from clusterflow.train import checkpoint as checkpoint_module
from clusterflow.train import evaluate as evaluate_module
from clusterflow.train.checkpoint import read_final, write_final
from clusterflow.train.cut import Checkpointer

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("bare_env")]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(64, 4, generator=gen), torch.randint(0, 3, (64,), generator=gen)


def _fit(hooks: list[Any], strategy: Any = None, epochs: int = 2) -> Any:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return fit(
        model,
        nn.CrossEntropyLoss(),
        opt,
        _data(),
        strategy=strategy,
        epochs=epochs,
        global_batch_size=16,
        metrics=["accuracy"],
        validation_data=_data(),
        hooks=hooks,
    )


# Summary ---------------------------------------------------------------------------------


def test_summary_event_files_hold_the_scalars(tmp_path: Path) -> None:
    history = _fit([Summary(tmp_path / "logs", every_steps=2)])
    events = EventAccumulator(str(tmp_path / "logs"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "samples_per_s", "lr", "accuracy"} <= tags
    assert {"epoch/loss", "epoch/accuracy", "epoch/val_loss", "epoch/val_accuracy"} <= tags
    assert [e.step for e in events.Scalars("loss")] == [2, 4, 6, 8]
    assert all(e.value == pytest.approx(0.1) for e in events.Scalars("lr"))
    epoch_loss = events.Scalars("epoch/loss")
    assert [e.step for e in epoch_loss] == [4, 8]
    assert [e.value for e in epoch_loss] == pytest.approx(history.history["loss"], rel=1e-6)


def test_summary_on_another_task_creates_nothing(tmp_path: Path) -> None:
    _fit([Summary(tmp_path / "logs")], strategy=FakeStrategy(chief=False))
    assert not (tmp_path / "logs").exists()


# Progress --------------------------------------------------------------------------------


def test_progress_writes_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    _fit([Progress(every_steps=2, stream=out)])
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 2/8 loss ") and "samples/s" in lines[0]
    assert any(line.startswith("epoch 0 loss ") and "val_accuracy" in line for line in lines)
    assert lines[-1].startswith("epoch 1 ")


def test_progress_draws_a_bar_on_a_terminal_and_nothing_off_the_chief() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    _fit([Progress(every_steps=2, stream=out)])
    assert "step 8/8" in out.getvalue() and "samples/s" in out.getvalue()
    quiet = io.StringIO()
    _fit([Progress(stream=quiet)], strategy=FakeStrategy(chief=False))
    assert quiet.getvalue() == ""


def test_hook_settings_are_checked() -> None:
    for make in (
        lambda: Summary("x", every_steps=0),
        lambda: Progress(every_steps=0),
        lambda: Checkpoint(every_steps=0),
        lambda: Checkpoint(every_secs=0),
        lambda: Checkpoint(keep=0),
        lambda: Evaluate("not a function"),  # type: ignore[arg-type]
        lambda: Evaluate(lambda m: {}, poll_s=0),
    ):
        with pytest.raises(TrainConfigError):
            make()


def test_evaluate_is_the_evaluators_one_frozen_config(tmp_path: Path) -> None:
    hook = Evaluate(lambda m: {}, directory=tmp_path, idle_timeout_s=0.0, poll_s=0.01)
    assert (hook.directory, hook.poll_s, hook.stop_file) == (tmp_path, 0.01, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        hook.poll_s = 5.0  # type: ignore[misc]
    with pytest.raises(TypeError, match="positional"):
        Evaluate(lambda m: {}, tmp_path)  # type: ignore[misc]  # only eval_fn by position
    # run_evaluator takes the same keywords, checked the same way.
    with pytest.raises(TrainConfigError, match="poll_s"):
        run_evaluator(nn.Linear(1, 1), lambda m: {}, directory=tmp_path, poll_s=-1)
    with pytest.raises(TypeError, match="pol_s"):
        run_evaluator(nn.Linear(1, 1), lambda m: {}, directory=tmp_path, pol_s=1)


# Checkpoint ------------------------------------------------------------------------------


class RecordingCheckpointer(Checkpointer):
    """The real ``Checkpointer`` (its schedule, ``maybe_save``, decides when to save) with
    its write replaced by a record: ``saved`` is the steps at which a save happened, in
    order, for the tests to compare with literal steps. It decides nothing itself."""

    made: list[RecordingCheckpointer] = []
    restore_step = 0
    """What ``restore`` finds (0: no checkpoint), as a stored checkpoint would give."""

    def __init__(self, strategy: Any, **kwargs: Any) -> None:
        super().__init__(strategy, **kwargs)
        self.kwargs = kwargs
        self.saved: list[int] = []
        self.closed = False
        RecordingCheckpointer.made.append(self)

    def restore(self, *, latest: bool = False) -> int:
        if self.restore_step:
            self.last_saved_step = self.restore_step  # as the real one after a load
        return self.restore_step

    def _save(self, step: int) -> int:
        self.saved.append(step)
        return step

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def recording_checkpointer(monkeypatch: pytest.MonkeyPatch) -> type[RecordingCheckpointer]:
    monkeypatch.setattr(RecordingCheckpointer, "made", [])
    monkeypatch.setattr(checkpoint_module, "open_checkpointer", RecordingCheckpointer)
    return RecordingCheckpointer


def test_checkpoint_saves_on_schedule_and_at_the_end_then_marks_final(
    tmp_path: Path, recording_checkpointer: type[RecordingCheckpointer]
) -> None:
    directory = tmp_path / "ckpt"
    write_final(str(directory), 3)  # an earlier run's marker: cleared on entering
    history = _fit([Checkpoint(directory, every_steps=3, keep=2), StopAtStep(7)])
    (made,) = recording_checkpointer.made
    assert made.kwargs["directory"] == str(directory) and made.kwargs["keep"] == 2
    assert made.saved == [3, 6, 7] and made.closed  # every 3rd step, then the last one
    assert history.step == 7
    assert read_final(str(directory)) == 7


def test_checkpoint_does_not_save_the_last_step_twice(
    tmp_path: Path, recording_checkpointer: type[RecordingCheckpointer]
) -> None:
    _fit([Checkpoint(tmp_path / "ckpt", every_steps=3), StopAtStep(6)])
    (made,) = recording_checkpointer.made
    assert made.saved == [3, 6]  # the schedule saved step 6: the end adds nothing
    assert read_final(str(tmp_path / "ckpt")) == 6


def test_the_final_marker_of_another_cluster_is_not_this_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLUSTERFLOW_CLUSTER_ID", "earlier")
    write_final(str(tmp_path), 36)
    assert read_final(str(tmp_path)) == 36
    monkeypatch.setenv("CLUSTERFLOW_CLUSTER_ID", "later")
    assert read_final(str(tmp_path)) is None  # the continued run is not finished
    monkeypatch.delenv("CLUSTERFLOW_CLUSTER_ID")
    assert read_final(str(tmp_path)) == 36  # outside a cluster, any marker counts
    (tmp_path / "FINAL.json").write_text('{"st')
    assert read_final(str(tmp_path)) is None


def test_checkpoint_saves_nothing_after_an_error(
    tmp_path: Path, recording_checkpointer: type[RecordingCheckpointer]
) -> None:
    hook = Checkpoint(tmp_path / "ckpt", every_steps=10)
    with pytest.raises(RuntimeError), TrainingSession(model=nn.Linear(1, 1), hooks=[hook]) as s:
        s.step_done()
        raise RuntimeError("lost a peer")
    (made,) = recording_checkpointer.made
    assert made.saved == [] and made.closed
    assert read_final(str(tmp_path / "ckpt")) is None


def test_checkpoint_resumes_the_session_at_the_restored_step(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    recording_checkpointer: type[RecordingCheckpointer],
) -> None:
    monkeypatch.setattr(recording_checkpointer, "restore_step", 40)
    monkeypatch.setenv("CLUSTERFLOW_CHECKPOINT_DIR", str(tmp_path / "env-dir"))
    hook = Checkpoint(every_steps=5)
    with TrainingSession(model=nn.Linear(1, 1), hooks=[StopAtStep(47), hook]) as session:
        assert session.step == 40
        while not session.should_stop():
            session.step_done()
    (made,) = recording_checkpointer.made
    assert made.saved == [45, 47]  # counted on from 40: 45 on schedule, 47 at the end
    assert hook.resolved_directory == str(tmp_path / "env-dir")
    assert read_final(str(tmp_path / "env-dir")) == 47


# Evaluate --------------------------------------------------------------------------------


class Commits:
    """A training run as the evaluator sees it: committed steps appear in a folder."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.steps: list[int] = []
        self.restores = 0

    def commit(self, step: int, final: bool = False) -> None:
        # The step is loadable before its file appears, as a real commit's manifest is
        # its last write: an evaluator that sees the file must find the step. (Appended
        # after the write, a poll between the two restored the step before and took the
        # file as seen, so the test waited forever for an evaluation.)
        self.steps.append(step)
        folder = self.directory / f"step-{step}"
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text("{}")
        if final:
            write_final(str(self.directory), step)

    def load(self, model: nn.Module, directory: str) -> int:
        """Stands in for ``load_into``: the newest step's value into the model."""
        assert directory == str(self.directory)
        self.restores += 1
        step = max(self.steps, default=0)
        with torch.no_grad():
            model.weight.fill_(float(step))  # type: ignore[operator]
        return step


def test_run_evaluator_evaluates_each_new_checkpoint_until_the_final_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commits = Commits(tmp_path / "ckpt")
    monkeypatch.setattr(evaluate_module, "load_into", commits.load)
    model = nn.Linear(1, 1)
    modes: list[bool] = []
    evaluated = threading.Condition()

    def eval_fn(m: nn.Module) -> dict[str, float]:
        with evaluated:
            modes.append(m.training)
            evaluated.notify_all()
        return {"w": float(m.weight.detach())}

    def train() -> None:
        # Each checkpoint once the evaluator took the one before: it sees every one,
        # however slowly either thread runs (it may skip ahead only when it lags).
        for n, step in enumerate((10, 20, 30)):
            with evaluated:
                assert evaluated.wait_for(lambda n=n: len(modes) >= n, 10)  # type: ignore[misc]
            commits.commit(step, final=step == 30)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    results = run_evaluator(
        model, eval_fn, directory=tmp_path / "ckpt", log_dir=tmp_path / "eval", poll_s=0.02
    )
    trainer.join(10)
    assert not trainer.is_alive()
    assert [r.step for r in results] == [10, 20, 30]
    assert [r.metrics["w"] for r in results] == [10.0, 20.0, 30.0]
    assert modes == [False, False, False] and model.training
    assert commits.restores <= 6  # only when the folder changed, not every poll
    events = EventAccumulator(str(tmp_path / "eval"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/w")] == [
        (10, 10.0),
        (20, 20.0),
        (30, 30.0),
    ]


def test_run_evaluator_ends_on_a_stop_file_or_when_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    commits = Commits(tmp_path / "ckpt")
    monkeypatch.setattr(evaluate_module, "load_into", commits.load)
    commits.commit(5)
    stop = tmp_path / "stop"
    stop.touch()
    with caplog.at_level(logging.INFO, logger="clusterflow.train.evaluate"):
        results = run_evaluator(
            nn.Linear(1, 1),
            lambda m: {"x": 1.0},
            directory=tmp_path / "ckpt",
            stop_file=stop,
            poll_s=0.01,
        )
    assert [r.step for r in results] == [5]
    assert f"stop file {stop} found" in caplog.text
    caplog.clear()
    # No checkpoint ever comes: it ends on its idle timeout (the test's own timeout is the
    # net for a hang), and says that this is why.
    with caplog.at_level(logging.INFO, logger="clusterflow.train.evaluate"):
        ended = run_evaluator(
            nn.Linear(1, 1),
            lambda m: {},
            directory=tmp_path / "none",
            idle_timeout_s=0.1,
            poll_s=0.01,
        )
    assert ended == []
    assert "the evaluator ends" in caplog.text and "no new checkpoint in" in caplog.text


def test_eval_fn_must_return_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commits = Commits(tmp_path / "ckpt")
    monkeypatch.setattr(evaluate_module, "load_into", commits.load)
    commits.commit(1, final=True)
    with pytest.raises(TrainConfigError, match="mapping of name -> number"):
        run_evaluator(nn.Linear(1, 1), lambda m: 0.5, directory=tmp_path / "ckpt")  # type: ignore[arg-type,return-value]


def test_on_the_evaluator_task_fit_evaluates_instead_of_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commits = Commits(tmp_path / "ckpt")
    monkeypatch.setattr(evaluate_module, "load_into", commits.load)
    commits.commit(8, final=True)
    spec = (
        '{"cluster": {"worker": ["127.0.0.1:1"], "evaluator": ["127.0.0.1:2"]}, '
        '"task": {"type": "evaluator", "index": 0}}'
    )
    monkeypatch.setenv("TF_CONFIG", spec)
    assert is_evaluator()
    hooks = [Evaluate(lambda m: {"w": float(m.weight.sum())}, directory=tmp_path / "ckpt")]
    history = _fit([*hooks, Summary(tmp_path / "never")])
    assert history.epoch == [8] and history.history["w"] == [8.0 * 3 * 4]
    assert not (tmp_path / "never").exists()  # no training, no training summaries
    with TrainingSession(model=nn.Linear(4, 3), hooks=hooks) as session:
        assert session.should_stop() and [e.step for e in session.evaluations] == [8]
    monkeypatch.delenv("TF_CONFIG")
    assert not is_evaluator()
