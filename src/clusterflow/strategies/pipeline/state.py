"""A stage's share of a checkpoint: the names of the parts and its optimizer slots.

Every stage writes the layers it trains (keys as in the whole model's ``state_dict``)
and the optimizer slots of their parameters into part ``stage-<k>``; ``load_module``
joins the parts named in the manifest's ``joined_parts`` into one plain module.
``StageCut`` is the strategy's side of it: what it writes at a cut and reads at a restore.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from clusterflow.strategies.api import CutRole, Part, ReadPart
from clusterflow.strategies.pipeline.api import PipelineConfig, PipelineError

if TYPE_CHECKING:
    from torch import nn

    from clusterflow.collective.group import CollectiveGroup
    from clusterflow.strategies.pipeline.layout import Layout

__all__ = ["StageCut", "join_names", "load_optimizer_part", "optimizer_part"]


def join_names(stages: int) -> list[str]:
    return [f"stage-{s}" for s in range(stages)]


def optimizer_part(
    optimizer: torch.optim.Optimizer, mine: set[int]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The slots of ``optimizer``'s parameters whose ``id`` is in ``mine``: JSON plus
    tensors named ``opt/<index>/<slot>`` (the index in the optimizer's own order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    slots: dict[str, dict[str, Any]] = {}
    for index, values in state["state"].items():
        if id(params[int(index)]) not in mine:
            continue
        slots[str(index)] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"opt/{index}/{key}"] = value.detach().cpu()
            else:
                slots[str(index)][key] = value
    groups = [{k: v for k, v in g.items()} for g in state["param_groups"]]
    return {"param_groups": _plain(groups), "slots": slots}, tensors


def load_optimizer_part(
    optimizer: torch.optim.Optimizer, meta: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> None:
    """Loads what :func:`optimizer_part` wrote into ``optimizer``."""
    state: dict[int, dict[str, Any]] = {int(p): dict(v) for p, v in meta["slots"].items()}
    for name, tensor in tensors.items():
        if name.startswith("opt/"):
            _, index, key = name.split("/", 2)
            state.setdefault(int(index), {})[key] = tensor
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


class StageCut:
    """``PipelineStrategy``'s side of the consistent cut (``train/checkpoint``): every
    stage of pipeline 0 writes its part, every pipeline's same stage reads it back.

    A mixin of the strategy, whose state it reads (declared below for the type checker).
    """

    if TYPE_CHECKING:
        layout: Layout
        config: PipelineConfig
        _group: CollectiveGroup
        _model: nn.Module | None
        _optimizer: torch.optim.Optimizer | None
        _bounds: list[range]
        _names: list[str]

        def _drain(self) -> None: ...

        def _my_parameters(self) -> list[nn.Parameter]: ...

        def refresh_model(self) -> None: ...

    def cut_role(self) -> CutRole:
        return CutRole("pipeline", self.layout.rank, self.layout.world, holds_model=True)

    def agree(self, flag: bool) -> bool:
        if self.layout.world == 1:
            return flag
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        return bool(self._group.broadcast_(value, 0).item())

    def own_parts(self) -> list[Part]:
        """This stage's layers and optimizer slots (pipeline 0 writes; the others hold
        the same). Drains PipeDream first, so the cut holds no half-applied batch."""
        self._drain()
        if self.layout.pipeline != 0 or self._model is None:
            return []
        keys = self._my_keys()
        state = self._model.state_dict()
        tensors = {f"model/{k}": state[k].detach().cpu() for k in keys}
        meta: dict[str, Any] = {"stage": self.layout.stage, "optimizer": None}
        if self._optimizer is not None:
            mine = {id(p) for p in self._my_parameters()}
            opt_meta, opt_tensors = optimizer_part(self._optimizer, mine)
            meta["optimizer"] = opt_meta
            tensors.update(opt_tensors)
        return [(join_names(self.layout.stages)[self.layout.stage], meta, tensors)]

    def own_part_names(self) -> list[str]:
        return join_names(self.layout.stages)

    def cut_meta(self) -> dict[str, Any]:
        return {
            "stages": self.layout.stages,
            "joined_parts": join_names(self.layout.stages),
            "schedule": self.config.schedule.value,
        }

    def barrier(self) -> None:
        self._group.barrier()

    def restore(self, meta: dict[str, Any], read: ReadPart, *, named: bool) -> None:
        """Loads this stage's part (every pipeline's same stage reads the same part).

        Raises:
            PipelineError: the checkpoint was cut into another number of stages.
        """
        if meta.get("stages") != self.layout.stages or self._model is None:
            raise PipelineError(
                f"the checkpoint holds {meta.get('stages')} stages; this pipeline has "
                f"{self.layout.stages}"
            )
        part_meta, tensors = read(join_names(self.layout.stages)[self.layout.stage])
        state = {k[6:]: t for k, t in tensors.items() if k.startswith("model/")}
        self._model.load_state_dict(state, strict=False)
        if self._optimizer is not None and part_meta.get("optimizer") is not None:
            load_optimizer_part(self._optimizer, part_meta["optimizer"], tensors)
        self.refresh_model()

    def _my_keys(self) -> list[str]:
        assert self._model is not None
        mine = {self._names[i] for c in self.layout.my_chunks() for i in self._bounds[c]}
        return [k for k in self._model.state_dict() if k.split(".", 1)[0] in mine]
