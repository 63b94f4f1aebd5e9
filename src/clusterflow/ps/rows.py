"""Embedding tables on the ps: how rows are sharded, and the row-wise optimizers.

A table of ``rows x dim`` is cut by rows over the ps tasks, never whole on one process:

* ``hash``: row ``i`` lives on shard ``i % P`` at local row ``i // P`` (TensorFlow's
  ``partition_strategy="mod"``). Power-law ids are hot at the low end, so consecutive
  hot ids land on different shards: the load spreads.
* ``range``: contiguous blocks (``torch.tensor_split`` boundaries; TensorFlow's ``div``).

The optimizers update only the rows a push names (sparse, as ``torch.optim.SparseAdam``,
TensorFlow's ``LazyAdam`` and TorchRec's fused row-wise optimizers do), and their state
is *lazy per row*: a row gets its slots the first time a gradient touches it, so the
state grows with the rows trained, not with the table. The math is torch's: SGD and
Adagrad match ``torch.optim.SGD``/``Adagrad`` on a dense table exactly (a row without a
gradient does not move under either); Adam matches ``torch.optim.SparseAdam`` (moments
of untouched rows stay, the step count is per table shard). Pure: no locks, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from clusterflow.errors import ConfigError
from clusterflow.ps.api import PSError

Sharding = Literal["hash", "range"]
Init = Literal["normal", "zeros", "uniform"]
ROW_OPTIMIZERS = ("SGD", "Adagrad", "Adam")


class TableIndexError(PSError):
    """An id outside ``[0, rows)``: the message names the table and the id."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TableSpec:
    """One embedding table as every worker declares it; the same on every shard."""

    name: str
    """The variable name of the table's weight (``v0003.EmbeddingBag.weight``)."""
    rows: int
    dim: int
    num_shards: int
    sharding: Sharding = "hash"
    init: Init = "normal"
    """``normal``: N(0, 1) as ``nn.Embedding``; ``uniform``: U(+-sqrt(1/rows)) as TorchRec."""
    seed: int = 0
    """Each shard draws its rows from a generator seeded by (seed, table, shard)."""
    padding_idx: int | None = None
    """The row kept at zero (``nn.Embedding(padding_idx=...)``)."""

    def __post_init__(self) -> None:
        if self.rows < 1 or self.dim < 1 or self.num_shards < 1:
            raise ConfigError(
                f"table {self.name!r}: rows, dim and shards must be positive, got "
                f"{self.rows}, {self.dim}, {self.num_shards}"
            )
        if self.sharding not in ("hash", "range"):
            raise ConfigError(f"table sharding must be hash or range, got {self.sharding!r}")
        if self.init not in ("normal", "zeros", "uniform"):
            raise ConfigError(f"table init must be normal, zeros or uniform, got {self.init!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableSpec:
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"invalid table spec {data!r:.200}: {exc}") from exc

    @property
    def nbytes(self) -> int:
        return self.rows * self.dim * 4

    def _bounds(self) -> list[int]:
        base, extra = divmod(self.rows, self.num_shards)
        out = [0]
        for i in range(self.num_shards):
            out.append(out[-1] + base + (1 if i < extra else 0))
        return out

    def shard_rows(self, shard: int) -> int:
        """How many rows shard ``shard`` holds."""
        if self.sharding == "hash":
            return (self.rows - shard + self.num_shards - 1) // self.num_shards
        bounds = self._bounds()
        return bounds[shard + 1] - bounds[shard]

    def shard_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The shard of each (in-range) id."""
        if self.sharding == "hash":
            return torch.remainder(ids, self.num_shards)
        starts = torch.tensor(self._bounds()[1:-1], dtype=ids.dtype)
        return torch.bucketize(ids, starts, right=True)

    def local(self, ids: torch.Tensor, shard: int) -> torch.Tensor:
        """Local row numbers on ``shard`` of ids that live there."""
        if self.sharding == "hash":
            return torch.div(ids, self.num_shards, rounding_mode="floor")
        return ids - self._bounds()[shard]

    def global_ids(self, shard: int) -> torch.Tensor:
        """The global id of every local row of ``shard``, in local order."""
        n = self.shard_rows(shard)
        if self.sharding == "hash":
            return torch.arange(n, dtype=torch.int64) * self.num_shards + shard
        return torch.arange(n, dtype=torch.int64) + self._bounds()[shard]

    def check_ids(self, ids: torch.Tensor) -> None:
        """Raises ``TableIndexError`` naming the first id outside ``[0, rows)``."""
        if ids.numel() == 0:
            return
        bad = (ids < 0) | (ids >= self.rows)
        if bool(bad.any()):
            first = int(ids[bad][0])
            raise TableIndexError(
                f"embedding table {self.name!r} ({self.rows} rows): id {first} is out of range"
            )

    def initial_rows(self, shard: int) -> torch.Tensor:
        """Shard ``shard``'s initial rows, drawn on the ps (never built whole anywhere)."""
        n = self.shard_rows(shard)
        values = torch.empty(n, self.dim)
        gen = torch.Generator().manual_seed(_mix(self.seed, self.name, shard))
        if self.init == "normal":
            values.normal_(generator=gen)
        elif self.init == "uniform":
            bound = math.sqrt(1.0 / self.rows)
            values.uniform_(-bound, bound, generator=gen)
        else:
            values.zero_()
        if self.padding_idx is not None:
            pad = torch.tensor([self.padding_idx])
            if int(self.shard_of(pad)) == shard:
                values[int(self.local(pad, shard))] = 0.0
        return values


