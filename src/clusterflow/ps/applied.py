"""The split keys a ps task has applied: at most one update per ``(dataset, epoch, split)``.

A split whose worker died before acking it is lent again, under a new lease id but the
same key; its second push must not move the variables again. The set of applied keys
lives in the ps's checkpointed state, so the rule holds across a ps restart too.

Bounded by the splits in flight, not by the run's length: per dataset and epoch the
keys are kept as a *prefix* (every split below it applied) plus the splits applied
beyond it. Splits are lent in a shuffled order, so while an epoch runs its applied
splits are scattered; once all of them are in, the epoch collapses to one number.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

Key = tuple[str, int, int]
"""``(dataset, epoch, split)``: ``clusterflow.data.SplitKey`` as it travels."""


@dataclass(slots=True)
class _Epoch:
    prefix: int = 0
    """Every split below this is applied."""
    extra: set[int] = field(default_factory=set)
    """Applied splits at or above ``prefix``."""

    def has(self, split: int) -> bool:
        return split < self.prefix or split in self.extra

    def add(self, split: int) -> None:
        if self.has(split):
            return
        self.extra.add(split)
        while self.prefix in self.extra:
            self.extra.discard(self.prefix)
            self.prefix += 1


class AppliedKeys:
    """Which split keys were applied; see the module docstring."""

    def __init__(self) -> None:
        self._epochs: dict[tuple[str, int], _Epoch] = {}

    def __contains__(self, key: object) -> bool:
        dataset, epoch, split = _parse(key)
        found = self._epochs.get((dataset, epoch))
        return found is not None and found.has(split)

    def __len__(self) -> int:
        return sum(e.prefix + len(e.extra) for e in self._epochs.values())

    def applied(self, keys: Iterable[Any]) -> list[Key]:
        """The keys of ``keys`` applied already, in their order."""
        return [k for k in (_parse(x) for x in keys) if k in self]

    def add(self, keys: Iterable[Any]) -> None:
        for key in keys:
            dataset, epoch, split = _parse(key)
            self._epochs.setdefault((dataset, epoch), _Epoch()).add(split)

    def to_state(self) -> list[list[Any]]:
        """JSON-able: ``[dataset, epoch, prefix, [extra splits]]`` per epoch seen."""
        return [
            [dataset, epoch, e.prefix, sorted(e.extra)]
            for (dataset, epoch), e in sorted(self._epochs.items())
        ]

    @classmethod
    def from_state(cls, state: Iterable[Sequence[Any]] | None) -> AppliedKeys:
        keys = cls()
        for dataset, epoch, prefix, extra in state or ():
            keys._epochs[(str(dataset), int(epoch))] = _Epoch(int(prefix), {int(s) for s in extra})
        return keys


def _parse(key: Any) -> Key:
    dataset, epoch, split = key
    return str(dataset), int(epoch), int(split)
