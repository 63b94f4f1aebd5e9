"""Consistent checkpoints of a training job, whatever its strategy (docs/architecture.md section 6).

A checkpoint is a cut: the state of every process that holds training state at one
moment, written by each process into one checkpoint folder and committed by the chief's
manifest, listing every part with its checksum, last. Per strategy:

* **Parameter servers** (sync or async): the chief quiesces every ps task (no push in
  flight; new ones wait), takes each shard's state (variables, optimizer slots, version
  and the leases it applied), the data service's cursor and its own state, commits, and
  lets the pushes through. The checkpoint's step is ps 0's version: in sync mode the
  global step, which every worker resumes from. Other workers write nothing: a ps worker
  holds no state of the model, and its data position is the dispatcher's leases; a
  respawned worker continues from the ps values and fresh leases. (Writing their RNG at
  a common step would need a barrier that async training does not have.)
* **All-reduce** (mirrored strategies) and single processes: every replica writes its own
  part (RNG states, step, extra state) at the same step, the chief writes the replicated
  model with its optimizer (and the data cursor), then the replicas meet at a barrier and
  the chief commits.

The cut knows no strategy by type: it asks the strategy's ``CheckpointParticipant``
methods (``strategies/api.py``) who writes what, so a new strategy takes part by
implementing them.

Restoring reads the checkpoint the manager chose for this incarnation
(``CLUSTERFLOW_RESTORE``), else the newest intact one. The ps tasks restore their own
shards as they start (``python -m clusterflow.ps``), and the manager restores the data
cursor, so every process of a restarted cluster starts from the same cut.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from clusterflow._checks import seconds, whole
from clusterflow.checkpoint import (
    CheckpointError,
    CheckpointStorage,
    CheckpointWriteError,
    Manifest,
    PartInfo,
)
from clusterflow.checkpoint.names import (
    DATA_PART,
    ENV_CHECKPOINT_DIR,
    ENV_RESTORE,
    MODEL_PART,
    ps_part,
    worker_part,
)
from clusterflow.errors import ConfigError
from clusterflow.ps.tables import join_tables
from clusterflow.server.manager_link import ManagerLink
from clusterflow.strategies.api import (
    CheckpointParticipant,
    SoloParticipant,
    Strategy,
)
from clusterflow.strategies.parameter_server.sparse import DENSE_PART
from clusterflow.strategies.variables import recording

log = logging.getLogger(__name__)

DEFAULT_DIRECTORY = "checkpoints"


class Stateful(Protocol):
    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any], /) -> Any: ...


class Checkpointer:
    """Saves and restores consistent checkpoints of one training job.

    Call :meth:`restore` once before training, and :meth:`maybe_save` after every step
    on every task (the schedule decides; under all-reduce every replica must call it,
    as they meet at a barrier).

    Args:
        strategy: the job's strategy; None for a single process.
        model: the model (required unless the strategy holds it on parameter servers).
        optimizer: its optimizer, saved with it (under parameter servers the slots live
            on the ps tasks and are saved there).
        directory: a path or fsspec URL; default ``$CLUSTERFLOW_CHECKPOINT_DIR`` (set
            by ``clusterflow start``), else ``./checkpoints``.
        every_steps: save when the step is a multiple of this.
        every_secs: save when this long passed since the last save.
        keep: committed checkpoints kept (older ones are deleted).
        state: more objects with ``state_dict``/``load_state_dict``, by name (an lr
            scheduler, a step counter of yours); saved with this task's part.
        data: a ``clusterflow.data`` client whose dispatcher cursor joins the cut.
    """

    def __init__(
        self,
        strategy: Strategy | None = None,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        directory: str | None = None,
        every_steps: int | None = None,
        every_secs: float | None = None,
        keep: int = 3,
        state: Mapping[str, Stateful] | None = None,
        data: Any = None,
    ) -> None:
        if every_steps is not None:
            every_steps = whole("every_steps", every_steps, least=1)
        if every_secs is not None:
            every_secs = seconds("every_secs", every_secs)
        self.strategy = strategy
        self.participant: CheckpointParticipant = (
            strategy if strategy is not None else SoloParticipant()
        )
        self.role = self.participant.cut_role()
        if model is None and not self.role.holds_model:
            raise ConfigError("Checkpointer needs the model (only parameter servers hold it)")
        self.model = model
        self.optimizer = optimizer
        self.directory = directory or os.environ.get(ENV_CHECKPOINT_DIR) or DEFAULT_DIRECTORY
        self.storage = CheckpointStorage(self.directory, keep=keep)
        self.every_steps = every_steps
        self.every_secs = every_secs
        self.extra = dict(state or {})
        self.data = data
        self.is_chief = strategy.is_chief if strategy is not None else True
        self.rank, self.replicas = self.role.rank, self.role.replicas
        if self.is_chief:
            _tell_the_manager(self.directory)
        self.last_saved_step: int | None = None
        self._last_save_time = time.monotonic()

    # Restore -----------------------------------------------------------------------

    def restore(self, *, latest: bool = False) -> int:
        """Loads the checkpoint to resume from; returns its step (0 if there is none).

        Args:
            latest: the newest intact checkpoint even when the manager named one for
                this incarnation (an evaluator follows the newest, not the restart's).

        Raises:
            CheckpointError: the checkpoint the manager named is missing or damaged, or
                it was written by another kind of strategy.
        """
        manifest = self.storage.latest() if latest else self._to_restore()
        if manifest is None:
            return 0
        kind = manifest.meta.get("kind")
        if kind != self._kind:
            raise CheckpointError(
                f"checkpoint at step {manifest.step} in {self.directory} was written by a "
                f"{kind!r} job; this job is {self._kind!r}"
            )
        if not self.role.holds_model:
            self._restore_model(manifest)
        self.participant.restore(
            dict(manifest.meta),
            lambda part: self.storage.read_tensors(manifest, part),
            named=bool(os.environ.get(ENV_RESTORE)),
        )
        own = worker_part(self.rank)
        if own in manifest.parts:
            meta, tensors = self.storage.read_tensors(manifest, own)
            _set_rng(meta, tensors)
            for name, obj in self.extra.items():
                if name in meta.get("extra", {}):
                    obj.load_state_dict(meta["extra"][name])
        step = manifest.step
        self.last_saved_step = step
        log.info("restored checkpoint at step %d from %s", step, self.directory)
        return step

    def _to_restore(self) -> Manifest | None:
        named = os.environ.get(ENV_RESTORE)
        if named:
            manifest = self.storage.at(int(named)) if named.isdigit() else None
            if manifest is not None:
                return manifest
            raise CheckpointError(
                f"{ENV_RESTORE}={named}: no committed checkpoint at that step in {self.directory}"
            )
        return self.storage.latest()

    def _restore_model(self, manifest: Manifest) -> None:
        assert self.model is not None
        meta, tensors = self.storage.read_tensors(manifest, MODEL_PART)
        module = _unwrapped(self.model)
        module.load_state_dict(_model_state(tensors))
        if self.optimizer is not None and meta.get("optimizer") is not None:
            self.optimizer.load_state_dict(_optimizer_state(meta["optimizer"], tensors))

    # Save --------------------------------------------------------------------------

    def maybe_save(self, step: int) -> bool:
        """Saves if the schedule says so at ``step``; whether it saved."""
        if not self._due(step):
            return False
        self.save(step)
        return True

    def save(self, step: int) -> None:
        """Takes a consistent checkpoint now (every replica, under all-reduce)."""
        started = time.monotonic()
        committed: int | None
        if self.role.replicas == 1 and not self.is_chief:
            return  # a parameter-server worker: only the chief cuts
        committed = self._save(step)
        self._last_save_time = time.monotonic()
        if committed is not None:
            self.last_saved_step = committed
            log.info(
                "checkpoint at step %d committed in %.2fs to %s",
                committed,
                self._last_save_time - started,
                self.directory,
            )

    def _due(self, step: int) -> bool:
        if step == self.last_saved_step:
            return False
        due = self.every_steps is not None and step % self.every_steps == 0
        if self.every_secs is not None and not due:
            due = time.monotonic() - self._last_save_time >= self.every_secs
            # Replicas' clocks differ: the chief's decides, for all to save together.
            due = self.participant.agree(due)
        return due

    def _save(self, step: int) -> int | None:
        """One cut: the strategy holds its updates while every part is written."""
        participant = self.participant
        quiesced = self.is_chief
        held = participant.quiesce() if quiesced else None
        writer = None
        try:
            at = step if held is None else held
            writer = self.storage.writer(at)
            parts = [
                writer.write_tensors(name, tensors, meta)
                for name, meta, tensors in (participant.parts() if self.is_chief else [])
            ]
            parts.append(self._write_own(writer, step))
            parts += [writer.write_tensors(n, t, m) for n, m, t in participant.own_parts()]
            if self.is_chief and not self.role.holds_model:
                parts.append(self._write_model(writer))
            participant.barrier()  # every replica's part is written
            if not self.is_chief:
                return None
            # After the barrier: every replica acked its splits of this step before it
            # came to save, so the cursor holds exactly the records the model learned.
            parts += self._write_shared(writer)
            others = [worker_part(r) for r in range(self.replicas) if r != self.rank]
            written = {part.name for part in parts}
            others += [n for n in participant.own_part_names() if n not in written]
            parts += writer.collect(others)
            meta = {"kind": self.role.kind, "replicas": self.replicas, **participant.cut_meta()}
            if held is not None:
                meta["local_step"] = step
            writer.commit(parts, meta)
            return at
        except CheckpointWriteError:
            if writer is not None:
                writer.abort()  # the filesystem refused: it gets back all we wrote of it
            raise
        finally:
            if quiesced:
                participant.resume()

    def _write_model(self, writer: Any) -> PartInfo:
        assert self.model is not None
        tensors = {f"model/{k}": v for k, v in _unwrapped(self.model).state_dict().items()}
        meta: dict[str, Any] = {"optimizer": None}
        if self.optimizer is not None:
            opt_meta, opt_tensors = _split_optimizer(self.optimizer.state_dict())
            meta["optimizer"] = opt_meta
            tensors.update(opt_tensors)
        return writer.write_tensors(MODEL_PART, tensors, meta)  # type: ignore[no-any-return]

    def _write_shared(self, writer: Any) -> list[PartInfo]:
        if self.data is None:
            return []
        cursor = self.data.dispatcher.state_dict()
        return [writer.write_json(DATA_PART, cursor)]

    def _write_own(self, writer: Any, step: int) -> PartInfo:
        meta, tensors = _get_rng()
        meta["step"] = step
        meta["extra"] = {name: _jsonable(obj.state_dict()) for name, obj in self.extra.items()}
        return writer.write_tensors(worker_part(self.rank), tensors, meta)  # type: ignore[no-any-return]

    def close(self) -> None:
        """Nothing is held between saves; kept for the hooks' symmetric life cycle."""

    @property
    def _kind(self) -> str:
        return self.role.kind


def load_module(
    directory: str, build: Callable[[], nn.Module], *, step: int | None = None
) -> tuple[nn.Module, int] | None:
    """A plain single-device module from a checkpoint of any strategy, with its step.

    ``build`` makes the model as the training job made it (the same code): under
    parameter servers the variables are stored by creation order, so the module is built
    under the same recording and each tensor goes back to where it was created; shards
    of a partitioned variable are joined along dimension 0. For an evaluator, or to
    export a trained model. Returns None when there is no (such) checkpoint.
    """
    storage, manifest = _committed(directory, step)
    if manifest is None:
        return None
    if manifest.meta.get("kind") != "parameter_server":
        model = build()
        model.load_state_dict(_joined_state(storage, manifest))
        return model, manifest.step
    with recording() as recorder:
        model = build()
    values = _ps_variables(storage, manifest)
    with torch.no_grad():
        for item in recorder.items:
            value = values.get(item.name)
            if value is None:
                raise CheckpointError(
                    f"checkpoint at step {manifest.step} has no variable {item.name!r}: "
                    "build() must make the model the training job made"
                )
            if value.shape != item.tensor.shape:
                raise CheckpointError(
                    f"variable {item.name!r} is {tuple(value.shape)} in the checkpoint, "
                    f"{tuple(item.tensor.shape)} in the model build() made"
                )
            item.tensor.copy_(value)
    return model, manifest.step


def load_into(model: nn.Module, directory: str, *, step: int | None = None) -> int:
    """Loads the newest (or ``step``'s) checkpoint of any strategy into a plain ``model``.

    ``model`` is built as the training job built it. Parameter-server variables are
    stored by creation order; they are matched to ``model``'s parameters and buffers in
    registration order (modules in ``model.modules()`` order), checking each one's
    module type, name and shape. A model whose order differs gets a clear error: use
    :func:`load_module` with the function that built it. Returns the step (0: none).
    """
    storage, manifest = _committed(directory, step)
    if manifest is None:
        return 0
    if manifest.meta.get("kind") != "parameter_server":
        model.load_state_dict(_joined_state(storage, manifest))
        return manifest.step
    values = _ps_variables(storage, manifest)
    mine = [
        (f"{type(module).__name__}.{name}", tensor)
        for module in model.modules()
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]
        if tensor is not None and name not in module._non_persistent_buffers_set
    ]
    stored = sorted(values)  # "v0000.Linear.weight", ...: creation order
    if len(stored) != len(mine):
        raise CheckpointError(
            f"checkpoint at step {manifest.step} holds {len(stored)} variables; the model "
            f"has {len(mine)} parameters and buffers: build it as the training job did"
        )
    with torch.no_grad():
        for name, (label, tensor) in zip(stored, mine, strict=True):
            value = values[name]
            if name.split(".", 1)[1] != label or value.shape != tensor.shape:
                raise CheckpointError(
                    f"variable {name!r} {tuple(value.shape)} does not match the model's "
                    f"{label} {tuple(tensor.shape)}: pass the builder to load_module instead"
                )
            tensor.copy_(value)
    return manifest.step


