"""The variables of one ps task, their optimizer, and how a push reaches them.

Pure of networking: ``service.py`` maps RPC methods onto this class, so every rule is
tested in-process. The rules that decide whether and when a push applies (version, sync
aggregation, staleness, split-key de-duplication, quiescing) are ``engine.py``'s, shared
with the embedding tables; this module checks gradients, averages them and steps the
optimizer.

Sync mode with several ps tasks needs one decision per step about *which* replicas'
gradients form the step, or shards could average different sets (TensorFlow's
``SyncReplicasOptimizer`` lets each accumulator decide alone). Here a worker first
pushes to every other shard, which buffer the gradients, then pushes to ps 0 with
``commit``; ps 0 takes the first N committers and tells every shard to apply exactly
that set. Late replicas are dropped on every shard alike, so their records can be
handed back whole.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from clusterflow.ps import chunks
from clusterflow.ps import optimizer as optim_bridge
from clusterflow.ps.api import PSConfig, PSError, PushRejected
from clusterflow.ps.applied import AppliedKeys
from clusterflow.ps.engine import Applied, ApplyEngine, Part, PushResult
from clusterflow.ps.loans import Loan, LoanBook, pooled_copy
from clusterflow.ps.optimizer import OptimizerSpec
from clusterflow.rpc.codec import DTYPES, PART_BYTES, Framed, raw_frame
from clusterflow.rpc.message import ReplyStream

log = logging.getLogger(__name__)


__all__ = ["PushResult", "VariableStore"]


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf, checked through the sum first.

    The sum is one cheap pass; ``isfinite(t).all()`` allocates a bool tensor as large
    as ``t`` (300 ms for 64 MiB on this machine, most of a push). A NaN or Inf always
    makes the sum non-finite; only then is each element checked, so a sum that merely
    overflows does not refuse finite gradients.
    """
    if math.isfinite(float(tensor.sum())):  # a Python float: two ops, not three, per frame
        return True
    return bool(torch.isfinite(tensor).all())


