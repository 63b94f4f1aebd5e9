"""``fit``: Keras's ``model.fit`` for a PyTorch model, under any strategy or none.

The contract, as with ``tf.distribute``: build the strategy, create the model (and
its optimizer) inside ``strategy.scope()``, then call ``fit`` on every task::

    strategy = clusterflow.MultiWorkerMirroredStrategy()   # or none at all
    with strategy.scope():
        model = Net()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    history = clusterflow.fit(model, nn.CrossEntropyLoss(), optimizer, (x, y),
                              strategy=strategy, epochs=5, global_batch_size=256,
                              metrics=["accuracy"])

The same call trains in one process (``strategy=None``) and on every replica of a
cluster. With the same global batches and seed, a synchronous run on ``n`` replicas
(all-reduce, or a sync parameter server) takes the same steps as one process: each
replica computes on its contiguous slice of every global batch and the update averages
the slices (``feed.py`` says how uneven final batches stay exact).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from clusterflow._checks import whole
from clusterflow.strategies.api import ALONE, Strategy
from clusterflow.train.api import Hook, TrainConfigError, TrainError
from clusterflow.train.evaluate import Evaluate, is_evaluator
from clusterflow.train.feed import Feed, Feeder, is_data_client
from clusterflow.train.history import History
from clusterflow.train.metrics import Metric, Totals, reduce_sums, resolve_metrics
from clusterflow.train.session import TrainingSession, checked_strategy

__all__ = ["fit"]

_log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(outputs, targets)``: the batch's mean loss, a one-element tensor."""


def fit(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    data: Any,
    *,
    strategy: Strategy | None = None,
    epochs: int = 1,
    steps_per_epoch: int | None = None,
    global_batch_size: int | None = None,
    validation_data: Any = None,
    metrics: Sequence[str | Metric] = (),
    hooks: Iterable[Hook] | None = (),
    seed: int | None = None,
    shuffle: bool = True,
) -> History:
    """Trains ``model`` on ``data`` for ``epochs`` epochs; returns the per-epoch figures.

    Call on every task with the same arguments. Blocks until training ends: all epochs
    done, the data ran out, or a hook (``StopAtStep``) asked to stop. A ``Checkpoint``
    hook makes the run resumable: a restarted ``fit`` continues from the saved step,
    on the same global batches it would have reached.

    Args:
        model: created inside ``strategy.scope()`` when a strategy is given.
        loss_fn: ``loss_fn(outputs, targets)`` -> the batch's *mean* loss.
        optimizer: the model's optimizer (``optimizer.step()`` is applied by the strategy).
        data: ``(inputs, targets)`` tensors, a map-style ``Dataset`` of such pairs, an
            iterable of ``(inputs, targets)`` global batches, or a data-service client
            whose ``collate_fn`` gives ``(inputs, targets)``. See ``feed.py``.
        strategy: the distribution strategy; None trains in this process alone.
        epochs: passes over the data. With a data-service client: train until its
            batches reach epoch ``epochs``.
        steps_per_epoch: steps an epoch takes at most; needed for a one-pass iterator
            trained for more than one epoch.
        global_batch_size: rows per step over all replicas (default 32 for tensors and
            datasets; for iterables, their batches' size). A multiple of the replicas.
        validation_data: evaluated after every epoch, in the same forms as ``data``
            (not a client). Every replica evaluates it whole, with no collective, so a
            replica that is done early never holds the others.
        metrics: names (``"accuracy"``, ``"mse"``, ``"mae"``) or functions
            ``(outputs, targets) -> batch mean``.
        hooks: ``StopAtStep``, ``Checkpoint``, ``Summary``, ``Progress``, ``Evaluate``, ...
        seed: seeds the per-epoch shuffle of tensors and datasets; every replica must
            draw the same order, so None means 0, never a per-process random seed.
        shuffle: reshuffle tensors and datasets every epoch.

    Returns:
        the ``History``: ``history.history["loss"]`` per epoch, averaged over every
        replica's samples (``strategy.reduce``), and ``val_*`` figures. Parameter-server
        workers share no collective, so each one's History holds its own replica's
        figures. On an evaluator task (with an ``Evaluate`` hook) it trains nothing and
        returns each evaluated checkpoint. A run resumed after its last step trains
        nothing either and returns one entry: the restored model evaluated on ``data``
        (not on a data-service client or a one-pass iterator, whose records are spent)
        and on ``validation_data``.

    Raises:
        TrainConfigError: an argument of the wrong kind or value (the message names it),
            or a model created outside ``strategy.scope()``.
        StrategyError, PeerLost: from the strategy, when a replica fails.
    """
    _check_args(model, loss_fn, optimizer, strategy, epochs, steps_per_epoch, seed)
    named = resolve_metrics(metrics)
    hooks = list(hooks or ())  # None: none, as TensorFlow's hooks=None
    evaluators = [h for h in hooks if isinstance(h, Evaluate)]
    if evaluators and is_evaluator():
        return _evaluate_only(model, evaluators)
    device = _device_of(model)
    feeder = Feeder(
        data,
        strategy.replicas() if strategy is not None else ALONE,
        global_batch_size=global_batch_size,
        shuffle=shuffle,
        seed=seed or 0,
        steps_per_epoch=steps_per_epoch,
        device=device,
    )
    if feeder.one_pass and epochs > 1 and steps_per_epoch is None:
        raise TrainConfigError(
            "data is a one-pass iterator: give steps_per_epoch, or pass a re-iterable "
            "(a list, a DataLoader, a Dataset) to train more than one epoch"
        )
    validation = _validation_feeder(validation_data, global_batch_size, device)
    steps = feeder.steps_in_epoch()
    loop = _Loop(model, loss_fn, optimizer, strategy, named, validation)
    session = TrainingSession(
        strategy=strategy,
        model=model,
        optimizer=optimizer,
        hooks=hooks,
        data=data if feeder.client else None,
        max_steps=None if steps is None or feeder.client else epochs * steps,
        # Replicas fed by the data service end unevenly: sync ps steps must stop
        # waiting for a replica whose data ran out. Otherwise all end on the same step.
        leave_at_end=feeder.client,
        # Each replica reads its own share from the data service, so the loop goes on at
        # another world size; global batches split by rank here would not.
        resizable=feeder.client,
    )
    with session:
        if feeder.client:
            loop.run_client(session, feeder, epochs, steps_per_epoch)
        else:
            loop.run(session, feeder, epochs, steps)
    loop.history.step = session.step
    return loop.history


