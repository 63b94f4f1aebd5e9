"""What ``fit`` returns: per-epoch figures, shaped like Keras's ``History``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from clusterflow.server import trial_report

__all__ = ["History"]


@dataclass(slots=True)
class History:
    """Per-epoch loss, metrics and validation figures of one ``fit`` call.

    ``history["loss"][i]`` is epoch ``epoch[i]``'s mean training loss over every
    replica's samples; validation figures are named ``val_loss``, ``val_<metric>``. On an
    evaluator task ``epoch`` holds the checkpoint steps evaluated instead.
    """

    epoch: list[int] = field(default_factory=list)
    """Epoch numbers, from 0; a resumed run starts at the epoch it resumed in."""
    history: dict[str, list[float]] = field(default_factory=dict)
    """Figure name -> one value per entry of ``epoch``."""
    step: int = 0
    """The global step when ``fit`` returned."""

    def append(self, epoch: int, logs: Mapping[str, float]) -> None:
        """Adds one epoch's figures; a figure missing from earlier epochs is padded with NaN."""
        for name in logs:
            self.history.setdefault(name, [float("nan")] * len(self.epoch))
        for name, values in self.history.items():
            values.append(float(logs.get(name, float("nan"))))
        self.epoch.append(epoch)
        # Inside a tuning trial every epoch's figures feed the study (and its pruner).
        trial_report.report(step=epoch, **logs)

    def last(self) -> dict[str, float]:
        """The last epoch's figures (empty before any epoch)."""
        return {name: values[-1] for name, values in self.history.items() if values}