def _mix(seed: int, name: str, shard: int) -> int:
    """A generator seed of (seed, table, shard) that does not depend on PYTHONHASHSEED."""
    h = seed & 0xFFFFFFFF
    for ch in f"{name}/{shard}".encode():
        h = (h * 1000003 ^ ch) & 0x7FFFFFFFFFFFFFFF
    return h


@dataclass(frozen=True, slots=True, kw_only=True)
class RowOptimizerSpec:
    """The row-wise optimizer of a table, from the worker's torch optimizer's group."""

    name: str
    """``SGD``, ``Adagrad`` or ``Adam`` (lazy; ``SparseAdam`` maps here)."""
    hyper: dict[str, Any]
    """lr, eps, betas, initial_accumulator_value: the group's values."""

    @classmethod
    def of(cls, optimizer_name: str, group: dict[str, Any], table: str) -> RowOptimizerSpec:
        """The row optimizer for a torch optimizer's param group holding ``table``.

        Raises:
            ConfigError: an optimizer or a setting that has no row-wise form (momentum,
                weight decay, AMSGrad, Adagrad's lr decay): it would touch every row.
        """
        name = "Adam" if optimizer_name in ("Adam", "SparseAdam", "AdamW") else optimizer_name
        if name not in ROW_OPTIMIZERS:
            raise ConfigError(
                f"embedding table {table!r}: {optimizer_name} has no row-wise form on the ps; "
                "use SGD, Adagrad, Adam or SparseAdam"
            )
        for key in ("momentum", "weight_decay", "lr_decay"):
            if group.get(key):
                raise ConfigError(
                    f"embedding table {table!r}: {optimizer_name}({key}={group[key]}) would "
                    "update rows without gradients; the ps applies row-wise updates only"
                )
        if group.get("amsgrad") or group.get("maximize") or group.get("nesterov"):
            raise ConfigError(
                f"embedding table {table!r}: amsgrad, maximize and nesterov have no row-wise form"
            )
        hyper: dict[str, Any] = {"lr": float(group.get("lr", 0.01))}
        if name == "Adagrad":
            hyper["eps"] = float(group.get("eps", 1e-10))
            hyper["initial_accumulator_value"] = float(group.get("initial_accumulator_value", 0))
        if name == "Adam":
            hyper["eps"] = float(group.get("eps", 1e-8))
            b1, b2 = group.get("betas", (0.9, 0.999))
            hyper["betas"] = [float(b1), float(b2)]
        return cls(name=name, hyper=hyper)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "hyper": dict(self.hyper)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RowOptimizerSpec:
        name = data.get("name")
        if name not in ROW_OPTIMIZERS:
            raise ConfigError(f"unknown row optimizer {name!r}; expected one of {ROW_OPTIMIZERS}")
        return cls(name=str(name), hyper=dict(data.get("hyper") or {}))

    @property
    def slot_names(self) -> tuple[str, ...]:
        return {"SGD": (), "Adagrad": ("sum",), "Adam": ("exp_avg", "exp_avg_sq")}[self.name]


