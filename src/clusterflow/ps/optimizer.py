"""The worker's optimizer, rebuilt on the ps and applied there to its shards.

The user builds ``torch.optim.Adam(model.parameters(), lr=...)`` as usual. The strategy
describes it as an ``OptimizerSpec``: the class name and, per param group, its scalar
hyper-parameters. The ps builds the same torch optimizer over its shards, so the update
math is torch's own, and slot state (momentum, Adam moments) lives next to the shards.
Each push carries the groups' current hyper-parameters, so a learning-rate schedule
stepped on the worker takes effect on the ps.

Only element-wise optimizers can be sharded this way (their update of an element
depends on that element alone); LBFGS, which needs a closure, is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clusterflow.errors import ConfigError

if TYPE_CHECKING:
    import torch

SUPPORTED = frozenset(
    {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop"}
)
"""Element-wise optimizers of ``torch.optim``: updates commute with sharding."""

_SKIPPED_KEYS = frozenset({"params", "initial_lr"})


def _wire_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_wire_value(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # a 0-d tensor lr
        return value.item()
    return value


def _scalar(value: Any) -> bool:
    if isinstance(value, bool | int | float | str) or value is None:
        return True
    return isinstance(value, list) and all(isinstance(v, int | float) for v in value)


@dataclass(frozen=True, slots=True)
class OptimizerSpec:
    name: str
    groups: tuple[dict[str, Any], ...]
    """Per param group, the hyper-parameters (lr, momentum, betas, ...)."""

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> OptimizerSpec:
        """Describes a torch optimizer.

        Raises:
            ConfigError: an optimizer the ps cannot apply shard by shard.
        """
        name = type(optimizer).__name__
        if name not in SUPPORTED or not type(optimizer).__module__.startswith("torch.optim"):
            raise ConfigError(
                f"optimizer {type(optimizer).__module__}.{name} cannot run on a parameter "
                f"server; supported: torch.optim.{', torch.optim.'.join(sorted(SUPPORTED))}"
            )
        return cls(name, tuple(hyperparameters(g) for g in optimizer.param_groups))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "groups": [dict(g) for g in self.groups]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OptimizerSpec:
        name = data.get("name")
        if not isinstance(name, str) or name not in SUPPORTED:
            raise ConfigError(f"unsupported optimizer {name!r} on the ps")
        return cls(str(name), tuple(dict(g) for g in data.get("groups") or [{}]))


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """The scalar hyper-parameters of a param group, as msgpack can carry them."""
    out = {}
    for key, value in group.items():
        if key in _SKIPPED_KEYS:
            continue
        wire = _wire_value(value)
        if _scalar(wire):
            out[key] = wire
    return out


def build(spec: OptimizerSpec, groups: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
    """The ps-side optimizer: group ``i`` holds this ps's shards of worker group ``i``."""
    import torch

    cls = getattr(torch.optim, spec.name)
    param_groups = []
    for i, params in enumerate(groups):
        hyper = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.groups[i].items()}
        # A 0-element group is legal for torch only with params=[]; keep group indices.
        param_groups.append({"params": params, **hyper})
    # Adagrad fills its "sum" state from the constructor's argument, not the group's.
    extra: dict[str, Any] = {}
    if spec.name == "Adagrad" and spec.groups and "initial_accumulator_value" in spec.groups[0]:
        extra["initial_accumulator_value"] = spec.groups[0]["initial_accumulator_value"]
    optimizer: torch.optim.Optimizer = cls(param_groups, **extra)
    return optimizer


def set_hyperparameters(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Applies the worker's current hyper-parameters (a schedule's lr) before a step."""
    for group, hyper in zip(optimizer.param_groups, groups, strict=False):
        for key, value in hyper.items():
            if key in group and key not in _SKIPPED_KEYS:
                group[key] = tuple(value) if isinstance(value, list) else value
