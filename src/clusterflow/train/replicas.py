"""What the training loop needs to know about a strategy, in one place.

``fit`` and ``TrainingSession`` take any strategy (or none); the few places where the
engines differ (who this replica is, whether an update averages the replicas, how a
model shows it was created in ``scope()``, how a replica leaves) are answered here, so
the loop itself has no branch per strategy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from clusterflow.strategies.api import Strategy
from clusterflow.train.api import TrainConfigError

if TYPE_CHECKING:
    from clusterflow.strategies.mirrored import CollectiveAllReduceStrategy
    from clusterflow.strategies.parameter_server import ParameterServerStrategy

__all__ = ["Replicas", "all_agree", "check_placed", "finish", "replicas_of", "sync_model"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Replicas:
    """This process's place among the replicas that share each global batch."""

    rank: int
    """Which slice of every global batch this replica takes."""
    count: int
    """Replicas the global batch is split across."""
    averaged: bool
    """Whether one update is the mean of exactly these ``count`` replicas' gradients.
    Then an uneven split (a final partial batch) is corrected by scaling each replica's
    loss by its share, as TensorFlow's ``compute_average_loss`` divides by the global
    batch size; async updates and sync steps with backup workers are not a mean over
    the split, so their losses are left alone."""
    collective: bool
    """Whether replicas meet in collectives (all-reduce), so all must make the same calls."""
    independent_steps: bool = False
    """Whether each replica's update is a global step of its own (async parameter
    servers): a restored global step then stands for about ``1/count`` of it per replica."""

    def own_steps(self, global_step: int) -> int:
        """Steps this replica took of ``global_step``: where its data resumes."""
        return global_step // self.count if self.independent_steps else global_step


def replicas_of(strategy: Strategy | None) -> Replicas:
    """This replica's rank and the split of each global batch under ``strategy``."""
    mirrored = _collective(strategy)
    if mirrored is not None:
        return Replicas(mirrored.rank, mirrored.num_replicas_in_sync, True, True)
    ps = _parameter_server(strategy)
    if ps is not None:
        config = ps.config
        averaged = config.mode == "sync" and config.backup_workers == 0
        independent = config.mode == "async"
        return Replicas(ps.worker_index, config.num_replicas, averaged, False, independent)
    # No strategy, or one of the user's own: every replica walks the whole data (the
    # user's strategy.distribute() is not ours to second-guess).
    return Replicas(0, 1, True, False)


def check_placed(strategy: Strategy | None, model: nn.Module, who: str) -> None:
    """Fails unless ``model``'s variables were created in ``strategy.scope()``.

    A model built outside the scope would train, but wrongly: under all-reduce its
    gradients are never averaged (the replicas drift apart), under a parameter server
    its updates stay local. TensorFlow users write ``with strategy.scope(): model = ...``;
    this makes forgetting it an error at the start instead of a silent divergence.

    Raises:
        TrainConfigError: the model was not created in the strategy's scope.
    """
    if strategy is None:
        return
    mirrored = _collective(strategy)
    if mirrored is not None:
        from clusterflow.strategies.module_scope import is_prepared

        if not is_prepared(model):
            raise TrainConfigError(
                f"{who}: the model was created outside strategy.scope(); build it inside "
                "`with strategy.scope():` (or call strategy.prepare(model) before the "
                "optimizer)"
            )
        return
    ps = _parameter_server(strategy)
    if ps is not None:
        outside = ps.unplaced(model)
        if outside:
            raise TrainConfigError(
                f"{who}: the model's parameters ({', '.join(outside[:3])}"
                f"{', ...' if len(outside) > 3 else ''}) were created outside "
                "strategy.scope(); build the model inside `with strategy.scope():`, so its "
                "variables live on the parameter servers"
            )


def sync_model(strategy: Strategy | None) -> None:
    """Makes the local model hold the shared parameters' newest values.

    Only a parameter-server replica holds stale values (the ps applied its last
    update after the last pull); all-reduce replicas are always current.
    """
    ps = _parameter_server(strategy)
    if ps is not None:
        ps.pull_values()


def all_agree(strategy: Strategy | None, mine: bool, count: int) -> bool:
    """Whether every replica says yes (one small all-reduce; every replica must call it).

    Replicas fed by the data service may run out of batches at different steps; agreeing
    before each step lets all of them stop together instead of leaving some to wait in a
    gradient all-reduce that the others never join.
    """
    if strategy is None or count == 1:
        return mine
    votes = strategy.reduce("sum", torch.tensor([1.0 if mine else 0.0]))
    return bool(float(votes[0]) >= count)


def finish(strategy: Strategy | None, *, error: BaseException | None, leave: bool) -> None:
    """What a replica does with its strategy when its training run ends.

    On error a replica drops out at once, so no peer waits on it until a deadline: a
    parameter-server replica leaves the sync steps, an all-reduce replica leaves its
    group. Without error a parameter-server replica leaves when ``leave`` (its data ran
    out: sync steps stop waiting for it), then pulls the final values into its model.
    Errors here are logged, not raised: the run itself is over.
    """
    ps = _parameter_server(strategy)
    if ps is not None:
        try:
            if error is not None or leave:
                ps.leave()
            if error is None:
                ps.pull_values()
        except Exception as exc:
            if error is None:
                raise
            _log.warning("could not leave the parameter servers after an error: %s", exc)
        return
    mirrored = _collective(strategy)
    if mirrored is not None and error is not None:
        try:
            mirrored.shutdown()
        except Exception as exc:
            _log.warning("could not leave the all-reduce group after an error: %s", exc)


def _collective(strategy: Strategy | None) -> CollectiveAllReduceStrategy | None:
    if strategy is None:
        return None
    from clusterflow.strategies.mirrored import CollectiveAllReduceStrategy

    return strategy if isinstance(strategy, CollectiveAllReduceStrategy) else None


def _parameter_server(strategy: Strategy | None) -> ParameterServerStrategy | None:
    if strategy is None:
        return None
    from clusterflow.strategies.parameter_server import ParameterServerStrategy

    return strategy if isinstance(strategy, ParameterServerStrategy) else None