class LazySlots:
    """Optimizer state for the rows touched so far: ``index[row]`` is its slot, or -1.

    Slots grow by doubling, so the state costs ``8 bytes x rows`` for the index plus
    ``slots x dim`` floats per touched row: with power-law ids, a small part of a table.
    """

    def __init__(self, rows: int, dim: int, names: tuple[str, ...], fill: float = 0.0) -> None:
        self.index = torch.full((rows,), -1, dtype=torch.int64)
        self.used = 0
        self.fill = fill
        self.data = {n: torch.full((min(rows, 1024), dim), fill) for n in names}

    def slots(self, local: torch.Tensor) -> torch.Tensor:
        """Slot numbers of ``local`` rows (unique), giving new rows fresh slots."""
        found = self.index[local]
        new = found < 0
        count = int(new.sum())
        if count:
            need = self.used + count
            for name, tensor in self.data.items():
                if need > tensor.shape[0]:
                    grown = torch.full((max(need, 2 * tensor.shape[0]), tensor.shape[1]), self.fill)
                    grown[: self.used] = tensor[: self.used]
                    self.data[name] = grown
            fresh = torch.arange(self.used, need, dtype=torch.int64)
            self.index[local[new]] = fresh
            found = found.clone()
            found[new] = fresh
            self.used = need
        return found

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}index": self.index.clone()}
        out.update({f"{prefix}{n}": t[: self.used].clone() for n, t in self.data.items()})
        return out

    def load(self, prefix: str, tensors: dict[str, torch.Tensor]) -> None:
        self.index = tensors[f"{prefix}index"].to(torch.int64).clone()
        self.used = int((self.index >= 0).sum())
        for name in self.data:
            saved = tensors[f"{prefix}{name}"]
            self.data[name] = saved.clone() if saved.shape[0] else self.data[name][:1]


class RowOptimizer:
    """Applies one optimizer to one table shard's rows; its state lives beside them."""

    def __init__(self, spec: RowOptimizerSpec, rows: int, dim: int) -> None:
        self.spec = spec
        self.step_count = 0
        fill = float(spec.hyper.get("initial_accumulator_value", 0.0))
        self.slots = LazySlots(rows, dim, spec.slot_names, fill)

    def apply(
        self, values: torch.Tensor, local: torch.Tensor, grads: torch.Tensor, lr_scale: float = 1.0
    ) -> None:
        """Updates ``values[local]`` (``local`` unique) by ``grads``; counts a step."""
        self.step_count += 1
        hyper = self.spec.hyper
        lr = float(hyper["lr"]) * lr_scale
        if local.numel() == 0:
            return
        if self.spec.name == "SGD":
            values.index_add_(0, local, grads, alpha=-lr)
            return
        slot = self.slots.slots(local)
        if self.spec.name == "Adagrad":
            total = self.slots.data["sum"]
            acc = total[slot].addcmul_(grads, grads)
            total[slot] = acc
            std = acc.sqrt().add_(float(hyper["eps"]))
            values[local] = values[local].addcdiv_(grads, std, value=-lr)
            return
        beta1, beta2 = (float(b) for b in hyper["betas"])
        exp_avg, exp_avg_sq = self.slots.data["exp_avg"], self.slots.data["exp_avg_sq"]
        old_avg, old_sq = exp_avg[slot], exp_avg_sq[slot]
        # torch.optim.SparseAdam's arithmetic, row for row.
        avg_update = grads.sub(old_avg).mul_(1 - beta1)
        exp_avg[slot] = old_avg + avg_update
        numer = avg_update.add_(old_avg)
        sq_update = grads.pow(2).sub_(old_sq).mul_(1 - beta2)
        exp_avg_sq[slot] = old_sq + sq_update
        denom = sq_update.add_(old_sq).sqrt_().add_(float(hyper["eps"]))
        bias1 = 1 - beta1**self.step_count
        bias2 = 1 - beta2**self.step_count
        step_size = lr * math.sqrt(bias2) / bias1
        values[local] = values[local] + numer.div_(denom).mul_(-step_size)

    def set_hyper(self, hyper: dict[str, Any]) -> None:
        """A schedule's current lr (a push carries it), the rest as built."""
        if "lr" in hyper:
            self.spec.hyper["lr"] = float(hyper["lr"])


def coalesce(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids, with the gradients of repeated ids summed."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    if unique.numel() == ids.numel():
        order = torch.empty_like(inverse)
        order[inverse] = torch.arange(ids.numel())
        return unique, grads[order]
    out = torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype)
    out.index_add_(0, inverse, grads)
    return unique, out
