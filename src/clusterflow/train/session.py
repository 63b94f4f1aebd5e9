"""``TrainingSession``: a custom training loop with restore, hooks and a clean exit.

TensorFlow's ``MonitoredTrainingSession`` for a PyTorch loop. Entering restores the
newest checkpoint (through a ``Checkpoint`` hook) and begins the hooks; each
``step_done`` (or ``run_step``) counts a step and drives the hooks, which save on
schedule, write summaries and request a stop; leaving ends the hooks and lets the
strategy go, also when the loop raised::

    with strategy.scope():
        model = Net()
        optimizer = torch.optim.Adam(model.parameters())
    hooks = [StopAtStep(1000), Checkpoint("ckpt", every_steps=100), Summary("logs")]
    with TrainingSession(strategy=strategy, model=model, optimizer=optimizer,
                         hooks=hooks) as session:
        while not session.should_stop():       # session.step: restored, then counted
            x, y = next(batches)
            session.run_step(train_step, x, y)  # strategy.run, then the hooks

With a data-service client, give it to the session (``data=client``) and pass each
batch as ``completes=batch``: the session then acks each split once its update is
applied and gives back the splits whose update was dropped (docs/failure-semantics.md)::

    with TrainingSession(strategy=strategy, model=model, data=client, hooks=hooks) as s:
        for batch in client:
            s.run_step(train_step, batch.data["x"], batch.data["y"], completes=batch)

Every task runs the same loop and calls the same hooks in the same order: checkpoints
are cut across tasks, so a hook that acts on the chief alone decides that itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from clusterflow._checks import whole
from clusterflow.cluster import TFConfig
from clusterflow.data.api import SplitKey
from clusterflow.strategies.api import Settled, Strategy, StrategyError
from clusterflow.strategies.batches import batch_size_of
from clusterflow.train.api import Hook, StepInfo, TrainConfigError, TrainError
from clusterflow.train.evaluate import Evaluate, Evaluation, is_evaluator
from clusterflow.train.meter import Throughput
from clusterflow.train.report import flush as flush_report
from clusterflow.train.report import report
from clusterflow.train.stop import StopAtStep

__all__ = ["TrainingSession"]

_log = logging.getLogger(__name__)


def checked_strategy(strategy: object) -> Strategy | None:
    """``strategy`` if it is a clusterflow ``Strategy`` or None: a strategy's name (say
    ``"mirrored"``) would otherwise fail with an ``AttributeError`` at its first use.

    Raises:
        TrainConfigError: naming the type given.
    """
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TrainConfigError(
            f"strategy must be a clusterflow Strategy or None, got {type(strategy).__name__}"
        )
    return strategy


class TrainingSession:
    """A training run's context: restores, counts steps, drives hooks, closes cleanly.

    Args:
        strategy: the distribution strategy (None: a plain single process).
        model: the model (created in ``strategy.scope()``); checkpointed by
            ``Checkpoint`` and evaluated by ``Evaluate``.
        optimizer: its optimizer; checkpointed with it.
        hooks: called in order (restoring hooks begin first).
        data: a data-service client, whose cursor goes into checkpoints. Steps given
            ``completes=`` ack its splits through it once their update is applied.
        state: more objects with ``state_dict``/``load_state_dict`` to checkpoint
            (an lr scheduler, a step counter of your own).
        max_steps: the run's length when known: shown by ``Progress``. ``StopAtStep``
            hooks set it too.
        leave_at_end: a parameter-server replica leaves the sync steps on exit (its
            data ran out, so the others must stop waiting for it). ``fit`` turns it off
            when every replica runs the same steps anyway.
        report_figures: send step, loss and samples/s to the cluster manager.
        resizable: the loop can go on at another world size, so an all-reduce group in
            an elastic cluster resizes live at step boundaries (``strategy.boundary``,
            run by ``run`` or by ``fit``). ``fit`` turns it off for data it splits by
            rank itself (tensors, datasets, batches).

    Raises:
        TrainConfigError: a hook is not a ``Hook``, or (on entering) the model was not
            created in ``strategy.scope()``.
    """

    def __init__(
        self,
        *,
        strategy: Strategy | None = None,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        hooks: Iterable[Hook] | None = (),
        data: Any = None,
        state: Mapping[str, Any] | None = None,
        max_steps: int | None = None,
        leave_at_end: bool = True,
        report_figures: bool = True,
        resizable: bool = True,
    ) -> None:
        self.strategy = checked_strategy(strategy)
        self.model = model
        self.optimizer = optimizer
        self.data = data
        self.state: dict[str, Any] = dict(state or {})
        if max_steps is not None:
            whole("max_steps", max_steps, least=1, error=TrainConfigError)
        self.hooks = list(hooks or ())  # None: none, as TensorFlow's hooks=None
        for hook in self.hooks:
            if not isinstance(hook, Hook):
                raise TrainConfigError(
                    f"hooks must be clusterflow.train.Hook instances, got {type(hook).__name__}"
                )
        stops = [h.last_step for h in self.hooks if isinstance(h, StopAtStep)]
        limits = [s for s in (max_steps, *stops) if s is not None]
        self.max_steps: int | None = min(limits) if limits else None
        self.evaluations: list[Evaluation] = []
        """On an evaluator task: what the ``Evaluate`` hooks evaluated."""
        self.sit_in_sample: Any = None
        """A batch's ``(inputs, targets)`` this replica can take part in its peers'
        steps with when it has no batch of its own (at a loss scale of 0, so nothing of
        it counts): ``fit`` sets it from each batch it reads; a group that resizes live
        sends one from a peer to a replica that never had one (a newcomer that joined
        once every split was lent out), at the boundary (``Strategy.boundary``)."""
        self._leave = leave_at_end
        self._report = report_figures
        self._resizable = resizable
        self._bounded = -1  # the step whose boundary ran (fit runs it with its vote)
        self._partial: set[int] = set()  # leases with records trained, not completed
        self._data_wait: Callable[[], None] | None = None
        self._step = 0
        self._initial_step = 0
        self._stop = False
        self._state = "new"
        self._begun: list[Hook] = []
        self._meter = Throughput()
        self._keyed = False  # a step named the splits it completes: the session acks
        self._local_keys: list[SplitKey] = []  # applied without a strategy

    # Who and where -------------------------------------------------------------------

    @property
    def is_chief(self) -> bool:
        """Whether this task writes what only one task writes (summaries, progress)."""
        if self.strategy is not None:
            return self.strategy.is_chief
        config = TFConfig.from_env(os.environ)
        if config is None or config.task is None:
            return True
        return config.cluster.is_chief(config.task)

    @property
    def step(self) -> int:
        """Steps done: the restored step, plus one per ``step_done``."""
        return self._step

    @property
    def initial_step(self) -> int:
        """The step the run started (or resumed) from."""
        return self._initial_step

    def restored(self, step: int) -> None:
        """Sets the step the run resumes from; for restoring hooks, in ``begin``."""
        if self._state != "entering":
            raise TrainError("restored() is for hooks restoring a checkpoint in begin()")
        if step > self._step:
            self._step = self._initial_step = int(step)

    # The loop's side -----------------------------------------------------------------

    def should_stop(self) -> bool:
        """Whether the loop should end: a hook (``StopAtStep``) or the loop asked."""
        return self._stop

    def request_stop(self) -> None:
        """Asks the loop to end after the current step; ``should_stop()`` turns True."""
        self._stop = True

    def run_step(
        self,
        fn: Callable[..., Any],
        *args: Any,
        samples: int | None = None,
        completes: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Runs one step ``fn(*args, **kwargs)`` (through ``strategy.run``), then ``step_done``.

        The step's loss, for the hooks, is ``fn``'s result when that is a number or a
        one-element tensor (or the first element of a tuple, or ``result["loss"]``).
        ``samples`` defaults to the leading size of the first tensor argument.
        ``completes``: the data-service ``Batch`` the step trains on (or its ``keys``);
        see :meth:`run`.

        Returns:
            what ``fn`` returned.
        """
        self._require_open("run_step")
        result = self.run(fn, args, kwargs, completes=completes)
        if samples is None and args:
            try:
                samples = batch_size_of(args[0])
            except Exception:
                samples = None
        self.step_done(loss=_loss_of(result), samples=samples)
        return result

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        completes: Any = None,
    ) -> Any:
        """Runs ``fn`` as one step through the strategy (or directly), without the hooks.

        Call ``step_done`` after it. ``completes`` is the data-service ``Batch`` whose
        records the step trains on (or the ``SplitKey`` values it completes): the
        session acks those splits through ``data`` once the update is applied, and
        gives back those whose update was dropped. Acking is then the session's, not
        ``next()``'s.

        Raises:
            TrainConfigError: ``completes`` is given but the session has no ``data``.
        """
        self._require_open("run")
        if self.strategy is not None and self._bounded != self._step:
            self.boundary(True, None)  # a custom loop: the membership may change here
        keys = _keys_of(completes)
        if keys and not self._keyed:
            self._take_over_acks()
        if self.strategy is not None:
            if keys:
                result = self.strategy.run(fn, args, kwargs, completes=keys)
            else:
                result = self.strategy.run(fn, args, kwargs)
            self._trained(completes)
            return result
        result = fn(*args, **(kwargs or {}))
        self._local_keys.extend(keys)
        return result

    @property
    def holds_partial_splits(self) -> bool:
        """Whether a split this replica holds has records trained and records not: a
        replica that left now would give it back whole, and its trained records would
        be trained again by whoever it is lent to (a leaving replica waits for this to
        turn false, a few steps at most)."""
        return bool(self._partial)

    def _trained(self, completes: Any) -> None:
        """Tracks the leases a ``Batch`` trained part of (known only from a ``Batch``)."""
        leases = getattr(completes, "leases", None)
        done = getattr(completes, "completes", None)
        if isinstance(leases, tuple) and isinstance(done, tuple):
            self._partial.update(leases)
            self._partial.difference_update(done)

    def _take_over_acks(self) -> None:
        if self.data is None or not hasattr(self.data, "ack_keys"):
            raise TrainConfigError(
                "a step completes data-service splits, but the TrainingSession has no "
                "data client to ack them: pass data=client to TrainingSession"
            )
        self._keyed = True
        resizes = bool(getattr(self.strategy, "resizes", False))
        self.data.manual_acks(on_wait=self._settle_all, every_s=0.05 if resizes else None)

    def on_data_wait(self, take_part: Callable[[], None]) -> None:
        """``take_part`` runs (on the loop's thread) while this replica's data client
        waits for splits still out, every 50 ms: a resizing all-reduce replica takes
        part in its peers' steps there (``fit`` sets it), since they may hold the very
        splits it waits for.

        The client calls back only once the session took over its acks, which a step
        that completes splits does; a replica that waits before its first step (a
        newcomer that joined once every split was lent out) would block in the client
        while its peers wait for its vote, so the session takes them over here.
        """
        self._data_wait = take_part
        if not self._keyed and self.data is not None and hasattr(self.data, "ack_keys"):
            self._take_over_acks()

    def _settle_all(self) -> None:
        """Waits until every step run so far is decided, then acks or gives back."""
        self._settle(wait=True)
        if self._data_wait is not None:
            self._data_wait()

    def _settle(self, *, wait: bool) -> None:
        """Acks the splits whose update is applied; gives back those dropped."""
        if not self._keyed:
            return
        settled = (
            self.strategy.settled(wait=wait)
            if self.strategy is not None
            else Settled(applied=tuple(self._local_keys))
        )
        self._local_keys = []
        if settled.applied:
            self.data.ack_keys(settled.applied)
        if settled.dropped:
            self.data.release_keys(settled.dropped)

    def boundary(self, go: bool | None, rows: int | None) -> tuple[bool, bool, float] | None:
        """The step boundary before the next ``run``, where the strategy resizes live
        (its group may re-form here): ``(step, end, loss scale)`` (``Strategy.boundary``;
        ``go``: this replica has a batch, its data ended, or None: it waits for splits
        still out). None where the strategy does not resize.

        ``fit`` calls it with its batch's ``rows``; ``run`` calls it itself otherwise.
        """
        self._require_open("boundary")
        if self.strategy is None:
            return None
        verdict = self.strategy.boundary(self, go, rows)
        self._bounded = self._step
        return verdict

    def step_done(
        self,
        *,
        loss: Any = None,
        samples: int | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> None:
        """Counts a finished step and drives the hooks (save on schedule, stop, summaries).

        Call once per step on every task, after the update (``optimizer.step()``).

        Args:
            loss: the step's loss: a float or tensor (read only if a hook wants it).
            samples: samples this replica trained on (for samples/s).
            metrics: per-step metrics, name -> float or tensor (written by ``Summary``).
        """
        self._require_open("step_done")
        # Before the hooks: a checkpoint cut at this step holds the acks of its updates.
        self._settle(wait=False)
        self._step += 1
        rate = self._meter.add(samples) if samples is not None else None
        info = StepInfo(self._step, samples, rate, loss, dict(metrics or {}))
        for hook in self._begun:
            hook.after_step(self, info)
        if self._report:
            report(step=self._step, loss=loss, samples_per_s=rate)

    def epoch_done(self, epoch: int, logs: Mapping[str, float]) -> None:
        """Tells the hooks an epoch ended, with its figures (``fit`` calls it)."""
        self._require_open("epoch_done")
        for hook in self._begun:
            hook.after_epoch(self, epoch, logs)

    # Entering and leaving ------------------------------------------------------------

    def __enter__(self) -> TrainingSession:
        if self._state != "new":
            raise TrainError("a TrainingSession is entered once; make a new one per run")
        self._state = "entering"
        evaluators = [h for h in self.hooks if isinstance(h, Evaluate)]
        if evaluators and is_evaluator():
            return self._evaluate(evaluators)
        try:
            if self.model is not None:
                _check_placed(self.strategy, self.model)
            ordered = [h for h in self.hooks if h.restores] + [
                h for h in self.hooks if not h.restores
            ]
            for hook in ordered:
                hook.begin(self)
                self._begun.append(hook)
            if self.strategy is not None:
                # After the restoring hooks: a worker added to a running group receives
                # the survivors' model, optimizer and step here, over any checkpoint.
                self.strategy.begin_session(self, resizable=self._resizable)
        except BaseException as exc:
            self._close(exc)
            raise
        self._state = "open"
        if self._initial_step:
            _log.info("resuming from step %d", self._initial_step)
        self._meter.restart()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state == "evaluated":
            self._state = "closed"
            return
        self._close(exc)

    def _close(self, error: BaseException | None) -> None:
        """Ends the begun hooks (in order), then lets the strategy go.

        With ``error`` set, failures here are logged rather than raised, so the loop's
        own error is the one that propagates. Without, the first failure is raised once
        every hook has ended.
        """
        self._state = "closing"
        failure: BaseException | None = None
        for hook in self._begun:
            try:
                hook.end(self, error)
            except Exception as exc:
                if error is not None:
                    _log.warning("%s.end() failed after an error: %s", type(hook).__name__, exc)
                elif failure is None:
                    failure = exc
        try:
            if self.strategy is not None:
                self.strategy.finish(error or failure, self._leave)
        except Exception as exc:
            if failure is None:
                failure = exc
        try:
            # The last steps' splits: acked once applied, so no record is lost or redone.
            self._settle(wait=error is None and failure is None)
        except Exception as exc:
            if error is None and failure is None:
                failure = exc
            else:
                _log.warning("could not settle the last steps' data splits: %s", exc)
        self._state = "closed"
        if self._report:
            # The rate limit holds back all but one report a second: the last step's
            # figures are sent now, or a short run would show its first ones for good.
            flush_report()
        if failure is not None and error is None:
            raise failure

    def _evaluate(self, evaluators: list[Evaluate]) -> TrainingSession:
        """On the evaluator task: evaluates checkpoints until the run ends; trains nothing."""
        if self.model is None:
            raise TrainConfigError("on the evaluator task, an Evaluate hook needs the model")
        for hook in evaluators:
            self.evaluations.extend(hook.run(self.model))
        self._stop = True
        self._state = "evaluated"
        return self

    def _require_open(self, what: str) -> None:
        if self._state != "open":
            raise TrainError(f"{what}() is called inside `with TrainingSession(...)` only")


def _check_placed(strategy: Strategy | None, model: nn.Module) -> None:
    """The strategy's ``check_placed``, as the session's configuration error."""
    if strategy is None:
        return
    try:
        strategy.check_placed(model)
    except StrategyError as exc:
        raise TrainConfigError(f"TrainingSession: {exc}") from exc


def _keys_of(completes: Any) -> tuple[SplitKey, ...]:
    """The split keys of a ``Batch``, or the keys as given."""
    if completes is None:
        return ()
    keys = getattr(completes, "keys", completes)
    if not isinstance(keys, Sequence) or isinstance(keys, str):
        raise TrainConfigError(
            f"completes takes a data-service Batch or its keys, got {type(completes).__name__}"
        )
    return tuple(keys)


def _loss_of(result: Any) -> Any:
    if isinstance(result, Mapping):
        result = result.get("loss")
    elif isinstance(result, tuple | list) and result:
        result = result[0]
    if isinstance(result, torch.Tensor):
        return result.detach() if result.numel() == 1 else None
    if isinstance(result, int | float) and not isinstance(result, bool):
        return result
    return None
