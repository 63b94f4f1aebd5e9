"""Metrics by name or function, and the per-epoch sums they are averaged from.

A metric is ``fn(outputs, targets) -> scalar``: the batch's mean, like the loss. An
epoch's figure is the mean over its samples, so every batch counts by its rows; the
sums stay on the device until the epoch ends (one sync per epoch, not per step), and
are summed across replicas in one ``strategy.reduce`` call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from clusterflow.strategies.api import Strategy
from clusterflow.train.api import TrainConfigError

__all__ = ["BUILTIN", "Metric", "Totals", "accuracy", "resolve_metrics"]

Metric = Callable[[Any, Any], Any]
"""``(outputs, targets) -> the batch's mean`` as a tensor or a number."""


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Share of rows whose highest-scoring class is the target.

    Targets are class indices, or one-hot (or soft) rows of the outputs' shape.

    Raises:
        TrainConfigError: outputs are not class scores of shape ``(batch, classes)``.
    """
    if outputs.dim() < 2 or outputs.shape[-1] < 2:
        raise TrainConfigError(
            f'metric "accuracy" takes class scores of shape (batch, classes), got '
            f"{tuple(outputs.shape)}; for other outputs pass a metric function"
        )
    if targets.shape == outputs.shape:
        targets = targets.argmax(dim=-1)
    return (outputs.argmax(dim=-1) == targets).float().mean()


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return torch.nn.functional.mse_loss(outputs.float(), targets.float())


def mae(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean absolute error."""
    return torch.nn.functional.l1_loss(outputs.float(), targets.float())


BUILTIN: Mapping[str, Metric] = {"accuracy": accuracy, "mse": mse, "mae": mae}


def resolve_metrics(metrics: Sequence[str | Metric]) -> dict[str, Metric]:
    """Name -> function for ``metrics``: built-in names, or functions named by ``__name__``.

    Raises:
        TrainConfigError: an unknown name, a reserved or repeated name, or a non-callable.
    """
    if isinstance(metrics, str):
        metrics = [metrics]
    resolved: dict[str, Metric] = {}
    for metric in metrics:
        if isinstance(metric, str):
            fn = BUILTIN.get(metric)
            if fn is None:
                raise TrainConfigError(
                    f"unknown metric {metric!r}; built in: {', '.join(sorted(BUILTIN))}, "
                    "or pass a function (outputs, targets) -> value"
                )
            name = metric
        elif callable(metric):
            fn, name = metric, getattr(metric, "__name__", "") or type(metric).__name__
        else:
            raise TrainConfigError(
                f"a metric is a name or a function (outputs, targets) -> value, got {metric!r}"
            )
        if name in resolved or name == "loss" or name.startswith("val_"):
            raise TrainConfigError(
                f"metric name {name!r} is repeated or reserved (loss, val_*); wrap the "
                "function in one with another __name__"
            )
        resolved[name] = fn
    return resolved


class Totals:
    """Row-weighted sums of the loss and metrics over one epoch on this replica."""

    def __init__(self, metrics: Mapping[str, Metric]) -> None:
        self._metrics = metrics
        self._sums: torch.Tensor | None = None
        self.rows = 0

    def add(self, loss: torch.Tensor, outputs: Any, targets: Any, rows: int) -> dict[str, Any]:
        """Adds one batch of ``rows``; returns its metrics (tensors, not synced)."""
        values = {name: fn(outputs, targets) for name, fn in self._metrics.items()}
        batch = torch.stack(
            [
                torch.as_tensor(v, dtype=torch.float64, device=loss.device).reshape(())
                for v in (loss, *values.values())
            ]
        )
        batch = batch * rows
        self._sums = batch if self._sums is None else self._sums + batch
        self.rows += rows
        return values

    def local(self) -> torch.Tensor:
        """``[rows, loss_sum, metric_sums...]`` of this replica, on the CPU."""
        width = 1 + len(self._metrics)
        sums = torch.zeros(width, dtype=torch.float64) if self._sums is None else self._sums.cpu()
        return torch.cat([torch.tensor([float(self.rows)], dtype=torch.float64), sums])

    def logs(self, summed: torch.Tensor, prefix: str = "") -> dict[str, float]:
        """Means from ``local()`` vectors (summed across replicas or not)."""
        rows = float(summed[0])
        if rows == 0:
            return {}
        names = ["loss", *self._metrics]
        return {f"{prefix}{n}": float(summed[1 + i]) / rows for i, n in enumerate(names)}


def reduce_sums(strategy: Strategy | None, sums: torch.Tensor) -> torch.Tensor:
    """``sums`` added up over the replicas (a collective under all-reduce strategies)."""
    if strategy is None:
        return sums
    reduced = strategy.reduce("sum", sums)
    return reduced if isinstance(reduced, torch.Tensor) else torch.as_tensor(reduced)
