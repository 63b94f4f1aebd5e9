"""A stage's share of a checkpoint: the names of the parts and its optimizer slots.

Every stage writes the layers it trains (keys as in the whole model's ``state_dict``)
and the optimizer slots of their parameters into part ``stage-<k>``; ``load_module``
joins the parts named in the manifest's ``joined_parts`` into one plain module.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["join_names", "load_optimizer_part", "optimizer_part"]


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