class _Loop:
    """The epochs of one ``fit`` call; holds what every step needs."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        strategy: Strategy | None,
        metrics: dict[str, Metric],
        validation: Feeder | None,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.strategy = strategy
        self.metrics = metrics
        self.validation = validation
        self.history = History()
        self._client_validation: dict[int, dict[str, float]] = {}
        # A pipeline's schedule runs forward, backward and update itself.
        own = strategy.train_step(model, loss_fn, optimizer) if strategy is not None else None
        self._step_fn = own or self._train_step

    # Synchronized data: every replica takes the same steps ----------------------------

    def run(self, session: TrainingSession, feeder: Feeder, epochs: int, steps: int | None) -> None:
        start = feeder.replicas.own_steps(session.step)
        if steps == 0:
            _log.warning("fit(): the data holds no batch; nothing to train")
            return
        first, done = divmod(start, steps) if steps else (0, start)
        # A one-pass stream restarts from its beginning in a new process: every step
        # already taken is skipped, not only this epoch's.
        skip = start if feeder.one_pass else done
        for epoch in range(first, epochs):
            if session.should_stop():
                break
            totals = Totals(self.metrics)
            ran = False
            for feed in feeder.epoch(epoch, skip=skip, done=done):
                ran = True
                self._step(session, totals, feed)
                if session.should_stop():
                    break
            skip = done = 0
            if not ran:  # the same on every replica: they walk the same global batches
                if epoch == first and start == 0:
                    _log.warning("fit(): the data holds no batch; nothing to train")
                else:
                    _log.warning("fit(): the data ran out before epoch %d", epoch)
                break
            logs = totals.logs(reduce_sums(self.strategy, totals.local()))
            logs.update(self._validate())
            self.history.append(epoch, logs)
            session.epoch_done(epoch, logs)
        if start > 0 and not self.history.epoch:
            self._restored_figures(feeder, min(first, epochs - 1))

    # The data service: replicas end epochs (and the run) at their own pace ------------

    def run_client(
        self,
        session: TrainingSession,
        feeder: Feeder,
        epochs: int,
        steps_per_epoch: int | None,
    ) -> None:
        """Trains on a data-service client's batches.

        Epochs follow the client's (``batch.epoch``), or every ``steps_per_epoch``
        steps. Each replica reads its own batches, so one may run out first; under
        all-reduce the replicas agree before every step whether all of them have one
        (as ``strategy.distribute`` does with a client), and all stop together, so no
        replica waits in a collective its peers never join. The epochs' figures are
        summed across replicas once, at the end. Each step names the splits its batch
        completes; the session acks them once the strategy applied the update and gives
        back those it dropped. Batches read but not trained on are never acked: their
        records go back to the data service.
        """
        lockstep = feeder.replicas.collective and feeder.replicas.count > 1
        sums: dict[int, torch.Tensor] = {}
        epoch, totals = -1, Totals(self.metrics)
        counted = session.step  # steps toward steps_per_epoch epochs
        batches = feeder.client_batches()
        last: list[Feed] = []  # this replica's last batch, for steps it has none in

        def sit_in() -> None:
            """A step of the others' that this replica, without a batch of its own,
            takes part in: its last batch at a loss scale of 0 (nothing of it counts),
            or, if it never read one, a peer's (``session.sit_in_sample``)."""
            if last:
                feed = dataclasses.replace(last[0], loss_scale=0.0)
            elif session.sit_in_sample is not None:
                inputs, targets = session.sit_in_sample
                feed = Feed(inputs, targets, rows=0, loss_scale=0.0, epoch=max(epoch, 0))
            else:  # the boundary sends one before any step this replica has no batch for
                raise TrainError(
                    "fit(): this replica has no batch to take part in its peers' step with"
                )
            self._step(session, None, feed)

        def while_waiting() -> None:
            """Its data client waits for splits still out: its peers may be training
            them, and their steps need this replica (a resizing group only)."""
            verdict = session.boundary(None, None)
            if verdict is not None and verdict[0]:
                sit_in()

        if getattr(self.strategy, "resizes", False):
            session.on_data_wait(while_waiting)
        while not session.should_stop():
            item = next(batches, None)
            number = epochs
            if item is not None:
                number = item[1].epoch if steps_per_epoch is None else counted // steps_per_epoch
            go = number < epochs and item is not None
            if item is not None:
                session.sit_in_sample = (item[1].inputs, item[1].targets)
            verdict = session.boundary(go, item[1].rows if go and item is not None else None)
            if verdict is not None:
                # A group that resizes live agreed (and maybe re-formed) here. It steps
                # while any replica has a batch: one that has none takes part at a loss
                # scale of 0, so the splits the others hold are trained, not left
                # unacked at the end; it waits while one waits for splits still out.
                # The vote weighs each replica by its rows: the update is the mean over
                # the union of the step's batches, however they were cut.
                step, end, scale = verdict
                if end:
                    break
                if not step:
                    continue
                if not go or item is None:
                    sit_in()
                    continue
                batch, feed = item
                feed = dataclasses.replace(feed, loss_scale=scale)
                last[:] = [feed]
            else:
                if lockstep:
                    go = _all_agree(self.strategy, go, feeder.replicas.count)
                if not go or item is None:
                    break
                batch, feed = item
            if number != epoch:
                if epoch >= 0:
                    sums[epoch] = self._end_client_epoch(session, epoch, totals)
                epoch, totals = number, Totals(self.metrics)
            self._step(session, totals, feed, completes=batch)
            counted += 1
        if epoch >= 0:
            sums[epoch] = self._end_client_epoch(session, epoch, totals)
        self._client_history(sums, epochs)
        if session.step > 0 and not self.history.epoch:
            # Resumed after its last step: the client's records are all acked, so only
            # the validation figures of the restored model can be given (the same on
            # every replica: the reduce above left each one the same empty history).
            self.history.append(epochs - 1, self._validate())

    def _end_client_epoch(
        self, session: TrainingSession, epoch: int, totals: Totals
    ) -> torch.Tensor:
        local = totals.local()
        logs = totals.logs(local)
        validation = self._validate()
        self._client_validation[epoch] = validation
        session.epoch_done(epoch, {**logs, **validation})
        return local

    def _client_history(self, sums: dict[int, torch.Tensor], epochs: int) -> None:
        """One reduce of every epoch's sums, of the same shape on every replica."""
        width = 2 + len(self.metrics)
        table = torch.zeros(epochs, width, dtype=torch.float64)
        for epoch, local in sums.items():
            if 0 <= epoch < epochs:
                table[epoch] = local
        summed = reduce_sums(self.strategy, table)
        template = Totals(self.metrics)
        for epoch in range(epochs):
            logs = template.logs(summed[epoch])
            if logs:
                logs.update(self._client_validation.get(epoch, {}))
                self.history.append(epoch, logs)

    # One step, one validation ---------------------------------------------------------

    def _step(
        self, session: TrainingSession, totals: Totals | None, feed: Feed, completes: Any = None
    ) -> None:
        """One step; ``totals`` None: a step this replica takes part in without data
        (its loss scale is 0), counted in no figure."""
        args = (feed.inputs, feed.targets, feed.loss_scale)
        loss, outputs = session.run(self._step_fn, args, completes=completes)
        if totals is None:
            session.step_done(samples=0)
            return
        values = totals.add(loss, outputs, feed.targets, feed.rows)
        session.step_done(loss=loss, samples=feed.rows, metrics=values)

    def _train_step(self, inputs: Any, targets: Any, scale: float) -> tuple[torch.Tensor, Any]:
        self.optimizer.zero_grad(set_to_none=True)
        outputs = self.model(inputs)
        loss = _mean_loss(self.loss_fn(outputs, targets))
        # The scale is 1 except on a final partial batch split unevenly (feed.py).
        torch.autograd.backward(loss * scale if scale != 1.0 else loss)
        self.optimizer.step()
        return loss.detach(), _detach(outputs)

    def _restored_figures(self, feeder: Feeder, epoch: int) -> None:
        """The figures of a run resumed with no step left (it had already finished).

        A caller that runs a finished job again (``start --resume``, or the same script
        with its checkpoint folder) must still get the model's figures, not an empty
        History: the restored model is evaluated on the training data (``loss`` and the
        metrics, summed over the replicas as an epoch's are, with no update) and on the
        validation data, and recorded as ``epoch``. No hook is told: nothing trained,
        so nothing is saved again. A one-pass iterator cannot be read again: only its
        validation figures are given.
        """
        _log.info("fit(): resumed after the run's last step; evaluating the restored model")
        logs: dict[str, float] = {}
        if not feeder.one_pass:
            totals = self._evaluate(feeder.epoch(epoch))
            logs = totals.logs(reduce_sums(self.strategy, totals.local()))
        logs.update(self._validate())
        self.history.append(epoch, logs)

    def _validate(self) -> dict[str, float]:
        if self.validation is None:
            return {}
        totals = self._evaluate(self.validation.epoch(0))
        return totals.logs(totals.local(), prefix="val_")

    @torch.no_grad()
    def _evaluate(self, feeds: Iterable[Feed]) -> Totals:
        """This replica's loss and metric sums over ``feeds``, in eval mode, no update."""
        if self.strategy is not None:
            self.strategy.refresh_model()  # a ps replica's model lags the ps
        totals = Totals(self.metrics)
        training = self.model.training
        self.model.eval()
        try:
            for feed in feeds:
                outputs = self.model(feed.inputs)
                loss = _mean_loss(self.loss_fn(outputs, feed.targets))
                totals.add(loss, outputs, feed.targets, feed.rows)
        finally:
            self.model.train(training)
        return totals


