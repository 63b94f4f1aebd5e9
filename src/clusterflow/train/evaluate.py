"""The evaluator task: evaluate each new checkpoint, never holding training back.

TensorFlow's ``evaluator`` job (and Keras's ``SidecarEvaluator``): a side task that
watches the checkpoint directory, loads each newly committed checkpoint into its own
copy of the model and evaluates it. Training tasks never wait on it and never talk to
it; all it shares with them is the directory. It ends once the checkpoint the chief
marked as the run's last (``FINAL.json``, written by the ``Checkpoint`` hook when the
run finishes) is evaluated, or on a stop file, a stop condition or an idle timeout::

    if clusterflow.train.is_evaluator():      # TF_CONFIG task type "evaluator"
        run_evaluator(Net(), lambda m: {"accuracy": accuracy(m, test_set)},
                      directory="ckpt")
        sys.exit()

Or pass ``Evaluate(eval_fn, directory=...)`` among the hooks of ``fit`` or a
``TrainingSession`` on every task: on training tasks it does nothing, and on the
evaluator task the session evaluates instead of training.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from clusterflow._checks import seconds
from clusterflow.cluster import TFConfig
from clusterflow.train.api import Hook, TrainConfigError
from clusterflow.train.checkpoint import read_final, resolve_directory
from clusterflow.train.cut import load_into

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["Evaluate", "Evaluation", "is_evaluator", "run_evaluator"]

_log = logging.getLogger(__name__)

EvalFn = Callable[[nn.Module], Mapping[str, float]]
"""``eval_fn(model) -> {"accuracy": 0.97, ...}``, the model holding a checkpoint's values."""


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One evaluated checkpoint."""

    step: int
    metrics: dict[str, float]


def is_evaluator(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is the cluster's evaluator task (``TF_CONFIG`` task type)."""
    config = TFConfig.from_env(os.environ if environ is None else environ)
    return config is not None and config.task is not None and config.task.job == "evaluator"


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Evaluate(Hook):
    """Evaluates each new checkpoint on the evaluator task; inert on training tasks.

    Its fields are the evaluator's whole configuration: ``run_evaluator`` takes the
    same keywords. ``eval_fn`` alone may be given by position.

    Raises:
        TrainConfigError: ``eval_fn`` is not callable or ``poll_s`` is not positive.
    """

    eval_fn: EvalFn = field(kw_only=False)
    """``eval_fn(model) -> {name: value}``, called in eval mode, without gradients."""
    directory: str | os.PathLike[str] | None = None
    """The checkpoint directory the training run writes (``Checkpoint``'s)."""
    log_dir: str | os.PathLike[str] | None = None
    """TensorBoard directory for the results (``eval/<name>`` at each step)."""
    poll_s: float = 1.0
    """Seconds between looks at the directory: a listing of a few small folders."""
    stop_file: str | os.PathLike[str] | None = None
    """End when this file exists."""
    should_stop: Callable[[], bool] | None = None
    """End when this returns True (checked every poll)."""
    idle_timeout_s: float | None = None
    """End when no new checkpoint came for this long."""

    def __post_init__(self) -> None:
        if not callable(self.eval_fn):
            raise TrainConfigError(
                f"Evaluate needs a function eval_fn(model), got {self.eval_fn!r}"
            )
        seconds("poll_s", self.poll_s, error=TrainConfigError)
        if self.idle_timeout_s is not None:
            seconds("idle_timeout_s", self.idle_timeout_s, zero=True, error=TrainConfigError)

    def run(self, model: nn.Module) -> list[Evaluation]:
        """Evaluates every newly committed checkpoint in ``directory`` until the run ends.

        Blocks, polling the directory every ``poll_s`` seconds, until the checkpoint
        marked final has been evaluated, ``stop_file`` exists, ``should_stop()`` is
        True, or no new checkpoint came for ``idle_timeout_s``. A checkpoint committed
        while another was being evaluated is not queued: the newest is evaluated next
        (as TensorFlow's evaluator skips to the latest).

        Returns:
            the evaluations, in step order.

        Raises:
            TrainConfigError: ``eval_fn`` returned something other than a mapping of
                numbers.
        """
        folder = resolve_directory(self.directory)
        watcher = _Watcher(folder)
        writer: SummaryWriter | None = None
        results: list[Evaluation] = []
        last = 0
        idle_since = time.monotonic()
        try:
            while True:
                final = read_final(folder)
                if watcher.changed() or (final is not None and last < final):
                    # The newest checkpoint of any strategy (parameter-server shards are
                    # joined), not the one a restarted incarnation was told to resume from.
                    step = load_into(model, folder)
                    if step > last:
                        metrics = _evaluate(model, self.eval_fn, step)
                        results.append(Evaluation(step, metrics))
                        _log.info("evaluated step %d: %s", step, _format(metrics))
                        if self.log_dir is not None:
                            writer = writer or _writer(self.log_dir)
                            for name, value in metrics.items():
                                writer.add_scalar(f"eval/{name}", value, step)
                            writer.flush()
                        last, idle_since = step, time.monotonic()
                        final = read_final(folder)
                if final is not None and last >= final:
                    _log.info("evaluated the run's final checkpoint (step %d)", final)
                    break
                if self.stop_file is not None and os.path.exists(self.stop_file):
                    _log.info("stop file %s found: the evaluator ends", self.stop_file)
                    break
                if self.should_stop is not None and self.should_stop():
                    break
                idle = self.idle_timeout_s
                if idle is not None and time.monotonic() - idle_since > idle:
                    _log.warning(
                        "no new checkpoint in %s for %.0f s: the evaluator ends", folder, idle
                    )
                    break
                time.sleep(self.poll_s)
        finally:
            if writer is not None:
                writer.close()
        return results