def _committed(directory: str, step: int | None) -> tuple[CheckpointStorage, Manifest | None]:
    """The newest intact checkpoint in ``directory``, or the one at ``step``."""
    storage = CheckpointStorage(directory)
    return storage, storage.latest() if step is None else storage.at(step)


def _joined_state(storage: CheckpointStorage, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The model's state dict: the ``model`` part, or the parts each pipeline stage
    wrote of its own layers (the manifest's ``joined_parts``), joined."""
    state: dict[str, torch.Tensor] = {}
    for part in manifest.meta.get("joined_parts") or [MODEL_PART]:
        _, tensors = storage.read_tensors(manifest, part)
        state.update(_model_state(tensors))
    return state


def _model_state(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state dict out of a ``model`` part (its keys carry ``model/``)."""
    return {k[6:]: t for k, t in tensors.items() if k.startswith("model/")}


def _ps_variables(storage: CheckpointStorage, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Every variable of a parameter-server checkpoint, its shards joined on dim 0."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    parts = [
        storage.read_tensors(manifest, ps_part(i)) for i in range(manifest.meta.get("num_ps", 0))
    ]
    if manifest.meta.get("dense_part"):  # dense="allreduce": the workers' dense values
        parts.append(storage.read_tensors(manifest, DENSE_PART))
    for _, tensors in parts:
        for key, tensor in tensors.items():
            if key.startswith("var/"):
                name, _, part = key[4:].partition("/part_")
                pieces.setdefault(name, []).append((int(part or 0), tensor))
    joined = {
        name: found[0][1]
        if len(found) == 1  # whole (possibly 0-dim, as a batch counter)
        else torch.cat([t for _, t in sorted(found, key=lambda p: p[0])])
        for name, found in pieces.items()
    }
    return joined | join_tables(parts)  # embedding tables: their rows from every shard


# State in safetensors: tensors by name, everything else as JSON -------------------------


def _unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (its state_dict keys lack ``module.``)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def _split_optimizer(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An optimizer's state_dict as JSON (groups, scalar slots) plus its tensor slots."""
    tensors: dict[str, torch.Tensor] = {}
    slots: dict[str, dict[str, Any]] = {}
    for param, values in state["state"].items():
        slots[str(param)] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"opt/{param}/{key}"] = value
            else:
                slots[str(param)][key] = value
    return {"param_groups": _jsonable(state["param_groups"]), "slots": slots}, tensors


def _optimizer_state(
    meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {int(p): dict(v) for p, v in meta["slots"].items()}
    for name, tensor in tensors.items():
        if name.startswith("opt/"):
            _, param, key = name.split("/", 2)
            state.setdefault(int(param), {})[key] = tensor
    return {"state": state, "param_groups": meta["param_groups"]}


def _get_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    np_state: Any = np.random.get_state()
    meta: dict[str, Any] = {
        "python_rng": _jsonable(random.getstate()),
        "numpy_rng": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    tensors = {
        "rng/torch": torch.get_rng_state(),
        "rng/numpy": torch.from_numpy(np.asarray(np_state[1], dtype=np.uint32).copy()),
    }
    return meta, tensors


def _tell_the_manager(directory: str) -> None:
    """Under ``clusterflow start``, a chief whose checkpoints live outside the cluster's
    checkpoint folder says where: the manager restores a whole restart (every task, the
    ps tasks' shards and the data cursor) from there, so they all come from one cut."""
    if directory == os.environ.get(ENV_CHECKPOINT_DIR):
        return
    link = ManagerLink.from_env()
    if link is None:
        return
    try:
        url = directory if "://" in directory else os.path.abspath(directory)
        if not link.checkpoints_at(url):
            log.warning(
                "the manager did not learn that checkpoints live at %s: a whole restart "
                "will not restore from them",
                url,
            )
    finally:
        link.close()


def _set_rng(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    if "rng/torch" in tensors:
        torch.set_rng_state(tensors["rng/torch"])
    if "rng/numpy" in tensors and meta.get("numpy_rng"):
        name, pos, has_gauss, gauss = meta["numpy_rng"]
        keys = tensors["rng/numpy"].numpy().astype(np.uint32)
        np.random.set_state((name, keys, int(pos), int(has_gauss), float(gauss)))
    if meta.get("python_rng"):
        version, internal, gauss = meta["python_rng"]
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))


def _jsonable(value: Any) -> Any:
    """Tuples to lists and tensors/NumPy scalars to numbers, so JSON round-trips it."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(
                f"a state_dict holds a tensor of shape {tuple(value.shape)} outside the model; "
                "only scalars can go into a checkpoint's metadata"
            )
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value