def _all_agree(strategy: Strategy | None, mine: bool, count: int) -> bool:
    """Whether every replica says yes (one small all-reduce; every replica must call it).

    Replicas fed by the data service may run out of batches at different steps; agreeing
    before each step lets all of them stop together instead of leaving some to wait in a
    gradient all-reduce that the others never join.
    """
    if strategy is None or count == 1:
        return mine
    votes = strategy.reduce("sum", torch.tensor([1.0 if mine else 0.0]))
    return bool(float(votes[0]) >= count)


def _evaluate_only(model: nn.Module, evaluators: list[Evaluate]) -> History:
    history = History()
    for hook in evaluators:
        for evaluation in hook.run(model):
            history.append(evaluation.step, evaluation.metrics)
            history.step = evaluation.step
    return history


def _validation_feeder(
    data: Any, global_batch_size: int | None, device: torch.device
) -> Feeder | None:
    if data is None:
        return None
    if is_data_client(data):
        raise TrainConfigError(
            "validation_data cannot be a data-service client: every replica evaluates the "
            "whole validation set; pass tensors, a Dataset or batches"
        )
    return Feeder(
        data,
        ALONE,
        global_batch_size=global_batch_size,
        shuffle=False,
        seed=0,
        steps_per_epoch=None,
        device=device,
        what="validation_data",
    )