class VariableStore(Applied):
    """Shards of variables held by one ps task."""

    def __init__(self, ps_index: int = 0) -> None:
        self.ps_index = ps_index
        self._engine: ApplyEngine[chunks.Grad] = ApplyEngine(f"ps:{ps_index}", self._apply)
        self._cond = self._engine.cond
        self.config: PSConfig | None = None
        self.vars: dict[str, torch.Tensor] = {}
        self.trainable: dict[str, bool] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_spec: OptimizerSpec | None = None
        self.group_of: dict[str, int] = {}
        self._opt_group: dict[int, int] = {}
        self._chunks: dict[str, list[torch.Tensor]] = {}
        """The optimizer's parameters of each trainable variable: itself, or its chunks
        (``ps/chunks.py``: a large one is stepped frame by frame)."""
        self._loans = LoanBook()
        """Variables that replies in flight still read (``ps/loans.py``)."""
        self._stream: tuple[ReplyStream, Loan] | None = None
        """Where the async push being applied sends its values as they are stepped (the
        lock is held); ``_streamed`` the variables it sent so."""
        self._streamed: list[str] = []

    # Set-up -----------------------------------------------------------------------

    def create(
        self,
        config: PSConfig,
        specs: list[Mapping[str, Any]],
        values: Mapping[str, torch.Tensor],
    ) -> list[str]:
        """Creates variables; ones that exist already are kept (the first creator wins).

        Raises:
            PSError: another config than the first creator's, or a variable redeclared
                with another shape or dtype.
        """
        created = []
        with self._cond:
            if self.config is None:
                self.config = config
            elif not self.config.agrees_with(config, resizable=self._engine.resizable):
                raise PSError(
                    f"ps:{self.ps_index} runs {self.config.to_dict()}; a worker asked for "
                    f"{config.to_dict()} (every worker must build the same strategy)"
                )
            for spec in specs:
                name = str(spec["name"])
                shape = tuple(int(d) for d in spec["shape"])
                if str(spec["dtype"]) not in DTYPES:
                    raise PSError(f"variable {name!r}: unsupported dtype {spec['dtype']!r}")
                dtype = getattr(torch, str(spec["dtype"]))
                if name in self.vars:
                    have = self.vars[name]
                    if tuple(have.shape) != shape or have.dtype != dtype:
                        raise PSError(
                            f"variable {name!r} exists as {tuple(have.shape)} {have.dtype}; "
                            f"redeclared as {shape} {dtype}"
                        )
                    continue
                value = values.get(name)
                if value is None or tuple(value.shape) != shape:
                    raise PSError(
                        f"variable {name!r}: initial value missing or not of shape {shape}"
                    )
                self.vars[name] = value.to(dtype).clone()
                self.trainable[name] = bool(spec.get("trainable", True))
                created.append(name)
        return created

    def set_optimizer(self, spec: OptimizerSpec, group_of: Mapping[str, int]) -> None:
        """Builds the optimizer once; a second worker's identical request is a no-op."""
        with self._cond:
            if self.optimizer_spec is not None:
                if self.optimizer_spec.name != spec.name:
                    raise PSError(
                        f"ps:{self.ps_index} applies {self.optimizer_spec.name}; a worker "
                        f"sent {spec.name}"
                    )
                return
            groups: dict[int, list[torch.Tensor]] = {}
            self._chunks = {}
            for name, tensor in self.vars.items():
                if not self.trainable[name]:
                    continue
                if name not in group_of:
                    raise PSError(f"variable {name!r} is in no param group of the optimizer")
                self._chunks[name] = chunks.params(tensor)
                groups.setdefault(int(group_of[name]), []).extend(self._chunks[name])
            if not groups:
                self.optimizer_spec = spec
                return
            order = sorted(groups)
            sub = OptimizerSpec(spec.name, tuple(spec.groups[i] for i in order))
            self.optimizer = optim_bridge.build(sub, [groups[i] for i in order])
            self._opt_group = {g: k for k, g in enumerate(order)}
            self.group_of = {n: int(g) for n, g in group_of.items() if n in self.vars}
            self.optimizer_spec = spec

    # Reads ------------------------------------------------------------------------

    def pull(
        self,
        names: list[str] | None,
        min_version: int = 0,
        timeout: float = 60.0,
        lend: Loan | None = None,
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """A consistent copy of the variables once ``version >= min_version``.

        Blocks until then, at most ``timeout`` seconds. With ``lend``, the live
        variables instead, lent under that loan until it is sent (``ps/loans.py``).

        Raises:
            PSError: unknown variable names.
            VersionTimeout: the version did not come in time.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            self._engine.wait_version(min_version, deadline, timeout)
            return self.version, self._copy(names, lend)

    def _copy(self, names: list[str] | None, lend: Loan | None) -> dict[str, torch.Tensor]:
        """Values to send: snapshots, or the variables lent under ``lend`` (the lock is held)."""
        if names is None:
            names = list(self.vars)
        unknown = [n for n in names if n not in self.vars]
        if unknown:
            raise PSError(f"ps:{self.ps_index} holds no variable {unknown[0]!r}")
        if lend is None:
            return {n: pooled_copy(self.vars[n]) for n in names}
        self._loans.lend(names, lend)
        # New tensor objects over the variables' memory: a writer that moves a variable
        # to a copy (``Tensor.set_``) must not move the reply with it.
        return {n: self.vars[n].detach() for n in names}

    def wait_version(self, version: int, timeout: float) -> int:
        """Blocks until this shard reached ``version`` (warm-up, tests); returns it."""
        self.pull([], version, timeout)
        return self.version

    # Pushes -----------------------------------------------------------------------

    def push(
        self,
        *,
        worker: str,
        version: int,
        grads: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor] | None = None,
        keys: list[Any] | tuple[Any, ...] = (),
        hyper: list[dict[str, Any]] | None = None,
        commit: bool = False,
        want_values: bool = False,
        timeout: float = 60.0,
        lend: Loan | None = None,
        finite: Collection[str] = (),
        stream: ReplyStream | None = None,
    ) -> PushResult:
        """Applies (async) or buffers and maybe commits (sync) one worker's gradients.

        ``keys`` are the ``(dataset, epoch, split)`` keys of the splits the push
        completes. A push naming a key this shard applied before is not applied again:
        the result lists those keys in ``duplicates``. ``lend``: as for ``pull``, for
        the values an async push sends back.

        A gradient may be a ``codec.Framed``, the frames it arrived in: each is checked,
        then stepped where it lies (``ps/chunks.py``). The push is all or nothing: every
        frame of every gradient is checked (names, shapes, dtypes, finite values) before
        the first in-place write, because a NaN in the last frame must refuse a push
        whose first frames would otherwise be applied already; and the push's keys count
        (and the version moves) only after its last chunk was applied, under the lock a
        checkpoint's ``state`` takes too, so no checkpoint holds part of a push.

        ``finite``: gradients whose every frame ``check_piece`` passed as it arrived (a
        push sent in parts): their finite check is not repeated here.

        ``stream`` (with ``lend`` and ``want_values``, async): a large variable's values
        leave through it chunk group by chunk group as the step writes them, while the
        next group is stepped (``_streamed_step``); the result's ``values`` hold the
        rest. The push's gradients have all arrived and been checked by then: it applies
        whole, as without, and the version moves after its last chunk.

        Raises:
            PushRejected: an unknown variable, a wrong shape or dtype, or a non-finite
                gradient; nothing of the push is applied.
            PSError: no config or optimizer yet, or the ps stayed quiesced past timeout.
        """
        checked = self._check(grads, finite)
        checked_buffers = self._check_buffers(buffers or {})
        deadline = time.monotonic() + timeout
        with self._cond:
            config = self._ready()
            admitted = self._engine.admit(config, worker, keys, deadline, timeout)
            self.stats["pushes"] += 1
            if admitted.refused is not None:
                return admitted.refused
            for name, value in checked_buffers.items():
                self._writable(name)
                self.vars[name].copy_(value)
            part = Part(checked if not admitted.duplicates else {}, admitted.keys, hyper or [])
            if config.mode == "async":
                if stream is not None and want_values and lend is not None:
                    self._stream = (stream, lend)
                try:
                    result = self._engine.apply_async(config, version, part)
                finally:
                    self._stream = None
                    sent, self._streamed = self._streamed, []
                if result.applied and want_values:
                    rest = [n for n in self.vars if n not in sent] if sent else None
                    result.values = self._copy(rest, lend)
                return result
            # A duplicate joins as an empty part: the step neither waits for it nor applies it.
            result = self._engine.buffer_sync(config, worker, version, part, commit)
            result.duplicates = admitted.duplicates
            return result

    def _ready(self) -> PSConfig:
        if self.config is None:
            raise PSError(f"ps:{self.ps_index} has no variables yet (no worker created them)")
        if self.optimizer is None and any(self.trainable.values()):
            raise PSError(f"ps:{self.ps_index} has no optimizer yet")
        return self.config

    def check_piece(self, name: str, piece: torch.Tensor) -> None:
        """The finite check of one arrived frame of variable ``name``'s gradient (a push
        sent in parts: ``PSService`` calls it as each part arrives, while the next is on
        the wire, so the check is not left until the last). The push's own ``_check``
        refuses an unknown or non-trainable name, so one is passed over here.

        Raises:
            PushRejected: the frame holds NaN or Inf (and the ps rejects them).
        """
        config = self.config
        if config is not None and not config.reject_nonfinite:
            return
        if not self.trainable.get(name, False):
            return
        if piece.is_floating_point() and not _all_finite(piece):
            raise PushRejected(f"gradient of {name!r} holds NaN or Inf; push refused")

    def _check(
        self, grads: Mapping[str, chunks.Grad], finite: Collection[str] = ()
    ) -> dict[str, chunks.Grad]:
        out = {}
        reject = self.config is None or self.config.reject_nonfinite
        for name, raw in grads.items():
            grad = raw
            var = self.vars.get(name)
            if var is None:
                raise PushRejected(f"push names unknown variable {name!r} on ps:{self.ps_index}")
            if not self.trainable.get(name, False):
                raise PushRejected(f"push sends a gradient for non-trainable variable {name!r}")
            if tuple(grad.shape) != tuple(var.shape):
                raise PushRejected(
                    f"gradient of {name!r} has shape {tuple(grad.shape)}; the variable is "
                    f"{tuple(var.shape)}"
                )
            if grad.dtype != var.dtype:
                if not (grad.dtype == torch.bfloat16 and var.dtype.is_floating_point):
                    raise PushRejected(
                        f"gradient of {name!r} is {grad.dtype}; the variable is {var.dtype}"
                    )
                grad = chunks.cast(grad, var.dtype)
            if (
                reject
                and name not in finite
                and grad.is_floating_point()
                and not chunks.all_finite(grad, _all_finite)
            ):
                raise PushRejected(f"gradient of {name!r} holds NaN or Inf; push refused")
            out[name] = grad
        return out

    def _check_buffers(self, buffers: Mapping[str, chunks.Grad]) -> dict[str, torch.Tensor]:
        for name, value in buffers.items():
            var = self.vars.get(name)
            if var is None or self.trainable.get(name, True):
                raise PushRejected(
                    f"push assigns {name!r}, which is no buffer on ps:{self.ps_index}"
                )
            if tuple(value.shape) != tuple(var.shape):
                raise PushRejected(
                    f"buffer {name!r} has shape {tuple(value.shape)}, not {tuple(var.shape)}"
                )
        # a buffer is assigned whole: one that came in frames is joined here
        return {n: v.join() if isinstance(v, Framed) else v for n, v in buffers.items()}

    def lent(self, name: str) -> bool:
        """Whether a reply in flight may still read variable ``name``'s memory."""
        with self._cond:
            return self._loans.out(name)

    def _writable(self, name: str) -> None:
        """Before an in-place write of ``name`` (the lock is held): see ``ps/loans.py``."""
        if self._loans.make_writable(name, self.vars[name]):
            self.stats["copied_on_write"] += 1
            if name in self._chunks:  # its chunks move with it (ps/chunks.py)
                chunks.repoint(self.vars[name], self._chunks[name])

    def _step(
        self,
        grads: Mapping[str, Sequence[torch.Tensor | None]],
        hyper: list[dict[str, Any]] | None,
        lr_scale: float,
    ) -> None:
        """One optimizer step over the given gradients, each cut as its variable's chunks
        are (``chunks.split``; None: a chunk this step leaves alone) (the lock is held)."""
        opt = self.optimizer
        if opt is None or not grads:
            return
        if hyper:
            optim_bridge.set_hyperparameters(
                opt, [hyper[g] for g in sorted(self._opt_group, key=self._opt_group.__getitem__)]
            )
        saved = None
        if lr_scale != 1.0:
            saved = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = g["lr"] * lr_scale
        streamed = self._stream_names(grads) if self._stream is not None else []
        for name, cut in grads.items():
            self._writable(name)
            if name in streamed:
                continue  # stepped below, a chunk group at a time
            for param, grad in zip(self._chunks[name], cut, strict=True):
                param.grad = grad
        try:
            if len(streamed) < len(grads):
                opt.step()
            if streamed:
                # Stepped once: the group steps below must pass these over.
                for name in grads:
                    if name not in streamed:
                        for param in self._chunks[name]:
                            param.grad = None
                self._streamed_step(opt, {n: grads[n] for n in streamed})
        finally:
            for name in grads:
                for param in self._chunks[name]:
                    param.grad = None
            if saved is not None:
                for g, lr in zip(opt.param_groups, saved, strict=True):
                    g["lr"] = lr

    def _stream_names(self, grads: Mapping[str, Sequence[torch.Tensor | None]]) -> list[str]:
        """The variables of this step whose values stream: those in several chunks."""
        return [n for n in grads if len(self._chunks[n]) > 1]

    def _streamed_step(
        self, opt: torch.optim.Optimizer, grads: Mapping[str, Sequence[torch.Tensor | None]]
    ) -> None:
        """Steps ``grads``' chunks a group of about ``PART_BYTES`` at a time, sending each
        group's new values as soon as it is stepped, while the next group is (the lock
        is held; ``hyper`` and ``lr_scale`` are set around it by ``_step``).

        Element-wise optimizers (``optimizer.SUPPORTED``) give every chunk the same
        update whichever ``step`` call takes it, and each chunk is stepped once, so
        this equals one step over all of them bit for bit (``tests/unit/test_ps_parts.py``).
        A chunk leaves as a slice of one memoryview of its variable's bytes (a torch view
        and a NumPy array per chunk cost ~10 us each, 1.3 ms for 64 MiB).
        """
        assert self._stream is not None
        stream, lend = self._stream
        names = list(grads)
        self._loans.lend(names, lend)
        self._streamed.extend(names)
        stream.begin({n: self.vars[n] for n in names})
        group: list[torch.Tensor] = []
        frames: list[Any] = []
        size = 0
        for name in names:
            var = self.vars[name]
            raw, itemsize = raw_frame(var), var.element_size()
            spans = chunks.bounds(var)
            for param, grad, (a, b) in zip(self._chunks[name], grads[name], spans, strict=True):
                param.grad = grad
                group.append(param)
                frames.append(raw[a * itemsize : b * itemsize])
                size += (b - a) * itemsize
                if size >= PART_BYTES:
                    self._step_group(opt, stream, group, frames)
                    group, frames, size = [], [], 0
        if group:
            self._step_group(opt, stream, group, frames)

    @staticmethod
    def _step_group(
        opt: torch.optim.Optimizer,
        stream: ReplyStream,
        group: list[torch.Tensor],
        frames: list[Any],
    ) -> None:
        """Steps ``group`` (the chunks whose gradients are set) and sends their bytes."""
        try:
            opt.step()  # only ``group`` has gradients: the others are passed over
        finally:
            for param in group:
                param.grad = None
        stream.send(frames)

    def _apply(self, parts: list[Part[chunks.Grad]], lr_scale: float) -> None:
        """The engine's step: one over the average of ``parts`` (the lock is held).

        An empty part (a duplicate) counts in the average as it did in the step. The
        average is taken chunk by chunk, from the frames the gradients came in.
        """
        if len(parts) == 1:
            cut = {n: chunks.split(g, self.vars[n]) for n, g in parts[0].grads.items()}
            self._step(cut, parts[0].hyper, lr_scale)
            return
        names = set().union(*(p.grads for p in parts))
        averaged: dict[str, Sequence[torch.Tensor | None]] = {}
        for name in names:
            cuts = [chunks.split(p.grads[name], self.vars[name]) for p in parts if name in p.grads]
            totals = []
            for pieces in zip(*cuts, strict=True):
                total = pieces[0].clone()
                for g in pieces[1:]:
                    total.add_(g)
                totals.append(total.div_(len(parts)))
            averaged[name] = totals
        self._step(averaged, parts[0].hyper if parts else None, lr_scale)

    def leave(self, worker: str) -> dict[str, Any] | None:
        """A replica will push no more; the step this completed, if any (``engine.py``)."""
        return self._engine.leave(self.config, worker)

    def members(
        self, workers: Sequence[str], version: int | None, previous: Sequence[str] = ()
    ) -> int:
        """From step ``version`` on (None: the next), a sync step takes ``workers``;
        the step that is (``ApplyEngine.set_members``)."""
        return self._engine.set_members(workers, version, previous)

    def apply_sync(self, version: int, workers: list[str]) -> int:
        """Applies step ``version`` that ps 0 decided (``ApplyEngine.apply_sync``)."""
        return self._engine.apply_sync(version, workers)

    # Checkpoint hooks -------------------------------------------------------------

    def quiesce(self, timeout: float = 60.0) -> int:
        """Holds new pushes and waits for in-flight fan-outs; returns the version held at."""
        return self._engine.quiesce(timeout)

    def resume(self) -> None:
        self._engine.resume()

    def begin_fanout(self) -> None:
        """Marks a sync step's fan-out to other shards as in flight (quiesce waits for it)."""
        self._engine.begin_fanout()

    def end_fanout(self) -> None:
        self._engine.end_fanout()

    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Everything needed to resume: variables, optimizer slots, version, applied split keys."""
        with self._cond:
            tensors = {f"var/{n}": t.clone() for n, t in self.vars.items()}
            meta: dict[str, Any] = {
                "ps_index": self.ps_index,
                "version": self.version,
                "applied_keys": self.applied.to_state(),
                "config": self.config.to_dict() if self.config else None,
                "optimizer": self.optimizer_spec.to_dict() if self.optimizer_spec else None,
                "group_of": dict(self.group_of),
                "trainable": dict(self.trainable),
                "slots": {},
            }
            if self.optimizer is not None:
                state = self.optimizer.state
                for name, params in self._chunks.items():
                    if params[0] not in state:
                        continue  # never stepped: no slots yet
                    # the whole variable's slots, however the ps chunked it (chunks.py)
                    joined = chunks.join_slots(self.vars[name], [state[p] for p in params])
                    scalars = {}
                    for key, value in joined.items():
                        if isinstance(value, torch.Tensor):
                            tensors[f"slot/{name}/{key}"] = value
                        else:
                            scalars[key] = value
                    meta["slots"][name] = scalars
            return meta, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        """Replaces everything with a state from ``state()``."""
        with self._cond:
            self.config = PSConfig.from_dict(meta["config"]) if meta.get("config") else None
            self.vars = {k[4:]: v.clone() for k, v in tensors.items() if k.startswith("var/")}
            self._loans = LoanBook()  # new tensors: replies in flight read the old ones
            self.trainable = {str(k): bool(v) for k, v in meta["trainable"].items()}
            self._engine.restore(
                int(meta["version"]), AppliedKeys.from_state(meta.get("applied_keys"))
            )
            self.optimizer = None
            self.optimizer_spec = None
            if meta.get("optimizer"):
                spec = OptimizerSpec.from_dict(meta["optimizer"])
                self.set_optimizer(spec, meta["group_of"])  # the lock is re-entrant
                assert self.optimizer is not None or not any(self.trainable.values())
                if self.optimizer is not None:
                    for name, scalars in meta.get("slots", {}).items():
                        slots: dict[str, Any] = dict(scalars)
                        prefix = f"slot/{name}/"
                        for key, value in tensors.items():
                            if key.startswith(prefix):
                                slots[key[len(prefix) :]] = value
                        cut = chunks.split_slots(self.vars[name], slots)  # copies
                        for param, chunk_slots in zip(self._chunks[name], cut, strict=True):
                            self.optimizer.state[param] = chunk_slots
            self._cond.notify_all()

    def snapshot_stats(self) -> dict[str, Any]:
        with self._cond:
            return {"version": self.version, **dict(self.stats)}