def run_evaluator(model: nn.Module, eval_fn: EvalFn, **options: Any) -> list[Evaluation]:
    """``Evaluate(eval_fn, **options).run(model)``: the evaluator loop, outside a session.

    Takes the keywords of :class:`Evaluate` (``directory``, ``log_dir``, ``poll_s``,
    ``stop_file``, ``should_stop``, ``idle_timeout_s``) and blocks as its ``run`` does.

    Raises:
        TrainConfigError: as :class:`Evaluate` and its ``run``.
        TypeError: a keyword that is not a field of :class:`Evaluate`.
    """
    return Evaluate(eval_fn, **options).run(model)


def _evaluate(model: nn.Module, eval_fn: EvalFn, step: int) -> dict[str, float]:
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            metrics = eval_fn(model)
    finally:
        model.train(training)
    if not isinstance(metrics, Mapping):
        raise TrainConfigError(
            f"eval_fn must return a mapping of name -> number, got {type(metrics).__name__}"
        )
    try:
        return {str(name): float(value) for name, value in metrics.items()}
    except (TypeError, ValueError) as exc:
        raise TrainConfigError(f"eval_fn returned a value that is not a number: {exc}") from None


def _format(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{name} {value:.4g}" for name, value in metrics.items())


def _writer(log_dir: str | os.PathLike[str]) -> SummaryWriter:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(os.fspath(log_dir))


class _Watcher:
    """Tells whether anything under the checkpoint directory changed since the last look.

    Cheaper than restoring to find out: a listing of a few small folders per poll,
    and the restore runs only when a file came, went or grew.
    """

    def __init__(self, directory: str) -> None:
        from fsspec.core import url_to_fs  # type: ignore[import-untyped]

        self._fs, self._path = url_to_fs(directory)
        self._seen: Any = None

    def changed(self) -> bool:
        try:
            found = self._fs.find(self._path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            found = {}
        snapshot = sorted((name, info.get("size")) for name, info in found.items())
        if snapshot == self._seen:
            return False
        self._seen = snapshot
        return bool(snapshot)