def _mean_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TrainConfigError(
            f"loss_fn must return the batch's mean loss as a one-element tensor, got {shape}"
        )
    return loss.reshape(())


def _detach(outputs: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        return outputs.detach()
    if isinstance(outputs, tuple | list):
        return type(outputs)(_detach(o) for o in outputs)
    if isinstance(outputs, dict):
        return {k: _detach(v) for k, v in outputs.items()}
    return outputs


def _device_of(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        if not tensor.is_meta:  # a ps-sharded embedding table's weight (issue 21)
            return tensor.device
    return torch.device("cpu")


def _check_args(
    model: object,
    loss_fn: object,
    optimizer: object,
    strategy: object,
    epochs: object,
    steps_per_epoch: object,
    seed: object,
) -> None:
    if not isinstance(model, nn.Module):
        raise TrainConfigError(
            f"fit() takes a torch.nn.Module as model, got {type(model).__name__}"
        )
    if not callable(loss_fn):
        raise TrainConfigError(
            f"loss_fn must be callable (outputs, targets) -> loss, got {loss_fn!r}"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TrainConfigError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    checked_strategy(strategy)
    whole("epochs", epochs, least=1, error=TrainConfigError)
    if steps_per_epoch is not None:
        whole("steps_per_epoch", steps_per_epoch, least=1, error=TrainConfigError)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TrainConfigError(f"seed must be an integer or None, got {seed!r}")
